"""Faults of the disk under MODEL_DIR: failed writes end the run, damaged steps are skipped.

Every run here is bounded by a timeout: a run that hangs fails the test.
"""

import glob
import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
from test_cli import SHALLOW, TINY, cli_env, run_cli, run_in_process, user_error_line

from t5lite import checkpoints, cli, dry_run, metrics, write_errors


# The processes these tests start compile at XLA's optimisation level 0
# (tests/conftest.py).
pytestmark = pytest.mark.fast_compile(
    "these tests check exit statuses, messages and which checkpoints a faulty disk leaves; "
    "the optimised programs' numbers are checked by the training and parity tests")


HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "checkpoint_fault_worker.py")
READER = os.path.join(HERE, "checkpoint_read_worker.py")


# ---------------------------------------------------------------------------
# Failed writes: exit 5 promptly, one line last on stderr


def _can_mount_tmpfs():
  """Whether a private tmpfs can be mounted (user namespaces, or root)."""
  try:
    return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /mnt"],
                          capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def _worker_command(cause, model_dir):
  python = [sys.executable, WORKER]
  if cause != "full":
    return [*python, cause, str(model_dir)]
  if not _can_mount_tmpfs():
    return [*python, "full-injected", str(model_dir)]
  model_dir.mkdir()
  # A real full disk: a 256 kB tmpfs of this process's own, for a 400 kB save.
  script = f'mount -t tmpfs -o size=256k none "{model_dir}" && exec "$@"'
  return ["unshare", "-rm", "sh", "-c", script, "sh", *python, "full", str(model_dir)]


def _run_worker(cause, model_dir):
  return subprocess.run(_worker_command(cause, model_dir), capture_output=True, text=True,
                        timeout=240, env=cli_env())


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["file", "readonly", "vanished", "full"])
def test_failed_checkpoint_write_exits_5_promptly_with_one_line(tmp_path, cause):
  began = time.monotonic()
  out = _run_worker(cause, tmp_path / "run")
  assert out.returncode == 5, out.stderr[-3000:]
  # Nothing but the reason: no report of Orbax's threads, no TensorStore
  # result handed to a closed event loop.
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith(
      "t5lite: CheckpointWriteError: Could not write checkpoint step "), lines
  assert "then rerun the same command" in lines[0]
  assert time.monotonic() - began < 200


@pytest.mark.slow
def test_checkpoints_directory_deleted_between_saves_is_said_not_hidden(tmp_path):
  out = _run_worker("deleted", tmp_path / "run")
  assert out.returncode == 5, out.stderr[-3000:]
  assert out.stderr.strip().splitlines() == [
      f"t5lite: CheckpointWriteError: Could not write checkpoint step 2 to {tmp_path}/run/"
      "checkpoints: the directory vanished, and the saved step(s) [1] with it. Nothing more is "
      "saved there; restore the directory from a copy and rerun the same command, or rerun it "
      "to train again from the start."]
  assert not (tmp_path / "run" / "checkpoints").exists()  # not quietly made anew


def _train_on_full_disk(model_dir, size, args):
  """t5lite-train with MODEL_DIR on a tmpfs of `size` of its own: a disk that
  fills up. Where no tmpfs can be mounted, a file size limit makes the
  writes fail instead (EFBIG, 'File too large')."""
  train = os.path.join(os.path.dirname(sys.executable), "t5lite-train")
  model_dir.mkdir()
  command = [train, f"--gin.MODEL_DIR='{model_dir}'", *args]
  limit = None
  if _can_mount_tmpfs():
    script = f'mount -t tmpfs -o size={size} none "{model_dir}" && exec "$@"'
    command = ["unshare", "-rm", "sh", "-c", script, "sh", *command]
  else:
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # noqa: E731
  return subprocess.run(command, capture_output=True, text=True, timeout=240, env=cli_env(),
                        cwd=os.path.dirname(HERE), preexec_fn=limit)


