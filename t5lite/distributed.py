"""Multi-process start-up and supervision through `jax.distributed`.

Every process of a job runs the same command (NCCL collectives on GPU, gloo
on CPU). The coordinator address and this process's index come from flags
or, with only --multiprocess_gpu, from the cluster environment JAX detects
(SLURM, Open MPI).

A multi-process job must never leave a process waiting forever for a peer
that is gone, and the person reading the logs must learn which peer it was:

- Joining: if not every process has joined after --initialization_timeout
  seconds, each waiting process prints which one is missing (the
  coordination service lists them when more than one could be) and exits.
- Running: each process heartbeats through the coordination service's
  key-value store. A peer whose heartbeat stops for --heartbeat_timeout
  seconds (killed, crashed, or its machine lost) makes every other process
  print "process K of N stopped responding ..." and exit, even from inside a
  blocked collective. A peer that fails with an error announces it first, so
  the others stop at once and repeat its message.
- Finishing: `finish` waits for every process at JAX's shutdown barrier.

JAX's own timeouts stay as a backstop behind these, set longer so that the
messages here are the ones a user sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from t5lite import jax_internals
from t5lite.errors import UserError


# Exit status of a process stopped because a peer stopped responding or the
# job could not assemble (a peer's own failure passes on its status instead).
PEER_LOST_EXIT = 4

_KEY_PREFIX = "t5lite_watchdog"
# JAX's own timeouts, relative to ours: late enough that ours fire first.
_JAX_BACKSTOP_S = 30
# How long a waiting process keeps running after its own join deadline so the
# coordination service can print the names of the missing processes.
_NAMING_GRACE_S = 10
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(\d+)$")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Flags that start a multi-process job.

  Attributes:
    multiprocess_gpu: start jax.distributed; without the three explicit
      flags below, read them from the cluster environment (SLURM, Open MPI).
    coordinator_address: 'host:port' where process 0 serves coordination.
    process_count: number of processes in the job.
    process_index: this process's index, 0 .. process_count - 1.
    initialization_timeout: seconds to wait for every process to join.
    heartbeat_timeout: seconds without a heartbeat after which a peer counts
      as dead and this process stops too.
  """

  multiprocess_gpu: bool = False
  coordinator_address: str | None = None
  process_count: int | None = None
  process_index: int | None = None
  initialization_timeout: int = 300
  heartbeat_timeout: int = 100

  @property
  def enabled(self) -> bool:
    return self.multiprocess_gpu or self.coordinator_address is not None

  @property
  def explicit(self) -> bool:
    """Whether the flags name the coordinator, count and index themselves."""
    return self.coordinator_address is not None


def validate(config: DistributedConfig) -> None:
  """Rejects incomplete or contradictory flags before anything starts.

  Raises:
    ValueError: naming the flag to add or fix.
  """
  explicit = [config.coordinator_address, config.process_count, config.process_index]
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise UserError(
        "--coordinator_address, --process_count and --process_index must be given together "
        f"(got {config.coordinator_address!r}, {config.process_count!r}, "
        f"{config.process_index!r}); or pass only --multiprocess_gpu to detect them from "
        "the cluster environment.")
  address = config.coordinator_address
  match = _HOST_PORT.match(address) if address is not None else None
  if address is not None and (not match or not 0 < int(match.group(2)) < 65536):
    raise UserError(f"--coordinator_address={config.coordinator_address!r} must be "
                    "'host:port', e.g. 'node001:1234', the same on every process.")
  if config.process_count is not None:
    if config.process_count < 1:
      raise UserError(f"--process_count={config.process_count} must be at least 1.")
    if not 0 <= config.process_index < config.process_count:
      raise UserError(f"--process_index={config.process_index} must be in "
                      f"[0, {config.process_count}) for --process_count={config.process_count}.")
  for name in ("initialization_timeout", "heartbeat_timeout"):
    if getattr(config, name) <= 0:
      raise UserError(f"--{name}={getattr(config, name)} must be a positive number of seconds.")


