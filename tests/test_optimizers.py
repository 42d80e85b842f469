"""Learners, wrappers and schedules against updates worked out by hand in numpy."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gin
from t5lite import cli, metrics, optimizers, testing, trainer
from t5lite.train_state import TrainState, state_logical_axes


# A tiny tree with muP-relevant paths; matrices are factored when
# min_dim_size_to_factor=2. Values differ everywhere so a mixed-up leaf shows.
PARAMS = {"attn/kernel": np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]),
          "mlp/kernel": np.array([[0.3, -0.6], [1.2, 0.9], [-1.1, 0.4]]),
          "norm/scale": np.array([1.0, 0.8, 1.3])}
GRADS = [{"attn/kernel": np.array([[0.2, -0.4, 0.1], [0.3, 0.05, -0.6]]),
          "mlp/kernel": np.array([[-0.5, 0.25], [0.15, 0.7], [0.45, -0.35]]),
          "norm/scale": np.array([0.05, -0.1, 0.2])},
         {"attn/kernel": np.array([[-0.1, 0.3, 0.25], [0.4, -0.2, 0.1]]),
          "mlp/kernel": np.array([[0.6, -0.1], [0.2, 0.3], [-0.4, 0.5]]),
          "norm/scale": np.array([-0.3, 0.15, 0.05])}]
# Rates of the two steps: multiply_schedules(constant(0.1), linear_decay(1, 0.5, 2)).
RATES = [0.1, 0.075]


def _schedule():
  return optimizers.multiply_schedules([optimizers.constant(0.1),
                                        optimizers.linear_decay(1.0, 0.5, 2)])


def _nest(flat):
  tree = {}
  for path, value in flat.items():
    outer, inner = path.split("/")
    tree.setdefault(outer, {})[inner] = jnp.asarray(value, jnp.float32)
  return tree


def _flat(tree):
  return {f"{o}/{i}": np.asarray(v) for o, sub in tree.items() for i, v in sub.items()}


def _train(tx, grads=GRADS):
  state = TrainState.create(_nest(PARAMS), tx)
  for g in grads:
    state = state.apply_gradients(_nest(g))
  return state


def _assert_params(state, expected):
  got = _flat(state.params)
  for path in PARAMS:
    np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-7, err_msg=path)


def _rms(x):
  return np.sqrt(np.mean(np.square(x)))


def _factored_estimate(rows, cols):
  # Adafactor's rank-one second moment: row means times column means over the mean.
  return np.outer(rows, cols) / rows.mean()


# ---------------------------------------------------------------------------
# Learners, two steps by hand


def test_adamw_two_steps_by_hand():
  b1, b2, eps, wd, clip = 0.9, 0.95, 1e-8, 0.5, 1.0
  wd_scale = {"attn/kernel": 1.0, "mlp/kernel": 2.0, "norm/scale": 0.0}
  tx = optimizers.adamw(_schedule(), b1=b1, b2=b2, eps=eps, weight_decay=wd, clip_norm=clip,
                        weight_decay_scales=[("norm/.*", 0.0), ("mlp/.*", 2.0)])
  p = {k: v.copy() for k, v in PARAMS.items()}
  m = {k: np.zeros_like(v) for k, v in PARAMS.items()}
  v = {k: np.zeros_like(x) for k, x in PARAMS.items()}
  for t, (g, lr) in enumerate(zip(GRADS, RATES), start=1):
    norm = math.sqrt(sum(np.sum(x ** 2) for x in g.values()))
    assert norm > clip  # the clip takes part
    for k in p:
      gc = g[k] * clip / norm
      m[k] = b1 * m[k] + (1 - b1) * gc
      v[k] = b2 * v[k] + (1 - b2) * gc ** 2
      u = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
      p[k] = p[k] - lr * (u + wd * wd_scale[k] * p[k])
  state = _train(tx)
  _assert_params(state, p)
  assert np.isclose(optimizers.learning_rate_from_state(state.opt_state), RATES[-1])


def test_adastar_two_steps_by_hand():
  b1, b2, ub, eps, threshold, wd = 0.8, 0.9, 0.5, 0.01, 0.9, 0.1
  tx = optimizers.adastar(_schedule(), gradient_ema_decay=b1, gradient_square_ema_decay=b2,
                          eps=eps, eps_square=0.0, update_clipping_threshold=threshold,
                          update_ema_decay=ub, update_ema_debias=True,
                          min_dim_size_to_factor=2, weight_decay=wd,
                          weight_decay_scales={"norm/scale": 0.0})
  wd_scale = {"attn/kernel": 1.0, "mlp/kernel": 1.0, "norm/scale": 0.0}
  p = {k: x.copy() for k, x in PARAMS.items()}
  m = {k: np.zeros_like(x) for k, x in PARAMS.items()}
  s = {k: np.zeros_like(x) for k, x in PARAMS.items()}
  v = {"norm/scale": np.zeros(3)}
  rows = {k: np.zeros(PARAMS[k].shape[0]) for k in ("attn/kernel", "mlp/kernel")}
  cols = {k: np.zeros(PARAMS[k].shape[1]) for k in ("attn/kernel", "mlp/kernel")}
  clipped = 0
  for t, (g, lr) in enumerate(zip(GRADS, RATES), start=1):
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      g2 = g[k] ** 2
      if k in rows:
        rows[k] = b2 * rows[k] + (1 - b2) * g2.mean(axis=1)
        cols[k] = b2 * cols[k] + (1 - b2) * g2.mean(axis=0)
        second = _factored_estimate(rows[k], cols[k])
      else:
        v[k] = b2 * v[k] + (1 - b2) * g2
        second = v[k]
      raw = (m[k] / (1 - b1 ** t)) / (np.sqrt(second / (1 - b2 ** t)) + eps)
      clipped += _rms(raw) > threshold
      u = raw / max(1.0, _rms(raw) / threshold)
      s[k] = ub * s[k] + (1 - ub) * u
      p[k] = p[k] - lr * (s[k] / (1 - ub ** t) + wd * wd_scale[k] * p[k])
  assert 0 < clipped < 6  # clipping changed some updates and not others
  state = _train(tx)
  _assert_params(state, p)
  assert np.isclose(optimizers.learning_rate_from_state(state.opt_state), RATES[-1])


def test_adafactor_two_steps_by_hand():
  tx = optimizers.adafactor(_schedule(), min_dim_size_to_factor=2)
  eps = 1e-30
  p = {k: x.copy() for k, x in PARAMS.items()}
  v = {"norm/scale": np.zeros(3)}
  rows = {k: np.zeros(PARAMS[k].shape[0]) for k in ("attn/kernel", "mlp/kernel")}
  cols = {k: np.zeros(PARAMS[k].shape[1]) for k in ("attn/kernel", "mlp/kernel")}
  for t, (g, lr) in enumerate(zip(GRADS, RATES), start=1):
    decay = 1 - t ** -0.8  # 0 at the first step: v starts as g^2
    for k in p:
      g2 = g[k] ** 2 + eps
      if k in rows:
        rows[k] = decay * rows[k] + (1 - decay) * g2.mean(axis=1)
        cols[k] = decay * cols[k] + (1 - decay) * g2.mean(axis=0)
        second = _factored_estimate(rows[k], cols[k])
      else:
        v[k] = decay * v[k] + (1 - decay) * g2
        second = v[k]
      u = g[k] / np.sqrt(second)
      u = u / max(1.0, _rms(u) / 1.0)
      p[k] = p[k] - lr * max(_rms(p[k]), 1e-3) * u
  _assert_params(_train(tx), p)


# ---------------------------------------------------------------------------
# Weight decay and update scales by path


def test_weight_decay_scale_by_regex_with_zero_gradients():
  # A zero gradient makes Adam's step zero, leaving exactly the decay.
  lr, wd = 0.1, 0.5
  tx = optimizers.adamw(lr, weight_decay=wd, clip_norm=None,
                        weight_decay_scales=[(".*/scale", 0.0), ("mlp/.*", 2.0)])
  zero = {k: np.zeros_like(x) for k, x in PARAMS.items()}
  state = _train(tx, [zero])
  got = _flat(state.params)
  np.testing.assert_array_equal(got["norm/scale"], PARAMS["norm/scale"].astype(np.float32))
  np.testing.assert_allclose(got["mlp/kernel"], PARAMS["mlp/kernel"] * (1 - lr * wd * 2.0),
                             rtol=1e-6)
  np.testing.assert_allclose(got["attn/kernel"], PARAMS["attn/kernel"] * (1 - lr * wd),
                             rtol=1e-6)


LEARNERS = {
    "adamw": lambda: optimizers.adamw(0.1, weight_decay=0.1, clip_norm=None),
    "adastar": lambda: optimizers.adastar(0.1, min_dim_size_to_factor=2, weight_decay=0.1),
    "adafactor": lambda: optimizers.adafactor(0.1, min_dim_size_to_factor=2),
}


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_update_scales_hit_only_matching_paths(name):
  scales = {"attn/.*": 0.5, "mlp/kernel": 3.0}
  plain = _train(LEARNERS[name](), GRADS[:1])
  scaled = _train(optimizers.scale_updates_by_path(LEARNERS[name](), scales), GRADS[:1])
  expected_scale = {"attn/kernel": 0.5, "mlp/kernel": 3.0, "norm/scale": 1.0}
  for path, value in _flat(scaled.params).items():
    start = PARAMS[path].astype(np.float32)
    plain_step = _flat(plain.params)[path] - start
    assert np.abs(plain_step).max() > 1e-3  # the parameter moves, so the ratio means something
    # Each step is a difference of float32 parameters below 2 in size, off by
    # at most half an ulp of 2 (1.2e-7) in the result and in the reference.
    scale = expected_scale[path]
    np.testing.assert_allclose(value - start, scale * plain_step, rtol=1e-6,
                               atol=(1 + scale) * 1.2e-7, err_msg=path)
  assert np.isclose(optimizers.learning_rate_from_state(scaled.opt_state), 0.1)


def test_path_rules_are_checked():
  with pytest.raises(ValueError, match=r"weight_decay_scales regex 'mpl/\.\*' matches no "
                                       r"parameter.*'attn/kernel'"):
    TrainState.create(_nest(PARAMS), optimizers.adamw(0.1, weight_decay_scales={"mpl/.*": 0.0}))
  with pytest.raises(ValueError, match=r"scale_updates_by_path scales regex '\(' does not "
                                       r"compile"):
    optimizers.scale_updates_by_path(optimizers.adamw(0.1), {"(": 2.0})
  with pytest.raises(ValueError, match=r"scale for 'attn/\.\*' must be a finite number >= 0, "
                                       r"got -1\.0"):
    optimizers.adastar(0.1, weight_decay_scales=[("attn/.*", -1.0)])
  with pytest.raises(ValueError, match=r"entry 'attn' must be a \(regex, scale\) pair"):
    optimizers.adamw(0.1, weight_decay_scales=["attn"])


# ---------------------------------------------------------------------------
# Clip and skip-and-clip by global norm


def _grads_with_norm(norm):
  g = GRADS[0]
  current = math.sqrt(sum(np.sum(x ** 2) for x in g.values()))
  return {k: x * norm / current for k, x in g.items()}


def _adam_eps_one():
  # eps = 1 keeps Adam's step sensitive to the gradient's size, so clipping shows.
  return optimizers.adamw(0.1, eps=1.0, clip_norm=None)


def test_skip_and_clip_clips_a_moderate_gradient():
  tx = optimizers.skip_and_clip_by_global_norm(_adam_eps_one(), drop_norm=10.0, max_norm=1.0)
  g = _grads_with_norm(5.0)
  state = _train(tx, [g])
  # First Adam step on the clipped gradient c = g / 5: m_hat = c, v_hat = c^2.
  expected = {k: PARAMS[k] - 0.1 * (g[k] / 5) / (np.abs(g[k] / 5) + 1.0) for k in PARAMS}
  _assert_params(state, expected)
  assert int(optimizers.skipped_steps_from_state(state.opt_state)) == 0


@pytest.mark.parametrize("norm", [1000.0, float("nan")])
def test_skip_and_clip_leaves_state_unchanged_on_a_huge_gradient(norm):
  tx = optimizers.skip_and_clip_by_global_norm(_adam_eps_one(), drop_norm=10.0, max_norm=1.0)
  before = _train(tx, [_grads_with_norm(0.5)])
  after = before.apply_gradients(_nest(_grads_with_norm(norm)))
  for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(after.opt_state.inner_state),
                  jax.tree.leaves(before.opt_state.inner_state)):
    np.testing.assert_array_equal(a, b)  # moments, counts and the schedule's position
  assert int(optimizers.skipped_steps_from_state(after.opt_state)) == 1
  # The next good step is the one an uninterrupted run would take.
  resumed = after.apply_gradients(_nest(GRADS[1]))
  straight = _train(tx, [_grads_with_norm(0.5), GRADS[1]])
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params)):
    np.testing.assert_array_equal(a, b)


def test_clip_by_global_norm_wrapper():
  clipped = _train(optimizers.clip_by_global_norm(_adam_eps_one(), max_norm=1.0),
                   [_grads_with_norm(5.0)])
  unit = _train(_adam_eps_one(), [_grads_with_norm(1.0)])
  _assert_params(clipped, _flat(unit.params))
  assert not np.allclose(_flat(_train(_adam_eps_one(), [_grads_with_norm(5.0)]).params)
                         ["attn/kernel"], _flat(unit.params)["attn/kernel"])
  with pytest.raises(ValueError, match=r"max_norm=0 must be a positive number"):
    optimizers.clip_by_global_norm(_adam_eps_one(), max_norm=0)
  with pytest.raises(ValueError, match=r"drop_norm=-1 must be a positive number"):
    optimizers.skip_and_clip_by_global_norm(_adam_eps_one(), drop_norm=-1)


class _LinearModel:
  """loss = sum(w * x): the gradient is the batch itself."""

  def loss_normalizer(self, batch):
    return jnp.ones((), jnp.float32)

  def loss_fn(self, params, batch, dropout_rng, loss_normalizer=None, num_microbatches=1):
    return jnp.sum(params["w"] * batch["x"]), {}


def test_skipped_steps_reach_the_train_metrics_and_add_up_per_period():
  tx = optimizers.skip_and_clip_by_global_norm(optimizers.adamw(0.1), drop_norm=10.0,
                                               max_norm=1.0)
  state = TrainState.create({"w": jnp.ones((3,))}, tx)
  step = jax.jit(lambda s, b: trainer.train_step(s, b, model=_LinearModel(), dropout_seed=0,
                                                 num_microbatches=None))
  per_step = []
  for x in ([1.0, 2.0, 2.0], [300.0, 0.0, 400.0], [0.5, 0.5, 0.5], [1e4, 0.0, 0.0]):
    state, m = step(state, {"x": jnp.asarray(x)})
    per_step.append(m)
  fetched = metrics.fetch(per_step)
  assert [m["optimizer/skipped_steps"] for m in fetched] == [0.0, 1.0, 0.0, 1.0]
  period = metrics.average(fetched)
  assert period["optimizer/skipped_steps"] == 2.0  # summed over the stats period
  assert period["learning_rate"] == pytest.approx(0.1)  # averaged as before
  # Optimizers that never skip do not log the metric.
  plain = TrainState.create({"w": jnp.ones((3,))}, optimizers.adamw(0.1))
  _, m = trainer.train_step(plain, {"x": jnp.ones((3,))}, model=_LinearModel(), dropout_seed=0,
                            num_microbatches=None)
  assert "optimizer/skipped_steps" not in m and "learning_rate" in m


# ---------------------------------------------------------------------------
# Learning rate and logical axes of every learner's state


WRAPPED = {
    "adamw": lambda lr: optimizers.adamw(lr),
    "adastar": lambda lr: optimizers.adastar(lr, min_dim_size_to_factor=2),
    "adafactor": lambda lr: optimizers.adafactor(lr, min_dim_size_to_factor=2),
    "clip(adastar)": lambda lr: optimizers.clip_by_global_norm(
        optimizers.adastar(lr), max_norm=1.0),
    "skip(scale(adamw))": lambda lr: optimizers.skip_and_clip_by_global_norm(
        optimizers.scale_updates_by_path(optimizers.adamw(lr), {"attn/.*": 0.5}),
        drop_norm=100.0, max_norm=1.0),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_learning_rate_is_recoverable(name):
  schedule = optimizers.linear_decay(0.4, 0.1, decay_steps=3)
  state = _train(WRAPPED[name](schedule), GRADS + GRADS[:1])
  # The third update used the rate at step 2: 0.4 - 2 * 0.1.
  assert np.isclose(optimizers.learning_rate_from_state(state.opt_state), 0.2)


AXES = {"attn": {"kernel": P("embed", "mlp")}, "mlp": {"kernel": P("mlp", "embed")},
        "norm": {"scale": P("mlp")}}


def _axes_by_shape(tx):
  state = jax.eval_shape(lambda: TrainState.create(_nest(PARAMS), tx))
  axes = state_logical_axes(state, AXES).opt_state
  shapes = [x.shape for x in jax.tree.leaves(state.opt_state)]
  specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P))
  assert len(shapes) == len(specs)
  return list(zip(shapes, specs))


def test_adastar_and_skip_state_axes():
  tx = optimizers.skip_and_clip_by_global_norm(
      optimizers.adastar(0.1, gradient_ema_decay=0.9, min_dim_size_to_factor=2), drop_norm=1.0)
  pairs = _axes_by_shape(tx)
  # Factored statistics, like adafactor's: attn [2, 3] (embed, mlp) and mlp
  # [3, 2] (mlp, embed) both keep embed on the rows (2,) and mlp on the columns (3,).
  assert pairs.count(((2,), P("embed"))) == 2
  # (3,) leaves: those two column statistics, and the norm scale's gradient
  # EMA, second moment and update EMA, which mirror the parameter.
  assert pairs.count(((3,), P("mlp"))) == 5
  assert pairs.count(((2, 3), P("embed", "mlp"))) == 2  # gradient and update EMAs
  assert pairs.count(((3, 2), P("mlp", "embed"))) == 2
  # Counters (skip count, adastar count, schedule count) and placeholders: replicated.
  assert all(spec == P() for shape, spec in pairs if shape in ((), (1,)))
  assert sum(shape == () for shape, _ in pairs) >= 4


# ---------------------------------------------------------------------------
# Schedules


def test_schedule_values():
  cos = optimizers.warmup_cosine(2.0, warmup_steps=10, decay_steps=110, alpha=0.1,
                                 begin_value=0.2)
  # Warmup 0.2 -> 2.0 over 10 steps, then 0.2 + 1.8 * (1 + cos(pi * k / 100)) / 2.
  for step, value in [(0, 0.2), (5, 1.1), (10, 2.0), (35, 0.2 + 0.9 * (1 + math.cos(math.pi / 4))),
                      (60, 1.1), (110, 0.2), (500, 0.2)]:
    assert float(cos(step)) == pytest.approx(value, rel=1e-6), step
  frac = optimizers.warmup_cosine(1.0, warmup_steps=None, decay_steps=200, warmup_fraction=0.05)
  assert float(frac(10)) == pytest.approx(1.0) and float(frac(5)) == pytest.approx(0.5)
  rs = optimizers.rsqrt_with_warmup(2.0, warmup_steps=100)
  assert float(rs(0)) == pytest.approx(0.2) and float(rs(400)) == pytest.approx(0.1)
  lin = optimizers.linear_decay(1.0, 0.0, decay_steps=100, begin_step=50)
  assert [float(lin(s)) for s in (0, 50, 75, 150, 300)] == pytest.approx([1, 1, 0.75, 0, 0])
  assert float(optimizers.constant(0.3)(12345)) == pytest.approx(0.3)
  product = optimizers.multiply_schedules([rs, lin, 0.5])
  assert float(product(100)) == pytest.approx(0.2 * 0.5 * 0.5)


def test_schedule_errors():
  with pytest.raises(ValueError, match=r"decay_steps=10 must exceed warmup_steps=10"):
    optimizers.warmup_cosine(1.0, warmup_steps=10, decay_steps=10)
  with pytest.raises(ValueError, match=r"set exactly one of them"):
    optimizers.warmup_cosine(1.0, warmup_steps=10, decay_steps=100, warmup_fraction=0.1)
  with pytest.raises(ValueError, match=r"warmup_fraction=1.5 must be in \[0, 1\)"):
    optimizers.warmup_cosine(1.0, decay_steps=100, warmup_fraction=1.5)
  with pytest.raises(ValueError, match=r"needs decay_steps"):
    optimizers.warmup_cosine(1.0, warmup_steps=10)
  with pytest.raises(ValueError, match=r"linear_decay needs decay_steps > 0"):
    optimizers.linear_decay(1.0, 0.0, decay_steps=0)
  with pytest.raises(ValueError, match=r"factor 'x' must be a schedule or a number"):
    optimizers.multiply_schedules([optimizers.constant(1.0), "x"])
  with pytest.raises(ValueError, match=r"b2=1.0 must be in \[0, 1\)"):
    optimizers.adamw(0.1, b2=1.0)


# ---------------------------------------------------------------------------
# The shipped recipes


def _recipe_optimizer(recipe, bindings=()):
  cli.parse_gin(["gin/pretrain_dense.gin", f"gin/learners/{recipe}.gin"],
                ["MODEL_DIR = '/tmp/unused'", *bindings], cli.gin_search_paths([]))
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  schedule = gin.query_parameter("%LEARNING_RATE").scoped_configurable_fn()
  return model, schedule


_SHAPES = {"encoder_input_tokens": (1, 8), "decoder_target_tokens": (1, 4),
           "decoder_input_tokens": (1, 4), "decoder_loss_weights": (1, 4)}


def _real_params(model):
  import flax.linen as nn
  boxed = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), _SHAPES))
  return jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), nn.unbox(boxed["params"]))


@pytest.mark.parametrize("recipe", ["adamw_cosine", "adastar", "adafactor_rsqrt"])
def test_recipe_trains_the_model_parameters(recipe, clean_gin):
  model, schedule = _recipe_optimizer(recipe, ["TRAIN_STEPS = 1000"])
  state = TrainState.create(_real_params(model), model.optimizer,  # path rules match
                            testing.param_axes(model, _SHAPES))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), state.params)
  update = jax.jit(lambda s: s.apply_gradients(grads))
  new = update(update(state))
  assert float(optimizers.learning_rate_from_state(new.opt_state)) == pytest.approx(
      float(schedule(1)), rel=1e-6)
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.params, state.params)
  assert any(jax.tree.leaves(moved))


def test_adamw_cosine_recipe_is_the_documented_one(clean_gin):
  _, schedule = _recipe_optimizer("adamw_cosine", ["TRAIN_STEPS = 1000"])
  peak = gin.query_parameter("%PEAK_LEARNING_RATE")
  # 5% warmup, then cosine to a tenth of the peak at TRAIN_STEPS.
  assert float(schedule(0)) == 0.0 and float(schedule(50)) == pytest.approx(peak)
  assert float(schedule(1000)) == pytest.approx(0.1 * peak)
  for name, value in [("b1", 0.9), ("b2", 0.95), ("eps", 1e-8), ("clip_norm", 1.0)]:
    assert gin.query_parameter(f"optimizers.adamw.{name}") == value


@pytest.mark.slow
def test_recipe_cli_run_logs_rate_and_skipped_steps(tmp_path, monkeypatch):
  from test_cli import SHALLOW, TINY, run_in_process, scalars
  model_dir = tmp_path / "run"
  # No evaluation: it logs under eval/, not train/, and would compile an eval
  # step. What is logged does not depend on depth.
  run_in_process([*TINY, "--gin_file=gin/learners/adastar.gin", f"--gin.MODEL_DIR='{model_dir}'",
                  "--gin.EVAL_PERIOD=0", *SHALLOW],
                 str(tmp_path), monkeypatch)
  logdir = os.path.join(model_dir, "train")
  assert scalars(logdir, "optimizer/skipped_steps") == {2: 0.0, 4: 0.0}
  rates = scalars(logdir, "learning_rate")
  # warmup_fraction 0.05 of 4 steps is no warmup: cosine from the peak 3e-3.
  cosine = lambda s: 3e-4 + 2.7e-3 * (1 + math.cos(math.pi * s / 4)) / 2  # noqa: E731
  assert rates[4] == pytest.approx((cosine(2) + cosine(3)) / 2, rel=1e-5)


# ---------------------------------------------------------------------------
# T5X's schedules


def _t5x_schedules():
  path = os.path.join(os.path.dirname(__file__), "data", "t5x_train", "schedules.npz")
  with np.load(path, allow_pickle=False) as f:
    return [json.loads(c) for c in f["configs"]], f["steps"], f["values"]


def test_create_learning_rate_scheduler_gives_t5x_s_values():
  # T5X's own values (make_schedules.py), computed under jit as in its train step.
  configs, steps, values = _t5x_schedules()
  assert {f.strip() for c in configs for f in c["factors"].split("*")} == {
      "constant", "linear_warmup", "rsqrt_decay", "rsqrt_normalized_decay", "linear_decay",
      "cosine_decay", "decay_every"}
  for config, want in zip(configs, values):
    schedule = jax.jit(optimizers.create_learning_rate_scheduler(**config))
    got = np.array([schedule(jnp.asarray(step, jnp.int32)) for step in steps])
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0, err_msg=config["factors"])


def test_create_learning_rate_scheduler_refuses_unknown_factors():
  with pytest.raises(ValueError, match=r"factor\(s\) \['rsqrt_decy'\] .* are unknown; choose "
                                       r"from constant, linear_warmup"):
    optimizers.create_learning_rate_scheduler("constant * rsqrt_decy")
  with pytest.raises(ValueError, match="'linear_warmup' needs a positive step count"):
    optimizers.create_learning_rate_scheduler("linear_warmup", warmup_steps=0)
