"""Bad input fails before compiling, in one line, exit 2, leaving MODEL_DIR as it was."""

import hashlib
import os
import subprocess

import pytest
from test_cli import BIN, SHALLOW, TINY, run_cli, run_in_process, user_error_line

from t5lite import testing


def _snapshot(root):
  """Every file under root with its content hash and modification time."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
  return out


def _last_line(result):
  return result.stderr.strip().splitlines()[-1]


def test_checkpoint_of_another_model_shape_names_the_variables(tmp_path, monkeypatch):
  # In this process: what matters is what each run says and leaves on disk
  # (the exit 2 of a user error is checked through the console script below).
  model_dir = tmp_path / "run"
  # Neither evaluation nor depth matters to what is checked.
  base = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=2", "--gin.EVAL_PERIOD=0",
          *SHALLOW]
  run_in_process(base, str(tmp_path), monkeypatch)
  before = _snapshot(model_dir)
  rerun = run_in_process(base, str(tmp_path), monkeypatch)  # already at the target step: a no-op
  assert "Already at step 2 (target 2); nothing to train." in rerun
  assert _snapshot(model_dir) == before  # config.gin not rewritten
  line = user_error_line([*base, "--gin.TRAIN_STEPS=4",
                          "--gin.transformer.TransformerConfig.mlp_dim=32"], str(tmp_path),
                         monkeypatch)
  assert "does not match this model" in line
  assert "params/decoder/layers_0/mlp/wi_0/kernel is (8, 16) in the checkpoint but (8, 32)" in line
  assert _snapshot(model_dir) == before  # config.gin, model-info.txt, checkpoints untouched


# The one line and exit 2 of a user error, and nothing written, through the
# console script once; the checks below run what the command runs in this
# process (`user_error_line`), as the message is the same.
@pytest.mark.slow
def test_missing_required_macro(tmp_path):
  out = run_cli(TINY, cwd=str(tmp_path))
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [_last_line(out)], out.stderr[-3000:]
  assert _last_line(out).startswith("t5lite: ValueError: Macro MODEL_DIR is required "
                                    "(%gin.REQUIRED) but not set; pass --gin.MODEL_DIR=..."), \
      _last_line(out)
  assert os.listdir(tmp_path) == []


def test_model_dir_that_cannot_be_created(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  line = user_error_line([*TINY, f"--gin.MODEL_DIR='{blocker / 'run'}'"], str(tmp_path),
                         monkeypatch)
  assert "is not writable" in line and "choose another MODEL_DIR" in line


def test_restore_path_that_does_not_exist(tmp_path, monkeypatch):
  line = user_error_line(
      [*TINY, f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
       "--gin.checkpoints.CheckpointConfig.restore=@checkpoints.RestoreCheckpointConfig()",
       f"--gin.checkpoints.RestoreCheckpointConfig.path='{tmp_path / 'nope'}'"],
      str(tmp_path), monkeypatch)
  assert "No checkpoint found under restore path" in line
  assert not (tmp_path / "r").exists()  # not even an empty checkpoints/ directory


# t5lite reads checkpoints from gs:// buckets (tests/test_object_storage.py)
# but writes only local files: a URL where it writes, or of a storage it
# cannot read, is refused by name before anything is read or written, instead
# of becoming a local directory `gs:` under the working directory.
_EVAL = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/eval.gin",
         "--gin_file=gin/testing/local_tiny.gin", "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'"]
_INFER = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/infer.gin",
          "--gin_file=gin/testing/local_tiny.gin"]
_EXPORT = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/export.gin"]


@pytest.mark.parametrize("script, args, named", [
    ("t5lite-train", [*TINY, "--gin.MODEL_DIR='s3://bucket/run'"], "MODEL_DIR 's3://bucket/run'"),
    ("t5lite-train", ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/finetune.gin",
                      "--gin_file=gin/testing/local_tiny.gin", "--gin.MODEL_DIR='new'",
                      "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'",
                      "--gin.INITIAL_CHECKPOINT_PATH='s3://b/ckpt'"], "path 's3://b/ckpt'"),
    ("t5lite-eval", [*_EVAL, "--gin.CHECKPOINT_PATH='s3://b/run'", "--gin.EVAL_OUTPUT_DIR='out'"],
     "path 's3://b/run'"),
    ("t5lite-eval", [*_EVAL, "--gin.CHECKPOINT_PATH='run'", "--gin.EVAL_OUTPUT_DIR='s3://b/e'"],
     "EVAL_OUTPUT_DIR 's3://b/e'"),
    ("t5lite-infer", [*_INFER, "--gin.CHECKPOINT_PATH='run'", "--gin.INFER_OUTPUT_DIR='out'",
                      "--gin.INPUT_FILE='s3://b/in.txt'"], "INPUT_FILE 's3://b/in.txt'"),
    ("t5lite-infer", [*_INFER, "--gin.CHECKPOINT_PATH='run'", "--gin.INFER_OUTPUT_DIR='s3://b/o'",
                      "--gin.INPUT_FILE='in.txt'"], "INFER_OUTPUT_DIR 's3://b/o'"),
    ("t5lite-export", [*_EXPORT, "--gin.CHECKPOINT_PATH='run'", "--gin.EXPORT_DIR='s3://b/hf'"],
     "EXPORT_DIR 's3://b/hf'"),
])
def test_an_object_storage_url_is_refused_by_name_and_nothing_is_written(
    tmp_path, monkeypatch, script, args, named):
  (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
  before = sorted(os.listdir(tmp_path))
  line = user_error_line(args, str(tmp_path), monkeypatch, script=script)
  assert named in line and " URL; " in line and "mounted" in line, line
  assert sorted(os.listdir(tmp_path)) == before
  assert os.listdir(tmp_path / "run") == ["checkpoints"]
  assert os.listdir(tmp_path / "run" / "checkpoints" / "2") == []


@pytest.mark.parametrize("flags, named", [
    (["--source=s3://b/t5x/checkpoint_10"], "--source 's3://b/t5x/checkpoint_10'"),
    (["--source=.", "--output=s3://b/model.gin"], "--output 's3://b/model.gin'")])
def test_import_refuses_an_object_storage_url(tmp_path, flags, named):
  # A process of its own: t5lite-import's flags are not t5lite-train's.
  out = run_cli(flags, cwd=str(tmp_path), script="t5lite-import")
  assert out.returncode == 2, out.stderr[-3000:]
  assert named in _last_line(out) and " URL; " in _last_line(out), _last_line(out)
  assert os.listdir(tmp_path) == []


def test_feature_lengths_missing_a_feature(tmp_path, monkeypatch):
  model_dir = tmp_path / "run"
  line = user_error_line([*TINY, f"--gin.MODEL_DIR='{model_dir}'",
                          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32}"], str(tmp_path),
                         monkeypatch)
  assert "task_feature_lengths keys ['inputs'] do not match the output features" in line
  assert "'t5lite_span_corruption': ['inputs', 'targets']" in line
  assert not model_dir.exists()


@pytest.mark.slow
def test_batch_not_divisible_by_data_parallel_size(tmp_path, monkeypatch):
  # run_cli passes this process's environment on: 8 fake CPU devices there.
  monkeypatch.setenv("XLA_FLAGS", testing.fake_device_flags(8))
  model_dir = tmp_path / "run"
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.BATCH_SIZE=6"],
                cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-2000:]
  line = _last_line(out)
  assert "Batch size 6 must be a positive multiple of the data-parallel size 8" in line
  assert "change BATCH_SIZE or the mesh" in line
  assert not model_dir.exists()


# Task modules that print to stderr while the process stops: at interpreter
# shutdown, as the finalizer of a library object still alive can ("RuntimeError:
# Event loop is closed"), and from a thread that keeps writing, as a library
# thread (or a finalizer run by a collection in one) can. Either way the
# reason stays the last line.
_NOISY_AT_SHUTDOWN = """
import atexit, sys
atexit.register(lambda: print("RuntimeError: noise at shutdown", file=sys.stderr))
"""
_NOISY_THREAD = """
import sys, threading, time
printed = threading.Event()
def noise():
  while True:
    sys.stderr.write("noise from a library thread\\n")
    sys.stderr.flush()
    printed.set()
    time.sleep(0.0002)
