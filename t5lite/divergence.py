"""Divergence checks: a non-finite or exploding update, or a loss spike.

The loop runs the check on each stats period's fetched metrics before that
period's state can be saved, so the newest checkpoint predates divergence.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from t5lite.errors import UserError


@dataclasses.dataclass(frozen=True)
class DivergenceLimits:
  """When a training step counts as diverged, besides a NaN or Inf loss,
  gradient norm or parameter norm (see docs/checkpoints.md for the defaults).

  Attributes:
    max_update_ratio: largest norm of one update as a multiple of the norm
      of the parameters it changes; None disables this check.
    loss_spike_factor: largest median loss of the last `SPIKE_STEPS` steps as
      a multiple of the median loss of the `loss_spike_window` steps before
      them; None disables this check.
    loss_spike_window: steps in that reference median; the spike check starts
      once the run (or the restart) has trained that many plus `SPIKE_STEPS`.

  Raises:
    ValueError: a ratio that is not a number above 0, a factor not above 1,
      or a window below 1.
  """

  max_update_ratio: float | None = 1.0
  loss_spike_factor: float | None = 3.0
  loss_spike_window: int = 100

  def __post_init__(self):
    for name in ("max_update_ratio", "loss_spike_factor"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not value > (0 if name == "max_update_ratio" else 1)):
        bound = "above 0" if name == "max_update_ratio" else "above 1"
        raise UserError(f"train.{name}={value!r} must be a number {bound}, or None to "
                        "disable that divergence check.")
    window = self.loss_spike_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
      raise UserError(f"train.loss_spike_window={window!r} must be a whole number of steps "
                      ">= 1.")


# A loss spike is judged on the median of this many steps, not on one step:
# single small batches are noisy, by up to 11x the median at low losses
# (docs/checkpoints.md), while a diverging run stays high.
SPIKE_STEPS = 10


class DivergenceCheck:
  """Finds the first diverged step of a stats period, before any of it is saved.

  A step's loss and gradient describe the parameters it started from; its
  update ratio and parameter norm describe the parameters it produced, the
  ones a checkpoint would save. Steps the optimizer skipped
  (`skip_and_clip_by_global_norm`) changed nothing and are not judged.
  """

  def __init__(self, limits: DivergenceLimits):
    self.limits = limits
    # The reference window, then the SPIKE_STEPS - 1 steps before the one judged.
    self._losses: collections.deque = collections.deque(
        maxlen=limits.loss_spike_window + SPIKE_STEPS - 1)

  def first_problem(self, fetched: list[dict[str, float]], first_step: int) -> str | None:
    """What went wrong at the first diverged step of `fetched`, or None.

    Args:
      fetched: per-step metrics of consecutive steps.
      first_step: the step number of `fetched[0]`.
    """
    for offset, metrics in enumerate(fetched):
      if metrics.get("optimizer/skipped_steps"):
        continue
      problem = self._problem(metrics)
      if problem:
        return f"at step {first_step + offset}: {problem}"
      if "loss" in metrics:
        self._losses.append(metrics["loss"])
    return None

  def _problem(self, metrics: dict[str, float]) -> str | None:
    for name, what in (("loss", "the loss"), ("grad_norm", "the gradient norm"),
                       ("param_norm", "the parameter norm")):
      if name in metrics and not math.isfinite(metrics[name]):
        return f"{what} became {metrics[name]}"
    ratio, limit = metrics.get("update_ratio"), self.limits.max_update_ratio
    if ratio is not None and limit is not None and ratio > limit:
      return (f"the update was {ratio:.3g} times the norm of the parameters (limit "
              f"max_update_ratio={limit:g})")
    factor, losses = self.limits.loss_spike_factor, list(self._losses)
    if factor is not None and "loss" in metrics and len(losses) == self._losses.maxlen:
      window = self.limits.loss_spike_window
      before = float(np.median(losses[:window]))
      recent = float(np.median(losses[window:] + [metrics["loss"]]))
      if recent > factor * before:
        return (f"the median loss of the last {SPIKE_STEPS} steps, {recent:.4g}, was "
                f"{recent / before:.3g} times the median {before:.4g} of the {window} steps "
                f"before them (limit loss_spike_factor={factor:g})")
    return None


def stop_message(problem: str, saved: Sequence[int]) -> str:
  """The line a diverged run stops with: what diverged where, what is on
  disk (the checkpoint steps `saved`, ascending), how to go on."""
  if not saved:
    return (f"Training diverged {problem}; stopped without saving it (no checkpoint yet). "
            "Rerun with a lower learning rate (or gradient clipping).")
  listed = ", ".join(str(s) for s in saved[-5:])
  return (f"Training diverged {problem}; stopped without saving it, the newest checkpoint "
          f"is step {saved[-1]}. Rerun with a lower learning rate (or gradient clipping) to "
          "continue from it, or restart from an earlier saved step (steps "
          f"{'..., ' if len(saved) > 5 else ''}{listed}) with "
          "--gin.train.resume_step=N.")
