"""The persistent compilation cache t5lite's commands turn on by default."""

import os
import re
import subprocess
import sys

import jax
import pytest
from test_cli import SHALLOW, TINY, run_cli

from t5lite import compilation_cache


# The processes these tests start compile at XLA's optimisation level 0
# (tests/conftest.py).
ABOUT_THE_PROGRAMS_NOT_THEIR_NUMBERS = pytest.mark.fast_compile(
    "it checks which programs a launch compiles, stores and loads, not what they compute; a"
    " launch's cache entries are keyed by its XLA flags, the same for every launch of the "
    "test")


_SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_enable_xla_caches")


@pytest.fixture
def jax_cache_settings(monkeypatch):
  """JAX's cache settings as they were, after the test; no cache variables
  from the test environment."""
  saved = {name: getattr(jax.config, name) for name in _SETTINGS}
  for name in (compilation_cache.ENV_DIRECTORY, compilation_cache.ENV_MIN_COMPILE_TIME):
    monkeypatch.delenv(name, raising=False)
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def test_default_directory_is_under_the_users_cache(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  directory = compilation_cache.configure(None)
  assert directory == str(tmp_path / "xdg" / "t5lite" / "jax-compilation")
  assert os.path.isdir(directory)
  assert jax.config.jax_compilation_cache_dir == directory
  assert jax.config.jax_enable_compilation_cache
  # Every program is cached, however short its compile.
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
  assert compilation_cache.use().directory == directory
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.default_directory() == str(
      tmp_path / "home" / ".cache" / "t5lite" / "jax-compilation")


def test_flag_beats_environment_beats_default(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.setenv(compilation_cache.ENV_DIRECTORY, str(tmp_path / "from_env"))
  monkeypatch.setenv(compilation_cache.ENV_MIN_COMPILE_TIME, "2.5")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
  assert compilation_cache.configure(None) == str(tmp_path / "from_env")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5  # the user's, kept
  assert compilation_cache.configure(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "flag")


def test_off_when_asked_or_when_the_directory_cannot_be_made(tmp_path, caplog,
                                                            jax_cache_settings):
  assert compilation_cache.configure(str(tmp_path / "unused"), enabled=False) is None
  assert not jax.config.jax_enable_compilation_cache
  assert compilation_cache.use().describe() == "compilation cache off"
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert compilation_cache.configure(str(blocker / "cache")) is None
  assert not jax.config.jax_enable_compilation_cache
  (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
  assert warning.getMessage().startswith(f"Compilation cache off, {blocker / 'cache'} cannot be "
                                         "created (Not a directory)"), warning.getMessage()


# A launch that compiles one program with the cache t5lite configures.
_LAUNCH = """
import sys
from t5lite import compilation_cache
compilation_cache.configure(sys.argv[1])
import jax
print("result", jax.jit(lambda x: x * 3 + 1)(1.0))
"""


def _launch(cache):
  """What a launch prints besides its result, line by line."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  done = subprocess.run([sys.executable, "-c", _LAUNCH, str(cache)], capture_output=True,
                        text=True, timeout=300, env=dict(env, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0 and "result 4.0" in done.stdout, done.stderr[-3000:]
  return [line for line in (done.stdout + done.stderr).splitlines()
          if line.strip() and line != "result 4.0"]


def test_an_unreadable_entry_of_jax_cache_is_reported_once_and_replaced(tmp_path):
  cache = tmp_path / "cache"
  assert _launch(cache) == []
  (entry,) = cache.glob("jit_*-cache")
  good = entry.read_bytes()
  entry.write_bytes(good[:len(good) // 2])  # a write cut short
  (line,) = _launch(cache)
  assert f"Compilation cache entry {entry} unreadable (" in line, line
  assert "written in its place" in line
  assert entry.read_bytes() == good
  assert _launch(cache) == []


def _unprivileged():
  """A command prefix under which permission bits bind this user: root
  drops the capability that overrides them."""
  if os.geteuid() != 0:
    return []
  return ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"]


# For launches that only need to run: what a cache reports does not depend on
# depth or on evaluation. (The launches that count the programs loaded keep
# evaluation, so that every kind of program a run compiles is counted; one
# layer per stack compiles the same programs, smaller.)
_SMALLER = [*TINY, *SHALLOW, "--gin.EVAL_PERIOD=0"]


@pytest.mark.slow
@ABOUT_THE_PROGRAMS_NOT_THEIR_NUMBERS
def test_a_read_only_cache_is_read_with_one_line_and_the_run_succeeds(tmp_path):
  from test_cli import BIN, cli_env
  cache = tmp_path / "cache"
  cache.mkdir()
  cache.chmod(0o555)
  done = subprocess.run([*_unprivileged(), os.path.join(BIN, "t5lite-train"), *_SMALLER,
                         f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                         f"--compilation_cache_dir={cache}"],
                        cwd=str(tmp_path), env=cli_env(), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  said = [line for line in (done.stdout + done.stderr).splitlines()
          if "compilation cache" in line.lower() and "program(s) loaded" not in line]
  assert len(said) == 1 and said[0].startswith("W"), said  # an absl warning
  assert said[0].endswith(f"] Compilation cache {cache} is read-only (Permission denied); its "
                          "programs are read, none are written."), said
  assert list(cache.iterdir()) == []
  assert list((tmp_path / "run").glob("checkpoints/[0-9]*"))


_USE = re.compile(r"compilation cache (\S+): (\d+) program\(s\) loaded, (\d+) compiled")


@pytest.mark.slow
@ABOUT_THE_PROGRAMS_NOT_THEIR_NUMBERS
def test_a_second_launch_loads_every_program_and_the_flag_turns_it_off(tmp_path):
  cache = tmp_path / "cache"
  uses = []
  for run in ("first", "second"):
    done = run_cli([*TINY, *SHALLOW, f"--gin.MODEL_DIR='{tmp_path / run}'",
                    f"--compilation_cache_dir={cache}"], cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    match = _USE.search(done.stdout)
    assert match, done.stdout[-2000:]
    uses.append((match.group(1), int(match.group(2)), int(match.group(3))))
  (first_dir, first_loaded, first_compiled), (second_dir, second_loaded, second_compiled) = uses
  assert first_dir == second_dir == str(cache)
  assert first_compiled > 0
  assert second_loaded == first_loaded + first_compiled and second_compiled == 0
  assert list((tmp_path / "second").glob("checkpoints/[0-9]*"))  # where a run keeps them
  done = run_cli([*_SMALLER, f"--gin.MODEL_DIR='{tmp_path / 'off'}'", "--nocompilation_cache"],
                 cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "compilation cache off" in done.stdout


# Partitioned.prepare: the train step compiled before its first batch.


@pytest.fixture
def cache(tmp_path, jax_cache_settings):
  """The compilation cache in tmp_path, JAX's cache opened afresh there
  (and again after the test, where the settings were)."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cache
  jax_cache.reset_cache()
  compilation_cache.configure(str(tmp_path / "cache"))
  yield tmp_path / "cache"
  jax_cache.reset_cache()


class _Traced:
  """`x * scale + 1`; counts its traces."""

  def __init__(self, scale: float = 2.0):
    self.scale, self.traces = scale, 0

  def fn(self, x):
    self.traces += 1
    return {"y": x * self.scale + 1}


def test_train_step_prepared_from_the_abstract_batch_serves_the_real_batches(cache):
  """Training compiles its step's program while the first batches are built,
  from their shapes and shardings alone, through JAX's cache (which a second
  launch reads: see the CLI test above); the batches that then arrive run
  that program, not a second trace and compile by jit."""
  from test_data import _config

  from t5lite import feeder, partitioning, testing
  from t5lite.data import tasks
  partitioner = partitioning.Partitioner(num_partitions=1)
  data = feeder.TrainData(testing.tiny_encoder_decoder(), _config(tasks.SPAN_CORRUPTION, pack=True),
                          partitioner, prefetch_batches=0)
  abstract = data.abstract_batch()
  batch = next(data)
  traced = _Traced()

  def tokens(batch):
    traced.fn(0.0)  # counts the trace
    return jax.tree.map(lambda x: x.sum(), batch)

  step = partitioner.partition(tokens, in_shardings=(data.shardings,), out_shardings=None)
  before = compilation_cache.use()
  step.prepare(abstract)
  assert compilation_cache.use().compiled == before.compiled + 1
  assert len(list(cache.glob("jit_tokens-*-cache"))) == 1
  for _ in range(2):
    assert step(batch) == jax.tree.map(lambda x: x.sum(), batch)
  assert step._compiled and traced.traces == 1  # prepared once, no jit fallback


def test_partitioned_calls_other_than_prepared_go_to_jit(cache):
  from t5lite import partitioning
  partitioner = partitioning.Partitioner(num_partitions=1)
  x = jax.numpy.ones((2, 3))
  traced = _Traced()
  step = partitioner.partition(traced.fn, in_shardings=None, out_shardings=None)
  step.prepare(jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert (step(x)["y"] == 3).all() and traced.traces == 1
  assert (step(jax.numpy.ones((5,)))["y"] == 3).all() and traced.traces == 2
  assert step._compiled is False
  assert (step(x)["y"] == 3).all()