def _one_line_exit_5(out):
  assert out.returncode == 5, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr[-3000:]
  # TensorFlow's C++ start-up lines (CUDA probing) stay off the console.
  assert "absl::InitializeLog" not in out.stderr and "cuInit" not in out.stderr, out.stderr
  return lines[0]


@pytest.mark.slow
def test_cli_failed_writes_exit_5_with_one_line_whichever_writer_meets_them(tmp_path):
  """t5lite-train ends with exit 5 and one line, no traceback or native noise,
  when `checkpoints` is a file, and on a disk that is full before config.gin
  is written, before the first save (the event files or the first checkpoint
  meet it first), and once two checkpoints are saved. One test, so that the
  launches after the first read the train step from its compilation cache."""
  model_dir = tmp_path / "file"
  model_dir.mkdir()
  (model_dir / "checkpoints").write_text("in the way")
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{model_dir}'"], cwd=str(tmp_path), timeout=300)
  line = _one_line_exit_5(out)
  assert line.startswith("t5lite: CheckpointWriteError: Could not write checkpoint step 2 "
                         f"to {model_dir}/checkpoints: [Errno 20] Not a directory"), line
  for size, steps in [("8k", 4), ("100k", 4), ("1m", 8)]:
    model_dir = tmp_path / size
    out = _train_on_full_disk(model_dir, size, [*TINY, f"--gin.TRAIN_STEPS={steps}"])
    line = _one_line_exit_5(out)
    assert re.match(r"t5lite: (Checkpoint)?WriteError: Could not write .*step \d+", line), line
    assert f" to {model_dir}" in line and "then rerun the same command" in line, line


def test_error_exit_does_not_wait_for_a_stuck_thread(tmp_path):
  # What Orbax's commit threads do after a failed write: wait for a signal
  # that never comes. Python would join them at exit, forever.
  script = ("import threading\nfrom t5lite import cli\n"
            "threading.Thread(target=threading.Event().wait, name='stuck').start()\n"
            "cli._stop(5, 'CheckpointWriteError: reason')\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
  assert out.returncode == 5
  assert out.stderr.strip().splitlines()[-1] == "t5lite: CheckpointWriteError: reason"


def test_results_for_a_loop_orbax_closed_are_not_reported(monkeypatch):
  import asyncio

  import tensorstore as ts
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", cli._drop_abandoned_loop_reports(reported.append))
  # What Orbax leaves when one write of a step fails: another write still
  # awaited on the loop it then closed.
  promise, pending = ts.Promise.new()

  async def writes():
    task = asyncio.ensure_future(_await(pending))
    task._log_destroy_pending = False  # pending for good, as in Orbax's case
    await asyncio.sleep(0.01)
    raise OSError("the first write failed")

  loop = asyncio.new_event_loop()
  with pytest.raises(OSError):
    loop.run_until_complete(writes())
  loop.close()
  promise.set_result(None)  # TensorStore hands the result to the closed loop
  assert reported == []

  class Finalizer:
    def __del__(self):
      raise RuntimeError("Event loop is closed")

  Finalizer()  # any other unraisable error is still reported
  assert [str(r.exc_value) for r in reported] == ["Event loop is closed"]


async def _await(future):
  await future


def test_failed_summary_write_is_a_write_error_naming_dir_and_step(tmp_path):
  (tmp_path / "train").write_text("a file where the event files go")
  writer = metrics.SummaryWriter(str(tmp_path / "train" / "task"))
  with pytest.raises(write_errors.WriteError, match=(
      f"^Could not write TensorBoard summaries to {tmp_path}/train/task at step 3: .*"
      "not a directory.* then rerun the same command")):
    writer.write_scalars(3, {"loss": 1.0})
  writer.write_scalars(4, {"loss": 1.0})  # said once; the run is stopping
  writer.close()
  assert issubclass(write_errors.WriteError, OSError)  # exit status 5


def test_write_error_is_exit_status_5_and_input_errors_stay_2():
  assert issubclass(checkpoints.CheckpointWriteError, OSError)
  assert not issubclass(checkpoints.CheckpointWriteError, (ValueError, FileNotFoundError))
  assert issubclass(checkpoints.CheckpointReadError, ValueError)  # exit 2: nothing written
  assert cli.IO_ERROR_EXIT == 5


def test_native_start_up_output_hidden_unless_verbosity(capfd, monkeypatch):
  def native_print(text):
    os.write(2, text.encode())

  monkeypatch.setattr(cli, "_LIBRARY_LOGS", False)
  with cli._native_start_up_logs_hidden():
    native_print("E0000 cuda_platform.cc:52] failed call to cuInit\n")
  assert "cuInit" not in capfd.readouterr().err
  with pytest.raises(ImportError):  # a failed start shows what was hidden
    with cli._native_start_up_logs_hidden():
      native_print("the reason the library did not load\n")
      raise ImportError("no")
  assert "the reason the library did not load" in capfd.readouterr().err
  cli._quiet_libraries(["t5lite-train", "--verbosity=0"])
  assert cli._LIBRARY_LOGS
  with cli._native_start_up_logs_hidden():
    native_print("E0000 cuda_platform.cc:52] failed call to cuInit\n")
  assert "cuInit" in capfd.readouterr().err


# ---------------------------------------------------------------------------
# Damaged checkpoints: fall back to the newest step that restores


def _files(root):
  out = {}
  for path in glob.glob(os.path.join(root, "**"), recursive=True):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _garbage(step_dir):
  for path in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True):
    with open(path, "wb") as f:
      f.write(os.urandom(os.path.getsize(path)))


