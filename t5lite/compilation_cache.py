"""JAX's persistent compilation cache, on by default for t5lite's commands.

A restarted or repeated run compiles exactly the programs the first one did
(the training step, evaluation, decoding); with the cache they are read from
disk instead, which on a preempted cluster job is most of the time from
launch to training. The directory is, first to last:

  --compilation_cache_dir=DIR, then $JAX_COMPILATION_CACHE_DIR, then
  $XDG_CACHE_HOME/t5lite/jax-compilation (~/.cache/t5lite/... without it).

`--nocompilation_cache` turns it off. Every program is cached however short
its compile (JAX's default skips those under a second, and a tiny model has
many of them); $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS still overrides
that. The directory grows with each new configuration and JAX version;
deleting it at any time only costs the next run its compiles.

An entry JAX fails to read (a truncated or garbled file) is removed when it
is the user's own, so the program compiled instead is written in its place;
one line per launch names the first such entry, and the next launch reads
the new one (JAX alone would warn at every launch and never rewrite it). An
entry of another user is left where it is. A directory that takes no new
files (a read-only mount, another user's directory) is used read-only: one
line says so, its programs are read, nothing is written to it.

JAX finds a program in its cache only after tracing and lowering it, which
for a training step takes seconds of a warm launch. The programs of a run
that `Partitioner.partition(..., program=...)` names (the train step, the
state's initialisation) are also kept in the program store,
DIR/t5lite-programs, under a key known before tracing (`program_key`): the
run's gin config (MODEL_DIR aside), t5lite's source files and those of the
other non-library modules loaded, the versions of the libraries that build
programs, JAX's settings and XLA's environment variables, the devices and
processes, the program's own constants (the dropout seed) and its
arguments' shapes, dtypes and shardings. A launch with the same key loads
the executable without tracing. Because a key cannot see everything (a
file a custom configurable reads, a library edited in place), every program
loaded from the store is traced and lowered once more on a background
thread after the first step, and its lowered module is compared with the one
it was stored with; a checkpoint waits for that check (`verify_loaded`), and
a program that differs stops the run before anything it computed is saved
(`StaleProgramError`), its entry removed so the next launch compiles it.
A stored train step is read on a background thread while the state is
initialised or restored (`preload`).

The training data pipeline's traced tf.data graph is kept there too, under
the same kind of key (`load_or_build_pipeline`): a warm launch reads it
instead of tracing SeqIO's preprocessors and packing again, and the graph
is checked the same way, built again in the background and compared.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import math
import os
import pickle
import re
import sys
import sysconfig
import tempfile
import threading
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import jax

from t5lite import jax_internals

ENV_DIRECTORY = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# The events JAX records for each compile that asks the cache, and each hit.
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_STORE_HIT = "t5lite/program_store_hits"
_FRESH_COMPILE = "t5lite/compiles_outside_jax_cache"
_PRELOAD_USED = "t5lite/program_store_preloads_used"
_PIPELINE_HIT = "t5lite/pipeline_store_hits"
_EVENTS: collections.Counter = collections.Counter()
PROGRAMS_SUBDIR = "t5lite-programs"
# Bumped when the entries' layout changes: older entries are then never read.
_STORE_FORMAT = 1
# The libraries whose code ends up in a program or a data pipeline; their
# versions are in every key.
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "gin-config",
                  "tensorflow", "tensorflow-text", "seqio", "sentencepiece")


def default_directory() -> str:
  """Under the user's cache directory (XDG), shared by every t5lite run."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "t5lite", "jax-compilation")


@dataclasses.dataclass(frozen=True)
class CacheUse:
  """How the programs compiled so far, and the training pipeline, were obtained."""
  directory: str | None
  loaded: int
  compiled: int
  pipelines_loaded: int = 0

  def describe(self) -> str:
    if self.directory is None:
      return "compilation cache off"
    pipelines = (f", {self.pipelines_loaded} data pipeline(s) loaded"
                 if self.pipelines_loaded else "")
    return (f"compilation cache {self.directory}: {self.loaded} program(s) loaded, "
            f"{self.compiled} compiled{pipelines}")


