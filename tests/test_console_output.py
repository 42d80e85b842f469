"""What a run shows: its metrics under one name each and on one scale, on the
console, in TensorBoard and in the JSONL files (issue 36 point 4), and a
first screen of t5lite's own lines only (issue 36 point 5)."""

import json
import logging
import os
import re
import shutil
import subprocess

import pytest
from test_cli import BIN, SHALLOW

from t5lite import cli, trainer
from t5lite.data import tasks


# A task whose every decoded prediction is right: the arithmetic task with a
# postprocessor that reads every output as the same word, so `exact_match`
# is 100 whatever the model decodes, the one value that tells a percentage
# from a fraction.
TASK = "console_all_right"
TASK_MODULE = f"""
import seqio
from t5lite.data import tasks

def same_word(output, example=None, is_target=False):
  return "right"

if {TASK!r} not in seqio.TaskRegistry.names():
  arithmetic = seqio.get_mixture_or_task(tasks.ARITHMETIC)
  seqio.TaskRegistry.add(
      {TASK!r}, source=arithmetic.source, output_features=arithmetic.output_features,
      preprocessors=arithmetic.preprocessors, postprocess_fn=same_word,
      metric_fns=[tasks.exact_match_accuracy])
"""

# The tiny model, one encoder and one decoder layer (nothing checked
# depends on depth), for 4 steps at a learning rate of 0.5 (rsqrt warm-up
# over 4 steps): it gets some tokens right, so `token_accuracy` is well above 1.
RUN = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/finetune.gin",
       "--gin_file=gin/testing/local_tiny.gin", *SHALLOW, "--gin.INITIAL_CHECKPOINT_PATH=None",
       f"--gin.MIXTURE_OR_TASK_NAME='{TASK}'", "--gin.MIXTURE_OR_TASK_MODULE='console_tasks'",
       "--gin.infer_eval/datasets.DatasetConfig.batch_size=200", "--gin.TRAIN_STEPS=4",
       "--gin.EVAL_PERIOD=4", "--gin.CHECKPOINT_PERIOD=4",
       "--gin.optimizers.rsqrt_with_warmup.warmup_steps=4"]

# t5lite's own lines on stderr. console.py and cli.py write one kind
# themselves: "<program>: <one line>" (a reason to stop, a flag error). The
# other kind is an absl log record of a t5lite module, which absl formats as
# "<level letter><MMDD> <HH:MM:SS.micro> <thread id> <file>:<line>] <message>";
# absl names the file without its directory, so a t5lite record is one whose
# file is a module of t5lite's.
_PROGRAM_LINE = re.compile(r"t5lite(-\w+)?: \S")
_ABSL_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ (?P<file>[\w.]+\.py):\d+\] ")
_T5LITE_FILES = {name for _, _, names in os.walk(os.path.dirname(cli.__file__))
                 for name in names if name.endswith(".py")}


def own_line(line):
  """Whether `line` of stderr is one t5lite wrote (see above)."""
  if _PROGRAM_LINE.match(line):
    return True
  record = _ABSL_LINE.match(line)
  return bool(record) and record.group("file") in _T5LITE_FILES


def _user_env(cache):
  """The environment of a newcomer's shell: nothing quiets TensorFlow or
  picks JAX's platform; a compilation cache of the test's own."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS") and not k.startswith("PYTHONWARN")}
  return dict(env, JAX_COMPILATION_CACHE_DIR=str(cache))


def _train(tmp_path, *extra):
  """Trains RUN in a real process in `tmp_path`: (the finished process, MODEL_DIR)."""
  (tmp_path / "console_tasks.py").write_text(TASK_MODULE)
  model_dir = tmp_path / "run"
  done = subprocess.run([os.path.join(BIN, "t5lite-train"), *RUN, f"--gin.MODEL_DIR='{model_dir}'",
                         *extra], cwd=str(tmp_path), env=_user_env(tmp_path / "cache"),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done, model_dir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One real run at the default verbosity (train-eval and inference eval),
  most of a minute; the tests only read it."""
  return _train(tmp_path_factory.mktemp("console"))


def _tags(logdir):
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
  acc.Reload()
  return set(acc.Tags()["scalars"]) | set(acc.Tags()["tensors"])


def _table(stdout, title):
  """{column: value} of the one-task table under `title` on the console."""
  lines = stdout.splitlines()
  at = lines.index(title)
  header, row = lines[at + 1].split(), lines[at + 2].split()
  assert header[0] == "task" and row[0] == TASK, lines[at:at + 3]
  return {name: float(value) for name, value in zip(header[1:], row[1:])}


@pytest.mark.slow
def test_a_tiny_run_names_each_accuracy_on_one_scale_and_shows_only_its_own_lines(tiny_run):
  # One run for the three checks: each is a few seconds, the run most of a minute.
  done, model_dir = tiny_run
  _check_token_accuracy(done, model_dir)
  _check_exact_match(done, model_dir)
  _check_first_screen(done)


