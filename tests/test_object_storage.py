"""Runs, checkpoints and imports in a gs:// bucket, against a local GCS server.

The server is fake-gcs-server (tests/gcs_emulator.py), started by this module.
What t5lite reads from a bucket must equal what it reads from the same files
on disk: T5X checkpoints of both layouts, Hugging Face folders and t5lite's
own checkpoints, through `t5lite-import`, a fine-tune's
INITIAL_CHECKPOINT_PATH and the readers under them. Runs train, evaluate
and infer into the bucket, are killed and resume bitwise, share it between
two processes, fall back past a damaged step, and stop with exit 5 when the
server goes away; a run in the bucket is exported into it. A URL of a
storage t5lite cannot read is one line.
"""

import json
import os
import re
import socket
import subprocess
import time

import gcs_emulator
import interop_helpers as h
import jax
import jax.numpy as jnp
import multihost
import numpy as np
import pytest
from test_cli import SHALLOW, TINY, Child, launch_cache, run_cli, run_in_process, user_error_line
from test_interruptions import assert_bitwise_equal, checkpoint_state

from t5lite import checkpoints, compilation_cache, interop, metrics, paths, run_lock
from t5lite.errors import UserError


# The processes these tests start compile at XLA's optimisation level 0
# (tests/conftest.py).
pytestmark = pytest.mark.fast_compile(
    "these tests check what reaches the bucket and what is read back: bytes, steps, exit "
    "statuses, and runs compared with runs of the same programs; the optimised programs' "
    "numbers are checked by the training and parity tests")


BYT5 = os.path.join(h.HF, "byt5")
T5X_RUN = os.path.join(h.DATA, "t5x_train", "encdec_a")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
  """The emulator, holding the committed foreign checkpoints; its variables
  are set in this process (and so in the commands tests start)."""
  server = gcs_emulator.Emulator(str(tmp_path_factory.mktemp("gcs")))
  saved = {name: os.environ.get(name) for name in server.env}
  os.environ.update(server.env)
  try:
    server.upload(BYT5, "hf/byt5")
    server.upload(h.T5X_CHECKPOINTS["a", "legacy"], "t5x/legacy/checkpoint_20")
    server.upload(os.path.join(T5X_RUN, "checkpoint_0"), "t5x/run/checkpoint_0")
    server.upload(os.path.join(T5X_RUN, "config.gin"), "t5x/run/config.gin")
    yield server
  finally:
    server.close()
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def _url(name):
  return f"gs://{gcs_emulator.BUCKET}/{name}"


def _arrays(path):
  arrays, _ = interop.read_foreign(path)
  return {name: array.read() for name, array in arrays.items()}


@pytest.mark.parametrize("local, name", [
    (BYT5, "hf/byt5"),
    (h.T5X_CHECKPOINTS["a", "legacy"], "t5x/legacy/checkpoint_20"),
    (os.path.join(T5X_RUN, "checkpoint_0"), "t5x/run"),
], ids=["hugging_face", "t5x_legacy", "t5x_orbax"])
def test_foreign_checkpoints_read_from_a_bucket_equal_the_files_on_disk(bucket, local, name):
  assert interop.checkpoint_format(_url(name)) == interop.checkpoint_format(local)
  assert interop.checkpoint_step(_url(name)) == interop.checkpoint_step(local)
  remote, on_disk = _arrays(_url(name)), _arrays(local)
  assert sorted(remote) == sorted(on_disk) and len(remote) > 20
  for array in on_disk:
    np.testing.assert_array_equal(remote[array], on_disk[array], err_msg=array)


def test_t5lite_checkpoints_restore_from_a_bucket(bucket, tmp_path):
  """A t5lite checkpoints directory copied to the bucket restores the same
  parameters, by directory (its newest step) and by step directory."""
  params = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4)},
            "scale": jnp.full((5,), 0.5, jnp.float32)}
  state = {"params": params, "step": jnp.int32(7)}
  saver = checkpoints.Checkpointer(str(tmp_path / "run"), checkpoints.SaveCheckpointConfig())
  for step in (3, 7):
    saver.save(step, jax.tree.map(lambda x, step=step: x + step, state))
  saver.close()
  run = bucket.upload(str(tmp_path / "run"), "own/run")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  for path, mode, step in ((run, "latest", 7), (f"{run}/checkpoints/3", "specific", 3)):
    restored, found = checkpoints.restore_params(
        checkpoints.RestoreCheckpointConfig(path=path, mode=mode), abstract)
    assert found == step
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
      np.testing.assert_array_equal(got, want + step)