def _truncate(step_dir):
  for path in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True):
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


def _no_metadata(step_dir):
  os.remove(os.path.join(step_dir, "state", "_METADATA"))


# The damaged-step tests read and damage files whatever the model's depth.
@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
  """MODEL_DIR of a tiny run of 8 steps with every checkpoint kept (2, 4, 6,
  8), trained once for the tests here; they copy it before changing it."""
  model_dir = tmp_path_factory.mktemp("eight_steps") / "run"
  with pytest.MonkeyPatch.context() as patch:
    run_in_process([*TINY, *SHALLOW, f"--gin.MODEL_DIR='{model_dir}'", "--gin.EVAL_PERIOD=0",
                    "--gin.CHECKPOINTS_TO_KEEP=None", "--gin.TRAIN_STEPS=8"],
                   str(model_dir.parent), patch)
  return model_dir


@pytest.mark.slow
def test_unreadable_checkpoints_fall_back_keep_files_and_resume_step(
    tmp_path, eight_steps, monkeypatch, capfd, caplog):
  model_dir = tmp_path / "run"
  shutil.copytree(eight_steps, model_dir)
  ckpts = model_dir / "checkpoints"
  base = [*TINY, *SHALLOW, f"--gin.MODEL_DIR='{model_dir}'", "--gin.EVAL_PERIOD=0",
          "--gin.CHECKPOINTS_TO_KEEP=None"]
  _garbage(ckpts / "8")
  _truncate(ckpts / "6")
  _no_metadata(ckpts / "4")
  damaged = {s: _files(ckpts / s) for s in ("4", "6", "8")}

  # In this process, which has no console of its own: the warnings are the
  # log records, what else is printed (or logged) during the run is in
  # capfd's stderr and caplog; what a process prints at its exit is the
  # subject of the read workers' tests below.
  capfd.readouterr()
  caplog.clear()
  stdout = run_in_process([*base, "--gin.TRAIN_STEPS=10"], str(tmp_path), monkeypatch)
  stderr = capfd.readouterr().err + caplog.text
  assert not [x for x in _READ_NOISE if x in stderr], stderr[-3000:]
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  for bad in (8, 6, 4):  # one warning each, naming the damaged step and the one restored
    lines = [x for x in warnings if x.startswith(f"Checkpoint {ckpts}/{bad} is unreadable")]
    assert len(lines) == 1, warnings
    assert "falling back to step 2." in lines[0], lines
  assert "does not match" not in stdout + stderr
  assert "steps 2 -> 10;" in stdout and "step 10/10" in stdout
  # Nothing deleted: the damaged steps are kept, byte for byte, out of the way.
  aside = model_dir / "checkpoints-unreadable"
  assert {s: _files(aside / s) for s in ("4", "6", "8")} == damaged
  assert sorted(int(s) for s in os.listdir(ckpts)) == [2, 4, 6, 8, 10]

  # train.resume_step goes back to an earlier step; the newer ones are moved,
  # neither deleted nor in the way of the new saves.
  last = user_error_line([*base, "--gin.TRAIN_STEPS=10", "--gin.train.resume_step=5"],
                         str(tmp_path), monkeypatch)
  assert "train.resume_step=5 is not a checkpoint" in last
  assert "available steps: [2, 4, 6, 8, 10]" in last
  stdout = run_in_process([*base, "--gin.TRAIN_STEPS=8", "--gin.train.resume_step=4"],
                          str(tmp_path), monkeypatch)
  assert "steps 4 -> 8;" in stdout
  assert "newer step(s) [6, 8, 10] moved to" in stdout
  assert sorted(int(s) for s in os.listdir(ckpts)) == [2, 4, 6, 8]
  assert sorted(os.listdir(model_dir / "checkpoints-abandoned-after-4")) == ["10", "6", "8"]


