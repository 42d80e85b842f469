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
"""

from __future__ import annotations

import collections
import dataclasses
import os

import jax

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
  """How the programs compiled so far were obtained."""
  directory: str | None
  loaded: int
  compiled: int

  def describe(self) -> str:
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
    fails for its cache).
  """
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
  return directory


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
  return CacheUse(directory, hits, _EVENTS[_REQUEST_EVENT] - hits)