def configure(directory: str | None, enabled: bool = True) -> str | None:
  """Points JAX's persistent compilation cache at its directory, before
  anything compiles.

  Args:
    directory: the directory (`--compilation_cache_dir`), or None for
      $JAX_COMPILATION_CACHE_DIR, else `default_directory()`.
    enabled: False turns the cache off (`--nocompilation_cache`).

  Returns:
    The directory in use, or None when the cache is off: off when asked, and
    when the directory cannot be created (a warning says so; a run never
    fails for its cache). A directory that takes no new files is read and
    never written (`_use_read_only_if_unwritable`).
  """
  _STORE["directory"], _STORE["writable"] = None, False
  if not enabled:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = directory or os.environ.get(ENV_DIRECTORY) or default_directory()
  try:
    if "://" not in directory:  # JAX opens gs:// and the like itself
      os.makedirs(directory, exist_ok=True)
  except OSError as error:
    print(f"t5lite: warning: compilation cache off, {directory} cannot be created "
          f"({error.strerror}); pass --compilation_cache_dir=DIR or --nocompilation_cache.",
          flush=True)
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if ENV_MIN_COMPILE_TIME not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if "://" not in directory:
    read_only = _use_read_only_if_unwritable(directory)
    jax_internals.handle_compilation_cache_read_errors(_unreadable_entry_errors(),
                                                       _replace_unreadable_entry)
    _STORE["directory"] = os.path.join(directory, PROGRAMS_SUBDIR)
    _STORE["writable"] = not read_only
  return directory


def _use_read_only_if_unwritable(directory: str) -> bool:
  """Whether `directory` refuses new files; if so, JAX's cache is set to
  read it and write nothing, and one line says so (JAX would warn at every
  program it failed to write)."""
  try:
    handle, probe = tempfile.mkstemp(prefix=".t5lite-write-probe-", dir=directory)
  except OSError as error:
    print(f"t5lite: warning: compilation cache {directory} is read-only ({error.strerror}); "
          "its programs are read, none are written.", flush=True)
    # JAX writes a program only if its compile took at least this long.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
    # XLA's GPU autotuning cache, kept in the same directory, would write too.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return True
  os.close(handle)
  os.remove(probe)
  return False


# XLA's status codes for an executable it cannot parse (any other failure,
# a device out of memory, is not the entry's and stays JAX's to report).
_DAMAGED_EXECUTABLE = ("INVALID_ARGUMENT", "INTERNAL", "DATA_LOSS")
_UNREADABLE = {"reported": False}
_UNREADABLE_LOCK = threading.Lock()


def _unreadable_entry_errors() -> tuple[type[BaseException], ...]:
  """What reading a damaged entry of JAX's cache raises: its decompression
  (zlib, or zstd where JAX has it) or XLA's parse of the executable."""
  errors: list[type[BaseException]] = [zlib.error, jax.errors.JaxRuntimeError]
  for module, name in (("compression.zstd", "ZstdError"), ("zstandard", "ZstdError")):
    try:
      errors.append(getattr(importlib.import_module(module), name))
    except ImportError:
      pass
  return tuple(errors)


def _replace_unreadable_entry(cache_key: str, error: BaseException) -> bool:
  """Removes the entry of JAX's cache that `error` failed to read, if it
  is this user's, so that the program compiled instead is written in its
  place; says what happened once per process.

  Returns:
    True when the failure was the entry's (JAX then compiles without its
    own warning), False to leave it to JAX.
  """
  if (isinstance(error, jax.errors.JaxRuntimeError)
      and not str(error).startswith(_DAMAGED_EXECUTABLE)):
    return False
  entry, access_time = jax_internals.compilation_cache_entry_files(
      jax.config.jax_compilation_cache_dir, cache_key)
  try:
    owner = os.stat(entry).st_uid
  except FileNotFoundError:  # another process removed it already
    return True
  if owner != os.geteuid():
    fate = f"left in place, it belongs to user {owner}"
  else:
    try:
      os.remove(entry)
      if os.path.exists(access_time):
        os.remove(access_time)
      fate = "removed, and the program compiled again is written in its place"
    except FileNotFoundError:
      fate = "removed by another process"
    except OSError as failure:
      fate = f"left in place ({failure.strerror})"
  with _UNREADABLE_LOCK:
    reported, _UNREADABLE["reported"] = _UNREADABLE["reported"], True
  if not reported:
    print(f"t5lite: warning: compilation cache entry {entry} unreadable ({_brief(error)}); "
          f"{fate}.", flush=True)
  return True


