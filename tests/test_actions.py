"""Early stopping and NaN actions: decisions, validation, and a real stop in train()."""

import math
import os

import pytest
from test_cli import SHALLOW, TINY, run_in_process, scalars

from t5lite import actions


def _feed(action, values, task="t", metric="loss"):
  return [action.run(step, {task: {metric: v}}) for step, v in enumerate(values)]


def test_early_stopping_min_waits_patience_checks_without_improvement():
  stop = actions.EarlyStopping(task="t", metric="loss", mode="min", patience=2)
  assert _feed(stop, [3.0, 2.0, 2.5, 2.1, 2.2]) == [False, False, False, True, True]
  assert stop.best == 2.0 and stop.best_step == 1
  assert "t/loss" in stop.reason() and "2" in stop.reason()


def test_early_stopping_max_and_tolerance():
  stop = actions.EarlyStopping(task="t", metric="acc", mode="max", patience=1, tolerance=0.5)
  # 10.3 beats 10.0 by less than the tolerance: no improvement.
  assert _feed(stop, [10.0, 10.3], metric="acc") == [False, True]
  stop = actions.EarlyStopping(task="t", metric="acc", mode="max", patience=1, tolerance=0.5)
  assert _feed(stop, [10.0, 10.6, 10.7], metric="acc") == [False, False, True]


def test_early_stopping_ignores_other_tasks_and_names_missing_metrics():
  stop = actions.EarlyStopping(task="t", metric="loss", patience=1)
  assert not stop.run(0, {"other": {"loss": 1.0}})
  with pytest.raises(ValueError, match="task 't' has no metric 'loss'.*'exact_match'"):
    stop.run(1, {"t": {"exact_match": 100.0}})


def test_a_config_watching_the_old_accuracy_is_told_its_new_names():
  stop = actions.EarlyStopping(task="t", metric="accuracy", mode="max", patience=1)
  with pytest.raises(ValueError, match=r"'accuracy' is now 'token_accuracy' \(train, train-eval\) "
                     r"or 'exact_match' \(inference eval\), both in percent\.$"):
    stop.run(1, {"t": {"exact_match": 100.0}})


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="up"), "mode must be 'min' or 'max'"),
    (dict(patience=0), "patience must be >= 1"),
    (dict(tolerance=-1.0), "tolerance must be >= 0")])
def test_early_stopping_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    actions.EarlyStopping(task="t", metric="loss", **kwargs)


def test_terminate_on_nan_checks_every_task_by_default():
  nan = actions.TerminateOnNan()
  assert not nan.run(0, {"a": {"loss": 1.0}, "b": {"loss": 2.0}})
  assert nan.run(1, {"a": {"loss": 1.0}, "b": {"loss": math.inf}})
  assert "b/loss" in nan.reason()
  assert not actions.TerminateOnNan.save_on_stop and actions.EarlyStopping.save_on_stop


def test_validate_actions_rejects_unknown_modes_and_values():
  with pytest.raises(ValueError, match=r"Unknown actions key 'EVAL'.*'TRAIN_EVAL'"):
    actions.validate_actions({"EVAL": [actions.TerminateOnNan()]})
  with pytest.raises(ValueError, match="must hold actions"):
    actions.validate_actions({"TRAIN": ["stop"]})
  by_mode = actions.validate_actions({"TRAIN": actions.TerminateOnNan()})
  assert list(by_mode) == [actions.ActionMode.TRAIN]


def test_run_actions_saves_unless_a_nan_action_fired():
  early = actions.EarlyStopping(task="t", metric="loss", patience=1)
  by_mode = {actions.ActionMode.TRAIN_EVAL: [early, actions.TerminateOnNan()]}
  assert actions.run_actions(by_mode, actions.ActionMode.TRAIN_EVAL, 0, {"t": {"loss": 1.0}}) \
      is None
  stop = actions.run_actions(by_mode, actions.ActionMode.TRAIN_EVAL, 1, {"t": {"loss": 1.0}})
  assert stop.save and "early stopping" in stop.reason
  stop = actions.run_actions(by_mode, actions.ActionMode.TRAIN_EVAL, 2, {"t": {"loss": math.nan}})
  assert not stop.save
  # Actions of other modes do not run.
  assert actions.run_actions(by_mode, actions.ActionMode.INFER_EVAL, 3, {"t": {"loss": 9.}}) \
      is None


@pytest.mark.slow
def test_early_stopping_ends_training_with_a_checkpoint(tmp_path, monkeypatch):
  # A tolerance no change can beat: the third evaluation (step 6) stops the
  # run of 20 steps, which saves that step (not a scheduled save: the period
  # is 4) and ends without an error. Depth does not matter here.
  model_dir = str(tmp_path / "run")
  args = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=20",
          "--gin.EVAL_PERIOD=2", "--gin.CHECKPOINT_PERIOD=4", "--gin.EVAL_STEPS=1",
          *SHALLOW,
          "--gin.train_lib.train.actions={'TRAIN_EVAL': [@actions.EarlyStopping()]}",
          "--gin.actions.EarlyStopping.task='t5lite_span_corruption'",
          "--gin.actions.EarlyStopping.metric='loss'",
          "--gin.actions.EarlyStopping.patience=2",
          "--gin.actions.EarlyStopping.tolerance=1000.0"]
  stdout = run_in_process(args, str(tmp_path), monkeypatch)
  assert "Stopped at step 6: early stopping" in stdout
  steps = sorted(int(s) for s in os.listdir(os.path.join(model_dir, "checkpoints"))
                 if s.isdigit())
  assert steps[-1] == 6
  evals = scalars(os.path.join(model_dir, "training_eval", "t5lite_span_corruption"), "loss")
  assert sorted(evals) == [2, 4, 6]