@pytest.mark.slow
def test_import_fine_tune_infer_evaluate_and_export_in_a_bucket(bucket, tmp_path, monkeypatch):
  """`t5lite-import` writes the same gin file from the bucket as from the disk
  (but for the paths it names), and writes it into the bucket; a fine-tune
  starts from the bucket with that gin file read from it and trains into
  it; t5lite-infer reads its inputs from the bucket and writes its
  predictions there, t5lite-eval its results, and t5lite-export the
  Hugging Face folder it writes on a disk."""
  cwd = str(tmp_path)
  for local, name, step in ((BYT5, "hf/byt5", ""), (T5X_RUN, "t5x/run", "/checkpoint_0")):
    settings = []
    for folder in (local, _url(name)):
      result = run_cli([f"--source={folder}{step}", "--output=model.gin", "--overwrite"], cwd,
                       script="t5lite-import")
      assert result.returncode == 0, result.stderr[-3000:]
      text = (tmp_path / "model.gin").read_text().replace(folder, "FOLDER")
      settings.append([line for line in text.splitlines() if not line.startswith("#")])
    assert settings[0] == settings[1] and len(settings[0]) > 10
  gin_file = _url("gin/byt5.gin")
  for _ in range(2):  # the second time over the first
    result = run_cli([f"--source={_url('hf/byt5')}", f"--output={gin_file}", "--overwrite"], cwd,
                     script="t5lite-import")
    assert result.returncode == 0, result.stderr[-3000:]
  assert f"Wrote {gin_file}: the " in result.stdout
  lengths = "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 24}"
  stdout = run_in_process(
      [f"--gin_file={gin_file}", "--gin_file=gin/runs/finetune.gin",
       f"--gin.INITIAL_CHECKPOINT_PATH='{_url('hf/byt5')}'", f"--gin.MODEL_DIR='{_url('ft')}'",
       "--gin.MIXTURE_OR_TASK_NAME='t5lite_sort'", "--gin.BATCH_SIZE=8", lengths,
       "--gin.TRAIN_STEPS=1", "--gin.EVAL_PERIOD=0", "--gin.CHECKPOINT_PERIOD=1"], cwd,
      monkeypatch)
  assert f"Imported 70 parameters from {_url('hf/byt5')}" in stdout
  assert checkpoints.list_steps(_url("ft"))[1] == [1]
  # Inference on the fine-tuned step, inputs from the bucket, predictions to it.
  (tmp_path / "inputs.txt").write_text("3 1 2\n\n5 4\n")
  inputs = bucket.upload(str(tmp_path / "inputs.txt"), "data/inputs.txt")
  run_in_process([f"--gin_file={gin_file}", "--gin_file=gin/runs/infer.gin",
                  f"--gin.CHECKPOINT_PATH='{_url('ft')}'",
                  f"--gin.INFER_OUTPUT_DIR='{_url('out')}'",
                  f"--gin.INPUT_FILE='{inputs}'", "--gin.BATCH_SIZE=2", lengths], cwd, monkeypatch,
                 script="t5lite-infer")
  rows = [json.loads(line) for line in
          paths.Path(_url("out/inputs-1.jsonl")).read_text().splitlines()]
  assert [row["inputs"] for row in rows] == ["3 1 2", "", "5 4"]
  # Evaluation of the run's checkpoints, its results in the bucket; a second
  # pass reads there which steps are done.
  evaluate = [f"--gin_file={gin_file}", "--gin_file=gin/runs/eval.gin",
              f"--gin.CHECKPOINT_PATH='{_url('ft')}'", f"--gin.EVAL_OUTPUT_DIR='{_url('ev')}'",
              "--gin.MIXTURE_OR_TASK_NAME='t5lite_sort'", "--gin.NUM_EVAL_EXAMPLES=4",
              "--gin.BATCH_SIZE=2", lengths]
  run_in_process(evaluate, cwd, monkeypatch, script="t5lite-eval")
  folder = paths.Path(_url("ev/inference_eval"))
  assert json.loads((folder / "evaluated_steps.json").read_text()) == [1]
  assert len((folder / "t5lite_sort-000001.jsonl").read_text().splitlines()) == 4
  events = gcs_emulator.download(_url("ev/inference_eval/t5lite_sort"), str(tmp_path / "ev"))
  assert list(metrics.read_scalars(events, "exact_match")) == [1]
  out = run_in_process(evaluate, cwd, monkeypatch, script="t5lite-eval")
  assert "Skipping steps already evaluated: [1]" in out

  # The fine-tuned step exported into the bucket is, byte for byte, the folder
  # an export to a disk writes; the same command again replaces its own
  # export. A file of someone else's in the folder is refused in one line,
  # the folder left as it is; --overwrite replaces it, that file too.
  export = [f"--gin_file={gin_file}", "--gin_file=gin/runs/export.gin",
            f"--gin.CHECKPOINT_PATH='{_url('ft')}'"]
  run_in_process([*export, "--gin.EXPORT_DIR='hf_local'"], cwd, monkeypatch, script="t5lite-export")
  to_bucket = [*export, f"--gin.EXPORT_DIR='{_url('hf_out')}'"]
  for _ in range(2):
    out = run_in_process(to_bucket, cwd, monkeypatch, script="t5lite-export")
    assert f"to {_url('hf_out')}: config.json" in out
  on_disk = _files(tmp_path / "hf_local")
  assert set(on_disk) >= {"config.json", "model.safetensors", "t5lite-export.json"}
  assert _files(gcs_emulator.download(_url("hf_out"), str(tmp_path / "got1"))) == on_disk
  paths.Path(_url("hf_out/notes.txt")).write_text("mine")
  line = user_error_line(to_bucket, cwd, monkeypatch, script="t5lite-export")
  assert "holds notes.txt, which its export did not write" in line and "--overwrite" in line
  assert _files(gcs_emulator.download(_url("hf_out"), str(tmp_path / "got2"))) == {
      **on_disk, "notes.txt": b"mine"}
  run_in_process([*to_bucket, "--overwrite"], cwd, monkeypatch, script="t5lite-export")
  assert _files(gcs_emulator.download(_url("hf_out"), str(tmp_path / "got3"))) == on_disk