@pytest.mark.slow
def test_no_readable_checkpoint_is_exit_2_naming_the_step_and_changes_nothing(
    tmp_path, eight_steps, monkeypatch):
  model_dir = tmp_path / "run"
  shutil.copytree(eight_steps, model_dir)
  base = [*TINY, *SHALLOW, f"--gin.MODEL_DIR='{model_dir}'", "--gin.EVAL_PERIOD=0"]
  _garbage(model_dir / "checkpoints" / "8")
  for step in ("6", "4", "2"):
    _no_metadata(model_dir / "checkpoints" / step)
  before = _files(model_dir)
  out = run_cli([*base, "--gin.TRAIN_STEPS=10"], cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-3000:]
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert f"Checkpoint {model_dir}/checkpoints/8 is unreadable" in last, last
  assert "(so are steps [6, 4, 2])" in last and "Move the damaged step directories out of" in last
  assert _files(model_dir) == before
  # Inference names the damaged checkpoint too, instead of a model mismatch
  # (its exit status and console are those of every input error).
  (tmp_path / "in.txt").write_text("hello\n")
  last = user_error_line(["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/infer.gin",
                          "--gin_file=gin/testing/local_tiny.gin", *SHALLOW,
                          f"--gin.CHECKPOINT_PATH='{model_dir}'",
                          f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'out'}'",
                          f"--gin.INPUT_FILE='{tmp_path / 'in.txt'}'"],
                         str(tmp_path), monkeypatch, script="t5lite-infer")
  assert last.startswith(f"CheckpointReadError: Checkpoint {model_dir}/checkpoints/8 is "
                         "unreadable"), last
  assert "Use another step (steps in" in last


# What a failed read left running printed tracebacks now and then, during the
# run or at its exit: each worker reads the damaged step several times.
_READ_NOISE = ("Traceback", "Event loop is closed", "Task exception was never retrieved")
_READS = 8


