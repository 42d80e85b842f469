"""A job that is preempted or diverges keeps the user's work."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_cli import SHALLOW, TINY, Child, run_cli, run_in_process, scalars


# End-to-end: real processes and training runs (part of `make test`). What a
# test needs before or after the process it interrupts (a run to restart, a
# restart's stdout) is trained in this process (`run_in_process`).
pytestmark = [pytest.mark.slow, pytest.mark.fast_compile(
    "these tests check exit statuses, checkpoints and runs compared with runs of the same "
    "programs; the optimised programs' numbers are checked by the training and parity tests")]


# Neither evaluation nor depth is what these tests are about: without them a
# launch compiles less.
LIGHT = [*SHALLOW, "--gin.EVAL_PERIOD=0"]


@pytest.fixture(scope="module")
def trained_to_step_4(tmp_path_factory):
  """A tiny run trained to step 4, checkpointed at steps 2 and 4; read-only
  (tests copy it)."""
  model_dir = tmp_path_factory.mktemp("trained") / "run"
  with pytest.MonkeyPatch.context() as patch:
    run_in_process([*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=4"],
                   str(model_dir.parent), patch)
  assert sorted(os.listdir(model_dir / "checkpoints"), key=int) == ["2", "4"]
  return model_dir


def test_sigterm_and_ctrl_c_checkpoint_the_current_step_exit_143_and_130_and_resume_loses_nothing(
    tmp_path, monkeypatch):
  """SIGTERM, then a resume, then Ctrl-C on another run: one test, so that the
  launches after the first read the train step from its compilation cache."""
  model_dir = tmp_path / "run"
  args = [*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=100000",
          "--gin.CHECKPOINT_PERIOD=50000", "--gin.STATS_PERIOD=1"]
  child = Child(args, cwd=str(tmp_path))
  child.wait_for_line("step 3/", timeout=300)  # wait until training is really under way
  child.proc.send_signal(signal.SIGTERM)
  returncode, _, err = child.finish(timeout=300)
  assert returncode == 143, err[-3000:]
  assert "Preempted at step" in err.strip().splitlines()[-1]
  saved = [int(s) for s in os.listdir(model_dir / "checkpoints")]
  assert len(saved) == 1 and saved[0] >= 3 and saved[0] % 50000
  # The same command continues from exactly that step.
  target = saved[0] + 2
  # (The later binding of TRAIN_STEPS wins.)
  again = run_in_process([*args, f"--gin.TRAIN_STEPS={target}"], str(tmp_path), monkeypatch)
  assert f"Restoring step {saved[0]}" in again
  assert f"steps {saved[0]} -> {target};" in again

  # Ctrl-C checkpoints the current step and exits 130.
  model_dir = tmp_path / "ctrl_c"
  args = [*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=100000",
          "--gin.CHECKPOINT_PERIOD=50000", "--gin.STATS_PERIOD=1"]
  child = Child(args, cwd=str(tmp_path))
  child.wait_for_line("step 3/", timeout=600)  # training is really under way
  child.proc.send_signal(signal.SIGINT)
  returncode, _, err = child.finish(300)
  assert returncode == 130, err[-3000:]
  assert "Interrupted: Stopped by Ctrl-C at step" in err.strip().splitlines()[-1]
  assert "press Ctrl-C again to exit at once" in err
  saved = [int(s) for s in os.listdir(model_dir / "checkpoints")]
  assert len(saved) == 1 and saved[0] >= 3 and saved[0] % 50000


_TWO_CTRL_C = """
import os, signal, sys, time
from t5lite import stops
with stops.SignalsToPreemption():
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(0.5)
  print("first Ctrl-C asked to stop:", stops.PREEMPTION.is_set(), flush=True)
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(30)
print("second Ctrl-C was ignored", flush=True)
"""


def test_second_ctrl_c_exits_at_once(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _TWO_CTRL_C], cwd=str(tmp_path), env=env,
                        capture_output=True, text=True, timeout=120)
  assert "first Ctrl-C asked to stop: True" in proc.stdout, proc.stderr[-3000:]
  assert "ignored" not in proc.stdout
  assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]  # the shell reports 130


def test_divergence_is_not_saved_restart_trains_on_and_half_written_step_is_not_restored(
    tmp_path, trained_to_step_4, monkeypatch, capfd, caplog):
  """Both restart from a copy of the run trained to step 4: one test, so that
  the launches after the first read the train step from its compilation
  cache."""
  model_dir = tmp_path / "run"
  # checkpoints and stats every 2 steps
  base = [*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'"]
  shutil.copytree(trained_to_step_4, model_dir)  # a good run to step 4
  # The update of step 5 blows the weights up (|params| ~1e9) with a finite
  # loss; the loss is NaN only at step 8, after step 6 would have been saved.
  bad = run_cli([*base, "--gin.TRAIN_STEPS=8",
                 "--gin.optimizers.rsqrt_with_warmup.base_learning_rate=1e9"],
                cwd=str(tmp_path))
  assert bad.returncode == 3, bad.stderr[-3000:]
  last = bad.stderr.strip().splitlines()[-1]
  assert "Training diverged at step 5: the update was" in last, last
  assert "the newest checkpoint is step 4" in last and "resume_step=N" in last, last
  assert sorted(os.listdir(model_dir / "checkpoints"), key=int) == ["2", "4"]
  # What is on disk is sound: the normal rate trains on from it.
  again = run_in_process([*base, "--gin.TRAIN_STEPS=8"], str(tmp_path), monkeypatch)
  assert "Restoring step 4" in again
  losses = scalars(str(model_dir / "train"), "loss")
  assert sorted(losses) == [2, 4, 6, 8] and all(0 < v < 7 for v in losses.values()), losses

  # A half-written checkpoint is never restored. In this process: the
  # warning is a log record (caplog), what else is printed is in capfd.
  model_dir = tmp_path / "half_written"
  shutil.copytree(trained_to_step_4, model_dir)
  # What a crash in the middle of writing step 8 leaves behind.
  partial = model_dir / "checkpoints" / "8.orbax-checkpoint-tmp" / "state"
  partial.mkdir(parents=True)
  (partial / "garbage").write_bytes(b"\x00" * 100)
  capfd.readouterr()
  caplog.clear()
  # An error (the counterpart of a non-zero exit) propagates.
  out = run_in_process([*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=6"],
                       str(tmp_path), monkeypatch)
  stderr = capfd.readouterr().err + caplog.text
  assert "Ignoring unfinished checkpoint(s) at step(s) [8]" in stderr
  assert "Restoring step 4" in out and "steps 4 -> 6;" in out


def checkpoint_state(step_dir):
  """Reads a checkpoint's whole train state (params, optimizer state, step)
  with plain Orbax (no t5lite), as (path, array) pairs."""
  import jax
  import orbax.checkpoint as ocp
  path = os.path.join(step_dir, "state")
  checkpointer = ocp.StandardCheckpointer()
  # Onto this process's first device, whatever mesh and process count saved it.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        checkpointer.metadata(path).item_metadata)
  return jax.tree_util.tree_flatten_with_path(checkpointer.restore(path, target))[0]


def assert_bitwise_equal(a, b):
  assert [p for p, _ in a] == [p for p, _ in b]
  assert any("opt_state" in str(p) for p, _ in a)  # the optimizer state is compared too
  for (path, x), (_, y) in zip(a, b):
    assert x.dtype == y.dtype and (x == y).all(), path  # bitwise, not approximately


# SIGKILL mid-run and a restart giving bitwise the uninterrupted run, for every
# shipped headline config, killed in one process and restarted in two or the
# other way round: test_multihost.py, test_sigkill_then_restart_on_the_other_
# process_count_equals_uninterrupted_run_bitwise.


# ---------------------------------------------------------------------------
# Ctrl-C before the loop takes SIGINT over: one line, exit 130, files whole


_INTERRUPTED_LINE = ("t5lite: Interrupted: Stopped by Ctrl-C; no checkpoint was being written. "
                     "Rerun the same command to start again.")


def _files(root):
  """Every file under root: its content hash, and the modification time of
  the checkpoint files (config.gin may be rewritten with the same text)."""
  out = {}
  for folder, _, names in os.walk(root):
    for name in names:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      kept = os.stat(path).st_mtime_ns if f"{os.sep}checkpoints{os.sep}" in path else None
      out[os.path.relpath(path, root)] = (digest, kept)
  return out


def _loaded(pid, library):
  with open(f"/proc/{pid}/maps") as f:
    return library in f.read()


def _wait_until(child, condition, what, timeout=300):
  """Polls `condition` until it holds; fails the test if the child ends or
  the time runs out first (a loaded machine is slow, never stuck)."""
  deadline = time.monotonic() + timeout
  while not condition():
    if child.proc.poll() is not None:
      _, _, err = child.finish(60)
      pytest.fail(f"exited ({child.proc.returncode}) before {what}; stderr ends:\n{err[-3000:]}")
    if time.monotonic() > deadline:
      child.proc.kill()
      child.finish(60)
      pytest.fail(f"no sign of {what} within {timeout}s")
    time.sleep(0.005)


# Each moment is recognised by a sign the process gives, not by a delay: a
# library mapped into it, the run lock, a line it prints.
_MOMENTS = {
    "importing JAX": lambda child, model_dir: _loaded(child.proc.pid, "jaxlib"),
    "importing TensorFlow, then parsing gin": lambda child, model_dir: _loaded(
        child.proc.pid, "tensorflow"),
    "tracing and compiling": lambda child, model_dir: (model_dir / "train.lock").exists(),
    "restoring": lambda child, model_dir: child.wait_for_line("Restoring step 4", timeout=300),
}


@pytest.mark.parametrize("moment", list(_MOMENTS))
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, trained_to_step_4, moment):
  model_dir = tmp_path / "run"
  shutil.copytree(trained_to_step_4, model_dir)
  before = _files(model_dir)
  # Without the compilation cache the train step really compiles (seconds).
  compile_for_real = ["--nocompilation_cache"] if moment == "tracing and compiling" else []
  child = Child([*TINY, *LIGHT, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=6",
                 *compile_for_real], cwd=str(tmp_path))
  _wait_until(child, lambda: _MOMENTS[moment](child, model_dir), moment)
  child.proc.send_signal(signal.SIGINT)
  returncode, _, err = child.finish(120)
  assert returncode == 130, err[-3000:]
  assert err.strip().splitlines()[-1] == _INTERRUPTED_LINE, err[-3000:]
  assert [line for line in err.splitlines() if line.startswith("t5lite")] == [_INTERRUPTED_LINE]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
  # The checkpoint is untouched, the lock released, nothing half-written.
  assert _files(model_dir) == before


# A module whose import is under way when Ctrl-C comes.
_SLOW_IMPORT = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.5)
FINISHED = True
"""
_IMPORT_THEN_WAIT = """
import os, sys, time
from t5lite import console
def interrupted():
  module = sys.modules.get("slow_import")
  print("import finished:", getattr(module, "FINISHED", False), flush=True)
  os._exit(130)
sys.path.insert(0, sys.argv[1])
with console.ctrl_c_as_one_line(interrupted):
  import slow_import
  time.sleep(60)
"""