@dataclasses.dataclass(frozen=True)
class Job:
  """The job as this process resolved it, from flags or the cluster.

  Attributes:
    coordinator_address: 'host:port' of process 0's coordination service.
    process_count: number of processes.
    process_index: this process's index.
    local_device_ids: the local devices this process uses; None for all.
  """

  coordinator_address: str
  process_count: int
  process_index: int
  local_device_ids: Sequence[int] | None


def _resolve_job(config: DistributedConfig) -> Job:
  """The job from the flags, or from the cluster environment JAX detects.

  Raises:
    ValueError: --multiprocess_gpu alone, and no cluster environment found.
  """
  if config.explicit:
    # Without cluster detection a process sees all of its host's devices, even
    # under SLURM, where detection would narrow it to one GPU per task.
    return Job(config.coordinator_address, config.process_count, config.process_index, None)
  env_ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
  local = [int(i) for i in env_ids.split(",")] if env_ids else None
  address, count, index, local = jax_internals.detect_cluster(
      os.environ.get("JAX_COORDINATOR_ADDRESS"), local, config.initialization_timeout)
  if address is None or count is None or index is None:
    raise UserError(
        "--multiprocess_gpu found no cluster environment (SLURM or Open MPI) to take the "
        "coordinator address, process count and process index from; launch with srun or "
        "mpirun, or pass --coordinator_address, --process_count and --process_index.")
  return Job(address, int(count), int(index), local)


