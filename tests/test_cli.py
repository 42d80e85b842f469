"""The console script end to end (in this process, or as a real process
where the test is about the process), and gin flag precedence."""

import contextlib
import glob
import io
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

import gin
from t5lite import cli, console, metrics, testing
from t5lite.errors import UserError


BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--gin_file=gin/pretrain_dense.gin", "--gin_file=gin/testing/local_tiny.gin"]
# One encoder and one decoder layer, for runs where nothing a test checks
# depends on depth: the shallower model compiles in about half the time.
SHALLOW_BINDINGS = ["transformer.TransformerConfig.num_encoder_layers = 1",
                    "transformer.TransformerConfig.num_decoder_layers = 1"]
SHALLOW = ["--gin." + binding.replace(" ", "") for binding in SHALLOW_BINDINGS]


# The 8-device launches below check placement and what a run logs (mesh
# lines, model-info, the expert metrics' tags), not the numbers; the processes
# start at XLA's optimisation level 0 (tests/conftest.py).
ON_EIGHT_DEVICES = pytest.mark.fast_compile(
    "it checks the mesh, the partition specs in model-info.txt and which metrics are logged, "
    "not their values; 8 devices are compared with 1 at the default level by tests/test_moe.py "
    "(expert-parallel training), tests/test_decoding.py and tests/test_python_api.py")


def cli_env():
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")


