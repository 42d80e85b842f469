"""The persistent compilation cache t5lite's commands turn on by default."""

import os
import pickle
import re
import subprocess
import sys

import jax
import pytest

from t5lite import compilation_cache
from test_cli import TINY, run_cli

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
  compilation_cache.configure(None, enabled=False)  # the program store off again


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


def test_off_when_asked_or_when_the_directory_cannot_be_made(tmp_path, capsys,
                                                            jax_cache_settings):
  assert compilation_cache.configure(str(tmp_path / "unused"), enabled=False) is None
  assert not jax.config.jax_enable_compilation_cache
  assert compilation_cache.use().describe() == "compilation cache off"
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert compilation_cache.configure(str(blocker / "cache")) is None
  assert not jax.config.jax_enable_compilation_cache
  warning = capsys.readouterr().out
  assert "compilation cache off" in warning and str(blocker / "cache") in warning


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
  assert line.startswith(f"t5lite: warning: compilation cache entry {entry} unreadable (")
  assert "written in its place" in line
  assert entry.read_bytes() == good
  assert _launch(cache) == []


def _unprivileged():
  """A command prefix under which permission bits bind this user: root
  drops the capability that overrides them."""
  if os.geteuid() != 0:
    return []
  return ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"]


@pytest.mark.slow
def test_a_read_only_cache_is_read_with_one_line_and_the_run_succeeds(tmp_path):
  from test_cli import BIN, cli_env
  cache = tmp_path / "cache"
  cache.mkdir()
  cache.chmod(0o555)
  done = subprocess.run([*_unprivileged(), os.path.join(BIN, "t5lite-train"), *TINY,
                         f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                         f"--compilation_cache_dir={cache}"],
                        cwd=str(tmp_path), env=cli_env(), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  said = [line for line in (done.stdout + done.stderr).splitlines()
          if "warning" in line.lower() or "persistent compilation cache" in line]
  assert said == [f"t5lite: warning: compilation cache {cache} is read-only (Permission "
                  "denied); its programs are read, none are written."], said
  assert list(cache.iterdir()) == []
  assert list((tmp_path / "run").glob("checkpoints/[0-9]*"))


_USE = re.compile(r"compilation cache (\S+): (\d+) program\(s\) loaded, (\d+) compiled")


@pytest.mark.slow
def test_a_second_launch_loads_every_program_and_the_flag_turns_it_off(tmp_path):
  cache = tmp_path / "cache"
  uses = []
  for run in ("first", "second"):
    done = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / run}'",
                    f"--compilation_cache_dir={cache}"], cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    match = _USE.search(done.stdout)
    assert match, done.stdout[-2000:]
    uses.append((match.group(1), int(match.group(2)), int(match.group(3))))
  (first_dir, first_loaded, first_compiled), (second_dir, second_loaded, second_compiled) = uses
  assert first_dir == second_dir == str(cache)
  assert first_compiled > 0
  assert second_loaded == first_loaded + first_compiled and second_compiled == 0
  # A stored train step that no longer matches what the code lowers to (its
  # recorded module changed by hand, as if something outside its key had):
  # the run stops in one line before it saves anything, and drops the entry.
  (entry,) = (cache / compilation_cache.PROGRAMS_SUBDIR).glob("train_step-*.program")
  content = pickle.loads(entry.read_bytes())
  entry.write_bytes(pickle.dumps(dict(content, module="0" * 64)))
  done = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'stale'}'",
                  f"--compilation_cache_dir={cache}"], cwd=str(tmp_path))
  assert done.returncode == 1, done.stderr[-3000:]
  error_lines = [line for line in done.stderr.splitlines() if "train_step program" in line]
  assert len(error_lines) == 1 and "run the same command again" in error_lines[0]
  assert "Traceback" not in done.stderr
  assert not entry.exists()
  assert not list((tmp_path / "stale").glob("checkpoints/[0-9]*"))
  assert list((tmp_path / "second").glob("checkpoints/[0-9]*"))  # where a run keeps them
  done = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'off'}'", "--nocompilation_cache"],
                 cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "compilation cache off" in done.stdout


# The program store: executables kept under a key known before tracing.