def _check_token_accuracy(done, model_dir):
  """Training and train-eval report `token_accuracy`, in percent."""
  from t5lite.metrics import read_scalars
  shown = _table(done.stdout, "train-eval at step 4")
  assert "token_accuracy" in shown and "accuracy" not in shown, shown
  logged = read_scalars(str(model_dir / "training_eval" / TASK), "token_accuracy")
  assert logged.keys() == {4}
  # The same number on the console and in TensorBoard; above 1, so not a fraction.
  assert shown["token_accuracy"] == pytest.approx(logged[4], abs=5e-5)
  assert 1 < logged[4] <= 100
  trained = read_scalars(str(model_dir / "train"), "token_accuracy")
  assert trained.keys() == {2, 4} and all(0 <= v <= 100 for v in trained.values())
  for logdir in (model_dir / "train", model_dir / "training_eval" / TASK):
    assert "accuracy" not in _tags(logdir)


def _check_exact_match(done, model_dir):
  """The inference eval reports `exact_match`, in percent."""
  from t5lite.metrics import read_scalars
  assert _table(done.stdout, "inference eval at step 4") == {"exact_match": 100.0}
  out = model_dir / "inference_eval"
  assert read_scalars(str(out / TASK), "exact_match") == {4: 100.0}
  assert "accuracy" not in _tags(out / TASK)
  rows = [json.loads(line) for line in (out / f"{TASK}-metrics.jsonl").read_text().splitlines()]
  assert rows == [{"step": 4, "exact_match": 100.0}]


def test_token_accuracy_has_the_scale_of_exact_match():
  assert trainer.TOKEN_ACCURACY_SCALE == 100.0
  assert tasks.exact_match_accuracy(["a", "b"], ["a", "c"]) == {"exact_match": 50.0}


def _check_first_screen(done):
  """stderr holds t5lite's own lines only; stdout no library's."""
  assert [line for line in done.stderr.splitlines() if not own_line(line)] == [], done.stderr
  # Nothing a library prints to stdout either (AutoGraph echoes its
  # warnings there in an interactive session).
  assert not any(_ABSL_LINE.match(line) or "WARNING" in line or "AutoGraph" in line
                 for line in done.stdout.splitlines()), done.stdout
  assert done.stdout.startswith("t5lite: training EncoderDecoder")


@pytest.mark.slow
def test_an_explicit_verbosity_brings_the_library_lines_back(tiny_run, tmp_path):
  # The same command again on a copy of the finished run, with --v=0
  # (absl's short spelling of --verbosity=0: INFO and up). It finds step 4
  # there, so it restores the checkpoint and trains nothing: the library
  # lines of that restore are what must show.
  _, model_dir = tiny_run
  shutil.copytree(model_dir, tmp_path / "run")
  done, _ = _train(tmp_path, "--v=0")
  assert "nothing to train" in done.stdout, done.stdout
  library = [line for line in done.stderr.splitlines() if not own_line(line)]
  assert any("checkpoint_manager.py" in line for line in library), done.stderr[-3000:]


@pytest.mark.parametrize("argv,given", [
    (["t5lite-train"], False),
    (["t5lite-train", "--gin.MODEL_DIR='v'", "--vocabulary=x"], False),
    (["t5lite-train", "--verbosity=1"], True),
    (["t5lite-train", "--verbosity", "0"], True),
    (["t5lite-train", "--v=0"], True),
    (["t5lite-train", "-v", "1"], True),
    (["t5lite-train", "-v=-1"], True),
    (["t5lite-train", "--", "--v=0"], False),
])
def test_verbosity_is_seen_in_every_spelling_absl_accepts(argv, given):
  assert cli.verbosity_given(argv) is given


def _autograph_warning():
  """The warning AutoGraph logs when it leaves a map function as written
  (two lambdas on one line: it cannot tell their sources apart), as the
  record TensorFlow's logger makes of it."""
  import tensorflow as tf
  records = []

  class Keep(logging.Handler):
    def emit(self, record):
      records.append(record)

  keep = Keep()
  tf.get_logger().addHandler(keep)
  try:
    ds = tf.data.Dataset.range(3)
    ds.map(lambda x: x + 1).map(lambda x: x * 2)
  finally:
    tf.get_logger().removeHandler(keep)
  return [r for r in records if "AutoGraph could not transform" in r.getMessage()]


def test_autograph_s_warning_is_kept_off_the_first_screen():
  (warning, *_) = _autograph_warning()
  assert warning.levelno == logging.WARNING
  assert not cli._drop_library_warnings(warning)
  # A library's errors still show.
  error = logging.makeLogRecord(dict(warning.__dict__, levelno=logging.ERROR,
                                     levelname="ERROR"))
  assert cli._drop_library_warnings(error)
  # t5lite's own warnings show.
  own = logging.makeLogRecord(dict(warning.__dict__, pathname=cli.__file__))
  assert cli._drop_library_warnings(own)