def run_cli(args, cwd, script="t5lite-train", timeout=600):
  return subprocess.run([os.path.join(BIN, script), *args], cwd=cwd, env=cli_env(),
                        capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def launch_cache(configure=True):
  """JAX's compilation-cache settings put back after the block, and the cache
  let go of (the next use opens the directory set then). With `configure`,
  compiles in the block go through the cache $JAX_COMPILATION_CACHE_DIR
  names, as a launch's do: the test's own, or in a module fixture the
  module's (tests/conftest.py); a command run in the block configures it
  itself."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache as jax_cache

  from t5lite import compilation_cache
  names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_enable_xla_caches")
  settings = {name: getattr(jax.config, name) for name in names}
  if configure:
    compilation_cache.configure(None)
  try:
    yield
  finally:
    for name, value in settings.items():
      jax.config.update(name, value)
    jax_cache.reset_cache()


@contextlib.contextmanager
def _in_process(args, cwd, monkeypatch, script, cache):
  """Parses `script ARGS` as the console script would, in `cwd`, and yields
  the command's entry point; everything the command sets in this process
  (flags, gin, JAX's compilation-cache settings, sys.path, the modules it
  imported from `cwd`, such as a user's task module) is put back after.
  With `cache`, the command uses the cache directory the test's
  launches use ($JAX_COMPILATION_CACHE_DIR, tests/conftest.py), as a launch
  would; without, `--nocompilation_cache`."""
  monkeypatch.chdir(cwd)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the command adds cwd to it
  imported = set(sys.modules)
  cli.FLAGS.unparse_flags()
  cli.FLAGS(cli.rewrite_gin_args([script, *([] if cache else ["--nocompilation_cache"]),
                                  *args]))
  gin.clear_config(clear_constants=True)
  try:
    with launch_cache(configure=False):
      yield cli.ENTRIES[script]
  finally:
    cli.FLAGS.unparse_flags()
    gin.clear_config(clear_constants=True)
    folder = os.path.join(os.path.abspath(cwd), "")
    for name in set(sys.modules) - imported:
      if (getattr(sys.modules[name], "__file__", None) or "").startswith(folder):
        del sys.modules[name]


def user_error_line(args, cwd, monkeypatch, script="t5lite-train"):
  """What `script ARGS` in `cwd` prints as its one line (after "t5lite: ")
  before it exits 2, found by running the command in this process: for
  bad-input checks, which need no process of their own. Fails the test if
  the command raises no `UserError`."""
  with _in_process(args, cwd, monkeypatch, script, cache=False) as entry:
    with pytest.raises(UserError) as raised:
      cli.start(entry)()
  return console.one_line(raised.value)


def tool_error_line(work, script, args, cwd, monkeypatch):
  """What a console script that joins no job (t5lite-vocab) prints as its one
  line before it exits 2, found by parsing ARGS as its flags and calling
  `work`, its function, in `cwd` in this process. Fails the test if `work`
  raises no `UserError`. (t5lite-import's flags share names with
  t5lite-train's, so it cannot be loaded next to them: its tests start it.)"""
  monkeypatch.chdir(cwd)
  cli.FLAGS.unparse_flags()
  cli.FLAGS([script, *args])
  try:
    with pytest.raises(UserError) as raised:
      work()
  finally:
    cli.FLAGS.unparse_flags()
  return f"{script}: {console.one_line(raised.value)}"


def run_in_process(args, cwd, monkeypatch, script="t5lite-train"):
  """Runs `script ARGS` in `cwd` in this process and returns what its run
  printed to stdout: for tests that check what a run writes or computes,
  not how its process behaves (exit status, signals, its console), which
  `run_cli` and `Child` start a process for. It compiles, and reads and
  writes the compilation cache, as a launch would. An error
  propagates."""
  out = io.StringIO()
  with _in_process(args, cwd, monkeypatch, script, cache=True) as entry:
    with contextlib.redirect_stdout(out):
      cli.start(entry)()
  return out.getvalue()


class Child:
  """A console script running in the background, for tests that act on it
  while it runs (signals, kills).

  Threads drain stdout and stderr as they arrive, so a chatty child never
  blocks on a full pipe, and every wait has a deadline: a stuck child fails
  the test (and is killed) instead of hanging the test run.
  """

  def __init__(self, args, cwd, script="t5lite-train"):
    self.proc = subprocess.Popen([os.path.join(BIN, script), *args], cwd=cwd, env=cli_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self._stdout_lines = queue.Queue()
    self._out, self._err = [], []
    self._threads = [threading.Thread(target=self._drain, args=(self.proc.stdout, self._out,
                                                                 self._stdout_lines)),
                     threading.Thread(target=self._drain, args=(self.proc.stderr, self._err, None))]
    for thread in self._threads:
      thread.daemon = True
      thread.start()

  @staticmethod
  def _drain(stream, lines, notify):
    for line in stream:
      lines.append(line)
      if notify is not None:
        notify.put(line)
    if notify is not None:
      notify.put(None)  # end of output

  def wait_for_line(self, prefix, timeout):
    """Returns the first stdout line starting with `prefix`; fails the test if
    none comes within `timeout` seconds or the child ends first."""
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self._stdout_lines.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        self.proc.kill()
        self.finish(60)
        pytest.fail(f"no stdout line starting with {prefix!r} within {timeout}s; "
                    f"stderr ends:\n{''.join(self._err)[-3000:]}")
      if line is None:
        returncode, _, err = self.finish(60)
        pytest.fail(f"exited ({returncode}) before printing a line starting with {prefix!r}; "
                    f"stderr ends:\n{err[-3000:]}")
      if line.startswith(prefix):
        return line

  def finish(self, timeout):
    """Waits for the child to end (killing it after `timeout` seconds, which
    fails the test) and returns (returncode, stdout, stderr)."""
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(timeout=60)
      pytest.fail(f"still running after {timeout}s; stderr ends:\n{''.join(self._err)[-3000:]}")
    for thread in self._threads:
      thread.join(timeout=60)
    return self.proc.returncode, "".join(self._out), "".join(self._err)


# Other test modules import it from here under this name.
scalars = metrics.read_scalars


# ---------------------------------------------------------------------------
# Gin precedence, in-process


def _write(path, text):
  path.write_text(text)
  return str(path)


def test_gin_precedence_files_then_bindings_then_shorthand(tmp_path, clean_gin):
  header = "from __gin__ import dynamic_registration\nfrom t5lite import checkpoints\n"
  a = _write(tmp_path / "a.gin", header + "checkpoints.SaveCheckpointConfig.period = 1\n"
             "checkpoints.SaveCheckpointConfig.keep = 1\n")
  b = _write(tmp_path / "b.gin", header + "checkpoints.SaveCheckpointConfig.period = 2\n")
  argv = cli.rewrite_gin_args(["prog", "--gin.checkpoints.SaveCheckpointConfig.keep=7"])
  assert argv[1] == "--gin_bindings=checkpoints.SaveCheckpointConfig.keep = 7"
  bindings = ["checkpoints.SaveCheckpointConfig.period = 3",
              argv[1].split("=", 1)[1]]
  cli.parse_gin([a, b], bindings[:1], [str(tmp_path)])
  from t5lite import checkpoints
  cfg = gin.get_configurable(checkpoints.SaveCheckpointConfig)()
  assert cfg.period == 3 and cfg.keep == 1   # binding beats both files
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin([a, b], [], [str(tmp_path)])
  assert gin.get_configurable(checkpoints.SaveCheckpointConfig)().period == 2  # later file wins
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin([a, b], bindings, [str(tmp_path)])
  assert gin.get_configurable(checkpoints.SaveCheckpointConfig)().keep == 7  # --gin. is a binding


def test_gin_file_resolves_from_package_root_anywhere(tmp_path, clean_gin):
  paths = cli.gin_search_paths([])
  assert os.path.exists(os.path.join(cli.package_gin_root(), "gin", "pretrain_dense.gin"))
  with pytest.raises(ValueError, match="Gin file 'gin/nope.gin' not found"):
    cli.parse_gin(["gin/nope.gin"], [], paths)


def test_start_up_collects_garbage_less_and_freezes_what_it_built(tmp_path):
  # What the entry point sees: the larger youngest generation, and the
  # imported libraries frozen (later collections skip them).
  script = ("import gc, sys\nfrom t5lite import cli\n"
            "def entry():\n"
            "  import jax, seqio\n"
            "  return lambda: print('gc', gc.get_threshold()[0], gc.get_freeze_count())\n"
            "sys.argv = ['t5lite-train']\ncli._main(entry)\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=cli_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  _, threshold, frozen = out.stdout.split()
  assert int(threshold) == 10_000 and int(frozen) > 100_000, out.stdout


def test_child_drains_stderr_and_fails_instead_of_hanging(tmp_path):
  # 1 MB on stderr fills any pipe buffer: a reader of stdout alone would wait
  # forever for "ready" while the child waits for room on stderr.
  chatty = Child(["-c", "import sys, time\nsys.stderr.write('x' * 2**20)\nsys.stderr.flush()\n"
                  "print('ready', flush=True)\ntime.sleep(600)"], cwd=str(tmp_path),
                 script="python")
  assert chatty.wait_for_line("ready", timeout=120) == "ready\n"
  chatty.proc.kill()
  returncode, _, err = chatty.finish(timeout=60)
  assert returncode < 0 and len(err) == 2**20
  # A child that never prints the line fails the test at the deadline, killed.
  stuck = Child(["-c", "import time; time.sleep(600)"], cwd=str(tmp_path), script="python")
  started = time.monotonic()
  with pytest.raises(pytest.fail.Exception, match="no stdout line starting with 'step'"):
    stuck.wait_for_line("step", timeout=2)
  assert time.monotonic() - started < 60 and stuck.proc.returncode is not None


# ---------------------------------------------------------------------------
# End to end (marked slow: they train; part of `make test`). The console
# script runs in this process (`run_in_process`) unless the test is about its
# process: exit status, stderr, devices set before JAX starts.


def test_bad_periods_write_nothing(tmp_path, monkeypatch):
  model_dir = tmp_path / "run"
  line = user_error_line([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.EVAL_PERIOD=3"],
                         str(tmp_path), monkeypatch)
  assert "is not a multiple of" in line and "eval_period=3" in line
  assert not model_dir.exists()


def test_unknown_task_names_the_closest_one(tmp_path, monkeypatch):
  line = user_error_line([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
                          "--gin.MIXTURE_OR_TASK_NAME='t5lite_span_corruptoin'"], str(tmp_path),
                         monkeypatch)
  assert "t5lite_span_corruptoin" in line and "t5lite_span_corruption" in line


# A bug that shows only hours into a run: the train step raises a TypeError
# at step 3, as a shape or type mistake in a model would. The module is
# loaded as the run's task module, the way a user's own code is.
_BUG_AT_STEP_3 = """
from t5lite import trainer

_compile = trainer.Trainer.compile_train_step


class BuggyAtStep3:
  def __init__(self, step_fn):
    self._step_fn, self._calls = step_fn, 0

  def __getattr__(self, name):
    return getattr(self._step_fn, name)

  def __call__(self, state, batch):
    self._calls += 1
    if self._calls == 3:
      raise TypeError("injected at step 3: unsupported operand type(s) for +: 'int' and 'NoneType'")
    return self._step_fn(state, batch)


trainer.Trainer.compile_train_step = lambda self, *args: BuggyAtStep3(_compile(self, *args))
"""


# For launches whose evaluation output no check reads.
_NO_EVAL = "--gin.EVAL_PERIOD=0"


USER_TASKS = """
import seqio
from t5lite import testing

testing.register_in_memory_task(
    "my_copy_task",
    [{"inputs": f"copy {i}", "targets": f"{i}"} for i in range(64)])
"""


@pytest.mark.slow
def test_train_writes_outputs_resumes_trains_user_task_and_late_bug_shows_traceback_exits_1(
    tmp_path, monkeypatch):
  # Launches of one configuration (model and shapes) in one test, so that they
  # share its compilation cache: the user's task and the buggy run compile
  # nothing the first launch did not.
  tiny = [*TINY, *SHALLOW]
  model_dir = tmp_path / "run"
  # A relative MODEL_DIR, as in `make train`.
  first = run_in_process([*tiny, "--gin.MODEL_DIR='run'"], str(tmp_path), monkeypatch)
  # Outputs a user opens.
  config = (model_dir / "config.gin").read_text()
  assert "train_lib.train" in config and "TRAIN_STEPS = 4" in config
  info = (model_dir / "model-info.txt").read_text()
  assert "Total number of parameters" in info and "logical" in info and "partition" in info
  assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4"]
  losses = scalars(str(model_dir / "train"), "loss")
  assert sorted(losses) == [2, 4] and all(v > 0 for v in losses.values())
  # A CPU has no datasheet peak: model FLOP/s, no MFU.
  assert "FLOP/s" in first and "MFU" not in first
  eval_dirs = glob.glob(str(model_dir / "training_eval" / "*"))
  assert eval_dirs and scalars(eval_dirs[0], "loss")
  assert "step 4/4" in first

  # Same command with more steps resumes from step 4 instead of starting over.
  # A peak bound by the user adds MFU to the progress line and the summaries.
  second = run_in_process([*tiny, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=6",
                           "--gin.train_lib.train.peak_flops_per_device=1e6"], str(tmp_path),
                          monkeypatch)
  assert "Restoring step 4" in second
  assert re.search(r"step 6/6 .*FLOP/s  MFU [\d.]+%", second), second
  mfu, flops = (scalars(str(model_dir / "train"), tag)[6]
                for tag in ("timing/mfu", "timing/model_flops_per_second"))
  assert mfu == pytest.approx(flops / 1e6, rel=1e-5)
  assert "step 6/6" in second and "step 2/" not in second
  assert "6" in os.listdir(model_dir / "checkpoints")

  # relative_steps trains N more from the restored step; equal total trains nothing.
  third = run_in_process([*tiny, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=6"],
                         str(tmp_path), monkeypatch)
  assert "nothing to train" in third
  fourth = run_in_process([*tiny, f"--gin.MODEL_DIR='{model_dir}'",
                           "--gin.train_lib.train.relative_steps=2"], str(tmp_path), monkeypatch)
  assert "step 8/8" in fourth
  # CHECKPOINTS_TO_KEEP = 3 (pretrain_dense.gin): step 2 was pruned from disk.
  assert sorted(os.listdir(model_dir / "checkpoints"), key=int) == ["4", "6", "8"]

  # A task from a user's module.
  import seqio
  (tmp_path / "my_tasks.py").write_text(USER_TASKS)
  user_dir = tmp_path / "user"
  # The command imports the module into this process (`run_in_process` takes
  # it out again); the task it registers is removed here.
  try:
    run_in_process([*tiny, f"--gin.MODEL_DIR='{user_dir}'",
                    "--gin.MIXTURE_OR_TASK_MODULE='my_tasks'",
                    "--gin.MIXTURE_OR_TASK_NAME='my_copy_task'",
                    "--gin.TRAIN_STEPS=2"], str(tmp_path), monkeypatch)
  finally:
    seqio.TaskRegistry.remove("my_copy_task")
  assert "my_copy_task" in os.listdir(user_dir / "training_eval")
  assert "my_tasks" not in sys.modules

  # A bug hours into a run (_BUG_AT_STEP_3), in a process of its own: its
  # exit status and what it prints are the point.
  (tmp_path / "bug_at_step_3.py").write_text(_BUG_AT_STEP_3)
  bug_dir = tmp_path / "bug"
  out = run_cli([*tiny, _NO_EVAL, f"--gin.MODEL_DIR='{bug_dir}'", "--gin.TRAIN_STEPS=6",
                 "--gin.MIXTURE_OR_TASK_MODULE='bug_at_step_3'"], cwd=str(tmp_path))
  assert out.returncode == 1, out.stderr[-3000:]
  assert "Traceback (most recent call last)" in out.stderr, out.stderr[-3000:]
  assert 'bug_at_step_3.py", line' in out.stderr  # the frame that raised it
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("t5lite: Unexpected error, a bug in t5lite or a library"), last
  assert "TypeError: injected at step 3" in last, last
  # What was saved before the bug stays.
  assert os.listdir(bug_dir / "checkpoints") == ["2"]


@pytest.mark.slow
def test_decoder_only_lm_trains(tmp_path, monkeypatch):
  # One layer: the checks are about the model class and the steps trained.
  model_dir = tmp_path / "lm"
  run_in_process(["--gin_file=gin/models/decoder_only_tiny.gin",
                  "--gin_file=gin/runs/pretrain.gin", "--gin_file=gin/testing/local_tiny.gin",
                  f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIXTURE_OR_TASK_NAME='t5lite_lm'",
                  "--gin.TASK_FEATURE_LENGTHS={'targets': 32}", _NO_EVAL,
                  "--gin.transformer.TransformerConfig.num_decoder_layers=1"],
                 str(tmp_path), monkeypatch)
  assert "DecoderOnlyModel" in (model_dir / "config.gin").read_text()
  assert sorted(scalars(str(model_dir / "train"), "loss")) == [2, 4]


@pytest.mark.slow
@ON_EIGHT_DEVICES
def test_partitioning_preset_on_eight_devices(tmp_path):
  model_dir = tmp_path / "tp"
  env_args = dict(XLA_FLAGS=testing.fake_device_flags(8))
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env_args)
  out = subprocess.run([os.path.join(BIN, "t5lite-train"), *TINY,
                        "--gin_file=gin/partitioning/fsdp_tp.gin", *SHALLOW, _NO_EVAL,
                        f"--gin.MODEL_DIR='{model_dir}'"],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "mesh: fsdp 4 x model 2" in out.stdout
  info = (model_dir / "model-info.txt").read_text()
  wi = next(line for line in info.splitlines() if "encoder/layers_0/mlp/wi_0/kernel" in line)
  assert "logical ('embed', 'mlp') partition ('fsdp', 'model')" in wi
  assert "Mesh: {'data': 1, 'fsdp': 4, 'expert': 1, 'seq': 1, 'model': 2}" in info


@pytest.mark.slow
@ON_EIGHT_DEVICES
def test_moe_headline_logs_expert_metrics_and_splits_experts_on_eight_devices(tmp_path):
  # The headline MoE config under the expert-parallel preset: one launch
  # (8 fake devices must be set before JAX starts) for what a MoE run logs
  # and for how the preset splits its experts. The overlay's two layers per
  # stack stay: every second layer is an MoE one, so each stack has one.
  model_dir = tmp_path / "ep"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=testing.fake_device_flags(8))
  args = ["--gin_file=gin/pretrain_moe.gin", "--gin_file=gin/testing/local_tiny.gin",
          "--gin_file=gin/partitioning/expert_parallel.gin", f"--gin.MODEL_DIR='{model_dir}'",
          "--gin.NUM_EXPERT_PARTITIONS=4", "--gin.BATCH_SIZE=8"]
  out = subprocess.run([os.path.join(BIN, "t5lite-train"), *args, _NO_EVAL], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  for tag in ("experts/auxiliary_loss", "experts/router_z_loss",
              "experts/fraction_tokens_left_behind", "experts/expert_usage",
              "experts/router_confidence"):
    assert sorted(scalars(str(model_dir / "train"), tag)) == [2, 4], tag
  wi = next(line for line in (model_dir / "model-info.txt").read_text().splitlines()
            if "encoder/layers_1/moe/wi_0 " in line)
  assert "'expert', 'embed', 'expert_mlp'" in wi
  assert "partition ('expert', None, 'model')" in wi
  # 6 experts cannot split over 4 devices: one line, exit 2, nothing written.
  # (The later binding of MODEL_DIR wins.)
  bad = subprocess.run([os.path.join(BIN, "t5lite-train"), *args,
                        f"--gin.MODEL_DIR='{tmp_path / 'bad'}'", "--gin.NUM_EXPERTS=6"],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2
  assert "num_experts=6" in bad.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "bad").exists()