@pytest.fixture
def store(tmp_path, jax_cache_settings, clean_gin):
  """The compilation cache and program store in tmp_path, JAX's cache opened
  afresh there (and again after the test, where the settings were)."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cache
  jax_cache.reset_cache()
  compilation_cache.configure(str(tmp_path / "cache"))
  yield tmp_path / "cache" / compilation_cache.PROGRAMS_SUBDIR
  jax_cache.reset_cache()


class _Traced:
  """`x * scale + 1` jitted; counts its traces."""

  def __init__(self, scale: float = 2.0):
    self.scale, self.traces = scale, 0
    self.jitted = jax.jit(self._fn)

  def _fn(self, x):
    self.traces += 1
    return {"y": x * self.scale + 1}


def _entries(directory, suffix=".program"):
  return sorted(p.name for p in directory.glob(f"*{suffix}")) if directory.exists() else []


def test_store_keeps_a_program_and_a_later_lookup_loads_it_without_tracing(store):
  x = jax.numpy.arange(6.0).reshape(2, 3)
  first = _Traced()
  before = compilation_cache.use()
  compiled = compilation_cache.load_or_compile("prog", (7,), (x,), first.jitted.lower)
  assert first.traces == 1 and _entries(store) == [p for p in _entries(store) if p.startswith("prog-")]
  assert len(_entries(store)) == 1
  assert compilation_cache.use().compiled == before.compiled + 1
  again = _Traced()  # a new process's function: only the store can spare its trace
  loaded = compilation_cache.load_or_compile("prog", (7,), (x,), again.jitted.lower)
  assert again.traces == 0
  assert compilation_cache.use().loaded == before.loaded + 1
  assert (loaded(x)["y"] == compiled(x)["y"]).all() and (loaded(x)["y"] == x * 2 + 1).all()
  compilation_cache.verify_loaded(wait=True)  # the same program: the check passes
  assert again.traces == 1 and len(_entries(store)) == 1


def test_store_key_covers_constants_argument_types_and_the_gin_config(store):
  import gin
  x = jax.numpy.zeros((2, 3))
  key = compilation_cache.program_key("prog", (1,), (x,))
  assert compilation_cache.program_key("prog", (1,), (x,)) == key
  assert compilation_cache.program_key("other", (1,), (x,)) != key
  assert compilation_cache.program_key("prog", (2,), (x,)) != key
  assert compilation_cache.program_key("prog", (1,), (jax.numpy.zeros((2, 4)),)) != key
  assert compilation_cache.program_key("prog", (1,), (x.astype("bfloat16"),)) != key
  gin.parse_config("MODEL_DIR = '/somewhere/else'")  # where a run writes: not in the key
  assert compilation_cache.program_key("prog", (1,), (x,)) == key
  gin.parse_config("LEARNING_RATE = 0.5")
  assert compilation_cache.program_key("prog", (1,), (x,)) != key


def test_store_reads_past_an_unreadable_entry_and_replaces_it(store, capsys):
  x = jax.numpy.ones((4,))
  compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower)
  (entry,) = store.glob("*.program")
  entry.write_bytes(b"not a program")
  fresh = _Traced(scale=2.0)
  compiled = compilation_cache.load_or_compile("prog", (), (x,), fresh.jitted.lower)
  assert "unreadable" in capsys.readouterr().out
  assert fresh.traces == 1 and (compiled(x)["y"] == 3).all()
  assert entry.read_bytes() != b"not a program"
  assert compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower)(x)["y"][0] == 3


def test_a_program_store_that_cannot_be_written_costs_one_line_not_the_run(store, capsys):
  x = jax.numpy.ones((3,))
  _Traced().jitted.lower(x).compile()  # into JAX's cache only: the store marks its key
  store.parent.mkdir(exist_ok=True)
  store.write_text("")  # a file where the store's directory should be
  compiled = compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower)
  assert (compiled(x)["y"] == 3).all()
  (line,) = capsys.readouterr().out.splitlines()
  assert line.startswith("t5lite: warning: prog not kept in the program store (")


def test_a_stale_program_is_refused_and_its_entry_removed(store):
  """What the key cannot see (here a Python constant left out of it) is
  caught by the check of the loaded program against a fresh lowering."""
  x = jax.numpy.ones((4,))
  compilation_cache.load_or_compile("prog", (), (x,), _Traced(scale=2.0).jitted.lower)
  stale = compilation_cache.load_or_compile("prog", (), (x,), _Traced(scale=5.0).jitted.lower)
  assert (stale(x)["y"] == 3).all()  # the old program, which the check must refuse
  with pytest.raises(compilation_cache.StaleProgramError, match="entry is removed"):
    compilation_cache.verify_loaded(wait=True)
  assert _entries(store) == []
  current = _Traced(scale=5.0)
  assert (compilation_cache.load_or_compile("prog", (), (x,), current.jitted.lower)(x)["y"]
          == 6).all()
  assert current.traces == 1
  compilation_cache.verify_loaded(wait=True)  # nothing loaded is pending any more


def test_a_program_jax_already_cached_is_stored_at_its_next_compile(store):
  """An executable JAX's cache served cannot be serialized again (XLA:CPU
  keeps no kernels of it), so the key is marked seen, and the next lookup
  compiles it without JAX's cache and stores it."""
  x = jax.numpy.ones((3,))
  _Traced().jitted.lower(x).compile()  # into JAX's cache only
  before = compilation_cache.use()
  first = compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower)
  assert compilation_cache.use().loaded == before.loaded + 1
  assert _entries(store) == [] and len(_entries(store, ".seen")) == 1
  second = compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower)
  assert compilation_cache.use().compiled == before.compiled + 1
  assert len(_entries(store)) == 1 and _entries(store, ".seen") == []
  assert jax.config.jax_enable_compilation_cache  # back on after the fresh compile
  third = _Traced()
  loaded = compilation_cache.load_or_compile("prog", (), (x,), third.jitted.lower)
  assert third.traces == 0
  for compiled in (first, second, loaded):
    assert (compiled(x)["y"] == 3).all()


