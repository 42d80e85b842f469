"""The step periods of a run and what happens at which step.

An epoch is the largest step count after which something has to happen (a
checkpoint, an evaluation or a garbage collection). `Periods.saves_at` and
`Periods.evaluates_at` are the one schedule the loop follows and the dry
run prints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from t5lite.errors import UserError


@dataclasses.dataclass(frozen=True)
class Periods:
  """Step counts of the loop; every non-zero period is a multiple of `epoch`."""

  epoch: int
  checkpoint: int
  eval: int
  gc: int
  stats: int
  checkpoint_steps: tuple[int, ...] = ()

  def next_boundary(self, step: int) -> int:
    """The first step after `step` where the loop must stop for something."""
    end = (step // self.epoch + 1) * self.epoch
    return min([end] + [s for s in self.checkpoint_steps if s > step])

  def saves_at(self, step: int, end: int) -> bool:
    """Whether a run ending at step `end` checkpoints after `step`."""
    return bool(self.checkpoint) and (step % self.checkpoint == 0 or step == end
                                      or step in self.checkpoint_steps)

  def evaluates_at(self, step: int, end: int) -> bool:
    """Whether a run ending at step `end` evaluates after `step`."""
    return bool(self.eval) and (step % self.eval == 0 or step == end)


def compute_periods(*, total_steps: int, eval_period: int | None, checkpoint_period: int | None,
                    gc_period: int | None, stats_period: int | None,
                    checkpoint_steps: tuple[int, ...] = ()) -> Periods:
  """Epoch length = min of the eval, checkpoint and gc periods, checked for nesting.

  Args:
    total_steps: the run's final step (used when no period is set).
    eval_period / checkpoint_period / gc_period: 0 or None to disable.
    stats_period: steps between metric fetches; defaults to the epoch length.

  Returns:
    The validated `Periods`.

  Raises:
    ValueError: a negative period, or periods that are not multiples of each
      other (the message names both and suggests a fix).
  """
  check_step_count("total_steps (TRAIN_STEPS)", total_steps)
  named = {"eval_period": eval_period or 0, "checkpoint_period": checkpoint_period or 0,
           "gc_period": gc_period or 0}
  for name, value in list(named.items()) + [("stats_period", stats_period or 0)]:
    check_step_count(name, value)
    if value < 0:
      raise UserError(f"{name}={value} must be positive (or 0 to disable).")
  active = sorted((v, k) for k, v in named.items() if v > 0)
  for (small, small_name), (big, big_name) in zip(active, active[1:]):
    if big % small:
      raise UserError(
          f"{big_name}={big} is not a multiple of {small_name}={small}; periods must "
          f"divide each other, e.g. set {big_name}={(big // small + 1) * small}.")
  epoch = active[0][0] if active else max(total_steps, 1)
  return Periods(epoch=epoch, checkpoint=named["checkpoint_period"], eval=named["eval_period"],
                 gc=named["gc_period"], stats=stats_period or epoch,
                 checkpoint_steps=tuple(sorted(int(s) for s in checkpoint_steps)))


def check_step_count(name: str, value: Any) -> None:
  """A step count must be an int (gin passes `'abc'` or `1e3` on as given)."""
  is_total = name.startswith("total_steps")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    example = "; e.g. --gin.TRAIN_STEPS=1000" if is_total else ""
    raise UserError(f"{name} must be a whole number of steps, got {value!r} "
                    f"({type(value).__name__}){example}.")
  if is_total and value < 0:
    raise UserError(f"{name}={value} must be 0 or more.")