def _files(folder):
  """Every file's bytes, by name."""
  return {name: paths.Path(folder, name).read_bytes() for name in os.listdir(folder)}


def test_the_compilation_cache_can_live_in_a_bucket(bucket):
  """JAX reads and writes a gs:// cache directory itself; t5lite passes it on."""
  with launch_cache(configure=False):
    assert compilation_cache.configure(_url("cache")) == _url("cache")
    jax.jit(lambda x: jnp.tanh(x) * 3.0)(jnp.ones(7)).block_until_ready()
  entries = [p.name for p in paths.Path(_url("cache")).iterdir()]
  assert any(name.startswith("jit__lambda") for name in entries), entries
  with pytest.raises(UserError,
                     match=r"directory 's3://b/cache' is a s3:// URL; t5lite reads and writes gs"):
    compilation_cache.configure("s3://b/cache")


def test_orbax_still_stores_arrays_in_gs_buckets_only():
  """Why s3:// is refused (t5lite/paths.py): Orbax places a checkpoint's
  arrays with TensorStore's gcs driver for gs:// and takes every other
  directory for a local path. When this fails, Orbax has learnt another
  scheme, and t5lite's SCHEMES can follow it, with a server to test it
  against."""
  from orbax.checkpoint._src.serialization import tensorstore_utils
  spec = tensorstore_utils.build_kvstore_tspec("gs://t5lite-test/run/checkpoints/4",
                                               name="params", use_ocdbt=True)
  assert spec["base"] == {"driver": "gcs", "bucket": "t5lite-test",
                          "path": "run/checkpoints/4"}, spec
  with pytest.raises(ValueError, match="should be absolute"):
    tensorstore_utils.build_kvstore_tspec("s3://t5lite-test/run/checkpoints/4",
                                          name="params", use_ocdbt=True)


