"""Why training stops early, and the signals that ask it to.

The exceptions carry the exit status the CLI ends with. SIGTERM and Ctrl-C
(SIGINT) do not kill the loop: they set `PREEMPTION` (and `INTERRUPTED`),
which the loop checks after each step, so the current step is checkpointed
first.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import numpy as np


class TrainingStopped(Exception):
  """Training ended early on purpose; `exit_code` is what the CLI exits with."""

  exit_code = 1


class Diverged(TrainingStopped):
  """Training diverged (a NaN/Inf, an exploding update or a loss spike); the
  diverged steps were not checkpointed."""

  exit_code = 3


NonFiniteLossError = Diverged  # the name before loss spikes were caught too


class Preempted(TrainingStopped):
  """A preemption request arrived; the state at `step` was checkpointed."""

  exit_code = 143  # 128 + SIGTERM, what schedulers expect from a terminated job
  _what = "Preempted"

  def __init__(self, step: int):
    super().__init__(f"{self._what} at step {step}; checkpoint written. Rerun the same "
                     "command to continue from it.")
    self.step = step


class Interrupted(Preempted):
  """Ctrl-C (SIGINT) arrived; the state at `step` was checkpointed."""

  exit_code = 130  # 128 + SIGINT, what shells report for Ctrl-C
  _what = "Stopped by Ctrl-C"


PREEMPTION = threading.Event()


INTERRUPTED = threading.Event()  # the stop was asked with Ctrl-C (SIGINT)


def request_preemption(interrupted: bool = False) -> None:
  """Asks the running loop to checkpoint after the current step and stop.

  SIGTERM calls this, and SIGINT with `interrupted=True` (the run then exits
  with 130 instead of 143); so can a cloud preemption notice watcher. In a
  multi-process job the processes agree at the next stats period, and all
  of them checkpoint that step, whichever of them was asked.
  """
  if interrupted:
    INTERRUPTED.set()
  PREEMPTION.set()


class SignalsToPreemption:
  """Within the loop, SIGTERM and Ctrl-C (SIGINT) request a clean preemption
  instead of killing; after a Ctrl-C, a second one kills at once."""

  def __enter__(self):
    PREEMPTION.clear()
    INTERRUPTED.clear()
    self._installed = threading.current_thread() is threading.main_thread()
    if self._installed:
      self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM,
                                                      lambda *_: request_preemption()),
                        signal.SIGINT: signal.signal(signal.SIGINT, _interrupt)}
    return self

  def __exit__(self, *exc):
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous[signal.SIGTERM])
      if not INTERRUPTED.is_set():  # else a second Ctrl-C must still end the process
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
    PREEMPTION.clear()


def _interrupt(*_: Any) -> None:
  """The first Ctrl-C: checkpoint the current step and stop (exit 130)."""
  # From now on SIGINT has the system's default action, so a second Ctrl-C
  # ends the process at once, even while it waits for a checkpoint write
  # (the half-written step is never restored).
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  if jax.process_index() == 0:
    os.write(2, b"t5lite: Ctrl-C: saving the current step, then exiting; press Ctrl-C again "
                b"to exit at once without saving.\n")
  request_preemption(interrupted=True)


def any_process_preempted(pending: list) -> bool:
  """Whether any process got SIGTERM or Ctrl-C: every process must checkpoint
  the same step, so a multi-process job agrees at each stats period (one
  small all-gather) instead of acting on its own signal mid-period.

  The all-gather waits for the steps dispatched before it: otherwise one
  process can start it while another is still in a step's collective, and
  on CPU (gloo) the two then wait for each other until the context times out.
  """
  from jax.experimental import multihost_utils
  jax.block_until_ready(pending)
  # 0: go on, 1: preemption asked, 2: Ctrl-C; one Ctrl-C makes every process exit 130.
  code = int(PREEMPTION.is_set()) + int(INTERRUPTED.is_set())
  codes = multihost_utils.process_allgather(np.asarray([code], np.int32))
  if np.any(codes == 2):
    INTERRUPTED.set()
  return bool(np.any(codes))