def _stop_process(exit_code: int, message: str) -> None:
  """Prints one line and ends the process at once, whatever other threads do."""
  print(f"t5lite: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(exit_code)  # not sys.exit: the main thread may be stuck in a collective


def _join_timeout_message(job: Job, timeout: int) -> str:
  fix = (f"Start every process with --coordinator_address={job.coordinator_address} "
         f"--process_count={job.process_count} and its own --process_index, check that they "
         "can reach that address, or raise --initialization_timeout.")
  if job.process_count == 2:
    missing = 1 - job.process_index
    role = " (the coordinator)" if missing == 0 else ""
    return (f"process {missing} of 2{role} did not join the job at {job.coordinator_address} "
            f"within {timeout} s. {fix}")
  return (f"process {job.process_index} of {job.process_count}: not every process joined the "
          f"job at {job.coordinator_address} within {timeout} s; the coordination service "
          f"names the missing ones below when process 0 is up. {fix}")


@contextlib.contextmanager
def _join_deadline(job: Job, timeout: int) -> Iterator[None]:
  """Stops this process with a message if joining takes longer than `timeout`."""
  def expire():
    message = _join_timeout_message(job, timeout)
    if job.process_count == 2:
      _stop_process(PEER_LOST_EXIT, message)
    print(f"t5lite: {message}", file=sys.stderr, flush=True)
    time.sleep(_NAMING_GRACE_S)
    _stop_process(PEER_LOST_EXIT, "stopping: the job did not assemble.")

  timer = threading.Timer(timeout, expire)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()


@contextlib.contextmanager
def _service_names_missing_processes(timeout: int) -> Iterator[None]:
  """Gives the coordination service its own registration deadline.

  With one, the service reports which processes never registered; without
  one (JAX's default), waiting processes only see an RPC deadline.
  `jax.distributed.initialize` has no argument for it, so the service
  factory it calls is wrapped for the duration of the call.
  """
  runtime = jax_internals.distributed_runtime()
  original = runtime.get_distributed_runtime_service

  def service(*args, **kwargs):
    kwargs.setdefault("cluster_register_timeout", timeout)
    try:
      return original(*args, **kwargs)
    except TypeError:  # a jaxlib without the argument: plain deadlines
      kwargs.pop("cluster_register_timeout")
      return original(*args, **kwargs)

  runtime.get_distributed_runtime_service = service
  try:
    yield
  finally:
    runtime.get_distributed_runtime_service = original


def _process_names(processes: Sequence[int]) -> str:
  if len(processes) == 1:
    return f"process {processes[0]}"
  return f"processes {', '.join(map(str, processes[:-1]))} and {processes[-1]}"


class Watchdog:
  """Heartbeats through the coordination service and stops this process when
  a peer fails or goes silent.

  One thread writes this process's counter under `<prefix>/alive/<index>`
  and reads everyone's keys; another judges what was read, so a key-value
  call stuck on an unreachable coordinator still ends in a verdict.

  Args:
    client: the connected `jax.distributed` client.
    job: this process's place in the job.
    timeout: seconds of silence after which a peer counts as dead.
  """

  def __init__(self, client: Any, job: Job, timeout: int):
    self._client, self._job, self._timeout = client, job, timeout
    self._interval = min(max(timeout / 5, 0.2), 5.0)
    now = time.monotonic()
    self._heard = {p: ("", now) for p in range(job.process_count) if p != job.process_index}
    self._contact = now  # last answer from the coordinator
    self._failed: dict[int, str] = {}
    self._done: set[int] = set()
    self._finishing = False
    self._lock = threading.Lock()
    self._stop = threading.Event()

  def start(self) -> None:
    """Starts the heartbeat and judge threads (daemons: they never hold up exit)."""
    for target in (self._beat, self._judge):
      threading.Thread(target=target, name=f"t5lite-{target.__name__[1:]}", daemon=True).start()

  def stop(self) -> None:
    """Ends both threads; no verdict is acted on after this."""
    self._stop.set()

  def _key(self, kind: str, process: int | None = None) -> str:
    return f"{_KEY_PREFIX}/{kind}/{self._job.process_index if process is None else process}"

  def announce(self, kind: str, value: str) -> None:
    """Publishes 'done', 'stopped' or 'failed' ('<exit code>|<message>') for this process."""
    with self._lock:
      self._finishing = True
    with contextlib.suppress(Exception):  # a gone coordinator cannot be told anything
      self._client.key_value_set(self._key(kind), value, allow_overwrite=True)

  def wait_for_peers_to_stop(self) -> None:
    """Until every peer has failed, finished or gone silent (bounded): process 0
    hosts the key-value store, so leaving early would hide its announcement."""
    deadline = time.monotonic() + 3 * self._interval + 1
    while time.monotonic() < deadline:
      with self._lock:
        now = time.monotonic()
        waiting = [p for p, (_, t) in self._heard.items() if p not in self._failed
                   and p not in self._done and now - t < self._timeout]
      if not waiting:
        return
      time.sleep(self._interval / 2)

  def wait_for_verdict(self) -> None:
    """Gives the judge one heartbeat timeout to stop this process over a silent
    or failed peer; returns if none turns up."""
    deadline = time.monotonic() + self._timeout + 2 * self._interval
    while time.monotonic() < deadline and not self._stop.is_set():
      time.sleep(self._interval / 2)

  def _beat(self) -> None:
    count = 0
    while not self._stop.is_set():
      try:
        self._client.key_value_set(self._key("alive"), str(count), allow_overwrite=True)
        self.record(self._client.key_value_dir_get(f"{_KEY_PREFIX}/"), time.monotonic())
      except Exception:  # noqa: BLE001 - silence is what the judge measures
        pass
      count += 1
      self._stop.wait(self._interval)

  def record(self, entries: Sequence[tuple[str, str]], now: float) -> None:
    """Takes in the watchdog keys read from the coordinator at time `now`."""
    with self._lock:
      self._contact = now
      for key, value in entries:
        kind, _, process = key[len(_KEY_PREFIX) + 1:].partition("/")
        process = int(process) if process.isdigit() else -1
        if process == self._job.process_index or not 0 <= process < self._job.process_count:
          continue
        if kind == "alive" and value != self._heard[process][0]:
          self._heard[process] = (value, now)
        elif kind == "failed":
          self._failed[process] = value
        elif kind in ("done", "stopped"):
          self._done.add(process)

  def _judge(self) -> None:
    while not self._stop.wait(self._interval / 2):
      verdict = self.verdict(time.monotonic())
      if verdict is not None and not self._stop.is_set():
        if self._failed:  # lets a failing process 0 know it may take the store down
          self.announce("stopped", "")
        _stop_process(*verdict)

  def verdict(self, now: float) -> tuple[int, str] | None:
    """(exit code, message) if this process must stop now, else None."""
    n, timeout = self._job.process_count, self._timeout
    with self._lock:
      if self._failed:
        process = min(self._failed)
        code, _, message = self._failed[process].partition("|")
        return int(code), f"process {process} of {n} failed ({message}); stopping this one too."
      if not self._finishing and now - self._contact > timeout:
        return PEER_LOST_EXIT, (
            f"process 0 of {n} (the coordinator at {self._job.coordinator_address}) stopped "
            f"responding: no answer for {timeout} s; stopping this one too. Check process 0's "
            "log and host.")
      silent = sorted(p for p, (_, t) in self._heard.items()
                      if p not in self._done and now - t > timeout)
    if silent:
      return PEER_LOST_EXIT, (
          f"{_process_names(silent)} of {n} stopped responding: no heartbeat for {timeout} s; "
          "stopping this one too. Check the log and host of the process named.")
    return None


_WATCHDOG: Watchdog | None = None


def initialize(config: DistributedConfig) -> None:
  """Starts jax.distributed when the flags ask for it; a no-op otherwise.

  Returns once every process has joined, with the heartbeat watchdog running
  when there is more than one process.

  Raises:
    ValueError: invalid flags, or --multiprocess_gpu outside a cluster.
  """
  global _WATCHDOG
  validate(config)
  if not config.enabled:
    return
  job = _resolve_job(config)
  # Multi-process CPU runs (tests, laptops) need a CPU collectives backend;
  # GPUs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout = config.initialization_timeout
  print(f"Joining the {job.process_count}-process job at {job.coordinator_address} as process "
        f"{job.process_index} (waiting up to {timeout} s for the others)", flush=True)
  with _join_deadline(job, timeout), _service_names_missing_processes(timeout + 1):
    jax.distributed.initialize(
        coordinator_address=job.coordinator_address, num_processes=job.process_count,
        process_id=job.process_index, local_device_ids=job.local_device_ids,
        cluster_detection_method="deactivate",
        initialization_timeout=timeout + _NAMING_GRACE_S + _JAX_BACKSTOP_S,
        heartbeat_timeout_seconds=config.heartbeat_timeout + _JAX_BACKSTOP_S)
  if job.process_count > 1:
    jax_internals.write_compilation_cache_in_every_process()
    _WATCHDOG = Watchdog(jax_internals.coordination_client(), job, config.heartbeat_timeout)
    _WATCHDOG.start()


def blame_lost_peer(error: BaseException) -> None:
  """Lets the watchdog name a dead peer behind `error`, if there is one.

  A collective can notice a peer's death before the heartbeat timeout does
  (gloo reports a reset connection as a runtime error). For such an error
  the watchdog gets one heartbeat timeout to stop this process with the
  peer named; otherwise, and for any other error, this returns.
  """
  if _WATCHDOG is not None and isinstance(error, jax.errors.JaxRuntimeError):
    _WATCHDOG.wait_for_verdict()


def report_failure(exit_code: int, message: str) -> None:
  """Tells the peers this process failed, then ends it with `exit_code`.

  Without this the peers would wait in their next collective until the
  heartbeat timeout. Returns (doing nothing) in a single-process run.

  Args:
    exit_code: the status this process exits with; peers exit with it too.
    message: one line saying what went wrong; peers repeat it.
  """
  watchdog = _WATCHDOG
  if watchdog is None:
    return
  watchdog.announce("failed", f"{exit_code}|{message}")
  if jax.process_index() == 0:
    watchdog.wait_for_peers_to_stop()
  watchdog.stop()
  sys.stdout.flush()
  sys.stderr.flush()
  # Not sys.exit: JAX's exit handler would wait for the peers at a shutdown
  # barrier they never reach.
  os._exit(exit_code)


def finish() -> None:
  """Waits for every process at JAX's shutdown barrier, still watching for peers
  that die before they arrive. A no-op unless jax.distributed was started."""
  global _WATCHDOG
  if not jax.distributed.is_initialized():
    return
  watchdog, _WATCHDOG = _WATCHDOG, None
  if watchdog is not None:
    watchdog.announce("done", "")
  jax.distributed.shutdown()
  if watchdog is not None:
    watchdog.stop()
