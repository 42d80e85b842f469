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

JAX looks a program up only after tracing and lowering it (its key is the
lowered module), so a warm launch still traces its programs; it skips their
compiles. `use()` counts, for the run's summary, the programs this process
read from the cache and those it compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import math
import os
import tempfile
import threading
import zlib

import jax
from absl import logging

from t5lite import jax_internals, paths


ENV_DIRECTORY = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# The events JAX records for each compile that asks the cache, and each hit.
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_EVENTS: collections.Counter = collections.Counter()


def default_directory() -> str:
  """Under the user's cache directory (XDG), shared by every t5lite run."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "t5lite", "jax-compilation")


@dataclasses.dataclass(frozen=True)
class CacheUse:
  """How the programs compiled so far were obtained.

  Attributes:
    directory: the cache directory, None when the cache is off.
    loaded: programs read from the cache.
    compiled: programs compiled (the cache asked and missed).
  """
  directory: str | None
  loaded: int
  compiled: int

  def describe(self) -> str:
    """One line for the run's summary."""
    if self.directory is None:
      return "compilation cache off"
    return (f"compilation cache {self.directory}: {self.loaded} program(s) loaded, "
            f"{self.compiled} compiled")


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
    never written (`_use_read_only_if_unwritable`). A gs:// directory is
    JAX's to read and write.

  Raises:
    UserError: the directory is a URL of a storage other than gs://.
  """
  if not enabled:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  directory = directory or os.environ.get(ENV_DIRECTORY) or default_directory()
  paths.check_scheme("The compilation cache directory", directory)
  try:
    if "://" not in directory:  # JAX opens gs:// and the like itself
      os.makedirs(directory, exist_ok=True)
  except OSError as error:
    logging.warning("Compilation cache off, %s cannot be created (%s); pass "
                    "--compilation_cache_dir=DIR or --nocompilation_cache.", directory,
                    error.strerror)
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if ENV_MIN_COMPILE_TIME not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if "://" not in directory:
    _use_read_only_if_unwritable(directory)
    jax_internals.handle_compilation_cache_read_errors(_unreadable_entry_errors(),
                                                       _replace_unreadable_entry)
  return directory


def _use_read_only_if_unwritable(directory: str) -> bool:
  """Whether `directory` refuses new files; if so, JAX's cache is set to
  read it and write nothing, and one line says so (JAX would warn at every
  program it failed to write)."""
  try:
    handle, probe = tempfile.mkstemp(prefix=".t5lite-write-probe-", dir=directory)
  except OSError as error:
    logging.warning("Compilation cache %s is read-only (%s); its programs are read, none are "
                    "written.", directory, error.strerror)
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
    logging.warning("Compilation cache entry %s unreadable (%s); %s.", entry, _brief(error), fate)
  return True


def _count(event: str, **unused_kwargs) -> None:
  if event in (_HIT_EVENT, _REQUEST_EVENT):
    _EVENTS[event] += 1


# Listening from import on: the commands import this module to configure the
# cache before they compile anything.
jax.monitoring.register_event_listener(_count)


def use() -> CacheUse:
  """The cache directory in use (None: off), and the programs this process
  loaded from it and compiled."""
  directory = jax.config.jax_compilation_cache_dir
  if not jax.config.jax_enable_compilation_cache or not directory:
    return CacheUse(None, 0, 0)
  hits = _EVENTS[_HIT_EVENT]
  return CacheUse(directory, hits, _EVENTS[_REQUEST_EVENT] - hits)


def _brief(error: BaseException) -> str:
  """`error` on one short line, for a warning."""
  return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