threading.Thread(target=noise, daemon=True).start()
printed.wait()  # it has printed before the run stops, however busy the machine
"""


@pytest.mark.slow
@pytest.mark.parametrize("module, text, noise, printed_before", [
    ("noisy_at_shutdown", _NOISY_AT_SHUTDOWN, "noise at shutdown", False),
    ("noisy_thread", _NOISY_THREAD, "noise from a library thread", True),
])
def test_reason_stays_the_last_line_whatever_else_prints(tmp_path, module, text, noise,
                                                          printed_before):
  (tmp_path / f"{module}.py").write_text(text)
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                 f"--gin.MIXTURE_OR_TASK_MODULE='{module}'",
                 "--gin.MIXTURE_OR_TASK_NAME='no_such_task'"], cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Unknown mixture or task 'no_such_task'" in _last_line(out), out.stderr[-2000:]
  assert (noise in out.stderr) == printed_before
  assert not (tmp_path / "run").exists()


# What JAX_PLATFORMS asks for must be on this machine. The CI machines have
# no NVIDIA GPU, and the test environment has no JAX CUDA or ROCm plugin, so
# neither value can start there; t5lite-eval shares the check.
@pytest.mark.slow
@pytest.mark.parametrize("script, platforms", [("t5lite-train", "gpu"), ("t5lite-eval", "cuda")])
def test_platform_this_machine_lacks_is_one_line_naming_what_it_has(tmp_path, script,
                                                                     platforms):
  model_dir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS=platforms, TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([os.path.join(BIN, script), *TINY, f"--gin.MODEL_DIR='{model_dir}'"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines() == [_last_line(out)], out.stderr[-3000:]
  assert _last_line(out).startswith(f"t5lite: ValueError: JAX_PLATFORMS='{platforms}' names a "
                                    "platform this machine does not have: "), _last_line(out)
  assert "'cuda'" in _last_line(out)
  assert "This machine has: cpu; set JAX_PLATFORMS=cpu, or unset it" in _last_line(out)
  assert not model_dir.exists()


@pytest.mark.parametrize("script, line", [
    ("t5lite-train", "t5lite: Unknown flag --gin_fiel; did you mean --gin_file?"),
    ("t5lite-import", "t5lite-import: Unknown flag --gin_fiel."),
    ("t5lite-vocab", "t5lite-vocab: Unknown flag --gin_fiel."),
])
def test_unknown_flag_is_one_line_naming_the_closest_known_one(tmp_path, script, line):
  out = run_cli(["--gin_fiel=x"], cwd=str(tmp_path), script=script, timeout=120)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip() == f"{line} --helpshort lists the flags.", out.stderr[-3000:]
