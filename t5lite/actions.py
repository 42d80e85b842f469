"""Actions: decisions taken on metrics between epochs (early stopping, NaN stops).

`train(actions=...)` takes a mapping from a mode to a list of actions:

  TRAIN       the stats-period averages of the training metrics, under the
              task name of the training data;
  TRAIN_EVAL  the teacher-forced metrics of each evaluated task;
  INFER_EVAL  the inference metrics (seqio metric functions) of each task.

After each evaluation (or stats period, for TRAIN) every action of that mode
sees `{task_name: {metric_name: value}}` and returns True to stop training.
Process 0 decides and broadcasts the decision, so every process stops at the
same step even if their metric copies differed in the last bit.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from t5lite.errors import UserError


TaskMetrics = Mapping[str, Mapping[str, float]]


class ActionMode(enum.Enum):
  TRAIN = "TRAIN"
  TRAIN_EVAL = "TRAIN_EVAL"
  INFER_EVAL = "INFER_EVAL"


class Action:
  """Base class: `run` returns True when training should stop.

  Attributes:
    save_on_stop: checkpoint the current step when this action stops
      training (False for a state that must not be kept, e.g. NaN).
  """

  save_on_stop = True

  def run(self, step: int, metrics_by_task: TaskMetrics) -> bool:
    raise NotImplementedError

  def reason(self) -> str:
    """Why the last `run` asked to stop, for the console and the logs."""
    return type(self).__name__


# Names an older config may still watch -> what the run reports instead.
_RENAMED_METRICS = {"accuracy": "'token_accuracy' (train, train-eval) or 'exact_match' "
                                "(inference eval), both in percent"}


def _lookup(metrics_by_task: TaskMetrics, task: str, metric: str, action: str) -> float | None:
  """The value of `metric` for `task`, or None when this mode did not report the task."""
  if task not in metrics_by_task:
    return None
  metrics = metrics_by_task[task]
  if metric not in metrics:
    renamed = (f" '{metric}' is now {_RENAMED_METRICS[metric]}."
               if metric in _RENAMED_METRICS else "")
    raise UserError(f"{action}: task '{task}' has no metric '{metric}'; its metrics are "
                    f"{sorted(metrics)}.{renamed}")
  return float(metrics[metric])


class EarlyStopping(Action):
  """Stops when a metric has not improved for `patience` consecutive checks.

  Args:
    task: the task (or mixture) whose metric is watched.
    metric: metric name, e.g. 'loss' or 'token_accuracy' (TRAIN_EVAL) or
      'exact_match' (INFER_EVAL).
    mode: 'min' if lower is better, 'max' if higher is better.
    patience: how many checks in a row without improvement are tolerated.
    tolerance: an improvement must beat the best value by more than this.

  Raises:
    ValueError: for a mode other than 'min'/'max', patience < 1 or a
      negative tolerance.
  """

  def __init__(self, task: str, metric: str, mode: str = "min", patience: int = 3,
               tolerance: float = 0.0):
    if mode not in ("min", "max"):
      raise UserError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}.")
    if patience < 1:
      raise UserError(f"EarlyStopping patience must be >= 1, got {patience}.")
    if tolerance < 0:
      raise UserError(f"EarlyStopping tolerance must be >= 0, got {tolerance}.")
    self.task, self.metric, self.mode = task, metric, mode
    self.patience, self.tolerance = patience, tolerance
    self.best: float | None = None
    self.best_step: int | None = None
    self.bad_checks = 0

  def _improved(self, value: float) -> bool:
    if self.best is None:
      return True
    if self.mode == "min":
      return value < self.best - self.tolerance
    return value > self.best + self.tolerance

  def run(self, step: int, metrics_by_task: TaskMetrics) -> bool:
    value = _lookup(metrics_by_task, self.task, self.metric, "EarlyStopping")
    if value is None:
      return False
    if self._improved(value):
      self.best, self.best_step, self.bad_checks = value, step, 0
      return False
    self.bad_checks += 1
    return self.bad_checks >= self.patience

  def reason(self) -> str:
    return (f"early stopping: {self.task}/{self.metric} has not improved on {self.best:.6g} "
            f"(step {self.best_step}) for {self.bad_checks} checks")


class TerminateOnNan(Action):
  """Stops when a metric of a task is NaN or infinite.

  Args:
    task: the task whose metric is checked; None checks every task.
    metric: metric name ('loss' by default).
  """

  save_on_stop = False

  def __init__(self, task: str | None = None, metric: str = "loss"):
    self.task, self.metric = task, metric
    self._bad: tuple[str, float] | None = None

  def run(self, step: int, metrics_by_task: TaskMetrics) -> bool:
    tasks = [self.task] if self.task is not None else sorted(metrics_by_task)
    for task in tasks:
      value = _lookup(metrics_by_task, task, self.metric, "TerminateOnNan")
      if value is not None and not math.isfinite(value):
        self._bad = (task, value)
        return True
    return False

  def reason(self) -> str:
    task, value = self._bad or ("?", float("nan"))
    return f"{task}/{self.metric} became {value}"


def validate_actions(actions: Mapping[str, Sequence[Action]] | None) -> dict[ActionMode, list]:
  """Checks the keys and values of `train(actions=...)`.

  Args:
    actions: mode name ('TRAIN', 'TRAIN_EVAL', 'INFER_EVAL') -> actions.

  Returns:
    The same mapping keyed by `ActionMode`.

  Raises:
    ValueError: an unknown mode, or a value that is not a list of actions.
  """
  allowed = [m.value for m in ActionMode]
  by_mode: dict[ActionMode, list] = {}
  for key, value in (actions or {}).items():
    name = key.value if isinstance(key, ActionMode) else key
    if name not in allowed:
      raise UserError(f"Unknown actions key {key!r}; allowed keys are {allowed}.")
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
      if not isinstance(item, Action):
        raise UserError(f"actions[{name!r}] must hold actions such as "
                        f"EarlyStopping or TerminateOnNan, got {item!r}.")
    by_mode[ActionMode(name)] = items
  return by_mode


@dataclasses.dataclass(frozen=True)
class Stop:
  """Training should stop: why, and whether to checkpoint the step first."""

  reason: str
  save: bool


_GO, _STOP_AND_SAVE, _STOP = 0, 1, 2


def broadcast_decision(code: int) -> int:
  """Process 0's decision code, on every process."""
  if jax.process_count() == 1:
    return code
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.asarray(code, np.int32)))


def run_actions(by_mode: Mapping[ActionMode, Sequence[Action]], mode: ActionMode, step: int,
                metrics_by_task: TaskMetrics) -> Stop | None:
  """Runs the actions of `mode`; returns a `Stop`, or None to go on.

  Every action runs (so each keeps its own history) before process 0's
  decision is broadcast. If any stopping action must not save (NaN), the
  step is not saved.
  """
  fired = [a for a in by_mode.get(mode, ()) if a.run(step, metrics_by_task)]
  code = _GO
  if fired:
    code = _STOP_AND_SAVE if all(a.save_on_stop for a in fired) else _STOP
  code = broadcast_decision(code)
  if code == _GO:
    return None
  reason = "; ".join(a.reason() for a in fired) or "stopped by process 0"
  return Stop(reason=reason, save=code == _STOP_AND_SAVE)