# A Ctrl-C whose handler runs inside a garbage-collector callback (JAX
# registers one): Python reports the KeyboardInterrupt raised there as
# unraisable and drops it.
_CTRL_C_IN_GC_CALLBACK = """
import gc, os, signal, sys, time
from t5lite import console
fired = []
def callback(phase, info):
  if phase == "start" and not fired:
    fired.append(True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs here, inside the callback
def interrupted():
  print("interrupted", flush=True)
  os._exit(130)
with console.ctrl_c_as_one_line(interrupted):
  gc.callbacks.append(callback)
  gc.collect()
  time.sleep(30)
  print("the Ctrl-C was lost", flush=True)
"""


def test_ctrl_c_dropped_in_a_gc_callback_is_raised_again(tmp_path):
  began = time.monotonic()
  out = subprocess.run([sys.executable, "-c", _CTRL_C_IN_GC_CALLBACK], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 130, out.stdout + out.stderr[-3000:]
  assert out.stdout == "interrupted\n", out.stdout
  assert "Exception ignored" not in out.stderr, out.stderr[-3000:]
  assert time.monotonic() - began < 20  # not after the sleep


def test_ctrl_c_during_an_import_takes_effect_when_it_is_done(tmp_path):
  # An exception raised into a C extension's initialisation can crash the
  # interpreter (jaxlib's does): the import is finished first.
  (tmp_path / "slow_import.py").write_text(_SLOW_IMPORT)
  began = time.monotonic()
  out = subprocess.run([sys.executable, "-c", _IMPORT_THEN_WAIT, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 130, out.stderr[-3000:]
  assert out.stdout == "import finished: True\n", out.stderr[-3000:]
  assert time.monotonic() - began < 30  # not the minute of the sleep after it