def _count(event: str, **unused_kwargs) -> None:
  if event in (_HIT_EVENT, _REQUEST_EVENT):
    _EVENTS[event] += 1


# Listening from import on: t5lite's modules import this one before they
# compile anything.
jax.monitoring.register_event_listener(_count)


def use() -> CacheUse:
  """The cache directory in use (None: off), and the programs this process
  loaded from it and compiled afresh."""
  directory = jax.config.jax_compilation_cache_dir
  if not jax.config.jax_enable_compilation_cache or not directory:
    return CacheUse(None, 0, 0)
  hits = _EVENTS[_HIT_EVENT]
  return CacheUse(directory, hits + _EVENTS[_STORE_HIT],
                  _EVENTS[_REQUEST_EVENT] - hits + _EVENTS[_FRESH_COMPILE],
                  _EVENTS[_PIPELINE_HIT])


# The program store's directory: set by `configure` (t5lite's commands, whose
# programs come from a gin config), never from JAX's settings alone, so a
# program built in Python outside a gin config is never looked up by a key
# that cannot describe it.
_STORE: dict[str, Any] = {"directory": None, "writable": False}


class StaleProgramError(RuntimeError):
  """A program loaded from the store differs from what this code compiles."""


def store_directory() -> str | None:
  """The program store in use, or None when it is off."""
  return _STORE["directory"]


