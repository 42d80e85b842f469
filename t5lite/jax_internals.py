"""The few JAX internals t5lite needs where JAX has no public API.

Each is one small function here and nowhere else, so a JAX release that
moves one breaks this module alone, and `tests/test_jax_internals.py`, which
calls every function, fails naming it. What each is for:

- `detect_cluster`: the SLURM / Open MPI detection `jax.distributed.initialize`
  runs itself, needed before joining to print which job is being joined and
  to check the flags.
- `distributed_runtime`: the module whose `get_distributed_runtime_service`
  `jax.distributed.initialize` calls; wrapping that call gives the
  coordination service a registration deadline, so it names missing peers.
- `coordination_client`: the client of the coordination service this process
  joined; the watchdog reads peers' heartbeats and failures through it.
- `registered_platforms`: the platform names JAX can start, to name an unknown
  `JAX_PLATFORMS` value before JAX fails on it deep inside start-up.
- `expand_platforms`, `passed_over`: what JAX does with `JAX_PLATFORMS` before
  it starts a backend (aliases, skipping CUDA without an NVIDIA GPU), so a
  platform this machine lacks is named instead of JAX's failed assertion;
  `platforms_present` says what the machine has instead, without JAX's
  advice on plugins, which its logger (named for a private module) prints.
- `write_compilation_cache_in_every_process`: JAX writes the persistent
  compilation cache from process 0 only; in a multi-process CPU job, whose
  cache keys differ per process, every process writes its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def detect_cluster(coordinator_address: str | None, local_device_ids: Sequence[int] | None,
                   initialization_timeout: int) -> tuple[Any, Any, Any, Any]:
  """(coordinator address, process count, process index, local device ids)
  from the cluster environment; None for what it does not give."""
  from jax._src import clusters
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      coordinator_address, None, None, local_device_ids, None, initialization_timeout)


def distributed_runtime() -> Any:
  """The module holding `get_distributed_runtime_service`."""
  from jax._src import distributed
  return distributed._jax  # noqa: SLF001


def coordination_client() -> Any:
  """This process's coordination-service client; None before it joined a job."""
  from jax._src import distributed
  return distributed.global_state.client


def registered_platforms() -> set[str]:
  """Names (and aliases) of the platforms JAX has a backend factory for."""
  from jax._src import xla_bridge
  return {*xla_bridge._backend_factories, *xla_bridge._platform_aliases}  # noqa: SLF001


def expand_platforms(jax_platforms: str) -> list[str]:
  """The platforms a `JAX_PLATFORMS` value names, with aliases expanded as
  JAX expands them (`gpu` is `cuda`, `rocm` and `oneapi`), in order."""
  from jax._src import xla_bridge
  names = [n.strip() for n in jax_platforms.split(",") if n.strip()]
  return [p for name in names for p in xla_bridge.expand_platform_alias(name)]


def passed_over(platform: str) -> str | None:
  """Why JAX skips `platform` without trying to start it, or None.

  JAX skips `cuda` on a machine without an NVIDIA GPU device file; when it
  skipped every platform named, its first device query fails an assertion.
  """
  from jax._src import hardware_utils
  if platform == "cuda" and not hardware_utils.has_visible_nvidia_gpu():
    return "no NVIDIA GPU is visible for 'cuda' (no NVIDIA device file in /dev)"
  return None


def platforms_present() -> list[str]:
  """The platforms JAX starts on this machine when left to choose, the
  accelerators first. It restarts JAX's backends, so it serves a message
  after a failed start, nothing else."""
  import logging

  import jax
  from jax._src import xla_bridge
  from jax.extend import backend
  backend.clear_backends()
  jax.config.update("jax_platforms", "")
  logger = logging.getLogger(xla_bridge.__name__)
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    return sorted(backend.backends(), key=lambda p: p == "cpu")
  finally:
    logger.setLevel(level)


def write_compilation_cache_in_every_process() -> None:
  """Lets every process of a CPU job write the persistent compilation cache.

  JAX writes cache entries from process 0 only: on GPUs and TPUs a program's
  key is the same in every process, and one writer avoids contention on
  shared filesystems. On CPUs the key names the process, so the other
  processes would find nothing on a restart and compile everything again;
  with this each writes its own CPU entries. Other platforms are unchanged.
  """
  from jax._src import compiler, distributed
  write = compiler._cache_write  # noqa: SLF001
  if getattr(write, "in_every_process", False):
    return

  def write_in_every_process(cache_key: str, compile_time_secs: float, module_name: str,
                             backend: Any, executable: Any, host_callbacks: Any) -> None:
    state = distributed.global_state
    if backend.platform != "cpu" or state.process_id == 0:
      write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
      return
    process_id, state.process_id = state.process_id, 0
    try:
      write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
    finally:
      state.process_id = process_id

  write_in_every_process.in_every_process = True
  compiler._cache_write = write_in_every_process  # noqa: SLF001


def handle_compilation_cache_read_errors(
    errors: tuple[type[BaseException], ...],
    handle: Callable[[str, BaseException], bool]) -> None:
  """Shows a failed read of JAX's persistent compilation cache to `handle` first.

  When reading the entry of key `cache_key` raises one of `errors`,
  `handle(cache_key, error)` is called: True makes the read a miss (JAX then
  compiles the program and writes its entry), False leaves the error to JAX
  (a warning, then the same). Called again, it replaces the earlier handler.
  """
  from jax._src import compilation_cache
  read = getattr(compilation_cache.get_executable_and_time, "t5lite_read",
                 compilation_cache.get_executable_and_time)

  def read_or_handle(cache_key: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    try:
      return read(cache_key, *args, **kwargs)
    except errors as error:
      if handle(cache_key, error):
        return None, None
      raise

  read_or_handle.t5lite_read = read
  compilation_cache.get_executable_and_time = read_or_handle


def compilation_cache_entry_files(directory: str, cache_key: str) -> tuple[str, str]:
  """The files JAX's persistent cache in `directory` keeps for `cache_key`:
  the entry and its access time (written only when the cache has a size
  limit)."""
  import os

  from jax._src import lru_cache
  return (os.path.join(directory, cache_key + lru_cache._CACHE_SUFFIX),  # noqa: SLF001
          os.path.join(directory, cache_key + lru_cache._ATIME_SUFFIX))  # noqa: SLF001