def _read_damaged(tmp_path, damage, how):
  out = subprocess.run([sys.executable, READER, damage, how, str(tmp_path / "run"), str(_READS)],
                       capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert not [x for x in _READ_NOISE if x in out.stderr], out.stderr[-3000:]
  return out


@pytest.mark.parametrize("damage", ["garbage", "truncated", "manifest"])
def test_fallback_past_an_unreadable_step_is_one_warning_line_every_time(tmp_path, damage):
  out = _read_damaged(tmp_path, damage, "fallback")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert len(lines) == _READS, out.stdout
  for step, line in enumerate(lines, start=2):
    assert line.startswith(f"Checkpoint {tmp_path}/run/checkpoints/{step} is "
                           "unreadable: "), line
    assert line.endswith(f"; falling back to step 1. Nothing is deleted: step {step} moves to "
                         "MODEL_DIR/checkpoints-unreadable/."), line
    assert "tensorstore_spec" not in line  # TensorStore's screen of JSON is not the reason


@pytest.mark.parametrize("how", ["all", "path", "params"])
def test_no_readable_step_is_one_line_naming_it_every_time(tmp_path, how):
  # all: a MODEL_DIR of damaged steps; path: t5lite-eval, t5lite-infer and a
  # whole-state INITIAL_CHECKPOINT_PATH; params: a params-only one.
  out = _read_damaged(tmp_path, "garbage", how)
  assert out.returncode == 2, out.stderr[-3000:]
  directory = f"{tmp_path}/run/checkpoints"
  # all: every read names the newest step; the others name the step they read.
  steps = [_READS + 1] * _READS if how == "all" else range(2, _READS + 2)
  lines = [*out.stdout.splitlines(), out.stderr.strip().splitlines()[-1]]
  assert len(lines) == _READS, out.stdout
  for step, line in zip(steps, lines):
    assert line.removeprefix("t5lite: ").startswith(
        f"CheckpointReadError: Checkpoint {directory}/{step} is unreadable: "), line
    if how == "all":
      assert line.endswith(f"Move the damaged step directories out of {directory} to start "
                           "from scratch, or use another MODEL_DIR."), line
    else:
      assert line.endswith(f"Use another step (steps in {directory}: "
                           f"{list(range(1, _READS + 2))}), or replace this one from a copy."), line
  assert lines[-1].startswith("t5lite: ")


# ---------------------------------------------------------------------------
# train.resume_step: the plan, as train() and the dry run read it


def _steps(model_dir, steps):
  for step in steps:
    os.makedirs(os.path.join(model_dir, "checkpoints", str(step), "state"))


def test_resume_plan(tmp_path):
  _steps(tmp_path, (2, 4, 6))
  assert checkpoints.plan_resume(str(tmp_path), None).candidates == (2, 4, 6)
  plan = checkpoints.plan_resume(str(tmp_path), 4)
  assert (plan.candidates, plan.set_aside, plan.aside_subdir) == (
      (4,), (6,), "checkpoints-abandoned-after-4")
  with pytest.raises(ValueError, match=r"train.resume_step=5 is not a checkpoint in .*; "
                     r"available steps: \[2, 4, 6\]\. Pass one of them"):
    checkpoints.plan_resume(str(tmp_path), 5)
  with pytest.raises(ValueError, match="available steps: none"):
    checkpoints.plan_resume(str(tmp_path / "empty"), 1)
  # A rerun of the same command, after the rollback was done, resumes normally.
  os.makedirs(tmp_path / "checkpoints-abandoned-after-4")
  plan = checkpoints.plan_resume(str(tmp_path), 4)
  assert plan.candidates == (2, 4, 6) and not plan.aside_subdir
  assert "was applied by an earlier run" in plan.note


def test_dry_run_reports_resume_step(tmp_path):
  _steps(tmp_path, (2, 4, 6))
  start, how, _ = dry_run._start(str(tmp_path), None, resume_step=2)
  assert start == 2 and "train.resume_step" in how and "[4, 6]" in how
  assert dry_run._start(str(tmp_path), None)[0] == 6


def test_gin_train_shorthand_binds_train_arguments():
  argv = cli.rewrite_gin_args(["t5lite-train", "--gin.train.resume_step=4",
                               "--gin.train_lib.train.random_seed=1", "--gin.MODEL_DIR='x'"])
  assert argv[1:] == ["--gin_bindings=train_lib.train.resume_step = 4",
                      "--gin_bindings=train_lib.train.random_seed = 1",
                      "--gin_bindings=MODEL_DIR = 'x'"]