@functools.cache
def _code_digest() -> str:
  """t5lite's source files, and those of every other loaded module imported
  from outside Python and its installed libraries (a user's configurables
  and what they import, from the working directory or $PYTHONPATH). Once
  per process: a run's modules are all imported before its first program."""
  digest = hashlib.sha256()
  package = os.path.dirname(os.path.realpath(__file__))
  files = set()
  for root, _, names in os.walk(package):
    files.update(os.path.join(root, n) for n in names if n.endswith(".py"))
  library_paths = [sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")]
  # Each as given and resolved: most modules are recognised without
  # resolving their own paths (thousands of them, a second of system calls).
  libraries = tuple({os.path.join(f(p), "") for p in library_paths
                     for f in (os.path.abspath, os.path.realpath)})
  roots = tuple({os.path.join(os.path.realpath(p or os.getcwd()), "") for p in sys.path})
  for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if path and path.endswith(".py") and not os.path.abspath(path).startswith(libraries):
      path = os.path.realpath(path)
      if path.startswith(roots) and not path.startswith(libraries):
        files.add(path)
  for path in sorted(files):
    try:
      with open(path, "rb") as f:
        content = f.read()
    except OSError:
      content = b"unreadable"
    digest.update(path.encode() + b"\0" + hashlib.sha256(content).digest())
  return digest.hexdigest()


def _gin_config() -> str:
  """Every gin binding of the run except the MODEL_DIR macro, which names
  where a run writes and nothing it computes (comments and blank lines left
  out too)."""
  import gin
  lines, skipping = [], False
  for line in gin.config_str().splitlines():
    if skipping and line[:1].isspace():
      continue
    skipping = line.startswith("MODEL_DIR = ")
    if not skipping and line.strip() and not line.startswith("#"):
      lines.append(line)
  return "\n".join(lines)


def _versions() -> dict[str, str]:
  versions = {}
  for name in _DISTRIBUTIONS:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = "absent"
  return versions


def program_key(name: str, constants: tuple, args: Any) -> str:
  """The store key of program `name` called with `args` in this process.

  Args:
    name: the program ("train_step", "init").
    constants: Python values the program bakes in that a gin binding does
      not give (e.g. a seed drawn from the clock).
    args: the positional arguments of the call (arrays).
  """
  leaves = jax.tree_util.tree_flatten_with_path(args)[0]
  return _key(name, constants, [(jax.tree_util.keystr(path), str(jax.typeof(x)),
                                 repr(x.sharding), getattr(x, "committed", True))
                                for path, x in leaves])


def _key(name: str, constants: tuple, arguments: list) -> str:
  """The store key of entry `name` with these constants and arguments in
  this process: everything of the run that can change what it builds."""
  described = {
      "format": _STORE_FORMAT, "name": name, "constants": repr(constants),
      "arguments": arguments,
      "python": sys.version, "libraries": _versions(), "code": _code_digest(),
      "gin": _gin_config(),
      "jax_config": sorted((k, repr(v)) for k, v in jax.config.values.items()),
      "environment": sorted((k, v) for k, v in os.environ.items()
                            if k.startswith(("XLA_", "JAX_", "LIBTPU", "TPU_", "NCCL_"))),
      "devices": [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()],
      "process": (jax.process_index(), jax.process_count()),
      "backend": jax.devices()[0].client.platform_version,
  }
  return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _static_objects(trees: tuple) -> list[Any]:
  """The objects pytree nodes keep beside their children (a train state's
  optimizer), in a fixed order; pickled by position, since functions
  defined inside other functions cannot be pickled themselves."""
  found = []

  def walk(treedef):
    data = treedef.node_data()
    if data is not None and data[1] is not None:
      aux = data[1]
      for item in (aux if type(aux) is tuple else (aux,)):
        if not isinstance(item, (str, bytes, int, float, bool, list)):
          found.append(item)
    for child in treedef.children():
      walk(child)

  for tree in trees:
    walk(jax.tree.structure(tree))
  return found


class _TreePickler(pickle.Pickler):
  def __init__(self, file, statics: list[Any]):
    super().__init__(file)
    self._positions = {id(obj): i for i, obj in enumerate(statics)}

  def persistent_id(self, obj):
    position = self._positions.get(id(obj))
    return None if position is None else ("static", position)


class _TreeUnpickler(pickle.Unpickler):
  def __init__(self, file, statics: list[Any]):
    super().__init__(file)
    self._statics = statics

  def persistent_load(self, pid):
    return self._statics[pid[1]]


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  """`x` without its values, lowered as `x` is: an uncommitted array (one
  jit may place anywhere) keeps no sharding, as a committed one does."""
  committed = getattr(x, "committed", True)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)


def _module_digest(lowered: Any) -> str:
  return hashlib.sha256(lowered.as_text().encode()).hexdigest()


@dataclasses.dataclass
class _Loaded:
  """An entry loaded from the store, to be checked against this code."""
  what: str  # "the train_step program", "the training pipeline"
  path: str
  digest: str
  current: Callable[[], str]  # the digest of what this code and config build now
  check: Any = None  # the background check, once started


_LOADED: list[_Loaded] = []
_LOADED_LOCK = threading.Lock()
# Entries being read ahead of their first use (`preload`): name -> (path, reading).
_PRELOADS: dict[str, tuple[str, Any]] = {}


def _entry_path(directory: str, name: str, key: str) -> str:
  return os.path.join(directory, f"{name}-{key[:40]}.program")


def _read_entry(path: str, args: tuple, like: Any) -> tuple[Any, str]:
  """The executable stored at `path` for calls like `args`, loaded onto the
  devices, and the digest of the module it was compiled from."""
  from jax.experimental import serialize_executable
  with open(path, "rb") as f:
    entry = pickle.load(f)
  out_tree = _TreeUnpickler(io.BytesIO(entry["out_tree"]), _static_objects((args, like))).load()
  in_tree = jax.tree.structure((args, {}))
  return serialize_executable.deserialize_and_load(entry["executable"], in_tree,
                                                   out_tree), entry["module"]


