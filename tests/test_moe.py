"""Tests of the Mixture-of-Experts layer (moe.py) and the MoE models built on it."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from t5lite import axis_names as ax
from t5lite import optimizers, testing, trainer
from t5lite.models import layers, models, moe, transformer


# Different size on every axis so that a swapped axis fails loudly.
BATCH, LENGTH, EMBED, EXPERTS, EXPERT_MLP = 3, 12, 8, 4, 16


def _inputs(seed=0, shape=(BATCH, LENGTH, EMBED)):
  # Drawn by NumPy: jax.random compiles a program for every new shape, which
  # at XLA's default level costs seconds each; the tests only need values.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _layer(**overrides):
  kwargs = dict(num_experts=EXPERTS, num_selected_experts=2, expert_mlp_dim=EXPERT_MLP,
                min_expert_capacity=1)
  return moe.MoeLayer(**{**kwargs, **overrides})


def _apply(layer, params, x, deterministic=True, rngs=None):
  """Output and the sown statistics (each a float) of one layer call."""
  out, state = layer.apply({"params": params}, x, deterministic, rngs=rngs,
                           mutable=["intermediates"])
  stats = {k: float(v[0]) for k, v in state["intermediates"].items()}
  return out, stats


@functools.lru_cache(maxsize=None)
def _params(**overrides):
  """The layer's parameters, drawn by NumPy and scaled by fan-in as in `_init`
  below: running the real init compiles a random program per parameter shape
  (seconds each); these tests only need weights of the right shapes."""
  layer = _layer(**overrides)
  abstract = nn.unbox(jax.eval_shape(lambda: layer.init(jax.random.key(0), _inputs()))["params"])
  rng = np.random.default_rng(0)
  return jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0.0, x.shape[-2] ** -0.5, x.shape), x.dtype), abstract)


def _router_to_expert_0(params):
  """Router weights that send every token with positive features to expert 0."""
  kernel = np.zeros((EMBED, EXPERTS), np.float32)
  kernel[:, 0] = 1.0
  return {**params, "router": {"kernel": jnp.asarray(kernel)}}


# ---------------------------------------------------------------------------
# Losses and routing on fixed router values.
# ---------------------------------------------------------------------------


def _numpy_losses(logits, choices):
  """Per-group load-balancing loss counting `choices` [groups, tokens, c] and
  the z-loss, in float64."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  num_experts = logits.shape[-1]
  aux = []
  for g in range(logits.shape[0]):
    fraction = np.bincount(choices[g].ravel(), minlength=num_experts) / logits.shape[1]
    aux.append(num_experts * np.sum(fraction * probs[g].mean(0)))
  lse = np.log(np.exp(logits).sum(-1))
  return float(np.mean(aux)), float(np.mean(lse**2))


