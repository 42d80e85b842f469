"""The epoch loop's periods: nesting rules and the messages users see."""

import pytest

from t5lite.errors import UserError
from t5lite.periods import compute_periods


def _periods(**kw):
  base = dict(total_steps=100, eval_period=None, checkpoint_period=None, gc_period=None,
              stats_period=None)
  base.update(kw)
  return compute_periods(**base)


def test_epoch_is_smallest_period():
  p = _periods(eval_period=20, checkpoint_period=40, gc_period=10)
  assert (p.epoch, p.eval, p.checkpoint, p.gc, p.stats) == (10, 20, 40, 10, 10)


def test_stats_period_is_kept():
  assert _periods(eval_period=20, stats_period=5).stats == 5


def test_no_periods_means_one_epoch():
  assert _periods().epoch == 100


def test_disabled_periods_are_ignored():
  assert _periods(eval_period=0, checkpoint_period=30).epoch == 30


@pytest.mark.parametrize("kw, message", [
    (dict(eval_period=30, checkpoint_period=20),
     r"eval_period=30 is not a multiple of checkpoint_period=20.*eval_period=40"),
    (dict(eval_period=10, checkpoint_period=25),
     r"checkpoint_period=25 is not a multiple of eval_period=10.*checkpoint_period=30"),
    (dict(eval_period=10, gc_period=15), r"gc_period=15 is not a multiple of eval_period=10"),
    (dict(eval_period=-1), r"eval_period=-1 must be positive"),
])
def test_bad_periods_fail_with_a_fix(kw, message):
  with pytest.raises(ValueError, match=message):
    _periods(**kw)


@pytest.mark.parametrize("kw, error, message", [
    (dict(total_steps="abc"), UserError,
     r"^total_steps \(TRAIN_STEPS\) must be a whole number of steps, got 'abc' \(str\); "
     r"e\.g\. --gin\.TRAIN_STEPS=1000\.$"),
    (dict(total_steps=2.5), UserError, r"got 2\.5 \(float\)"),
    (dict(total_steps=-3), ValueError, r"^total_steps \(TRAIN_STEPS\)=-3 must be 0 or more\.$"),
    (dict(eval_period="10"), UserError, r"^eval_period must be a whole number of steps, got '10'"),
])
def test_step_counts_of_the_wrong_type_or_sign_fail(kw, error, message):
  with pytest.raises(error, match=message):
    _periods(**kw)