def preload(name: str, constants: tuple, args: tuple, like: Any = None) -> None:
  """Starts reading program `name` for calls like `args` from the store on a
  background thread, if the store holds it; `load_or_compile` with the same
  key then takes it instead of reading it. Loading an executable spends most
  of its time outside Python's interpreter lock, so a launch loads its train
  step while it loads and runs the state's initialisation. Nothing is traced
  or compiled here; a missing entry is left to `load_or_compile`.

  Args:
    name / constants / like: see `load_or_compile`.
    args: the first call's arguments, or `jax.ShapeDtypeStruct`s with their
      shardings (an argument of another shape, dtype or sharding has another
      key, and the entry read ahead is then dropped unused).
  """
  from t5lite.threads import Background
  directory = store_directory()
  if directory is None:
    return
  path = _entry_path(directory, name, program_key(name, constants, args))
  if os.path.exists(path):
    _PRELOADS[name] = (path, Background(functools.partial(_read_entry, path, args, like),
                                        f"t5lite-load-{name}"))


def drop_preloads() -> None:
  """Waits for the entries still being read ahead and forgets them: a launch
  that ends without calling its programs (nothing left to train) must not
  exit while a thread is loading an executable."""
  while _PRELOADS:
    _, (_, reading) = _PRELOADS.popitem()
    reading.join()


def load_or_compile(name: str, constants: tuple, args: tuple, lower: Callable[..., Any],
                    like: Any = None) -> Any:
  """The compiled program `name` for `args`, from the store or compiled and
  stored; None when the store is off (the caller's jit then compiles).

  Args:
    name / constants: see `program_key`.
    args: the positional arguments of the first call.
    lower: `lower(*args)` traces and lowers the program (`Partitioned.lower`).
    like: a tree whose static node data the outputs share (the abstract
      train state of an initialisation, whose arguments hold no optimizer).

  Returns:
    A `jax.stages.Compiled`, or None.
  """
  directory = store_directory()
  if directory is None:
    return None
  from jax.experimental import serialize_executable
  path = _entry_path(directory, name, program_key(name, constants, args))
  read_ahead, reading = _PRELOADS.pop(name, (None, None))
  seen = f"{path}.seen"
  afresh = os.path.exists(seen)
  if os.path.exists(path):
    try:
      if read_ahead == path:
        compiled, module = reading.result()
        _EVENTS[_PRELOAD_USED] += 1
      else:
        compiled, module = _read_entry(path, args, like)
    except Exception as error:  # noqa: BLE001  an unreadable entry is compiled again
      print(f"t5lite: warning: {path} unreadable ({_brief(error)}); compiling {name} "
            "instead.", flush=True)
      afresh = True  # and stored in its place
    else:
      _EVENTS[_STORE_HIT] += 1
      abstract = jax.tree.map(_abstract, args)
      with _LOADED_LOCK:
        _LOADED.append(_Loaded(f"the {name} program", path, module,
                               lambda: _module_digest(lower(*abstract))))
      return compiled
  lowered = lower(*args)
  if not _STORE["writable"]:  # a read-only cache: nothing is stored
    return lowered.compile()
  if afresh:
    compiled = _compile_afresh(lowered)
  else:
    hits = _EVENTS[_HIT_EVENT]
    compiled = lowered.compile()
    if _EVENTS[_HIT_EVENT] != hits:
      # Read from JAX's cache (the same program under another key): an
      # executable XLA loaded from bytes cannot be serialized again whole
      # (XLA:CPU drops its kernels). The key's next launch compiles it
      # afresh and stores it; a key launched once costs nothing more.
      try:
        _write(seen, b"")
      except OSError as error:  # a run never fails for its cache
        print(f"t5lite: warning: {name} not kept in the program store ({_brief(error)}).",
              flush=True)
      return compiled
  try:
    executable, _, out_tree = serialize_executable.serialize(compiled)
    trees = io.BytesIO()
    _TreePickler(trees, _static_objects((args, like))).dump(out_tree)
    entry = {"executable": executable, "out_tree": trees.getvalue(),
             "module": _module_digest(lowered)}
    _write(path, pickle.dumps(entry))
    if os.path.exists(seen):
      os.remove(seen)
  except Exception as error:  # noqa: BLE001  a run never fails for its cache
    print(f"t5lite: warning: {name} not kept in the program store ({_brief(error)}).",
          flush=True)
  return compiled