def test_store_is_off_with_the_cache_and_outside_t5lites_commands(tmp_path, jax_cache_settings):
  x = jax.numpy.ones((3,))
  compilation_cache.configure(str(tmp_path / "cache"), enabled=False)
  assert compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower) is None
  # JAX's cache turned on by hand, not by t5lite's commands: no store either.
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
  assert compilation_cache.load_or_compile("prog", (), (x,), _Traced().jitted.lower) is None
  assert not (tmp_path / "cache").exists() and not (tmp_path / "jax").exists()


def test_partitioned_program_loads_from_the_store_and_jits_other_shapes(store):
  from t5lite import partitioning
  partitioner = partitioning.Partitioner(num_partitions=1)
  x = jax.numpy.ones((2, 3))
  for run in range(2):
    traced = _Traced()
    step = partitioner.partition(traced._fn, in_shardings=None, out_shardings=None,
                                 program=("prog", 1))
    assert (step(x)["y"] == 3).all()
    assert traced.traces == (1 if run == 0 else 0)
  assert len(_entries(store)) == 1
  # A call the stored program was not compiled for goes to jit.
  assert (step(jax.numpy.ones((5,)))["y"] == 3).all() and traced.traces == 1
  assert (step(x)["y"] == 3).all()
  compilation_cache.verify_loaded(wait=True)


def test_train_step_program_prepared_from_the_abstract_batch_serves_the_real_batches(store):
  """Training loads its step's program while the first batches are built,
  from their shapes and shardings alone; the batches that then arrive must
  have the same key and run that program, not fall back to jit."""
  from t5lite import feeder, partitioning, testing
  from t5lite.data import tasks
  from test_data import _config
  partitioner = partitioning.Partitioner(num_partitions=1)
  data = feeder.TrainData(testing.tiny_encoder_decoder(), _config(tasks.SPAN_CORRUPTION, pack=True),
                          partitioner, prefetch_batches=0)
  abstract = data.abstract_batch()
  batch = next(data)
  assert (compilation_cache.program_key("p", (), (abstract,))
          == compilation_cache.program_key("p", (), (batch,)))
  traced = _Traced()

  def tokens(batch):
    traced._fn(0.0)  # counts the trace
    return jax.tree.map(lambda x: x.sum(), batch)

  for run in range(2):
    traced.traces = 0
    step = partitioner.partition(tokens, in_shardings=(data.shardings,), out_shardings=None,
                                 program=("tokens",))
    step.prepare(abstract)
    assert traced.traces == (1 if run == 0 else 0)
    for _ in range(2):
      assert step(batch) == jax.tree.map(lambda x: x.sum(), batch)
    assert step._compiled and traced.traces == (1 if run == 0 else 0)  # no jit fallback
  compilation_cache.verify_loaded(wait=True)


