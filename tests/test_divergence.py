"""What counts as a diverged step (the checks run before a stats period is saved)."""

import math
import os

import pytest

from t5lite.divergence import SPIKE_STEPS, DivergenceCheck, DivergenceLimits


def _step(loss=2.0, grad_norm=1.0, param_norm=50.0, update_ratio=0.01, **extra):
  return dict(loss=loss, grad_norm=grad_norm, param_norm=param_norm, update_ratio=update_ratio,
              **extra)


@pytest.mark.parametrize("bad, named", [
    (dict(loss=math.nan), "the loss became nan"),
    (dict(grad_norm=math.inf), "the gradient norm became inf"),
    (dict(param_norm=math.nan), "the parameter norm became nan"),
    (dict(update_ratio=5e7), "the update was 5e+07 times the norm of the parameters"),
])
def test_first_bad_step_of_a_period_is_named(bad, named):
  check = DivergenceCheck(DivergenceLimits())
  problem = check.first_problem([_step(), _step(**bad), _step(**bad)], first_step=5)
  assert problem.startswith(f"at step 6: {named}")


def test_steps_the_optimizer_skipped_are_not_judged():
  check = DivergenceCheck(DivergenceLimits())
  skipped = _step(loss=math.nan, grad_norm=math.inf, update_ratio=0.0,
                  **{"optimizer/skipped_steps": 1.0})
  assert check.first_problem([skipped, _step()], first_step=1) is None


def test_loss_spike_needs_a_full_window_then_fires_when_it_lasts():
  assert SPIKE_STEPS == 10
  check = DivergenceCheck(DivergenceLimits(loss_spike_factor=3.0, loss_spike_window=4))
  # Steps 1-13 fill the window (4) and the spike steps (10 - 1): even a jump passes.
  first = [9.0, 1.0, 30.0] + [1.0] * 10
  assert check.first_problem([_step(loss=v) for v in first], first_step=1) is None
  # One noisy batch far above the median (step 14) is not a spike.
  assert check.first_problem([_step(loss=50.0)], first_step=14) is None
  # Losses that stay above 3x the median are, at the step (19) that makes them
  # the majority of the last 10 (with step 14).
  problem = check.first_problem([_step(loss=4.0)] * 10, first_step=15)
  assert problem == ("at step 19: the median loss of the last 10 steps, 4, was 4 times the "
                     "median 1 of the 4 steps before them (limit loss_spike_factor=3)"), problem


def test_limits_can_be_disabled():
  check = DivergenceCheck(DivergenceLimits(loss_spike_factor=None, max_update_ratio=None,
                                           loss_spike_window=1))
  steps = [_step(loss=1.0), _step(loss=100.0, update_ratio=1e9)]
  assert check.first_problem(steps, first_step=1) is None
  assert check.first_problem([_step(loss=math.inf)], first_step=3).startswith("at step 3")


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_spike_factor=1.0), "loss_spike_factor=1.0 must be a number above 1"),
    (dict(loss_spike_factor="3"), "loss_spike_factor='3' must be a number above 1"),
    (dict(max_update_ratio=0), "max_update_ratio=0 must be a number above 0"),
    (dict(loss_spike_window=0), "loss_spike_window=0 must be a whole number"),
])
def test_bad_limits_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    DivergenceLimits(**kwargs)


def _measured(name):
  """Per-step metrics of a normal run of a shipped config (command in the file)."""
  path = os.path.join(os.path.dirname(__file__), "data", "divergence", f"{name}_tiny.txt")
  rows = [line.split() for line in open(path) if not line.startswith("#")]
  return [dict(loss=float(loss), update_ratio=float(ratio)) for _, loss, ratio in rows]


@pytest.mark.parametrize("name", ["pretrain_dense", "pretrain_moe", "finetune_dense"])
def test_defaults_never_fire_on_normal_runs_of_the_shipped_configs(name):
  steps = _measured(name)
  assert DivergenceCheck(DivergenceLimits()).first_problem(steps, first_step=1) is None


def test_fine_tuning_noise_at_low_loss_is_what_sets_the_default_factor():
  steps = _measured("finetune_dense")  # batch 4, losses down to 0.03: the noisiest run
  problem = DivergenceCheck(DivergenceLimits(loss_spike_factor=2.0)).first_problem(steps, 1)
  assert problem is not None and "median loss of the last 10 steps" in problem