def _brief(error: BaseException) -> str:
  """`error` on one short line, for a warning."""
  return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _write(path: str, content: bytes) -> None:
  """Writes `path` whole or not at all (a concurrent reader never sees half)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  partial = f"{path}.{os.getpid()}.partial"
  with open(partial, "wb") as f:
    f.write(content)
  os.replace(partial, path)


def _compile_afresh(lowered: Any) -> Any:
  """`lowered` compiled by XLA, JAX's cache neither read nor written (it
  holds the program already). JAX's cache is a process-wide setting: this
  runs at start-up, before any other thread compiles."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cache
  jax.config.update("jax_enable_compilation_cache", False)
  jax_cache.reset_cache()
  try:
    compiled = lowered.compile()
    _EVENTS[_FRESH_COMPILE] += 1
    return compiled
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    jax_cache.reset_cache()


def load_or_build_pipeline(name: str, build: Callable[[], Any], constants: tuple) -> Any:
  """The tf.data pipeline `build()` returns, read from the store when it
  holds one under this run's key, else built and stored.

  Tracing a SeqIO pipeline (its preprocessors, packing, AutoGraph) takes
  seconds of Python; the graph it produces is read back in milliseconds,
  and gives the same batches and the same iterator checkpoints (both are
  functions of the graph alone). The key is that of the programs
  (`program_key`): the gin config, the code, the library versions. What the
  graph holds that the key cannot see (a vocabulary file or the list of a
  task's data files, both read while tracing) is checked as a loaded
  program is: the pipeline is built again on a background thread after the
  first step (`verify_loaded`), and if its graph differs the run stops
  before anything is saved. A pipeline whose graph cannot be serialized
  (one holding Python functions, `tf.py_function`) is built each launch.

  Args:
    name: the pipeline ("train").
    build: returns the pipeline (a `tf.data.Dataset` of dicts of tensors).
    constants: what `build` depends on that the gin config may not give
      (the dataset config, the data shard).
  """
  directory = store_directory()
  if directory is None:
    return build()
  import tensorflow as tf  # the pipeline is tf.data already; imported where used
  path = os.path.join(directory, f"{name}-{_key(name, constants, [])[:40]}.pipeline")
  if os.path.exists(path):
    try:
      with open(path, "rb") as f:
        entry = pickle.load(f)
      structure = {k: tf.TensorSpec(shape, tf.as_dtype(dtype))
                   for k, (shape, dtype) in entry["element_spec"].items()}
      ds = tf.data.experimental.from_variant(
          tf.raw_ops.DatasetFromGraph(graph_def=_own_seed_generators(entry["graph"])),
          structure=structure)
    except Exception as error:  # noqa: BLE001  an unreadable entry is built again
      print(f"t5lite: warning: {path} unreadable ({_brief(error)}); building {name} "
            "instead.", flush=True)
    else:
      _EVENTS[_PIPELINE_HIT] += 1
      with _LOADED_LOCK:  # one check per entry, however often it is loaded
        if all(loaded.path != path for loaded in _LOADED):
          _LOADED.append(_Loaded(f"the {name} pipeline", path, entry["digest"],
                                 functools.partial(_built_digest, build)))
      return ds
  ds = build()
  spec = ds.element_spec
  if _STORE["writable"] and isinstance(spec, dict) and all(isinstance(v, tf.TensorSpec) for v in spec.values()):
    try:
      graph = _serialized(ds)
    except Exception:  # noqa: BLE001  not serializable: built each launch, as without a store
      return ds
    try:
      _write(path, pickle.dumps({
          "graph": graph, "digest": _pipeline_digest(graph),
          "element_spec": {k: (v.shape.as_list(), v.dtype.name) for k, v in spec.items()}}))
    except OSError as error:  # a run never fails for its cache
      print(f"t5lite: warning: the {name} pipeline not kept in the program store "
            f"({_brief(error)}).", flush=True)
  return ds