def test_train_step_is_read_ahead_from_the_abstract_state(store):
  """Training starts reading its stored step while it initialises the state,
  from the state's shapes and shardings alone; the real state then has the
  same key and takes that executable instead of reading it again."""
  from t5lite import partitioning
  partitioner = partitioning.Partitioner(num_partitions=1)
  x = jax.device_put(jax.numpy.ones((2, 3)), jax.devices()[0])  # placed, as a state is
  abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  for run in range(2):
    traced = _Traced()
    step = partitioner.partition(traced._fn, in_shardings=None, out_shardings=None,
                                 program=("prog", 1))
    used = compilation_cache._EVENTS[compilation_cache._PRELOAD_USED]
    step.preload(abstract)  # nothing stored yet on the first run: nothing read
    assert (step(x)["y"] == 3).all() and traced.traces == (1 if run == 0 else 0)
    assert compilation_cache._EVENTS[compilation_cache._PRELOAD_USED] == used + run
  # Read ahead for other arguments (another key): dropped, the call still right.
  step = partitioner.partition(_Traced()._fn, in_shardings=None, out_shardings=None,
                               program=("prog", 1))
  used = compilation_cache._EVENTS[compilation_cache._PRELOAD_USED]
  step.preload(abstract)
  assert (step(jax.numpy.ones((2, 3), "int32") * 2)["y"] == 5).all()
  assert compilation_cache._EVENTS[compilation_cache._PRELOAD_USED] == used
  # A launch with nothing left to train waits for what it reads ahead, then forgets it.
  partitioner.partition(_Traced()._fn, in_shardings=None, out_shardings=None,
                        program=("prog", 1)).preload(abstract)
  assert set(compilation_cache._PRELOADS) == {"prog"}
  compilation_cache.drop_preloads()
  assert compilation_cache._PRELOADS == {}
  step = partitioner.partition(_Traced()._fn, in_shardings=None, out_shardings=None,
                               program=("prog", 1))
  assert (step(x)["y"] == 3).all()
  assert compilation_cache._EVENTS[compilation_cache._PRELOAD_USED] == used
  compilation_cache.verify_loaded(wait=True)


# The pipeline store: the training pipeline's traced graph.


def _batches(ds, count, iterator=None):
  import numpy as np
  iterator = iterator if iterator is not None else iter(ds)
  return [{k: np.asarray(v) for k, v in next(iterator).items()} for _ in range(count)]


def _same(a, b):
  import numpy as np
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _build_counting(cfg):
  """`build` for the pipeline store, and the list its calls are counted in."""
  import seqio
  from t5lite.data import datasets
  calls = []

  def build():
    calls.append(1)
    return datasets.get_dataset(cfg, 0, 1, seqio.EncDecFeatureConverter, num_epochs=None)
  return build, calls


def test_pipeline_store_loads_the_graph_with_the_same_batches_and_iterator_checkpoints(
    store, tmp_path):
  import tensorflow as tf
  from t5lite.data import tasks
  from test_data import _config
  cfg = _config(tasks.SPAN_CORRUPTION, pack=True, shuffle=True)
  build, calls = _build_counting(cfg)
  built = compilation_cache.load_or_build_pipeline("train", build, (cfg,))
  assert len(calls) == 1 and len(_entries(store, ".pipeline")) == 1
  expected = _batches(built, 5)
  before = compilation_cache.use().pipelines_loaded
  loaded = compilation_cache.load_or_build_pipeline("train", build, (cfg,))
  assert len(calls) == 1  # read from the store, not traced
  assert compilation_cache.use().pipelines_loaded == before + 1
  assert "1 data pipeline(s) loaded" in compilation_cache.use().describe()
  assert loaded.element_spec == built.element_spec
  assert _same(_batches(loaded, 5), expected)
  # Each load starts from the seeds, as a fresh build does (a second
  # iterator over one pipeline reshuffles).
  assert _same(_batches(compilation_cache.load_or_build_pipeline("train", build, (cfg,)), 5),
               expected)
  # An iterator saved from either restores into the other, at its position.
  load = lambda: compilation_cache.load_or_build_pipeline("train", build, (cfg,))  # noqa: E731
  for number, (source, target) in enumerate(((build(), load()), (load(), build()))):
    iterator = iter(source)
    _batches(source, 2, iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / f"iterator-{number}"))
    restored = iter(target)
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    assert _same(_batches(target, 3, restored), expected[2:])
  calls.clear()
  compilation_cache.verify_loaded(wait=True)  # built again, the same graph: it passes
  assert len(calls) == 1  # once, however often it was loaded
  # Another seed is another key: built and stored beside the first.
  other = _config(tasks.SPAN_CORRUPTION, pack=True, shuffle=True, seed=1)
  compilation_cache.load_or_build_pipeline("train", _build_counting(other)[0], (other,))
  assert len(_entries(store, ".pipeline")) == 2


