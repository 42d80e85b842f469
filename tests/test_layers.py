"""Unit tests of the T5.1.1 building blocks in t5lite.models.layers."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite import axis_names as ax
from t5lite.models import layers


# Different size on every axis so that a swapped axis fails loudly.
BATCH, Q_LEN, KV_LEN, EMBED, HEADS, HEAD_DIM, MLP = 2, 5, 7, 8, 4, 3, 16


def _init(module, *args, **kwargs):
  return module.init(jax.random.key(0), *args, **kwargs)


def _fake_init(module, *args, **kwargs):
  """Variables of `module.init`'s shapes and logical axes, drawn by NumPy and
  scaled by fan-in like the real init: a real init compiles a random program
  per parameter shape (seconds each at XLA's default level), and these tests
  only need some weights, compared against references built from them."""
  abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), *args, **kwargs))
  rng = np.random.default_rng(0)

  def draw(x):
    std = x.shape[0] ** -0.5 if x.ndim >= 2 else 1.0
    return jnp.asarray(rng.normal(0.0, std, x.shape), x.dtype)

  return jax.tree.map(draw, abstract)


def _spec(variables, *path):
  spec = nn.get_partition_spec(variables)["params"]
  for p in path:
    spec = spec[p]
  return tuple(spec)


def _normal(seed, shape):
  # Drawn by NumPy: jax.random compiles a program for every new shape, which
  # at XLA's default level costs seconds each; the tests only need values.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


@pytest.mark.parametrize("rel, bidirectional, expected", [
    # 32 buckets, max_distance 128: bidirectional uses 16 per direction,
    # 8 exact, then log-spaced: 8 + int(log(n/8) / log(16) * 8).
    (0, True, 0),
    (-1, True, 1),      # key one step before the query
    (1, True, 17),      # key one step after: second half of the buckets
    (-7, True, 7),
    (-8, True, 8),      # 8 + int(log(1) ...) = 8
    (-20, True, 10),    # 8 + int(log(2.5)/log(16)*8 = 2.64)
    (20, True, 26),
    (-127, True, 15),   # 8 + int(7.98)
    (-5000, True, 15),  # clipped to the last bucket
    # Unidirectional: 16 exact, then 16 + int(log(n/16) / log(8) * 16).
    (5, False, 0),      # future keys all share bucket 0
    (-15, False, 15),
    (-20, False, 17),   # 16 + int(1.72)
    (-100, False, 30),  # 16 + int(log(6.25)/log(8)*16 = 14.1)
    (-128, False, 31),
])
def test_relative_position_bucket_hand_values(rel, bidirectional, expected):
  bucket = layers.relative_position_bucket(np.array([rel]), bidirectional, 32, 128)
  assert int(bucket[0]) == expected


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (64, 256), (10, 20), (32, 8)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_numpy_equals_jax_numpy(num_buckets, max_distance,
                                                         bidirectional):
  """Static positions are bucketed by NumPy while tracing, traced ones by
  jax.numpy: both give the same ids over every distance up to 5000, and
  `_buckets` takes the NumPy path for a Python-int offset (no device work
  and no compilation per new shape while a model is traced)."""
  rel = np.arange(-5000, 5001, dtype=np.int32)
  by_numpy = layers.relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
  by_jax = jax.jit(layers.relative_position_bucket, static_argnums=(1, 2, 3))(
      rel, bidirectional, num_buckets, max_distance)
  assert isinstance(by_numpy, np.ndarray)
  # Distances past the exact ones reach the last bucket, and no further.
  assert by_numpy.min() == 0 and by_numpy.max() == num_buckets - 1
  np.testing.assert_array_equal(by_numpy, np.asarray(by_jax))
  module = layers.RelativePositionBiases(num_buckets, max_distance, HEADS)
  static = module._buckets(Q_LEN, KV_LEN, bidirectional, 3)
  assert isinstance(static, np.ndarray) and static.shape == (Q_LEN, KV_LEN)
  traced = module._buckets(Q_LEN, KV_LEN, bidirectional, jnp.array([3, 3]))
  np.testing.assert_array_equal(np.asarray(traced), np.stack([static, static]))


def test_relative_position_biases_gather_per_head():
  module = layers.RelativePositionBiases(num_buckets=10, max_distance=20, num_heads=HEADS)
  variables = _fake_init(module, Q_LEN, KV_LEN)
  assert _spec(variables, "rel_embedding") == (ax.HEADS, ax.RELPOS_BUCKETS)
  table = nn.unbox(variables)["params"]["rel_embedding"]  # [heads, buckets]
  bias = module.apply(variables, Q_LEN, KV_LEN, bidirectional=True)
  assert bias.shape == (1, HEADS, Q_LEN, KV_LEN)
  rel = np.arange(KV_LEN)[None, :] - np.arange(Q_LEN)[:, None]
  buckets = np.asarray(layers.relative_position_bucket(rel, True, 10, 20))
  np.testing.assert_allclose(bias[0], np.asarray(table)[:, buckets], rtol=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_biases_static_and_traced_offsets_agree_with_their_gradient(
    bidirectional):
  """Under jit, a Python-int offset (buckets fixed while tracing) and a
  traced per-example offset give the same bias, equal to indexing the table
  with the buckets, and the table's gradient of a weighted sum of the bias
  is the weights summed into each (head, bucket)."""
  module = layers.RelativePositionBiases(num_buckets=10, max_distance=20, num_heads=HEADS)
  table = nn.unbox(_fake_init(module, Q_LEN, KV_LEN))["params"]["rel_embedding"]
  weights = _normal(3, (BATCH, HEADS, Q_LEN, KV_LEN))

  def loss(table, offset):
    bias = module.apply({"params": {"rel_embedding": table}}, Q_LEN, KV_LEN,
                        bidirectional=bidirectional, q_offset=offset)
    return jnp.sum(jnp.broadcast_to(bias, weights.shape) * weights), bias

  static = jax.jit(jax.grad(lambda t: loss(t, 2), has_aux=True))
  traced = jax.jit(jax.grad(loss, has_aux=True))
  grad_static, bias_static = static(table)
  grad_traced, bias_traced = traced(table, jnp.full((BATCH,), 2, jnp.int32))
  assert bias_static.shape == (1, HEADS, Q_LEN, KV_LEN)
  assert bias_traced.shape == (BATCH, HEADS, Q_LEN, KV_LEN)
  rel = np.arange(KV_LEN)[None, :] - (np.arange(Q_LEN)[:, None] + 2)
  buckets = np.asarray(layers.relative_position_bucket(rel, bidirectional, 10, 20))
  want_bias = np.asarray(table)[:, buckets]
  np.testing.assert_array_equal(bias_static[0], want_bias)
  for b in range(BATCH):
    np.testing.assert_array_equal(bias_traced[b], want_bias)
  want_grad = np.zeros((HEADS, 10), np.float64)
  summed = np.asarray(weights, np.float64).sum(axis=0)  # [heads, q, k]
  for h in range(HEADS):
    np.add.at(want_grad[h], buckets, summed[h])
  np.testing.assert_allclose(grad_static, want_grad, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grad_traced, want_grad, rtol=1e-5, atol=1e-5)


def test_dense_general_contracts_and_names_axes():
  module = layers.DenseGeneral(features=(HEADS, HEAD_DIM), kernel_axes=(ax.EMBED, ax.HEADS, ax.KV))
  x = _normal(1, (BATCH, Q_LEN, EMBED))
  variables = _fake_init(module, x)
  kernel = nn.unbox(variables)["params"]["kernel"]
  assert kernel.shape == (EMBED, HEADS, HEAD_DIM)
  assert _spec(variables, "kernel") == (ax.EMBED, ax.HEADS, ax.KV)
  y = module.apply(variables, x)
  np.testing.assert_allclose(y, np.einsum("ble,ehd->blhd", x, kernel), rtol=1e-5, atol=1e-6)


def test_dense_general_contracts_multiple_axes():
  module = layers.DenseGeneral(features=EMBED, axis=(-2, -1),
                               kernel_axes=(ax.HEADS, ax.KV, ax.EMBED))
  x = _normal(2, (BATCH, Q_LEN, HEADS, HEAD_DIM))
  variables = _fake_init(module, x)
  kernel = nn.unbox(variables)["params"]["kernel"]
  y = module.apply(variables, x)
  np.testing.assert_allclose(y, np.einsum("blhd,hde->ble", x, kernel), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,axis,features", [
    ((BATCH, Q_LEN, EMBED), -1, MLP),                         # an MLP input
    ((BATCH, Q_LEN, EMBED), -1, (HEADS, HEAD_DIM)),           # a query projection
    ((BATCH, Q_LEN, HEADS, HEAD_DIM), (-2, -1), EMBED),       # an attention output
    ((BATCH, EMBED, Q_LEN), 1, MLP),                          # a middle axis
])
def test_dense_general_is_one_2d_matmul_with_the_values_and_gradients_of_dot_general(
    shape, axis, features):
  """Trailing contracted axes run as one [tokens, in] x [in, out] matmul
  (XLA on the CPU differentiates it much faster than the 3-D dot_general);
  other axes as a dot_general. Either way the output and both gradients are
  those of the plain contraction."""
  features_t = (features,) if isinstance(features, int) else features
  axes = (axis,) if isinstance(axis, int) else axis
  in_dims = tuple(shape[a] for a in axes)
  names = ("a", "b", "c", "d")[:len(in_dims) + len(features_t)]
  module = layers.DenseGeneral(features=features, axis=axis, kernel_axes=names)
  x = _normal(4, shape)
  kernel = nn.unbox(_fake_init(module, x))["params"]["kernel"]
  out = jax.eval_shape(lambda: module.apply({"params": {"kernel": kernel}}, x))
  weights = _normal(5, out.shape)

  def loss(x, kernel):
    return jnp.sum(module.apply({"params": {"kernel": kernel}}, x) * weights)

  def reference(x, kernel):
    contract = (tuple(a % len(shape) for a in axes), tuple(range(len(in_dims))))
    return jnp.sum(jax.lax.dot_general(x, kernel, (contract, ((), ()))) * weights)

  ranks = [len(e.invars[0].aval.shape) for e in jax.make_jaxpr(loss)(x, kernel).eqns
           if e.primitive.name == "dot_general"]
  trailing = axes[-1] % len(shape) == len(shape) - 1
  assert ranks == ([2] if trailing else [len(shape)])
  got, want = jax.grad(loss, (0, 1))(x, kernel), jax.grad(reference, (0, 1))(x, kernel)
  np.testing.assert_allclose(loss(x, kernel), reference(x, kernel), rtol=1e-6)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.abs(w).max()))


# The two-operand einsums of the models in 16 bits: projections, the tied
# logits, attention's value product, MoE dispatch, combine and expert matmuls.
# Every matrix dim is at least 8: XLA runs smaller products in float32 anyway.
_MODEL_EINSUMS = [
    ("ti,io->to", (48, 24), (24, 40)),
    ("ble,ve->blv", (2, 8, 16), (50, 16)),
    ("bhqk,bhkd->bhqd", (2, 3, 8, 9), (2, 3, 9, 10)),
    ("bhqd,bhkd->bhqk", (2, 3, 8, 10), (2, 3, 9, 10)),
    ("gtec,gtd->gecd", (2, 8, 2, 4), (2, 8, 9)),
    ("gecd,gtec->gtd", (2, 2, 4, 9), (2, 8, 2, 4)),
    ("emd,edh->emh", (3, 10, 8), (3, 8, 12)),
]


def _dot_operand_dtypes(hlo_text: str) -> list[tuple[str, str]]:
  """(lhs, rhs) element types of every dot in optimized HLO text, fused ones
  included."""
  types = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", hlo_text, re.M))
  return [(types[a], types[b]) for a, b in
          re.findall(r"= \w+\[[\d,]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo_text)]


@pytest.mark.parametrize("subscripts,a_shape,b_shape", _MODEL_EINSUMS)
def test_bfloat16_einsum_and_its_gradients_match_jax_einsum(subscripts, a_shape, b_shape):
  """On the CPU a bfloat16 einsum and both gradients run as native-layout
  products with float32 results; the values are those of JAX's own
  float32-result einsum and its gradient, which round the same float32 sums
  to bfloat16 (the order of summation may differ: one bfloat16 unit)."""
  a, b = _normal(1, a_shape), _normal(2, b_shape)
  weights = _normal(3, jax.eval_shape(lambda: jnp.einsum(subscripts, a, b)).shape)

  def ours(a, b):
    out = layers.einsum(subscripts, a, b, jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  def jaxs(a, b):
    out = jnp.einsum(subscripts, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                     preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32) * weights), out

  # Both in one program: one compile instead of two.
  both = jax.jit(lambda a, b: (jax.value_and_grad(ours, (0, 1), has_aux=True)(a, b),
                               jax.value_and_grad(jaxs, (0, 1), has_aux=True)(a, b)))
  ((_, got), got_grads), ((_, want), want_grads) = both(a, b)
  assert got.dtype == jnp.bfloat16
  for g, w in [(got, want), *zip(got_grads, want_grads)]:
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.parametrize("subscripts,a_shape,b_shape", _MODEL_EINSUMS)
def test_bfloat16_einsum_gradients_stay_bfloat16_products_on_the_cpu(
    subscripts, a_shape, b_shape):
  """XLA on the CPU widens a bfloat16 dot to float32 (the slower kernel)
  unless its left operand contracts its last dims. JAX's gradient of a
  kernel contracts the token axis, which comes first, and multiplies a
  float32 cotangent; t5lite's keeps every product of the forward and
  backward pass in bfloat16. The loss is a plain sum, whose cotangent XLA
  simplifies to a broadcast: the layout must survive that too."""
  a, b = _normal(1, a_shape), _normal(2, b_shape)

  def loss(a, b):
    return jnp.sum(layers.einsum(subscripts, a, b, jnp.bfloat16).astype(jnp.float32))

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  dtypes = _dot_operand_dtypes(step.lower(a, b).compile().as_text())
  assert len(dtypes) == 3 and dtypes == [("bf16", "bf16")] * 3, dtypes
  jax.block_until_ready(step(a, b))  # and XLA can run what it compiled


def test_bfloat16_mlp_gradients_are_bfloat16_products_with_values_of_jax_einsum():
  """The same through a module: a bfloat16 gated MLP's forward and backward
  products are all bfloat16 on the CPU, and its gradients are those of the
  plain float32-result einsums (the cotangent of a bfloat16 result holds
  bfloat16 values, so the backward products see the same numbers)."""
  module = layers.MlpBlock(mlp_dim=MLP, activations=("gelu", "linear"),
                           dtype=jnp.bfloat16)
  x = _normal(6, (BATCH, Q_LEN, EMBED))
  params = nn.unbox(_fake_init(module, x))["params"]
  weights = _normal(7, (BATCH, Q_LEN, EMBED))

  def loss(params):
    return jnp.sum(module.apply({"params": params}, x).astype(jnp.float32) * weights)

  step = jax.jit(jax.grad(loss))
  dtypes = _dot_operand_dtypes(step.lower(params).compile().as_text())
  # XLA merges some (both input projections share x): count none, check all.
  assert dtypes and set(dtypes) == {("bf16", "bf16")}, dtypes
  got = step(params)
  specs = layers._einsum_specs
  try:
    layers._einsum_specs = lambda subscripts: None  # JAX's own einsum and gradient
    want = jax.jit(jax.grad(loss))(params)
  finally:
    layers._einsum_specs = specs
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2.0 ** -8, atol=1e-6 * float(np.abs(w).max()))


def test_dense_general_rejects_wrong_number_of_axis_names():
  module = layers.DenseGeneral(features=MLP, kernel_axes=(ax.EMBED,))
  with pytest.raises(ValueError, match="one name per dim"):
    _init(module, jnp.ones((BATCH, EMBED)))


def test_rms_norm_matches_numpy_and_keeps_dtype():
  x = _normal(3, (BATCH, Q_LEN, EMBED))
  module = layers.RMSNorm(dtype=jnp.bfloat16)
  variables = _fake_init(module, x)
  assert _spec(variables, "scale") == (ax.EMBED,)
  scale = np.linspace(0.5, 2.0, EMBED).astype(np.float32)
  y = module.apply({"params": {"scale": scale}}, x)
  assert y.dtype == jnp.bfloat16
  xn = np.asarray(x, np.float64)
  expected = xn / np.sqrt(np.mean(xn**2, axis=-1, keepdims=True) + 1e-6) * scale
  # Computed in float32, rounded once to bfloat16 (8 significant bits): at
  # most half a unit in the last place, 2**-8 of the value.
  np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=2.0 ** -8)


def test_embed_lookup_and_attend():
  vocab = 32
  module = layers.Embed(num_embeddings=vocab, features=EMBED)
  tokens = jnp.array([[0, 3, 31], [7, 7, 1]])
  variables = _fake_init(module, tokens)
  assert _spec(variables, "embedding") == (ax.VOCAB, ax.EMBED)
  table = np.asarray(nn.unbox(variables)["params"]["embedding"])
  np.testing.assert_array_equal(module.apply(variables, tokens), table[np.asarray(tokens)])
  query = _normal(4, (BATCH, Q_LEN, EMBED))
  logits = module.apply(variables, query, method=module.attend)
  assert logits.shape == (BATCH, Q_LEN, vocab)
  np.testing.assert_allclose(logits, np.einsum("ble,ve->blv", query, table), rtol=1e-5,
                             atol=1e-5)


def _attention_module(**kwargs):
  return layers.MultiHeadDotProductAttention(num_heads=HEADS, head_dim=HEAD_DIM, **kwargs)


def test_attention_axes_and_numpy_reference():
  module = _attention_module()
  q_in = _normal(5, (BATCH, Q_LEN, EMBED))
  kv_in = _normal(6, (BATCH, KV_LEN, EMBED))
  mask = jnp.asarray(np.random.default_rng(7).random((BATCH, 1, Q_LEN, KV_LEN)) < 0.7)
  mask = mask.at[..., 0].set(True)  # every query keeps one key
  bias = _normal(8, (1, HEADS, Q_LEN, KV_LEN))
  variables = _fake_init(module, q_in, kv_in, mask, bias)
  for name in ("query", "key", "value"):
    assert _spec(variables, name, "kernel") == (ax.EMBED, ax.HEADS, ax.KV)
  assert _spec(variables, "out", "kernel") == (ax.HEADS, ax.KV, ax.EMBED)
  p = jax.tree.map(np.asarray, nn.unbox(variables)["params"])
  q = np.einsum("bqe,ehd->bqhd", q_in, p["query"]["kernel"])
  k = np.einsum("bke,ehd->bkhd", kv_in, p["key"]["kernel"])
  v = np.einsum("bke,ehd->bkhd", kv_in, p["value"]["kernel"])
  # No run-time 1/sqrt(head_dim): it is folded into the query init.
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) + bias + np.where(mask, 0, -1e10)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd,hde->bqe", w, v, p["out"]["kernel"])
  y = module.apply(variables, q_in, kv_in, mask, bias)
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_attention_ignores_masked_keys():
  module = _attention_module()
  q_in = _normal(9, (BATCH, Q_LEN, EMBED))
  kv_in = _normal(10, (BATCH, KV_LEN, EMBED))
  mask = jnp.ones((BATCH, 1, Q_LEN, KV_LEN), bool).at[..., -2:].set(False)
  variables = _fake_init(module, q_in, kv_in, mask)
  y = module.apply(variables, q_in, kv_in, mask)
  y_changed = module.apply(variables, q_in, kv_in.at[:, -2:].set(100.0), mask)
  np.testing.assert_array_equal(y, y_changed)


def test_query_init_folds_in_one_over_sqrt_head_dim():
  embed, heads, head_dim = 128, 4, 64
  module = layers.MultiHeadDotProductAttention(num_heads=heads, head_dim=head_dim)
  x = jnp.ones((1, 1, embed))
  p = nn.unbox(_init(module, x, x))["params"]
  key_std = float(np.std(p["key"]["kernel"]))
  query_std = float(np.std(p["query"]["kernel"]))
  # The sample standard deviation of n draws has a relative spread of at most
  # 1/sqrt(2n) for a (truncated) normal; five of those is a bound a correct
  # initializer misses about once in three million seeds, while a missing
  # 1/sqrt(head_dim) (a factor of 8 here) misses it by far.
  rtol = 5 / np.sqrt(2 * p["key"]["kernel"].size)
  np.testing.assert_allclose(key_std, 1 / np.sqrt(embed), rtol=rtol)
  np.testing.assert_allclose(query_std, 1 / np.sqrt(embed * head_dim), rtol=rtol)


def test_attention_dropout_needs_rng_only_when_enabled():
  module = _attention_module(dropout_rate=0.5)
  x = _normal(11, (BATCH, Q_LEN, EMBED))
  variables = _fake_init(module, x, x)
  a = module.apply(variables, x, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  b = module.apply(variables, x, x, deterministic=True)
  assert not np.allclose(a, b)


def test_mlp_is_gated_gelu():
  module = layers.MlpBlock(mlp_dim=MLP)
  x = _normal(12, (BATCH, Q_LEN, EMBED))
  variables = _fake_init(module, x)
  assert _spec(variables, "wi_0", "kernel") == (ax.EMBED, ax.MLP)
  assert _spec(variables, "wi_1", "kernel") == (ax.EMBED, ax.MLP)
  assert _spec(variables, "wo", "kernel") == (ax.MLP, ax.EMBED)
  p = jax.tree.map(np.asarray, nn.unbox(variables)["params"])
  h0 = np.einsum("ble,em->blm", x, p["wi_0"]["kernel"])
  h1 = np.einsum("ble,em->blm", x, p["wi_1"]["kernel"])
  gelu = 0.5 * h0 * (1 + np.tanh(np.sqrt(2 / np.pi) * (h0 + 0.044715 * h0**3)))
  expected = np.einsum("blm,me->ble", gelu * h1, p["wo"]["kernel"])
  np.testing.assert_allclose(module.apply(variables, x), expected, rtol=1e-4, atol=1e-6)


# float64 references of every MLP activation, written out by hand.
_NUMPY_ACTIVATIONS = {
    "gelu": lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
    "gelu_exact": lambda h: 0.5 * h * (1 + np.vectorize(math.erf)(h / np.sqrt(2))),
    "relu": lambda h: np.maximum(h, 0.0),
    "silu": lambda h: h / (1 + np.exp(-h)),
    "linear": lambda h: h,
}


@pytest.mark.parametrize("activation", sorted(_NUMPY_ACTIVATIONS))
def test_single_activation_mlp_has_one_wi_kernel_and_matches_numpy(activation):
  # ('relu',) is the T5 v1.0 MLP, wo(relu(wi x)), with T5X/HF kernel names.
  module = layers.MlpBlock(mlp_dim=MLP, activations=(activation,))
  x = _normal(13, (BATCH, Q_LEN, EMBED))
  variables = _fake_init(module, x)
  assert set(variables["params"]) == {"wi", "wo"}
  assert _spec(variables, "wi", "kernel") == (ax.EMBED, ax.MLP)
  assert _spec(variables, "wo", "kernel") == (ax.MLP, ax.EMBED)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(variables)["params"])
  assert p["wi"]["kernel"].shape == (EMBED, MLP)
  h = np.einsum("ble,em->blm", np.asarray(x, np.float64), p["wi"]["kernel"])
  expected = np.einsum("blm,me->ble", _NUMPY_ACTIVATIONS[activation](h), p["wo"]["kernel"])
  np.testing.assert_allclose(module.apply(variables, x), expected, rtol=1e-5, atol=1e-6)


def test_gelu_exact_differs_from_the_tanh_gelu_of_t5_1_1():
  x = _normal(14, (BATCH, Q_LEN, EMBED))
  tanh_gelu = layers.MlpBlock(mlp_dim=MLP)
  variables = _fake_init(tanh_gelu, x)
  exact = layers.MlpBlock(mlp_dim=MLP, activations=("gelu_exact", "linear"))
  a, b = tanh_gelu.apply(variables, x), exact.apply(variables, x)
  # The two GELUs differ by at most ~5e-4, far above float32 rounding.
  assert 1e-5 < float(jnp.abs(a - b).max()) < 1e-2
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), nn.unbox(variables)["params"])
  h0 = np.einsum("ble,em->blm", np.asarray(x, np.float64), p["wi_0"]["kernel"])
  h1 = np.einsum("ble,em->blm", np.asarray(x, np.float64), p["wi_1"]["kernel"])
  expected = np.einsum("blm,me->ble", _NUMPY_ACTIVATIONS["gelu_exact"](h0) * h1,
                       p["wo"]["kernel"])
  np.testing.assert_allclose(b, expected, rtol=1e-5, atol=1e-6)


def test_mlp_rejects_unknown_or_missing_activations():
  x = jnp.ones((BATCH, Q_LEN, EMBED))
  with pytest.raises(ValueError, match=r"MlpBlock.activations=\('swish',\) has unknown "
                                       r"activation name\(s\) \['swish'\]; allowed names are "
                                       r"\('gelu', 'gelu_exact', 'relu', 'silu', 'linear'\)"):
    _init(layers.MlpBlock(mlp_dim=MLP, activations=("swish",)), x)
  with pytest.raises(ValueError, match="MlpBlock.activations is empty"):
    _init(layers.MlpBlock(mlp_dim=MLP, activations=()), x)


def test_masks():
  np.testing.assert_array_equal(layers.causal_mask(3)[0, 0],
                                [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  pad = layers.padding_mask(jnp.array([[5, 0]]), jnp.array([[3, 4, 0]]))
  assert pad.shape == (1, 1, 2, 3)
  np.testing.assert_array_equal(pad[0, 0], [[1, 1, 0], [0, 0, 0]])
  seg = layers.segment_mask(jnp.array([[1, 1, 2]]), jnp.array([[1, 2, 2]]))
  np.testing.assert_array_equal(seg[0, 0], [[1, 0, 0], [1, 0, 0], [0, 1, 1]])
  assert layers.combine_masks(None, None) is None


def test_decoder_self_mask_prefix_lm_packing_and_padding():
  targets = jnp.array([[4, 5, 6, 7, 8, 9, 0]])
  segments = jnp.array([[1, 1, 1, 1, 2, 2, 0]])
  prefix = jnp.array([[1, 1, 0, 0, 1, 0, 0]])
  mask = layers.decoder_self_mask(targets, segments, prefix)
  expected = [
      [1, 1, 0, 0, 0, 0, 0],  # prefix position attends to the later prefix position
      [1, 1, 0, 0, 0, 0, 0],
      [1, 1, 1, 0, 0, 0, 0],  # targets stay causal
      [1, 1, 1, 1, 0, 0, 0],
      [0, 0, 0, 0, 1, 0, 0],  # second packed example sees only itself
      [0, 0, 0, 0, 1, 1, 0],
      [0, 0, 0, 0, 0, 0, 0],  # padding
  ]
  assert mask.shape == (1, 1, 7, 7)
  np.testing.assert_array_equal(mask[0, 0], expected)


def test_activation_constraints_reach_the_jaxpr_under_a_mesh():
  # Without a mesh, with_logical_constraint is a silent no-op; make sure the
  # layers really emit constraints once a mesh and rules are set.
  module = layers.MlpBlock(mlp_dim=MLP)
  x = jnp.ones((BATCH, Q_LEN, EMBED))
  variables = nn.unbox(_fake_init(module, x))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh), nn.logical_axis_rules([(ax.BATCH, "data")]):
    jaxpr = jax.make_jaxpr(module.apply)(variables, x)
  constraints = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
  assert len(constraints) >= 2


def test_broadcast_batch_repeats_the_bias_and_sums_its_gradient():
  bias = _normal(4, (1, HEADS, Q_LEN, KV_LEN))
  upstream = _normal(5, (BATCH, HEADS, Q_LEN, KV_LEN))
  out, pullback = jax.vjp(lambda b: layers.broadcast_batch(b, BATCH), bias)
  assert out.shape == (BATCH, HEADS, Q_LEN, KV_LEN)
  for b in range(BATCH):
    np.testing.assert_array_equal(out[b], bias[0])
  (grad,) = pullback(upstream)
  np.testing.assert_allclose(grad, np.asarray(upstream).sum(axis=0, keepdims=True),
                             rtol=1e-6, atol=1e-6)
  # A bias that already has a batch axis, or a batch of one, passes through.
  assert layers.broadcast_batch(upstream, BATCH) is upstream
  assert layers.broadcast_batch(bias, 1) is bias


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2.0 ** -7)])
def test_gated_gelu_gradient_equals_autodiff(dtype, rtol):
  """The gated GELU's hand-written gradient equals autodiff's of
  gelu(gate) * linear (to the dtype's rounding) across the range where tanh
  saturates, and the forward value is autodiff's exactly."""
  gate = jnp.linspace(-12.0, 12.0, 4801).astype(dtype)
  # jax.random's draws, as when the tolerances were set: in bfloat16 one
  # element of other draws can land on a rounding boundary.
  linear = jax.random.normal(jax.random.key(8), gate.shape).astype(dtype)
  cotangent = jax.random.normal(jax.random.key(9), gate.shape).astype(dtype)

  def autodiff(gate, linear):
    return jax.nn.gelu(gate, approximate=True) * linear

  got, got_vjp = jax.vjp(layers._gated_gelu, gate, linear)
  want, want_vjp = jax.vjp(autodiff, gate, linear)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  for g, w in zip(got_vjp(cotangent), want_vjp(cotangent)):
    assert g.dtype == w.dtype == dtype
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()))


def test_gated_gelu_mlp_uses_the_hand_written_gradient():
  """T5.1.1's ('gelu', 'linear') MLP goes through `_gated_gelu`; other
  activation lists through autodiff."""
  x = _normal(6, (BATCH, Q_LEN, EMBED))

  def custom_calls(activations):
    module = layers.MlpBlock(mlp_dim=MLP, activations=activations)
    params = _fake_init(module, x)
    jaxpr = jax.make_jaxpr(lambda p: module.apply(p, x))(params)
    return sum(e.primitive.name.startswith("custom_vjp") for e in jaxpr.eqns)

  assert custom_calls(("gelu", "linear")) == 1
  assert custom_calls(("relu",)) == 0
  assert custom_calls(("linear", "gelu")) == 0