@pytest.mark.slow
def test_a_run_in_a_bucket_killed_resumes_bitwise_in_two_processes(bucket, tmp_path):
  """MODEL_DIR in the bucket: checkpoints, config.gin, model-info.txt and the
  TensorBoard events land there. A run killed with SIGKILL once its step-2
  checkpoint is committed is resumed from its newest committed step by a
  2-process job (one device each): process 0 takes over the lock the killed
  run left and writes the run's files, both take part in every save, the
  lock is released at the end, and step 8 equals, bit for bit, an
  uninterrupted run in one process with two devices (on 2 devices every sum
  adds two numbers, whose order does not matter)."""
  args = [*TINY, *SHALLOW, "--gin.EVAL_PERIOD=0", "--gin.TRAIN_STEPS=8",
          "--gin.CHECKPOINT_PERIOD=2", "--gin.STATS_PERIOD=1"]
  straight, killed = _url("runs/straight"), _url("runs/killed")

  def start(model_dir, name, count, *extra):
    return multihost.start_job(lambda i: [*args, f"--gin.MODEL_DIR='{model_dir}'", *extra],
                               cwd=str(tmp_path), log_dir=str(tmp_path / name), count=count,
                               devices_per_process=2 // count, with_distributed_flags=count > 1)

  # With a train-eval at the end, whose events go to the bucket too.
  jobs = [start(straight, "straight", 1, "--gin.EVAL_PERIOD=8")]
  try:
    jobs[0].wait_for_output(0, "step 1/8", timeout=600)  # then its step is in the cache
    jobs.append(start(killed, "killed", 1, "--gin.TRAIN_STEPS=1000"))
    deadline = time.monotonic() + 300
    while 2 not in checkpoints.list_steps(killed)[1]:
      assert jobs[1].procs[0].poll() is None and time.monotonic() < deadline, jobs[1].describe()
      time.sleep(0.2)
    jobs[1].kill_all()
    assert paths.Path(f"{killed}/train.lock").exists()  # left behind by the killed process
    committed = checkpoints.list_steps(killed)[1]
    assert 2 <= max(committed) < 8, committed
    jobs.append(start(killed, "resumed", 2))
    resumed = jobs[2].wait(600)
    (done,) = jobs[0].wait(600)
  finally:
    for job in jobs:
      job.kill_all()
  assert done.returncode == 0, done.stderr[-3000:]
  assert [r.returncode for r in resumed] == [0, 0], [r.stderr[-2000:] for r in resumed]

  names = {p.name for p in paths.Path(straight).iterdir()}
  assert {"checkpoints", "config.gin", "model-info.txt", "train", "training_eval"} <= names, names
  evaluated = gcs_emulator.download(f"{straight}/training_eval", str(tmp_path / "eval"))
  assert sorted(metrics.read_scalars(os.path.join(evaluated, os.listdir(evaluated)[0]),
                                     "loss")) == [8]
  assert not paths.Path(f"{straight}/train.lock").exists()  # released at the end
  events = gcs_emulator.download(f"{straight}/train", str(tmp_path / "tb"))
  assert sorted(metrics.read_scalars(events, "loss")) == list(range(1, 9))

  assert f"Restoring step {max(committed)}" in resumed[0].stdout
  assert "step 8/8" in resumed[0].stdout and "step 8/8" not in resumed[1].stdout
  assert 8 in checkpoints.list_steps(killed)[1]
  names = {p.name for p in paths.Path(killed).iterdir()}
  assert {"checkpoints", "config.gin", "model-info.txt", "train"} <= names, names
  assert "train.lock" not in names
  assert_bitwise_equal(checkpoint_state(f"{straight}/checkpoints/8"),
                       checkpoint_state(f"{killed}/checkpoints/8"))


def test_the_lock_of_a_run_in_a_bucket_keeps_a_second_trainer_out(bucket):
  model_dir = _url("runs/locked")
  first = run_lock.acquire(model_dir)
  try:
    with pytest.raises(run_lock.ModelDirInUse, match=r"in use by another t5lite-train \(host"):
      run_lock.acquire(model_dir)
  finally:
    first.release()
  assert not paths.Path(f"{model_dir}/train.lock").exists()
  # A lock object of a process of this host that is gone is taken over.
  dead = _dead_pid()
  paths.Path(f"{model_dir}/train.lock").write_text(
      json.dumps({"host": socket.gethostname(), "pid": dead, "started": 0.0}))
  taken = []
  lock = run_lock.acquire(model_dir, log=taken.append)
  lock.release()
  assert taken and f"pid {dead}" in taken[0], taken


def _dead_pid():
  process = subprocess.Popen(["true"])
  process.wait()
  return process.pid


@pytest.mark.slow
def test_a_bucket_lost_mid_run_stops_it_with_exit_5_and_keeps_its_committed_steps(
    bucket, tmp_path, monkeypatch):
  """The server goes away once step 2 is committed: the next save fails
  within about a minute (TensorStore's retries bounded as gcsfs's), the run
  exits 5 with one line naming the step, the bucket and what to do, and
  leaves the lock object behind with a warning. With the server back, the
  same command resumes from step 2 and finishes."""
  model_dir = _url("runs/lost")
  args = [*TINY, *SHALLOW, "--gin.EVAL_PERIOD=0", "--gin.TRAIN_STEPS=6",
          "--gin.CHECKPOINT_PERIOD=2", "--gin.STATS_PERIOD=1", f"--gin.MODEL_DIR='{model_dir}'"]
  child = Child([*args, "--gin.TRAIN_STEPS=1000"], str(tmp_path))
  deadline = time.monotonic() + 300
  while 2 not in checkpoints.list_steps(model_dir)[1]:
    assert child.proc.poll() is None and time.monotonic() < deadline, child.finish(60)
    time.sleep(0.2)
  bucket.kill()
  try:
    began = time.monotonic()
    returncode, _, err = child.finish(240)
    waited = time.monotonic() - began
  finally:
    bucket.start()
  assert returncode == 5, err[-3000:]
  assert waited < 180, waited
  line = err.strip().splitlines()[-1]
  assert re.match(r"t5lite: CheckpointWriteError: Could not write checkpoint step \d+ to "
                  rf"{model_dir}/checkpoints: .*Check that the bucket can be reached", line), line
  assert "Traceback" not in err, err[-3000:]
  assert "Could not remove the lock" in err
  assert paths.Path(f"{model_dir}/train.lock").exists()
  committed = checkpoints.list_steps(model_dir)[1]
  assert 2 in committed and max(committed) < 6, committed
  out = run_in_process(args, str(tmp_path), monkeypatch)
  assert f"Restoring step {max(committed)}" in out
  assert checkpoints.list_steps(model_dir)[1][-1] == 6


@pytest.mark.slow
def test_an_unreadable_newest_step_in_a_bucket_is_set_aside_and_the_run_falls_back(
    bucket, tmp_path, monkeypatch, caplog):
  """As on a disk (docs/checkpoints.md): a step whose array files are
  garbage is named in one warning, moved whole to checkpoints-unreadable/
  in the bucket, and the run resumes from the step before it."""
  model_dir = _url("runs/damaged")
  args = [*TINY, *SHALLOW, "--gin.EVAL_PERIOD=0", "--gin.CHECKPOINT_PERIOD=2",
          "--gin.CHECKPOINTS_TO_KEEP=None", f"--gin.MODEL_DIR='{model_dir}'"]
  run_in_process([*args, "--gin.TRAIN_STEPS=4"], str(tmp_path), monkeypatch)
  step_4 = paths.Path(f"{model_dir}/checkpoints/4")
  chunks = [f for f in paths.files_under(step_4) if f.parent.name == "d"]
  assert chunks
  for chunk in chunks:
    chunk.write_bytes(os.urandom(len(chunk.read_bytes())))
  damaged = {os.fspath(f)[len(os.fspath(step_4)):]: f.read_bytes()
             for f in paths.files_under(step_4)}
  caplog.clear()
  out = run_in_process([*args, "--gin.TRAIN_STEPS=6"], str(tmp_path), monkeypatch)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert [w for w in warnings if w.startswith(f"Checkpoint {model_dir}/checkpoints/4 is "
                                              "unreadable") and "falling back to step 2" in w]
  assert "steps 2 -> 6;" in out and "step 6/6" in out
  aside = paths.Path(f"{model_dir}/checkpoints-unreadable/4")
  assert {os.fspath(f)[len(os.fspath(aside)):]: f.read_bytes()
          for f in paths.files_under(aside)} == damaged
  assert checkpoints.list_steps(model_dir)[1] == [2, 4, 6]