def test_aux_and_z_loss_match_hand_values():
  # A uniform router has lse = log(E), and its loss counts the choices: 1
  # for the first choice, k for all k, whichever experts they are.
  uniform = jnp.zeros((2, 5, EXPERTS))
  top2 = jnp.stack([jnp.arange(5) % EXPERTS, (jnp.arange(5) + 1) % EXPERTS], -1)
  top2 = jnp.tile(top2, (2, 1, 1))
  probs = jax.nn.softmax(uniform)
  np.testing.assert_allclose(moe.load_balancing_loss(probs, top2[..., :1]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(moe.load_balancing_loss(probs, top2), 2.0, rtol=1e-6)
  np.testing.assert_allclose(moe.router_z_loss(uniform), np.log(EXPERTS) ** 2, rtol=1e-6)
  # Everything on expert 0 with probability p: E * 1 * p.
  collapsed = jnp.asarray([[[2.0, 0.0, 0.0, 0.0]] * 3])
  p0 = np.exp(2.0) / (np.exp(2.0) + 3)
  np.testing.assert_allclose(
      moe.load_balancing_loss(jax.nn.softmax(collapsed), jnp.zeros((1, 3, 1), jnp.int32)),
      EXPERTS * p0, rtol=1e-6)


@pytest.mark.parametrize("choices, balanced", [("first", 1.0), ("all", 2.0)])
def test_a_balanced_top2_router_logs_the_number_of_counted_choices(choices, balanced):
  # 8 tokens whose router probabilities are (0.4, 0.3, 0.2, 0.1) rotated by
  # the token's position: each expert is the first choice of 2 tokens, one
  # of the two choices of 4, and has mean probability 1/4.
  probs = np.stack([np.roll([0.4, 0.3, 0.2, 0.1], t) for t in range(8)])[None]
  logits = jnp.asarray(np.log(probs), jnp.float32)
  routing = moe.route_top_k(jax.nn.softmax(logits), 2, capacity=8)
  counted = routing.expert_index[..., :1] if choices == "first" else routing.expert_index
  np.testing.assert_allclose(moe.load_balancing_loss(jax.nn.softmax(logits), counted),
                             balanced, rtol=1e-6)
  # The layer sows the same value for inputs whose router logits are these.
  layer = _layer(load_balancing_choices=choices)
  params = {**_params(), "router": {"kernel": jnp.eye(EMBED, EXPERTS)}}
  x = jnp.zeros((1, 8, EMBED)).at[..., :EXPERTS].set(logits)
  _, stats = _apply(layer, params, x)
  np.testing.assert_allclose(stats[moe.AUXILIARY_LOSS], balanced, rtol=1e-6)


@pytest.mark.parametrize("choices, k", [("all", 2), ("first", 1)])
def test_layer_sows_losses_matching_numpy_for_fixed_router_weights(choices, k):
  layer = _layer(load_balancing_choices=choices)
  kernel = np.random.default_rng(3).normal(0, 1.0, (EMBED, EXPERTS)).astype(np.float32)
  params = {**_params(), "router": {"kernel": jnp.asarray(kernel)}}
  x = _inputs(1)
  _, stats = _apply(layer, params, x)
  logits = np.einsum("gtd,de->gte", np.asarray(x, np.float64), kernel)
  aux, z = _numpy_losses(logits, np.argsort(-logits, -1)[..., :k])
  np.testing.assert_allclose(stats[moe.AUXILIARY_LOSS], aux, rtol=1e-5)
  np.testing.assert_allclose(stats[moe.ROUTER_Z_LOSS], z, rtol=1e-5)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top2 = np.sort(probs, -1)[..., -2:].sum(-1)
  np.testing.assert_allclose(stats[moe.ROUTER_CONFIDENCE], top2.mean(), rtol=1e-5)


def test_load_balancing_choices_are_validated():
  with pytest.raises(ValueError, match=r"MoeLayer.load_balancing_choices='top1' is not "
                                       r"supported; use 'all'.*or 'first'"):
    _layer(load_balancing_choices="top1").init(jax.random.key(0), _inputs())
  with pytest.raises(ValueError, match=r"TransformerConfig.load_balancing_choices='x'"):
    _moe_config(load_balancing_choices="x")
  layer = transformer._moe(_moe_config(load_balancing_choices="first"))
  assert layer.load_balancing_choices == "first"
  assert transformer._moe(_moe_config()).load_balancing_choices == "all"  # T5X's


def test_expert_capacity_formula():
  # ceil(1.25 * 12 * 2 / 4) = 8
  assert moe.expert_capacity(12, 4, 2, 1.25, 4) == 8
  assert moe.expert_capacity(12, 4, 1, 1.0, 4) == 4  # ceil(3) raised to the minimum
  assert moe.expert_capacity(12, 4, 1, 1.0, 1) == 3
  assert moe.expert_capacity(2, 4, 2, 1.0, 4) == 2  # never above tokens per group
  assert moe.expert_capacity(12, 4, 2, 0.0, 4) == 12  # dropless
  assert moe.expert_capacity(12, 4, 2, -1.0, 4) == 12


def test_num_groups():
  assert moe.num_groups(3, 12, None) == 3  # one per example
  assert moe.num_groups(3, 12, 12) == 3
  assert moe.num_groups(3, 12, 36) == 1
  assert moe.num_groups(3, 12, 5) == 9  # 36 tokens: ceil(36/5)=8 groups do not divide, 9 do
  assert moe.num_groups(3, 12, 1000) == 1


def test_route_top_k_priorities():
  # One group of 5 tokens, 3 experts, capacity 2.
  probs = jnp.asarray([[
      [0.6, 0.3, 0.1],  # t0: expert 0, then 1
      [0.5, 0.4, 0.1],  # t1: expert 0, then 1
      [0.9, 0.05, 0.05],  # t2: expert 0 (most confident)
      [0.2, 0.7, 0.1],  # t3: expert 1, then 0
      [0.1, 0.2, 0.7],  # t4: expert 2, then 1
  ]])
  top1 = moe.route_top_k(probs, 1, capacity=2)
  # Position order: t0 and t1 fill expert 0; t2 is left behind.
  np.testing.assert_array_equal(top1.dispatch[0, :, 0, :],
                                [[1, 0], [0, 1], [0, 0], [0, 0], [0, 0]])
  np.testing.assert_allclose(top1.fraction_tokens_left_behind, 1 / 5)
  np.testing.assert_allclose(top1.combine[0, 1, 0, 1], 0.5)
  np.testing.assert_allclose(top1.expert_usage, 4 / 6)  # 4 of 3 * 2 slots
  np.testing.assert_allclose(top1.router_confidence, np.mean([0.6, 0.5, 0.9, 0.7, 0.7]))
  # Batch-prioritized: t2 (0.9) and t0 (0.6) win expert 0, t1 is dropped.
  bpr = moe.route_top_k(probs, 1, capacity=2, batch_prioritized_routing=True)
  np.testing.assert_array_equal(bpr.dispatch[0, :, 0, :],
                                [[0, 1], [0, 0], [1, 0], [0, 0], [0, 0]])
  # Top-2: every first choice queues before any second choice, so t3's
  # first choice takes expert 1 before t0's second choice, and t4's second
  # choice (expert 1) finds it full after t0.
  top2 = moe.route_top_k(probs, 2, capacity=2)
  np.testing.assert_array_equal(top2.dispatch[0, :, 1, :],
                                [[0, 1], [0, 0], [0, 0], [1, 0], [0, 0]])
  np.testing.assert_allclose(top2.fraction_tokens_left_behind, 1 / 5)  # t2: 0 full, 1 full
  assert float(top2.dispatch[0, 2].sum()) == 0


def test_route_top_k_renormalize_divides_by_the_chosen_probabilities():
  probs = jnp.asarray([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]])
  raw = moe.route_top_k(probs, 2, capacity=3)
  norm = moe.route_top_k(probs, 2, capacity=3, renormalize=True)
  np.testing.assert_array_equal(norm.dispatch, raw.dispatch)
  np.testing.assert_allclose(raw.combine.sum((2, 3)), [[0.8, 0.9, 0.9]], rtol=1e-6)
  np.testing.assert_allclose(norm.combine.sum((2, 3)), [[1.0, 1.0, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(norm.combine[0, 1, 1].sum(), 0.6 / 0.9, rtol=1e-6)
  assert float(norm.router_confidence) == float(raw.router_confidence)  # raw probabilities
  top1 = moe.route_top_k(probs, 1, capacity=3, renormalize=True)
  np.testing.assert_allclose(top1.combine.sum((2, 3)), [[1.0, 1.0, 1.0]])


# ---------------------------------------------------------------------------
# Capacity: dropped tokens give exactly zero; dropless drops nothing.
# ---------------------------------------------------------------------------


def _dyadic_params(params, seed):
  """Expert weights in quarters from -1/2 to 1/2, router unchanged: with
  inputs in quarters too, every matmul sum is exact in float32, so outputs
  cannot depend on the order XLA adds them in."""
  rng = np.random.default_rng(seed)
  draw = lambda a: jnp.asarray(rng.integers(-2, 3, a.shape) / 4, jnp.float32)  # noqa: E731
  return {k: v if k == "router" else draw(v) for k, v in params.items()}


def test_overflow_tokens_are_dropped_to_exact_zero_and_counted():
  # ReLU-gated experts keep the expert MLP exact on the dyadic values below.
  kwargs = dict(num_selected_experts=1, activations=("relu", "linear"))
  layer = _layer(**kwargs, train_capacity_factor=1.0, eval_capacity_factor=4.0)
  params = _dyadic_params(_router_to_expert_0(_params(**kwargs)), seed=2)
  # Positive features in quarters: every token prefers expert 0.
  x = jnp.asarray(np.random.default_rng(2).integers(1, 5, (BATCH, LENGTH, EMBED)) / 4,
                  jnp.float32)
  # Train: capacity ceil(1.0 * 12 / 4) = 3 per group, so tokens 3.. overflow.
  out, stats = _apply(layer, params, x, deterministic=False)
  assert np.all(np.asarray(out[:, 3:]) == 0.0)
  assert np.all(np.abs(np.asarray(out[:, :3])).sum(-1) > 0)
  np.testing.assert_allclose(stats[moe.FRACTION_TOKENS_LEFT_BEHIND], 9 / 12)
  np.testing.assert_allclose(stats[moe.EXPERT_USAGE], 3 / (EXPERTS * 3))
  # Eval factor 4.0 gives capacity 12: nothing is dropped, and the kept
  # tokens' outputs are bitwise the same (another capacity is another matmul
  # shape, which the exact dyadic sums make irrelevant).
  out_eval, stats_eval = _apply(layer, params, x, deterministic=True)
  assert stats_eval[moe.FRACTION_TOKENS_LEFT_BEHIND] == 0.0
  assert np.all(np.abs(np.asarray(out_eval)).sum(-1) > 0)
  np.testing.assert_array_equal(out_eval[:, :3], out[:, :3])


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_dropless_keeps_every_token(factor):
  layer = _layer(train_capacity_factor=factor, min_expert_capacity=1)
  params = _router_to_expert_0(_params())
  _, stats = _apply(layer, params, jnp.abs(_inputs(2)), deterministic=False)
  assert stats[moe.FRACTION_TOKENS_LEFT_BEHIND] == 0.0
  # Top-2 of 4 experts with capacity = tokens: half the slots are used.
  np.testing.assert_allclose(stats[moe.EXPERT_USAGE], 2 / EXPERTS)


def test_one_expert_equals_the_dense_mlp():
  layer = _layer(num_experts=1, num_selected_experts=1, train_capacity_factor=1.0)
  params = _params(num_experts=1, num_selected_experts=1, train_capacity_factor=1.0)
  dense = layers.MlpBlock(mlp_dim=EXPERT_MLP)
  dense_params = {name: {"kernel": params[name][0]} for name in ("wi_0", "wi_1", "wo")}
  x = _inputs(4)
  out, stats = _apply(layer, params, x, deterministic=False)
  np.testing.assert_allclose(out, dense.apply({"params": dense_params}, x), rtol=1e-6,
                             atol=1e-6)
  # One expert: logsumexp of the single logit is the logit itself.
  logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64)
  np.testing.assert_allclose(stats.pop(moe.ROUTER_Z_LOSS), np.mean(logits ** 2), rtol=1e-5)
  assert stats == {moe.AUXILIARY_LOSS: 1.0, moe.FRACTION_TOKENS_LEFT_BEHIND: 0.0,
                   moe.EXPERT_USAGE: 1.0, moe.ROUTER_CONFIDENCE: 1.0}


def test_bfloat16_experts_keep_a_float32_router():
  layer = _layer(dtype=jnp.bfloat16)
  out, state = layer.apply({"params": _params()}, _inputs(6).astype(jnp.bfloat16),
                           mutable=["intermediates"])
  assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
  assert all(v[0].dtype == jnp.float32 for v in state["intermediates"].values())
  # The float32 reference takes the experts' weights as the bfloat16 layer
  # holds them (the router stays float32 in both). What is left is the
  # rounding of activations to bfloat16, at most 2**-8 of a value each (8
  # significant bits): the hidden activations, then the output, so within
  # 2 * 2**-8 of the output's largest magnitude.
  params = _params()
  rounded = {name: value if name == "router" else
             jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16).astype(jnp.float32), value)
             for name, value in params.items()}
  reference, _ = _apply(_layer(), rounded, _inputs(6).astype(jnp.bfloat16))
  bound = 2 * 2.0 ** -8 * float(np.abs(reference).max())
  np.testing.assert_allclose(out.astype(jnp.float32), reference, rtol=0, atol=bound)


def test_jitter_only_in_training():
  layer = _layer(router_jitter_noise=0.1)
  params, x = _params(router_jitter_noise=0.1), _inputs(5)

  def z_loss(deterministic, seed):
    rngs = {"dropout": jax.random.key(seed)}
    return _apply(layer, params, x, deterministic, rngs)[1][moe.ROUTER_Z_LOSS]

  assert z_loss(True, 0) == z_loss(True, 1)
  assert len({z_loss(True, 0), z_loss(False, 0), z_loss(False, 1)}) == 3


def test_layer_rejects_bad_values():
  with pytest.raises(ValueError, match=r"num_selected_experts must be in \[1, num_experts=4\]"):
    _layer(num_selected_experts=5).init(jax.random.key(0), _inputs())
  with pytest.raises(ValueError, match="group_size must be >= 1 or None, got 0"):
    _layer(group_size=0).init(jax.random.key(0), _inputs())


# ---------------------------------------------------------------------------
# Switch Transformers: ReLU experts, fixed capacity, raw top-1 probability.
# ---------------------------------------------------------------------------

_SWITCH = dict(num_selected_experts=1, activations=("relu",))


def _numpy_switch(params, x, renormalize=False):
  """float64 top-1 MoE without capacity: p * wo(relu(wi x)) of the chosen expert."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  logits = x @ p["router"]["kernel"]  # [batch, length, experts]
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for b, t in np.ndindex(x.shape[:2]):
    e = int(np.argmax(probs[b, t]))
    weight = 1.0 if renormalize else probs[b, t, e]
    out[b, t] = weight * (np.maximum(x[b, t] @ p["wi"][e], 0.0) @ p["wo"][e])
  return out


def test_single_activation_experts_have_one_wi_kernel():
  # Shapes and axis names only: eval_shape gives both without compiling the
  # random initialisers (seconds each at XLA's default level).
  variables = jax.eval_shape(lambda: _layer(**_SWITCH).init(jax.random.key(0), _inputs()))
  specs = nn.get_partition_spec(variables)["params"]
  assert tuple(specs["wi"]) == (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP)
  assert tuple(specs["wo"]) == (ax.EXPERT, ax.EXPERT_MLP, ax.EMBED)
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables)["params"])
  assert shapes == {"router": {"kernel": (EMBED, EXPERTS)}, "wi": (EXPERTS, EMBED, EXPERT_MLP),
                    "wo": (EXPERTS, EXPERT_MLP, EMBED)}


@pytest.mark.parametrize("renormalize", [False, True])
def test_switch_top1_output_is_router_probability_times_the_expert(renormalize):
  # Dropless, so every token reaches its expert; only the weight differs.
  layer = _layer(**_SWITCH, eval_capacity_factor=0.0, renormalize_router_weights=renormalize)
  params = _params(**_SWITCH)
  x = _inputs(8, (2, 5, EMBED))
  out, _ = _apply(layer, params, x)
  np.testing.assert_allclose(out, _numpy_switch(params, x, renormalize), rtol=1e-5, atol=1e-6)


def test_fixed_expert_capacity_keeps_the_earliest_token_of_each_group():
  # The factors and the minimum would give 3 slots; expert_capacity=1 overrides them.
  layer = _layer(**_SWITCH, expert_capacity=1, train_capacity_factor=4.0,
                 eval_capacity_factor=4.0, min_expert_capacity=4)
  params = _router_to_expert_0(_params(**_SWITCH))
  x = jnp.abs(_inputs(7, (2, 3, EMBED)))  # 2 groups of 3 tokens, all choose expert 0
  for deterministic in (True, False):
    out, stats = _apply(layer, params, x, deterministic)
    assert np.all(np.asarray(out[:, 1:]) == 0.0)
    np.testing.assert_allclose(out[:, 0], _numpy_switch(params, x)[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[moe.FRACTION_TOKENS_LEFT_BEHIND], 2 / 3)
    np.testing.assert_allclose(stats[moe.EXPERT_USAGE], 1 / EXPERTS)


def test_fixed_expert_capacity_is_clamped_to_the_group():
  # 64 slots (the Hugging Face default) for groups of 3 tokens: nothing drops.
  layer = _layer(**_SWITCH, expert_capacity=64)
  params = _router_to_expert_0(_params(**_SWITCH))
  x = jnp.abs(_inputs(7, (2, 3, EMBED)))
  out, stats = _apply(layer, params, x)
  assert stats[moe.FRACTION_TOKENS_LEFT_BEHIND] == 0.0
  np.testing.assert_allclose(stats[moe.EXPERT_USAGE], 1 / EXPERTS)  # 3 of 3 slots on 1 expert
  np.testing.assert_allclose(out, _numpy_switch(params, x), rtol=1e-5, atol=1e-6)


def test_router_runs_in_float32_under_bfloat16():
  x = _inputs(6).astype(jnp.bfloat16)
  _, stats = _apply(_layer(dtype=jnp.bfloat16), _params(), x)
  # The z-loss of float32 logits of the bfloat16 inputs; a bfloat16 router
  # would be off by about 1e-3.
  logits = np.asarray(x, np.float64) @ np.asarray(_params()["router"]["kernel"], np.float64)
  z_loss = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
  np.testing.assert_allclose(stats[moe.ROUTER_Z_LOSS], z_loss, rtol=1e-5)


def test_switch_options_reach_every_moe_layer():
  cfg = _moe_config(num_selected_experts=1, mlp_activations=("relu",), expert_capacity=3,
                    renormalize_router_weights=True)
  layer = transformer._moe(cfg)
  assert (layer.activations, layer.expert_capacity, layer.renormalize_router_weights) == (
      ("relu",), 3, True)
  shapes = {"encoder_input_tokens": (1, _ENC_LEN), "decoder_input_tokens": (1, _DEC_LEN)}
  params = nn.unbox(jax.eval_shape(lambda: _model(cfg).get_initial_variables(
      jax.random.key(0), shapes))["params"])
  assert set(params["encoder"]["layers_1"]["moe"]) == {"router", "wi", "wo"}
  assert params["decoder"]["layers_3"]["moe"]["wi"].shape == (EXPERTS, EMBED, EXPERT_MLP)
  assert set(params["decoder"]["layers_0"]["mlp"]) == {"wi", "wo"}
  with pytest.raises(ValueError, match="expert_capacity must be >= 1 or None, got 0"):
    _moe_config(expert_capacity=0)


def test_layer_rejects_bad_switch_values():
  with pytest.raises(ValueError, match="MoeLayer.expert_capacity must be >= 1 or None, got 0"):
    _layer(expert_capacity=0).init(jax.random.key(0), _inputs())
  with pytest.raises(ValueError, match=r"MoeLayer.activations=\('tanh',\) has unknown"):
    _layer(activations=("tanh",)).init(jax.random.key(0), _inputs())


# ---------------------------------------------------------------------------
# Expert parallelism.
# ---------------------------------------------------------------------------


def test_expert_params_logical_axes():
  # Shapes and axis names only, as above: no initialiser is compiled.
  variables = jax.eval_shape(lambda: _layer().init(jax.random.key(0), _inputs()))
  specs = nn.get_partition_spec(variables)["params"]
  assert tuple(specs["router"]["kernel"]) == (ax.EMBED, None)
  assert tuple(specs["wi_0"]) == (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP)
  assert tuple(specs["wi_1"]) == (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP)
  assert tuple(specs["wo"]) == (ax.EXPERT, ax.EXPERT_MLP, ax.EMBED)
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables)["params"])
  assert shapes == {"router": {"kernel": (EMBED, EXPERTS)},
                    "wi_0": (EXPERTS, EMBED, EXPERT_MLP), "wi_1": (EXPERTS, EMBED, EXPERT_MLP),
                    "wo": (EXPERTS, EXPERT_MLP, EMBED)}


def test_router_kernel_shards_as_its_docstring_says():
  from jax.sharding import PartitionSpec as P

  from t5lite import partitioning
  boxed = jax.eval_shape(lambda: _layer().init(jax.random.key(0), _inputs()))
  router = nn.get_partition_spec(boxed)["params"]["router"]["kernel"]
  assert "experts dimension is never split" in " ".join(moe.MoeLayer.__doc__.split())
  expected = ((partitioning.standard_logical_axis_rules(), P(None, None)),
              (partitioning.fsdp_logical_axis_rules(), P("fsdp", None)),
              (partitioning.standard_logical_axis_rules(1, 2), P("data", None)))
  for rules, spec in expected:
    assert partitioning.Partitioner(logical_axis_rules=rules).logical_to_mesh_spec(
        router) == spec


def test_validate_expert_partitioning():
  moe.validate_expert_partitioning(8, 4)
  moe.validate_expert_partitioning(4, 4)
  moe.validate_expert_partitioning(6, 1)
  with pytest.raises(ValueError, match=r"num_experts=6 does not divide evenly over the "
                                       r"expert mesh axis of size 4.*\[1, 2, 3, 6\]"):
    moe.validate_expert_partitioning(6, 4)
  with pytest.raises(ValueError, match=r"num_experts=2 is fewer than the expert mesh axis "
                                       r"of size 4.*'data'"):
    moe.validate_expert_partitioning(2, 4)


# Rules under which the experts' inputs shard as (expert, groups over data):
# the expert rule must come before the batch rule, and the batch needs a
# fallback without `expert` for arrays that already use it.
# The standard rules, which list `expert` before `batch` for expert parallelism.
_EXPERT_RULES = """
from t5lite import partitioning
RULES = partitioning.standard_logical_axis_rules()
"""

_SHARDING_SCRIPT = _EXPERT_RULES + """
import json, re
import flax.linen as nn, jax, jax.numpy as jnp
from jax.sharding import NamedSharding
from t5lite.models import moe

out = {}
x = jnp.ones((16, 12, 8))
for rules_name, rules in (('standard', RULES),):
  p = partitioning.Partitioner(mesh_shape={'data': 2, 'expert': 4}, logical_axis_rules=rules)
  for experts in (4, 8):
    layer = moe.MoeLayer(num_experts=experts, num_selected_experts=2, expert_mlp_dim=16)
    boxed = jax.eval_shape(lambda: layer.init(jax.random.key(0), x))
    sh = p.logical_to_sharding(nn.get_partition_spec(boxed))['params']
    out[f'{rules_name}/{experts}'] = {
        'spec': [str(a) for a in sh['wi_0'].spec],
        'shard': sh['wi_0'].shard_shape((experts, 8, 16)),
        'router': [str(a) for a in sh['router']['kernel'].spec]}
  # Lowered on the abstract variables: the program's collectives do not
  # depend on the weights' values, so no initialisation is compiled for them.
  with p.activate():
    hlo = jax.jit(lambda v, x: layer.apply(v, x), in_shardings=(
        p.logical_to_sharding(nn.get_partition_spec(boxed)), p.batch_sharding(3))).lower(
            boxed, x).compile().as_text()
  out[f'{rules_name}/collectives'] = sorted(set(re.findall(r' (all-to-all|all-gather)\\(', hlo)))
print('SHARDING' + json.dumps(out), flush=True)
"""


def _result(proc, prefix):
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [out for out in proc.stdout.splitlines() if out.startswith(prefix)][-1]
  return json.loads(line[len(prefix):])


@pytest.fixture(scope="module")
def expert_parallel_run():
  """Both 8-device scripts in one process: one JAX start-up instead of two."""
  return testing.run_with_devices(_SHARDING_SCRIPT + _TRAIN_SCRIPT)


def test_expert_weights_and_tokens_shard_over_the_expert_axis(expert_parallel_run):
  out = _result(expert_parallel_run, "SHARDING")
  for rules in ("standard",):
    assert out[f"{rules}/4"]["spec"] == ["expert", "None", "model"]
    assert out[f"{rules}/4"]["shard"] == [1, 8, 16]  # one expert per device
    assert out[f"{rules}/8"]["shard"] == [2, 8, 16]  # two experts per device
    assert out[f"{rules}/8"]["router"] == ["None", "None"]  # replicated
  # Tokens travel to their experts' devices by all-to-all, and no device
  # gathers the whole batch.
  assert out["standard/collectives"] == ["all-to-all"]


_TRAIN_SCRIPT = _EXPERT_RULES + """
import json
import flax.linen as nn, jax, numpy as np
from t5lite import optimizers, state_init, testing, trainer as trainer_lib
from t5lite.train_state import TrainState

# With moe_layer_interval=1 every layer is an MoE layer, so one encoder and
# one decoder layer already train experts sharded over both stacks; more
# layers would only repeat them (and their compile time).
model = testing.tiny_encoder_decoder(
    optimizer=optimizers.adafactor(optimizers.constant(0.05)),
    num_experts=4, num_selected_experts=2, moe_layer_interval=1, expert_mlp_dim=12,
    train_capacity_factor=1.0, min_expert_capacity=1,
    num_encoder_layers=1, num_decoder_layers=1)
B, LI, LT = 8, 12, 7
rng = np.random.default_rng(0)
batches = []
for _ in range(5):
  t = rng.integers(3, 300, (B, LT)).astype(np.int32)
  batches.append({'encoder_input_tokens': rng.integers(3, 300, (B, LI)).astype(np.int32),
                  'decoder_target_tokens': t,
                  'decoder_input_tokens': np.pad(t[:, :-1], ((0, 0), (1, 0))),
                  'decoder_loss_weights': np.ones((B, LT), np.float32)})
shapes = {k: (1,) + v.shape[1:] for k, v in batches[0].items()}
types = {k: v.dtype for k, v in batches[0].items()}

def run(partitioner):
  specs, init_fn = state_init.state_specs(model, partitioner, shapes, types)
  state = partitioner.partition(init_fn, in_shardings=None,
                                out_shardings=specs.shardings)(jax.random.key(0))
  batch_sh = {k: partitioner.batch_sharding(2) for k in shapes}
  step = trainer_lib.Trainer(model=model, partitioner=partitioner).compile_train_step(
      specs.shardings, batch_sh)
  history = []
  for b in batches:
    state, m = step(state, jax.device_put(b, batch_sh))
    history.append({k: float(v) for k, v in m.items()})
  wi_0 = state.params['encoder']['layers_0']['moe']['wi_0']
  return history, str(wi_0.sharding.spec)

one, _ = run(partitioning.Partitioner(mesh_shape={'data': 1}, devices=jax.devices()[:1]))
expert, spec = run(partitioning.Partitioner(mesh_shape={'data': 2, 'expert': 4},
                                            logical_axis_rules=RULES))
print('TRAINING' + json.dumps({'one': one, 'expert': expert, 'spec': spec}))
"""


def test_training_on_one_device_equals_expert_parallel(expert_parallel_run):
  out = _result(expert_parallel_run, "TRAINING")
  assert "expert" in out["spec"]
  one, expert = out["one"], out["expert"]
  for step, (a, b) in enumerate(zip(one, expert)):
    for name in ("loss", "experts/auxiliary_loss", "experts/router_z_loss",
                 "experts/fraction_tokens_left_behind", "experts/router_confidence"):
      np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6,
                                 err_msg=f"step {step} {name}")
  assert one[-1]["loss"] < one[0]["loss"]  # it trains, so equality means something
  assert any(s["experts/fraction_tokens_left_behind"] > 0 for s in one)


# ---------------------------------------------------------------------------
# MoE networks and the model's loss.
# ---------------------------------------------------------------------------

_ENC_LEN, _DEC_LEN = 10, 6


def _moe_config(**overrides):
  kwargs = dict(vocab_size=32, emb_dim=EMBED, num_heads=4, head_dim=3, mlp_dim=20,
                num_encoder_layers=3, num_decoder_layers=4, dropout_rate=0.0,
                num_experts=EXPERTS, expert_mlp_dim=EXPERT_MLP, min_expert_capacity=1,
                train_capacity_factor=1.0)
  return transformer.TransformerConfig(**{**kwargs, **overrides})


def _model(config, **kwargs):
  vocab = seqio.PassThroughVocabulary(32)
  return models.EncoderDecoderModel(transformer.EncoderDecoder(config), vocab, vocab,
                                    optimizers.adafactor(0.01), **kwargs)


def _batch(seed=0, batch=4):
  rng = np.random.default_rng(seed)
  targets = rng.integers(2, 32, (batch, _DEC_LEN)).astype(np.int32)
  return {
      "encoder_input_tokens": jnp.asarray(rng.integers(2, 32, (batch, _ENC_LEN)), jnp.int32),
      "decoder_input_tokens": jnp.asarray(np.pad(targets[:, :-1], ((0, 0), (1, 0)))),
      "decoder_target_tokens": jnp.asarray(targets),
      "decoder_loss_weights": jnp.ones((batch, _DEC_LEN), jnp.float32),
  }


def _init(model, shapes=None):
  """Params of the model's shapes drawn with numpy, fan-in scaled.

  Compiling a real init costs seconds on CPU; these tests only need weights.
  """
  shapes = shapes or {"encoder_input_tokens": (1, _ENC_LEN),
                      "decoder_input_tokens": (1, _DEC_LEN)}
  abstract = nn.unbox(jax.eval_shape(
      lambda: model.get_initial_variables(jax.random.key(0), shapes))["params"])
  rng = np.random.default_rng(0)

  def draw(x):
    # Expert kernels [experts, in, out] are scaled by their own fan-in.
    fan_in = x.shape[-2] if x.ndim >= 2 else 1
    return jnp.asarray(rng.normal(0.0, fan_in ** -0.5, x.shape), x.dtype)

  return jax.tree.map(draw, abstract)


@functools.lru_cache(maxsize=None)
def _moe_setup():
  """The model whose loss and gradients the tests below compile. Two layers a
  stack: with the default interval that is one dense and one MoE layer in
  each, all that the loss and microbatch checks need; every further layer
  only adds compile time."""
  model = _model(_moe_config(num_encoder_layers=2, num_decoder_layers=2),
                 aux_loss_factor=0.5, router_z_loss_factor=0.25)
  return model, _init(model)


def test_moe_layers_sit_in_every_interval_th_layer():
  cfg = _moe_config(moe_layer_interval=2)
  assert [i for i in range(4) if cfg.is_moe_layer(i)] == [1, 3]
  assert not any(_moe_config(num_experts=0).is_moe_layer(i) for i in range(4))
  shapes = {"encoder_input_tokens": (1, _ENC_LEN), "decoder_input_tokens": (1, _DEC_LEN)}
  params = jax.eval_shape(lambda: _model(_moe_config()).get_initial_variables(
      jax.random.key(0), shapes))["params"]
  for stack, depth in (("encoder", 3), ("decoder", 4)):
    kinds = ["moe" if "moe" in params[stack][f"layers_{i}"] else "mlp" for i in range(depth)]
    assert kinds == ["mlp", "moe", "mlp", "moe"][:depth], stack


def test_config_validation_and_dense_defaults():
  dense = transformer.TransformerConfig(vocab_size=32, emb_dim=8, num_heads=4,
                                        num_encoder_layers=2, num_decoder_layers=2,
                                        head_dim=3, mlp_dim=16)
  assert dense.num_experts == 0 and not dense.is_moe_layer(1)
  with pytest.raises(ValueError, match=r"num_selected_experts must be in \[1, num_experts=4\]"):
    _moe_config(num_selected_experts=5)
  with pytest.raises(ValueError, match="num_experts must be >= 0"):
    _moe_config(num_experts=-1)
  with pytest.raises(ValueError, match=r"moe_layer_interval=2 layers, which must divide "
                                       r"num_encoder_layers=3"):
    _moe_config(scan_layers=True)
  with pytest.raises(ValueError, match="aux_loss_factor must be >= 0"):
    _model(_moe_config(), aux_loss_factor=-1.0)


def test_moe_loss_adds_weighted_aux_losses_and_reports_expert_metrics():
  model, params = _moe_setup()
  batch = _batch()
  rng = jax.random.key(1)
  # One program for both microbatch counts: one compile instead of two.
  both = jax.jit(lambda params, batch, rng: (model.loss_fn(params, batch, rng, None, 1),
                                             model.loss_fn(params, batch, rng, None, 2)))
  (loss, sums), (loss_2, sums_2) = both(params, batch, rng)
  names = {f"experts/{n}" for n in moe.METRIC_NAMES}
  assert names <= set(sums)
  aux, z = sums["experts/auxiliary_loss"], sums["experts/router_z_loss"]
  assert float(aux) >= 1.0 and float(z) > 0
  token_loss = (sums["cross_ent_sum"] + sums["z_loss_sum"]) / sums["weight_sum"]
  np.testing.assert_allclose(loss, token_loss + 0.5 * aux + 0.25 * z, rtol=1e-6)
  # Per-microbatch terms are divided by the number of microbatches.
  np.testing.assert_allclose(loss_2, token_loss + (0.5 * aux + 0.25 * z) / 2, rtol=1e-6)
  for name in names:
    np.testing.assert_allclose(sums_2[name], sums[name] / 2, rtol=1e-6)


def test_collect_moe_metrics_averages_over_layers():
  # Two unscanned layers and a scanned stack of two blocks: four layers.
  intermediates = {
      "encoder": {"layers_1": {"moe": {moe.AUXILIARY_LOSS: (jnp.float32(1.0),),
                                       moe.EXPERT_USAGE: (jnp.float32(0.5),)}}},
      "decoder": {"layers_1": {"moe": {moe.AUXILIARY_LOSS: (jnp.float32(2.0),)}},
                  "layers": {"layers_1": {"moe": {moe.AUXILIARY_LOSS: (
                      jnp.asarray([3.0, 6.0]),)}}},
                  "other": {"not_moe": (jnp.float32(100.0),)}},
  }
  collected = models.collect_moe_metrics(intermediates)
  assert set(collected) == {moe.AUXILIARY_LOSS, moe.EXPERT_USAGE}
  np.testing.assert_allclose(collected[moe.AUXILIARY_LOSS], 3.0)
  np.testing.assert_allclose(collected[moe.EXPERT_USAGE], 0.5)
  assert models.collect_moe_metrics({}) == {}


def test_dense_model_has_no_expert_metrics_and_the_plain_loss():
  model = testing.tiny_encoder_decoder()
  batch = _batch()
  params = _init(model)
  loss, sums = jax.jit(model.loss_fn)(params, batch, None)
  assert not [k for k in sums if k.startswith("experts/")]
  np.testing.assert_allclose(loss, (sums["cross_ent_sum"] + sums["z_loss_sum"])
                             / sums["weight_sum"], rtol=1e-6)


def test_moe_microbatches_equal_full_batch():
  model, params = _moe_setup()
  batch = _batch(seed=2)
  rng = jax.random.key(3)
  grad = jax.jit(trainer.accumulate_gradients, static_argnums=(0, 4))
  full_g, full_loss, full_sums = grad(model, params, batch, rng, None)
  mb_g, mb_loss, mb_sums = grad(model, params, batch, rng, 2)
  # Counts are exact. The rest is not, for a reason outside the trainer: a
  # microbatch runs every matmul at another batch shape, and XLA's CPU
  # kernels round those differently (the same example's logits differ by
  # 3.5e-6 of 2.5 between batches of 4 and 2). Measured: scalars within
  # 1.1e-7 relative; each gradient leaf within 1.6e-5 of its largest
  # element on the former 3+4-layer model (shuffling the full batch, same
  # shapes, moved it by 3.5e-7), within 1.0e-6 on this 2+2-layer one.
  for k in ("weight_sum", "num_examples", "correct_sum"):
    assert float(mb_sums[k]) == float(full_sums[k]), k
  np.testing.assert_allclose(mb_loss, full_loss, rtol=1e-6)
  for k in full_sums:
    np.testing.assert_allclose(mb_sums[k], full_sums[k], rtol=1e-6, err_msg=k)
  # In NumPy (the same float32 arithmetic): eager jnp would compile a
  # program per leaf shape.
  for a, b in zip(jax.tree.leaves(mb_g), jax.tree.leaves(full_g)):
    a, b = np.asarray(a), np.asarray(b)
    assert float(np.abs(a - b).max()) <= 5e-5 * float(np.abs(b).max())
  router = full_g["encoder"]["layers_1"]["moe"]["router"]["kernel"]
  assert float(jnp.abs(router).max()) > 0  # the router learns through the gates


def test_group_size_with_microbatches_is_refused_before_compiling():
  from t5lite import partitioning
  grouped = _model(_moe_config(group_size=8))
  with pytest.raises(ValueError, match=r"MoE group_size=8 cannot be used with "
                                       r"num_microbatches=2.*Set GROUP_SIZE=None"):
    trainer.Trainer(model=grouped, partitioner=partitioning.Partitioner(),
                    num_microbatches=2).validate(4)
  # One group per example, or no microbatches, is fine.
  trainer.Trainer(model=_model(_moe_config()), partitioner=partitioning.Partitioner(),
                  num_microbatches=2).validate(4)
  trainer.Trainer(model=grouped, partitioner=partitioning.Partitioner()).validate(4)


def _stack_blocks(stack, depth, interval):
  """Unscanned `layers_{i}` -> scanned `layers/layers_{j}` with a blocks axis."""
  out = {k: v for k, v in stack.items() if not k.startswith("layers_")}
  out["layers"] = {
      # NumPy stacks without compiling a program per leaf shape.
      f"layers_{j}": jax.tree.map(lambda *xs: np.stack(xs),
                                  *[stack[f"layers_{b * interval + j}"]
                                    for b in range(depth // interval)])
      for j in range(interval)}
  return out


def test_scanned_moe_equals_unscanned_and_decoder_only_works():
  cfg = dict(num_encoder_layers=2, num_decoder_layers=4)
  model = _model(_moe_config(**cfg))
  scanned = _model(_moe_config(scan_layers=True, **cfg))
  params = _init(model)
  stacked = dict(params, encoder=_stack_blocks(params["encoder"], 2, 2),
                 decoder=_stack_blocks(params["decoder"], 4, 2))
  assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, _init(scanned))
  batch = _batch(seed=4)
  loss, sums = jax.jit(model.loss_fn)(params, batch, None)
  s_loss, s_sums = jax.jit(scanned.loss_fn)(stacked, batch, None)
  np.testing.assert_allclose(s_loss, loss, rtol=1e-5)
  for k in sums:
    np.testing.assert_allclose(s_sums[k], sums[k], rtol=1e-5, atol=1e-6, err_msg=k)

  vocab = seqio.PassThroughVocabulary(32)
  decoder_only = models.DecoderOnlyModel(
      transformer.DecoderOnly(_moe_config(num_encoder_layers=0)), vocab, vocab,
      optimizers.adafactor(0.01), aux_loss_factor=0.0, router_z_loss_factor=0.0)
  d_params = _init(decoder_only, {"decoder_input_tokens": (1, _DEC_LEN)})
  assert "moe" in d_params["decoder"]["layers_3"] and "mlp" in d_params["decoder"]["layers_2"]
  _, d_sums = jax.jit(decoder_only.loss_fn)(d_params, batch, None)
  assert {f"experts/{n}" for n in moe.METRIC_NAMES} <= set(d_sums)


def test_per_expert_matmul_is_one_batched_matmul_with_the_einsums_values_and_gradients():
  """[experts, groups, capacity, in] x [experts, in, out] runs with one row
  axis per expert (XLA on the CPU differentiates that kernel much faster)
  and gives the four-axis einsum's values and gradients."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(4, 3, 5, 6)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(4, 6, 8)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(4, 3, 5, 8)), jnp.float32)

  def loss(x, k):
    return jnp.sum(moe._per_expert_matmul(x, k, jnp.float32) * weights)

  def reference(x, k):
    return jnp.sum(jnp.einsum("egcd,edh->egch", x, k) * weights)

  ranks = [len(e.invars[0].aval.shape) for e in jax.make_jaxpr(loss)(x, kernel).eqns
           if e.primitive.name == "dot_general"]
  assert ranks == [3]
  np.testing.assert_allclose(loss(x, kernel), reference(x, kernel), rtol=1e-6)
  for g, w in zip(jax.grad(loss, (0, 1))(x, kernel), jax.grad(reference, (0, 1))(x, kernel)):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.abs(w).max()))