def _built_digest(build: Callable[[], Any]) -> str:
  """The digest of the pipeline `build` makes now."""
  return _pipeline_digest(_serialized(build()))


def _nodes(graph_def: Any) -> tuple:
  """The nodes of a graph and of the functions in its library."""
  return (*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def))


def _own_seed_generators(graph: bytes) -> bytes:
  """`graph` with the seed generators of its shuffles renamed for one load.

  A serialized shuffle names its generator's state, and every dataset made
  from that graph in a process would share it (and so draw another order
  each, where a fresh build draws the first order again); under a name of
  its own, each load starts from the seeds, as a fresh build does."""
  from tensorflow.core.framework import graph_pb2
  graph_def = graph_pb2.GraphDef.FromString(graph)
  suffix = f"/t5lite-load-{uuid.uuid4().hex}"
  for node in _nodes(graph_def):
    if node.op == "Const" and "value" in node.attr:
      for handle in node.attr["value"].tensor.resource_handle_val:
        if "SeedGenerator" in handle.maybe_type_name:
          handle.name += suffix
  return graph_def.SerializeToString()


def _serialized(ds: Any) -> bytes:
  """`ds`'s graph; fails for a pipeline that depends on state outside it."""
  import tensorflow as tf
  return ds._as_serialized_graph(  # noqa: SLF001  tf.data's own serialization, no public API
      external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL).numpy()


# Numbers TensorFlow appends to names (of functions, nodes, datasets): they
# count what the process built before, not what it builds.
_NAME_NUMBER = re.compile(r"_\d+")


def _pipeline_digest(graph: bytes) -> str:
  """A digest of a pipeline's graph that two processes building it from the
  same code and inputs agree on, whatever they built before: the sorted
  operations of the graph and of its functions, each with its attributes
  (constants, file names, vocabularies, lengths, seeds; protobuf's text form
  sorts them), without node names, their numbering and the dataset names
  of the `metadata` attributes."""
  from tensorflow.core.framework import graph_pb2
  graph_def = graph_pb2.GraphDef.FromString(graph)
  described = []
  for node in _nodes(graph_def):
    node.attr.pop("metadata", None)
    node.ClearField("name")
    node.ClearField("input")
    described.append(_NAME_NUMBER.sub("", str(node)))
  return hashlib.sha256("\n".join(sorted(described)).encode()).hexdigest()


def _check(loaded: _Loaded) -> None:
  if loaded.current() != loaded.digest:
    try:
      os.remove(loaded.path)
    except OSError:
      pass
    raise StaleProgramError(
        f"{loaded.what} loaded from {loaded.path} is not what this code and "
        "config build (something outside its key changed); the entry is removed and "
        "nothing this launch computed was saved: run the same command again.")


def verify_loaded(wait: bool) -> None:
  """Checks every program this process loaded from the store against the
  one its code and config lower to now.

  Args:
    wait: False starts the checks on a background thread and returns; True
      also waits for them.

  Raises:
    StaleProgramError: with `wait`, a loaded program differs.
  """
  from t5lite.threads import Background
  with _LOADED_LOCK:
    pending = list(_LOADED)
    for loaded in pending:
      if loaded.check is None:
        loaded.check = Background(functools.partial(_check, loaded),
                                  f"t5lite-check-{os.path.basename(loaded.path)}")
  if wait:
    for loaded in pending:
      try:
        loaded.check.result()
      finally:  # checked once: a later run in this process loads its own
        with _LOADED_LOCK:
          _LOADED.remove(loaded)
