"""`RunConfig`: train()'s keyword arguments, checked once, then read-only."""

import dataclasses
import inspect

import pytest

from t5lite import actions as actions_lib
from t5lite import train as train_lib
from t5lite.run_config import RunConfig


RESOLVED = {"random_seed": "seed", "max_update_ratio": "divergence",
            "loss_spike_factor": "divergence", "loss_spike_window": "divergence"}


def _arguments(**overrides):
  """train()'s defaults, with placeholders for what it requires."""
  args = {name: (p.default if p.default is not inspect.Parameter.empty else f"<{name}>")
          for name, p in inspect.signature(train_lib.train).parameters.items()}
  return {**args, **overrides}


def test_every_train_argument_has_its_setting():
  fields = {f.name for f in dataclasses.fields(RunConfig)}
  params = set(inspect.signature(train_lib.train).parameters)
  assert fields == {RESOLVED.get(name, name) for name in params}


def test_end_step_and_evaluations_are_decided_here():
  from t5lite.periods import compute_periods
  absolute = RunConfig.from_train_arguments(_arguments(total_steps=10), seed=0)
  relative = RunConfig.from_train_arguments(_arguments(total_steps=10, relative_steps=3), seed=0)
  assert (absolute.end_step(0), absolute.end_step(4), absolute.end_step(12)) == (10, 10, 10)
  assert (relative.end_step(0), relative.end_step(4), relative.end_step(12)) == (3, 7, 15)
  run = RunConfig.from_train_arguments(_arguments(infer_eval_dataset_cfg="<infer>"), seed=0)
  evaluating = compute_periods(total_steps=10, eval_period=2, checkpoint_period=2, gc_period=0,
                               stats_period=None)
  never = compute_periods(total_steps=10, eval_period=0, checkpoint_period=2, gc_period=0,
                          stats_period=None)
  assert run.evaluations(evaluating) == {"infer-eval": "<infer>"}
  assert run.evaluations(never) == {}


def test_settings_are_resolved_and_read_only():
  early = actions_lib.EarlyStopping(task="t", metric="loss")
  run = RunConfig.from_train_arguments(
      _arguments(loss_spike_factor=5.0, actions={"TRAIN_EVAL": [early]}), seed=7)
  assert run.seed == 7 and run.total_steps == "<total_steps>"
  assert (run.divergence.loss_spike_factor, run.divergence.max_update_ratio) == (5.0, 1.0)
  assert run.actions == {actions_lib.ActionMode.TRAIN_EVAL: [early]}
  assert run.datasets == ("<train_dataset_cfg>",)  # the unset eval data are left out
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.total_steps = 10  # type: ignore[misc]


@pytest.mark.parametrize("override, message", [
    ({"peak_flops_per_device": 0}, r"^train.peak_flops_per_device must be a positive FLOP/s "
                                   r"figure or None, got 0\.$"),
    ({"loss_spike_factor": 0.5}, r"^train.loss_spike_factor=0.5 must be a number above 1"),
    ({"actions": {"EVAL": []}}, r"^Unknown actions key 'EVAL'; allowed keys are"),
])
def test_a_setting_no_run_could_use_is_refused(override, message):
  with pytest.raises(ValueError, match=message):
    RunConfig.from_train_arguments(_arguments(**override), seed=0)