def test_a_stale_pipeline_is_refused_and_its_entry_removed(store):
  """What the key cannot see (here a seed left out of it, as a vocabulary
  file replaced under the same name would be) is caught when the loaded
  pipeline's graph is compared with the one the code builds now."""
  from t5lite.data import tasks
  from test_data import _config
  first = _config(tasks.SPAN_CORRUPTION, pack=True, shuffle=True, seed=0)
  compilation_cache.load_or_build_pipeline("train", _build_counting(first)[0], ())
  changed = _config(tasks.SPAN_CORRUPTION, pack=True, shuffle=True, seed=1)
  build, calls = _build_counting(changed)
  compilation_cache.load_or_build_pipeline("train", build, ())
  assert calls == []  # the old graph was loaded, which the check must refuse
  with pytest.raises(compilation_cache.StaleProgramError,
                     match="the train pipeline loaded from .*entry is removed"):
    compilation_cache.verify_loaded(wait=True)
  assert _entries(store, ".pipeline") == []


def test_pipeline_store_builds_past_an_unreadable_entry_and_skips_unserializable_ones(
    store, capsys):
  import tensorflow as tf
  from t5lite.data import tasks
  from test_data import _config
  cfg = _config(tasks.ARITHMETIC, pack=True)
  build, calls = _build_counting(cfg)
  expected = _batches(compilation_cache.load_or_build_pipeline("train", build, ()), 2)
  (entry,) = store.glob("*.pipeline")
  entry.write_bytes(b"not a pipeline")
  rebuilt = compilation_cache.load_or_build_pipeline("train", build, ())
  assert "unreadable" in capsys.readouterr().out and len(calls) == 2
  assert _same(_batches(rebuilt, 2), expected)
  assert entry.read_bytes() != b"not a pipeline"  # replaced by the rebuilt graph
  assert _same(_batches(compilation_cache.load_or_build_pipeline("train", build, ()), 2),
               expected)
  assert len(calls) == 2

  def with_python():  # a graph that calls back into Python cannot be stored
    ds = tf.data.Dataset.range(3)
    return ds.map(lambda x: {"x": tf.py_function(lambda v: v + 1, [x], tf.int64)})
  for _ in range(2):
    ds = compilation_cache.load_or_build_pipeline("python", with_python, ())
    assert [int(b["x"]) for b in ds] == [1, 2, 3]
  assert not list(store.glob("python-*"))
  compilation_cache.verify_loaded(wait=True)


def test_a_pipeline_the_store_cannot_keep_is_still_built(store, capsys):
  import tensorflow as tf
  store.mkdir(parents=True, exist_ok=True)
  store.chmod(0o500)  # entries cannot be written
  try:
    if os.access(store, os.W_OK):
      store.chmod(0o700)
      store.rmdir()
      store.write_text("")  # running as root: a file where the directory should be
    ds = compilation_cache.load_or_build_pipeline(
        "train", lambda: tf.data.Dataset.range(2).map(lambda x: {"x": x}), ())
    assert [int(b["x"]) for b in ds] == [0, 1]
    assert "not kept in the program store" in capsys.readouterr().out
  finally:
    if store.is_dir():
      store.chmod(0o700)


def test_pipeline_store_is_off_with_the_cache(tmp_path, jax_cache_settings):
  import tensorflow as tf
  compilation_cache.configure(str(tmp_path / "cache"), enabled=False)
  calls = []

  def build():
    calls.append(1)
    return tf.data.Dataset.range(2).map(lambda x: {"x": x})
  for _ in range(2):
    compilation_cache.load_or_build_pipeline("train", build, ())
  assert len(calls) == 2 and not (tmp_path / "cache").exists()


def test_train_data_keys_its_pipeline_on_where_seqio_reads(monkeypatch):
  """--tfds_data_dir and --seqio_additional_cache_dirs are flags, not gin
  bindings: they are in the stored pipeline's key through the data's own
  description."""
  import seqio
  from t5lite import feeder, partitioning, testing
  from t5lite.data import tasks
  from test_data import _config

  def describe():
    return feeder.TrainData(testing.tiny_encoder_decoder(), _config(tasks.ARITHMETIC),
                            partitioning.Partitioner(num_partitions=1))._describe
  plain = describe()
  monkeypatch.setattr(seqio.utils, "_TFDS_DATA_DIR_OVERRIDE", "/data/tfds")
  with_tfds = describe()
  monkeypatch.setattr(seqio.utils, "_GLOBAL_CACHE_DIRECTORIES", ["/data/cache"])
  assert len({repr(plain), repr(with_tfds), repr(describe())}) == 3
