"""Runs a t5lite command as a multi-process job on localhost, for tests.

Each process gets its own fake CPU devices (XLA_FLAGS, set before JAX
starts), gloo collectives and the distributed flags for its index, exactly
as a user would launch one process per host. Output goes to files, so a
chatty process never blocks on a full pipe, and a job that outlives its
deadline is killed and reported with every process's log tail.

    results = run_two_processes(lambda i: [*TINY, f"--gin.MODEL_DIR='{d}'"], cwd=tmp)
    assert [r.returncode for r in results] == [0, 0]
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from t5lite import testing


BIN = os.path.dirname(sys.executable)
TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
  """A TCP port nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(num_devices: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """Environment of one process: CPU only, `num_devices` fake devices; the
  test's compilation cache comes with the environment (tests/conftest.py)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              XLA_FLAGS=testing.fake_device_flags(num_devices),
              **(extra or {}))


def distributed_flags(port: int, index: int, count: int, *, heartbeat_timeout: int,
                      initialization_timeout: int) -> list[str]:
  return [f"--coordinator_address=localhost:{port}", f"--process_count={count}",
          f"--process_index={index}", f"--heartbeat_timeout={heartbeat_timeout}",
          f"--initialization_timeout={initialization_timeout}"]


def command(script: str, args: Sequence[str]) -> list[str]:
  """A console script by name ('t5lite-train') or a Python file under tests/."""
  if script.endswith(".py"):
    return [sys.executable, os.path.join(TESTS, script), *args]
  return [os.path.join(BIN, script), *args]


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  """How one process of a job ended.

  Attributes:
    index: its process index.
    returncode: exit status (negative: killed by that signal).
    stdout / stderr: everything it printed.
    ended_at: time.monotonic() when it was seen to have exited.
  """

  index: int
  returncode: int
  stdout: str
  stderr: str
  ended_at: float

  def last_error_line(self) -> str:
    lines = self.stderr.strip().splitlines()
    return lines[-1] if lines else ""


class Job:
  """Processes started together, keyed by process index; see `start_job`."""

  def __init__(self, procs: Mapping[int, subprocess.Popen], logs: Mapping[int, tuple[str, str]]):
    self.procs = dict(procs)
    self._logs = dict(logs)
    self._ended: dict[int, float] = {}

  def output(self, index: int) -> tuple[str, str]:
    out, err = self._logs[index]
    with open(out) as f, open(err) as g:
      return f.read(), g.read()

  def wait_for_output(self, index: int, text: str, timeout: float) -> None:
    """Blocks until process `index` printed `text` to stdout.

    Raises:
      AssertionError: it exited or `timeout` passed first (the job is killed).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if text in self.output(index)[0]:
        return
      if self.procs[index].poll() is not None:
        break
      time.sleep(0.2)
    self.kill_all()
    raise AssertionError(f"process {index} never printed {text!r}:\n{self.describe()}")

  def kill(self, index: int) -> None:
    self.procs[index].send_signal(signal.SIGKILL)

  def kill_all(self) -> None:
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
    for proc in self.procs.values():
      proc.wait()

  def wait(self, timeout: float) -> list[ProcessResult]:
    """Waits for every process; on timeout kills them all and fails with their logs.

    Returns:
      One `ProcessResult` per started process, in index order.
    """
    deadline = time.monotonic() + timeout
    while len(self._ended) < len(self.procs):
      for i, proc in self.procs.items():
        if i not in self._ended and proc.poll() is not None:
          self._ended[i] = time.monotonic()
      if time.monotonic() > deadline:
        self.kill_all()
        raise AssertionError(f"job still running after {timeout} s:\n{self.describe()}")
      time.sleep(0.1)
    return [ProcessResult(i, self.procs[i].returncode, *self.output(i), self._ended[i])
            for i in sorted(self.procs)]

  def describe(self) -> str:
    parts = []
    for i, proc in sorted(self.procs.items()):
      out, err = self.output(i)
      parts.append(f"--- process {i} (exit {proc.poll()}) stdout:\n{out[-2000:]}\n"
                   f"--- process {i} stderr:\n{err[-3000:]}")
    return "\n".join(parts)


def start_job(args_fn: Callable[[int], Sequence[str]], *, cwd: str, log_dir: str,
              script: str = "t5lite-train", count: int = 2, indices: Sequence[int] | None = None,
              devices_per_process: int = 4, heartbeat_timeout: int = 30,
              initialization_timeout: int = 120, port: int | None = None,
              env_fn: Callable[[int], Mapping[str, str]] | None = None,
              with_distributed_flags: bool = True) -> Job:
  """Starts the processes of a `count`-process job on localhost.

  Args:
    args_fn: process index -> its command-line arguments (without the
      distributed flags, which are appended).
    cwd: working directory of every process.
    log_dir: where each process's stdout/stderr files go.
    script: console script name, or a Python file under tests/.
    count: processes in the job (--process_count).
    indices: the indices to actually start (default all); leave one out to
      play a peer that never arrives.
    devices_per_process: fake CPU devices of each process.
    heartbeat_timeout / initialization_timeout: the flags of the same name.
    port: the coordinator port (default: a free one).
    env_fn: process index -> extra environment variables.
    with_distributed_flags: False to leave the job to the environment
      (e.g. SLURM variables from `env_fn` with --multiprocess_gpu).

  Returns:
    The running `Job`.
  """
  port = port or free_port()
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = {}, {}
  for i in (range(count) if indices is None else indices):
    args = list(args_fn(i))
    if with_distributed_flags:
      args += distributed_flags(port, i, count, heartbeat_timeout=heartbeat_timeout,
                                initialization_timeout=initialization_timeout)
    out, err = os.path.join(log_dir, f"{i}.out"), os.path.join(log_dir, f"{i}.err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
      procs[i] = subprocess.Popen(
          command(script, args), cwd=cwd, stdout=stdout, stderr=stderr,
          env=process_env(devices_per_process, env_fn(i) if env_fn else None))
    logs[i] = (out, err)
  return Job(procs, logs)


def run_two_processes(args_fn: Callable[[int], Sequence[str]], *, cwd: str,
                      log_dir: str | None = None, timeout: float = 300,
                      **kwargs) -> list[ProcessResult]:
  """Runs a 2-process job to the end; `kwargs` go to `start_job`.

  Returns:
    The two `ProcessResult`s, in process order.

  Raises:
    AssertionError: the job did not end within `timeout` seconds (it is
      killed; the message carries both logs).
  """
  log_dir = log_dir or os.path.join(cwd, f"logs-{free_port()}")
  return start_job(args_fn, cwd=cwd, log_dir=log_dir, count=2, **kwargs).wait(timeout)
