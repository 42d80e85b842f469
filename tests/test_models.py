"""Tests of the T5.1.1 networks (transformer.py) and the model API (models.py)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio

from t5lite import axis_names as ax
from t5lite import testing
from t5lite.models import models, transformer


# Different size on every axis so that a swapped axis fails loudly.
VOCAB, EMBED, HEADS, HEAD_DIM, MLP, BUCKETS = 32, 8, 4, 3, 16, 10
ENC_LAYERS, DEC_LAYERS = 2, 3
ENC_LEN, DEC_LEN = 7, 6


def _config(**overrides) -> transformer.TransformerConfig:
  kwargs = dict(vocab_size=VOCAB, emb_dim=EMBED, num_heads=HEADS,
                num_encoder_layers=ENC_LAYERS, num_decoder_layers=DEC_LAYERS,
                head_dim=HEAD_DIM, mlp_dim=MLP, dropout_rate=0.1,
                relative_attention_num_buckets=BUCKETS, relative_attention_max_distance=20)
  kwargs.update(overrides)
  return transformer.TransformerConfig(**kwargs)


def _model(module, z_loss=1e-4, label_smoothing=0.0, **kwargs):
  vocab = seqio.PassThroughVocabulary(VOCAB)
  cls = (models.EncoderDecoderModel if isinstance(module, transformer.EncoderDecoder)
         else models.DecoderOnlyModel)
  return cls(module, vocab, vocab, optax.sgd(0.1), z_loss=z_loss,
             label_smoothing=label_smoothing, **kwargs)


def _shapes(batch=2):
  return {"encoder_input_tokens": (batch, ENC_LEN), "decoder_input_tokens": (batch, DEC_LEN)}


def _abstract(model, shapes=None):
  """Boxed variables as ShapeDtypeStructs: shapes and axes, no compile."""
  shapes = shapes or _shapes()
  return jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))


def _random_params(model, seed=0):
  """Params of the model's shapes drawn with numpy.

  A real init of even the tiny model costs seconds of XLA compilation on CPU;
  tests of information flow and of the loss only need some random weights.
  """
  rng = np.random.default_rng(seed)
  abstract = nn.unbox(_abstract(model))["params"]

  def draw(x):
    # Roughly fan-in scaled, so activations stay O(1) as with a real init.
    std = 1.0 if x.ndim < 2 else x.shape[0] ** -0.5
    return jnp.asarray(rng.normal(0.0, std, x.shape), x.dtype)

  return jax.tree.map(draw, abstract)


def _tokens(seed, shape):
  # Drawn by NumPy: jax.random compiles a program for every new shape, which
  # at XLA's default level costs seconds each; the tests only need tokens.
  return np.random.default_rng(seed).integers(2, VOCAB, shape).astype(np.int32)


def _encdec_batch(seed=0, batch=2):
  # Built in NumPy (eager jax.numpy compiles a program per op and shape).
  targets = _tokens(seed + 1, (batch, DEC_LEN))
  return jax.tree.map(jnp.asarray, {
      "encoder_input_tokens": _tokens(seed, (batch, ENC_LEN)),
      "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
      "decoder_target_tokens": targets,
      "decoder_loss_weights": np.ones((batch, DEC_LEN), np.float32),
  })


@functools.lru_cache(maxsize=None)
def _encdec(**overrides):
  model = _model(transformer.EncoderDecoder(_config(**overrides)))
  return model, _random_params(model), jax.jit(model.predict_logits)


@functools.lru_cache(maxsize=None)
def _decoder_only(**overrides):
  model = _model(transformer.DecoderOnly(_config(**overrides)),
                 inputs_bidirectional_attention=True)
  return model, _random_params(model), jax.jit(model.predict_logits)


def _param_count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------
# Parameters: logical axes, counts, real-size shapes.
# ---------------------------------------------------------------------------


def test_every_param_has_logical_axes_and_named_params_have_the_right_ones():
  model = _model(transformer.EncoderDecoder(_config()))
  variables = _abstract(model)
  leaves = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  assert all(len(x.names) == len(x.value.shape) for x in leaves)
  p = variables["params"]
  expected = {
      ("token_embedder", "embedding"): ((ax.VOCAB, ax.EMBED), (VOCAB, EMBED)),
      ("encoder", "relpos_bias", "rel_embedding"): ((ax.HEADS, ax.RELPOS_BUCKETS),
                                                    (HEADS, BUCKETS)),
      ("encoder", "layers_1", "attention", "query", "kernel"): (
          (ax.EMBED, ax.HEADS, ax.KV), (EMBED, HEADS, HEAD_DIM)),
      ("decoder", "layers_2", "encoder_decoder_attention", "out", "kernel"): (
          (ax.HEADS, ax.KV, ax.EMBED), (HEADS, HEAD_DIM, EMBED)),
      ("decoder", "layers_0", "mlp", "wi_1", "kernel"): ((ax.EMBED, ax.MLP), (EMBED, MLP)),
      ("decoder", "layers_0", "mlp", "wo", "kernel"): ((ax.MLP, ax.EMBED), (MLP, EMBED)),
      ("decoder", "decoder_norm", "scale"): ((ax.EMBED,), (EMBED,)),
      ("decoder", "logits_dense", "kernel"): ((ax.EMBED, ax.VOCAB), (EMBED, VOCAB)),
  }
  for path, (names, shape) in expected.items():
    leaf = functools.reduce(lambda t, k: t[k], path, p)
    assert (tuple(leaf.names), leaf.value.shape) == (names, shape), path


def _t511_param_count(cfg: transformer.TransformerConfig, decoder_only=False) -> int:
  e, h, d, m, v = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  attention = 4 * e * h * d
  mlp = 3 * e * m
  encoder = (cfg.relative_attention_num_buckets * h + e
             + cfg.num_encoder_layers * (2 * e + attention + mlp))
  cross = 0 if decoder_only else e + attention
  decoder = (cfg.relative_attention_num_buckets * h + e
             + cfg.num_decoder_layers * (2 * e + attention + cross + mlp))
  logits = 0 if cfg.logits_via_embedding else e * v
  return v * e + (0 if decoder_only else encoder) + decoder + logits


def test_param_count_matches_hand_formula():
  params = _abstract(_model(transformer.EncoderDecoder(_config())))
  # 256 embed + 256 logits + 2*40 relpos + 2*8 final norms
  # + 2 encoder layers * 784 + 3 decoder layers * 1176.
  assert _param_count(params) == _t511_param_count(_config()) == 5704
  tied = _model(transformer.EncoderDecoder(_config(logits_via_embedding=True)))
  assert _param_count(_abstract(tied)) == 5704 - EMBED * VOCAB
  dec = _model(transformer.DecoderOnly(_config()))
  assert _param_count(_abstract(dec)) == _t511_param_count(_config(), decoder_only=True)


_ALLOWED_ACTIVATIONS = r"\('gelu', 'gelu_exact', 'relu', 'silu', 'linear'\)"


def test_mlp_activations_are_validated_and_stored_as_a_tuple():
  assert _config().mlp_activations == ("gelu", "linear")
  cfg = _config(mlp_activations=["relu"])  # gin may pass a list
  assert cfg.mlp_activations == ("relu",)
  hash(cfg)  # still hashable
  with pytest.raises(ValueError, match=r"mlp_activations=\('relu', 'tanh'\) has unknown "
                                       r"activation name\(s\) \['tanh'\]; allowed names are "
                                       + _ALLOWED_ACTIVATIONS):
    _config(mlp_activations=("relu", "tanh"))
  with pytest.raises(ValueError, match="mlp_activations is empty; give one or more activation "
                                       "names from " + _ALLOWED_ACTIVATIONS):
    _config(mlp_activations=())
  with pytest.raises(ValueError, match=r"such as \('relu',\), got the string 'relu'"):
    _config(mlp_activations="relu")


def test_t5_v1_0_relu_mlp_has_one_wi_kernel_per_layer():
  cfg = _config(mlp_activations=("relu",))
  params = _abstract(_model(transformer.EncoderDecoder(cfg)))["params"]
  for stack, depth in (("encoder", ENC_LAYERS), ("decoder", DEC_LAYERS)):
    for i in range(depth):
      assert set(params[stack][f"layers_{i}"]["mlp"]) == {"wi", "wo"}, (stack, i)
  wi = params["decoder"]["layers_1"]["mlp"]["wi"]["kernel"]
  assert (tuple(wi.names), wi.value.shape) == ((ax.EMBED, ax.MLP), (EMBED, MLP))
  # One input kernel fewer per layer than T5.1.1's 5704 parameters.
  assert _param_count(params) == 5704 - (ENC_LAYERS + DEC_LAYERS) * EMBED * MLP


def test_forward_flops_count_one_input_projection_per_activation():
  gated = transformer.forward_flops(_config(), 2, DEC_LEN, ENC_LEN)
  relu = transformer.forward_flops(_config(mlp_activations=("relu",)), 2, DEC_LEN, ENC_LEN)
  tokens = 2 * (ENC_LAYERS * ENC_LEN + DEC_LAYERS * DEC_LEN)
  assert gated["mlp"] == tokens * 6 * EMBED * MLP
  assert relu["mlp"] == tokens * 4 * EMBED * MLP
  assert relu["total"] == gated["total"] - tokens * 2 * EMBED * MLP


def test_t5_1_1_base_shapes_without_allocating():
  cfg = _config(vocab_size=32128, emb_dim=768, num_heads=12, head_dim=64, mlp_dim=2048,
                num_encoder_layers=12, num_decoder_layers=12,
                relative_attention_num_buckets=32, relative_attention_max_distance=128)
  model = _model(transformer.EncoderDecoder(cfg))
  shapes = {"encoder_input_tokens": (2, 512), "decoder_input_tokens": (2, 114)}
  abstract = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))
  params = nn.unbox(abstract)["params"]
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  # t5.1.1 base with untied logits: ~248M.
  assert _param_count(params) == _t511_param_count(cfg) == 247_577_856
  specs = nn.get_partition_spec(abstract)["params"]
  assert tuple(specs["decoder"]["layers_11"]["self_attention"]["query"]["kernel"]) == (
      ax.EMBED, ax.HEADS, ax.KV)


def test_scanned_params_gain_a_leading_layers_axis():
  model = _model(transformer.EncoderDecoder(_config(scan_layers=True)))
  variables = _abstract(model)
  kernel = variables["params"]["encoder"]["layers"]["attention"]["query"]["kernel"]
  assert tuple(kernel.names) == (ax.LAYERS, ax.EMBED, ax.HEADS, ax.KV)
  assert kernel.value.shape == (ENC_LAYERS, EMBED, HEADS, HEAD_DIM)
  wo = variables["params"]["decoder"]["layers"]["mlp"]["wo"]["kernel"]
  assert wo.value.shape == (DEC_LAYERS, MLP, EMBED)
  assert _param_count(nn.unbox(variables)) == 5704


def test_config_rejects_bad_values():
  with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
    _config(dtype="float64")
  with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
    _config(num_heads=0)
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    _config(dropout_rate=1.0)


# ---------------------------------------------------------------------------
# Information flow: causality, packing, prefix-LM, padding.
# ---------------------------------------------------------------------------


def _with(x, index, value):
  """A NumPy copy of `x` with `x[index] = value` (eager `.at[].set` compiles)."""
  x = np.array(x)
  x[index] = value
  return x


def _changed_positions(a, b):
  """Positions of batch row 0 whose logits differ between `a` and `b`."""
  # In NumPy: eager jax.numpy compiles a program per op and shape.
  a, b = np.asarray(a), np.asarray(b)
  return np.flatnonzero(np.any(a[0] != b[0], axis=-1)).tolist()


def test_decoder_is_causal():
  _, params, logits_fn = _encdec()
  batch = _encdec_batch()
  base = logits_fn(params, batch)
  dec_in = np.array(batch["decoder_input_tokens"])
  dec_in[0, 3] = 9
  changed = dict(batch, decoder_input_tokens=dec_in)
  assert _changed_positions(base, logits_fn(params, changed)) == [3, 4, 5]


def test_packed_segments_do_not_interact():
  _, params, logits_fn = _encdec()
  # Row 0 packs example A (enc 3, dec 2 tokens) and B (enc 3, dec 4 tokens).
  # The decoder has no padding: logits of padding positions are meaningless.
  enc = jnp.array([[5, 6, 7, 8, 9, 10, 0]])
  dec_tgt = jnp.array([[11, 12, 13, 14, 15, 16]])
  dec_in = jnp.array([[0, 11, 0, 13, 14, 15]])
  packed = {
      "encoder_input_tokens": enc, "decoder_input_tokens": dec_in,
      "decoder_target_tokens": dec_tgt,
      "encoder_segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 0]]),
      "decoder_segment_ids": jnp.array([[1, 1, 2, 2, 2, 2]]),
      "encoder_positions": jnp.array([[0, 1, 2, 0, 1, 2, 0]]),
      "decoder_positions": jnp.array([[0, 1, 0, 1, 2, 3]]),
  }
  base = logits_fn(params, packed)
  enc_b = dict(packed, encoder_input_tokens=_with(enc, (0, 4), 20))  # token of B
  assert _changed_positions(base, logits_fn(params, enc_b)) == [2, 3, 4, 5]
  enc_a = dict(packed, encoder_input_tokens=_with(enc, (0, 1), 20))  # token of A
  assert _changed_positions(base, logits_fn(params, enc_a)) == [0, 1]
  dec_a = dict(packed, decoder_input_tokens=_with(dec_in, (0, 1), 20))
  assert _changed_positions(base, logits_fn(params, dec_a)) == [1]
  # Each packed example gives the logits it gets alone.
  alone = {
      "encoder_input_tokens": jnp.array([[5, 6, 7, 0, 0, 0, 0], [8, 9, 10, 0, 0, 0, 0]]),
      "decoder_input_tokens": jnp.array([[0, 11, 0, 0, 0, 0], [0, 13, 14, 15, 0, 0]]),
      "decoder_target_tokens": jnp.array([[11, 12, 0, 0, 0, 0], [13, 14, 15, 16, 0, 0]]),
  }
  single = logits_fn(params, alone)
  np.testing.assert_allclose(base[0, :2], single[0, :2], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(base[0, 2:], single[1, :4], rtol=1e-5, atol=1e-5)


def test_decoder_only_packing_and_prefix_lm():
  _, params, logits_fn = _decoder_only()
  dec_in = jnp.array([[0, 5, 6, 0, 8, 9]])
  batch = {
      "decoder_input_tokens": dec_in,
      "decoder_target_tokens": jnp.array([[5, 6, 7, 8, 9, 10]]),
      "decoder_segment_ids": jnp.array([[1, 1, 1, 2, 2, 2]]),
      # Prefix = first two positions of example 1, first of example 2.
      "decoder_causal_attention": jnp.array([[1, 1, 0, 1, 0, 0]]),
  }
  base = logits_fn(params, batch)

  def changed(pos):
    return _changed_positions(base, logits_fn(params, dict(
        batch, decoder_input_tokens=_with(dec_in, (0, pos), 20))))

  assert changed(1) == [0, 1, 2]  # a later prefix token is seen by the earlier one
  assert changed(2) == [2]  # targets stay causal, and B never sees A
  assert changed(4) == [4, 5]  # ...nor A sees B
  causal = {k: v for k, v in batch.items() if k != "decoder_causal_attention"}
  causal_base = logits_fn(params, causal)
  causal_changed = logits_fn(params, dict(causal, decoder_input_tokens=_with(dec_in, (0, 1), 20)))
  assert _changed_positions(causal_base, causal_changed) == [1, 2]


def test_encoder_padding_does_not_affect_outputs():
  model, params, logits_fn = _encdec()
  batch = _encdec_batch()
  short = dict(batch, encoder_input_tokens=batch["encoder_input_tokens"][:, :4])
  padded = dict(batch, encoder_input_tokens=jnp.pad(short["encoder_input_tokens"],
                                                    ((0, 0), (0, 3))))
  encode = jax.jit(lambda p, t: model.module.apply({"params": p}, t, enable_dropout=False,
                                                   method="encode"))
  np.testing.assert_allclose(encode(params, padded["encoder_input_tokens"])[:, :4],
                             encode(params, short["encoder_input_tokens"]),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits_fn(params, padded), logits_fn(params, short),
                             rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Scanned layers.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("network", ["encdec", "decoder_only"])
def test_scan_layers_equals_unscanned(network):
  build = _encdec if network == "encdec" else _decoder_only
  _, params, logits_fn = build()
  _, scanned_init, scanned_fn = build(scan_layers=True)
  stacked = testing.stack_layers(params)
  assert jax.tree.structure(stacked) == jax.tree.structure(scanned_init)
  assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, scanned_init)
  batch = _encdec_batch(seed=3)
  batch["decoder_causal_attention"] = np.array([[1, 1, 0, 0, 0, 0]] * 2, np.int32)
  batch["decoder_target_tokens"] = np.array(batch["decoder_target_tokens"])
  batch["decoder_target_tokens"][1, 4:] = 0
  np.testing.assert_allclose(scanned_fn(stacked, batch), logits_fn(params, batch),
                             rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Loss.
# ---------------------------------------------------------------------------


def _numpy_loss_sums(logits, targets, weights, z_loss, label_smoothing):
  logits = np.asarray(logits, np.float64)
  v = logits.shape[-1]
  lse = np.log(np.sum(np.exp(logits), axis=-1))
  log_probs = logits - lse[..., None]
  on, off = 1 - label_smoothing, label_smoothing / (v - 1)
  soft = np.full(logits.shape, off)
  np.put_along_axis(soft, np.asarray(targets)[..., None], on, axis=-1)
  constant = -(on * np.log(on) + (v - 1) * off * np.log(off)) if label_smoothing else 0.0
  cross_ent = -np.sum(soft * log_probs, axis=-1) - constant
  w = np.asarray(weights, np.float64)
  return {
      "cross_ent_sum": np.sum(w * cross_ent),
      "z_loss_sum": np.sum(w * z_loss * lse**2),
      "correct_sum": np.sum(w * (np.argmax(logits, -1) == np.asarray(targets))),
      "weight_sum": np.sum(w),
      "num_examples": float(np.sum(np.any(w != 0, axis=-1))),
  }


def _weighted_batch():
  batch = _encdec_batch(seed=5, batch=4)
  weights = np.ones((4, DEC_LEN), np.float32)
  weights[0, 4:] = 0
  weights[2, :] = 0  # an example with nothing to learn
  weights[1, 2] = 0.5
  weights[3, :3] = 2.0
  return dict(batch, decoder_loss_weights=jnp.asarray(weights))


@functools.lru_cache(maxsize=None)
def _loss_setup():
  """A model with visible z-loss and label smoothing, and its jitted functions.

  Shared by the loss tests so that each function compiles once per process.
  """
  model = _model(transformer.EncoderDecoder(_config()), z_loss=0.01, label_smoothing=0.1)
  _, params, logits_fn = _encdec()
  grad_fn = jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True))
  return model, params, logits_fn, jax.jit(model.eval_fn), grad_fn


def test_loss_fn_matches_numpy_with_z_loss_and_label_smoothing():
  _, params, logits_fn, eval_fn, _ = _loss_setup()
  batch = _weighted_batch()
  loss, sums = eval_fn(params, batch)
  expected = _numpy_loss_sums(logits_fn(params, batch), batch["decoder_target_tokens"],
                              batch["decoder_loss_weights"], 0.01, 0.1)
  for key, value in expected.items():
    assert sums[key].dtype == jnp.float32 and sums[key].shape == ()
    np.testing.assert_allclose(sums[key], value, rtol=1e-5, err_msg=key)
  assert float(sums["num_examples"]) == 3.0
  assert float(sums["weight_sum"]) == 18.5
  np.testing.assert_allclose(loss, (expected["cross_ent_sum"] + expected["z_loss_sum"])
                             / expected["weight_sum"], rtol=1e-5)
  # Zero-weight tokens contribute nothing, whatever their target.
  relabelled = dict(batch, decoder_target_tokens=batch["decoder_target_tokens"]
                    .at[0, 4:].set(3).at[2].set(7))
  loss2, sums2 = eval_fn(params, relabelled)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  for key in sums:
    np.testing.assert_allclose(sums2[key], sums[key], rtol=1e-6, err_msg=key)


def test_loss_normalizer_options():
  model, params, _, eval_fn, grad_fn = _loss_setup()
  batch = _weighted_batch()
  normalizer = model.loss_normalizer(batch)
  assert normalizer.dtype == jnp.float32 and float(normalizer) == 18.5
  fixed = _model(transformer.EncoderDecoder(_config()), loss_normalizing_factor=4.0)
  assert float(fixed.loss_normalizer(batch)) == 4.0
  (loss, sums), _ = grad_fn(params, batch, None, jnp.float32(4.0))
  np.testing.assert_allclose(loss, (sums["cross_ent_sum"] + sums["z_loss_sum"]) / 4.0,
                             rtol=1e-6)
  empty = dict(batch, decoder_loss_weights=jnp.zeros_like(batch["decoder_loss_weights"]))
  assert float(eval_fn(params, empty)[0]) == 0.0
  with pytest.raises(ValueError, match="label_smoothing must be in"):
    _model(transformer.EncoderDecoder(_config()), label_smoothing=1.0)
  with pytest.raises(ValueError, match="loss_normalizing_factor=0.0 must be None"):
    _model(transformer.EncoderDecoder(_config()), loss_normalizing_factor=0.0)


def test_dropout_only_with_rng():
  model, params, _, eval_fn, _ = _loss_setup()
  batch = _weighted_batch()
  # 'rbg' keys: dropout masks from threefry take seconds to compile on CPU.
  # Made inside the jitted loss from an integer seed: made eagerly, each key
  # runs op by op, a compile per op. Still three separate calls.
  loss_fn = jax.jit(lambda params, batch, seed: model.loss_fn(
      params, batch, jax.random.key(seed, impl="rbg")))
  dropped = [float(loss_fn(params, batch, seed)[0]) for seed in (1, 1, 2)]
  assert dropped[0] == dropped[1]
  assert len({float(eval_fn(params, batch)[0]), dropped[0], dropped[2]}) == 3


def test_microbatch_losses_and_gradients_add_up():
  model, params, _, _, grad_fn = _loss_setup()
  batch = _weighted_batch()
  normalizer = model.loss_normalizer(batch)
  (loss, sums), grads = grad_fn(params, batch, None, normalizer)
  # Sliced and summed in NumPy: eager jax.numpy compiles a program per op and shape.
  halves = [jax.tree.map(lambda x, s=s: np.asarray(x)[s], batch)
            for s in (slice(0, 2), slice(2, 4))]
  (loss_a, sums_a), grads_a = grad_fn(params, halves[0], None, normalizer)
  (loss_b, sums_b), grads_b = grad_fn(params, halves[1], None, normalizer)
  np.testing.assert_allclose(loss_a + loss_b, loss, rtol=1e-5)
  for key in sums:
    np.testing.assert_allclose(sums_a[key] + sums_b[key], sums[key], rtol=1e-5, err_msg=key)
  summed = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), grads_a, grads_b)
  for (path, g), s in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(summed)):
    np.testing.assert_allclose(s, g, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------
# Model API details and a training pulse.
# ---------------------------------------------------------------------------


def test_feature_converters_and_ignored_keys():
  assert models.EncoderDecoderModel.FEATURE_CONVERTER_CLS is seqio.EncDecFeatureConverter
  prefix_model, params, logits_fn = _decoder_only()
  assert prefix_model.FEATURE_CONVERTER_CLS is seqio.PrefixLMFeatureConverter
  assert models.DecoderOnlyModel.FEATURE_CONVERTER_CLS is seqio.DecoderFeatureConverter
  plain = _model(transformer.DecoderOnly(_config()))
  assert plain.FEATURE_CONVERTER_CLS is seqio.DecoderFeatureConverter
  batch = _encdec_batch()  # has encoder_input_tokens, which a decoder-only model ignores
  batch["decoder_causal_attention"] = jnp.array([[1, 1, 1, 0, 0, 0]] * 2)
  prefix_logits = logits_fn(params, batch)
  plain_logits = jax.jit(plain.predict_logits)(params, batch)
  # The plain model ignores the prefix feature, so the prefix-LM's differ.
  assert not np.allclose(prefix_logits[:, 0], plain_logits[:, 0])
  del batch["decoder_causal_attention"]
  np.testing.assert_array_equal(jax.jit(plain.predict_logits)(params, batch), plain_logits)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = _model(transformer.EncoderDecoder(_config(dtype="bfloat16")))
  params = _random_params(model)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_abstract(model)))
  logits = jax.jit(model.predict_logits)(params, _encdec_batch())
  assert logits.dtype == jnp.float32 and logits.shape == (2, DEC_LEN, VOCAB)
  f32_fn = _encdec()[2]
  reference = f32_fn(params, _encdec_batch())
  # bfloat16 keeps ~3 significant digits per op; five layers deep, a few
  # percent of relative error is expected, a wrong cast would be far worse.
  relative_error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
  assert 0 < relative_error < 0.03


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_logits_are_a_float32_product_as_in_t5x(tied):
  """T5X computes the output layer in float32 whatever the activation dtype
  ("for stability"): the bfloat16 output of the final norm times the float32
  kernel (or embedding table). Rounding the logits to bfloat16 instead moves
  each by up to 2**-9 of itself, which T5X's bfloat16 run shows after a few
  updates (tests/test_t5x_training.py)."""
  model = _model(transformer.EncoderDecoder(_config(dtype="bfloat16",
                                                    logits_via_embedding=tied)))
  params = _random_params(model)
  batch = _encdec_batch()
  logits, state = jax.jit(lambda p, b: model.module.apply(
      {"params": p}, **model._module_inputs(b), enable_dropout=False,
      capture_intermediates=True, mutable=["intermediates"]))(params, batch)
  normed = state["intermediates"]["decoder"]["decoder_norm"]["__call__"][0]
  assert normed.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  normed = np.asarray(normed, np.float64)
  if tied:
    table = np.asarray(params["token_embedder"]["embedding"], np.float64)
    want = normed @ table.T / np.sqrt(EMBED)
  else:
    want = normed @ np.asarray(params["decoder"]["logits_dense"]["kernel"], np.float64)
  # float32 products: within a few float32 roundings (2**-24) of the exact
  # sum; a bfloat16 product would be up to 2**-9 off.
  gap = np.max(np.abs(np.asarray(logits, np.float64) - want)) / np.max(np.abs(want))
  assert gap < 1e-5, gap


def test_training_on_a_copy_task_lowers_the_loss():
  cfg = _config(emb_dim=64, num_heads=4, head_dim=8, mlp_dim=128, num_encoder_layers=2,
                num_decoder_layers=2, dropout_rate=0.0)
  model = _model(transformer.EncoderDecoder(cfg))
  # The real init, from an 'rbg' key: its random program compiles in a
  # fifth of threefry's time on CPU; the draws have the same distributions
  # (with seeds 0 and 1 the loss falls to 6% and 5% of its start).
  shapes = {"encoder_input_tokens": (16, 6), "decoder_input_tokens": (16, 6)}
  init = jax.jit(lambda: model.get_initial_variables(jax.random.key(0, impl="rbg"), shapes))
  params = nn.unbox(init())["params"]
  optimizer = optax.adam(3e-3)
  # Jitted: eager, the optimizer's init and the key split compile a program
  # per op and shape.
  opt_state = jax.jit(optimizer.init)(params)
  rngs = jax.jit(lambda: jax.random.split(jax.random.key(0), 600))()

  @jax.jit
  def step(params, opt_state, rngs, i):
    tokens = jax.random.randint(rngs[i], (16, 6), 2, VOCAB)
    batch = {"encoder_input_tokens": tokens, "decoder_target_tokens": tokens,
             "decoder_input_tokens": jnp.pad(tokens[:, :-1], ((0, 0), (1, 0))),
             "decoder_loss_weights": jnp.ones((16, 6), jnp.float32)}
    (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  # Copying needs the decoder to find its position in the encoder output;
  # the loss drops sharply once it does, after roughly 250-450 steps.
  for i in range(600):
    params, opt_state, loss = step(params, opt_state, rngs, i)
    losses.append(float(loss))
  assert np.mean(losses[:10]) > 3.0
  assert np.mean(losses[-20:]) < 0.25 * np.mean(losses[:10])


# ---------------------------------------------------------------------------
# Relative-position tables per layer (relpos_per_layer, T5X scalable_t5).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, blocks", [
    ({}, None),
    (dict(scan_layers=True), None),
    (dict(scan_layers=True, num_experts=4, moe_layer_interval=2, num_decoder_layers=4), 2),
], ids=["unscanned", "scanned", "scanned-moe"])
def test_relpos_per_layer_gives_every_layer_its_own_table(overrides, blocks):
  cfg = _config(relpos_per_layer=True, **overrides)
  params = _abstract(_model(transformer.EncoderDecoder(cfg)))["params"]
  table = (ax.HEADS, ax.RELPOS_BUCKETS)
  for stack, depth in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    assert "relpos_bias" not in params[stack], stack
    if not cfg.scan_layers:
      found = {name: params[stack][name]["relpos_bias"]["rel_embedding"]
               for name in (f"layers_{i}" for i in range(depth))}
      expected = {name: (table, (HEADS, BUCKETS)) for name in found}
    elif blocks is None:
      found = {"layers": params[stack]["layers"]["relpos_bias"]["rel_embedding"]}
      expected = {"layers": ((ax.LAYERS, *table), (depth, HEADS, BUCKETS))}
    else:  # every member of the scanned MoE block, a leading blocks axis
      found = {j: params[stack]["layers"][f"layers_{j}"]["relpos_bias"]["rel_embedding"]
               for j in range(cfg.moe_layer_interval)}
      expected = {j: ((ax.LAYERS, *table), (depth // blocks, HEADS, BUCKETS)) for j in found}
    assert {k: (tuple(v.names), v.value.shape) for k, v in found.items()} == expected, stack
  if not cfg.num_experts:
    # One [heads, buckets] table per layer instead of one per stack.
    extra = (ENC_LAYERS + DEC_LAYERS - 2) * HEADS * BUCKETS
    assert _param_count(nn.unbox(params)) == 5704 + extra


def _per_layer_tables(shared_params, scanned):
  """Params of a relpos_per_layer model: each stack's shared table copied
  into every layer (stacked along LAYERS for scanned layers)."""
  out = {}
  for name, subtree in shared_params.items():
    if name not in ("encoder", "decoder"):
      out[name] = subtree
      continue
    stack = dict(subtree)
    table = stack.pop("relpos_bias")
    if scanned:
      depth = len(jax.tree.leaves(stack["layers"])[0])
      stack["layers"] = dict(stack["layers"], relpos_bias=jax.tree.map(
          lambda t, n=depth: jnp.broadcast_to(t, (n, *t.shape)), table))
    else:
      for key in [k for k in stack if k.startswith("layers_")]:
        stack[key] = dict(stack[key], relpos_bias=table)
    out[name] = stack
  return out


def _relpos_setup(network, scan):
  """Shared and per-layer (model, params, logits_fn) and a batch for both.

  The per-layer params copy the shared model's tables into every layer.
  """
  build = _encdec if network == "encdec" else _decoder_only
  # Unscanned as build(), the way the other tests call it: the same cached
  # model and compiled function (build(scan_layers=False) is another entry).
  shared_model, shared_params, shared_fn = build(scan_layers=True) if scan else build()
  per_layer_model, per_layer_init, per_layer_fn = build(scan_layers=scan, relpos_per_layer=True)
  per_layer_params = _per_layer_tables(shared_params, scan)
  assert jax.tree.map(jnp.shape, per_layer_params) == jax.tree.map(jnp.shape, per_layer_init)
  batch = _encdec_batch(seed=3)
  batch["decoder_causal_attention"] = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], np.int32)
  batch["decoder_target_tokens"] = np.array(batch["decoder_target_tokens"])
  batch["decoder_target_tokens"][1, 5:] = 0
  return ((shared_model, shared_params, shared_fn),
          (per_layer_model, per_layer_params, per_layer_fn), batch)


def _greedy_decode(model, params, batch, use_cache=True):
  """Greedy tokens `[batch, 5]` and their log-probability `[batch]` (cached
  unless `use_cache=False`)."""
  tokens, scores = _greedy_decoder(model, use_cache)(params, batch)
  return np.asarray(tokens[:, -1]), np.asarray(scores[:, -1])


@functools.lru_cache(maxsize=None)
def _greedy_decoder(model, use_cache):
  """The jitted decode of `_greedy_decode`, one per model and cache mode, so
  that the relpos tests decoding the same model compile it once."""
  decoder = _model(model.module, max_decode_length=5,
                   **({} if isinstance(model.module, transformer.EncoderDecoder)
                      else dict(inputs_bidirectional_attention=True)))
  return jax.jit(functools.partial(decoder.decode_batch, use_cache=use_cache))


def _assert_same_decodes(a, b):
  np.testing.assert_array_equal(a[0], b[0])
  # Equal tokens can hide a wrong step bias; their scores cannot.
  np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("network", ["encdec", "decoder_only"])
def test_relpos_per_layer_with_equal_tables_equals_the_shared_table(network, scan):
  shared, per_layer, batch = _relpos_setup(network, scan)
  (shared_model, shared_params, shared_fn), (_, per_layer_params, per_layer_fn) = shared, per_layer
  np.testing.assert_allclose(per_layer_fn(per_layer_params, batch),
                             shared_fn(shared_params, batch), rtol=0, atol=1e-6)
  # Cached decoding: prefill, then one step per token with the rows of the
  # current position, in every layer.
  _assert_same_decodes(_greedy_decode(per_layer[0], per_layer_params, batch),
                       _greedy_decode(shared_model, shared_params, batch))


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("network", ["encdec", "decoder_only"])
def test_relpos_per_layer_uses_each_layers_own_table(network, scan):
  shared, per_layer, batch = _relpos_setup(network, scan)
  (_, shared_params, shared_fn), (per_layer_model, params, per_layer_fn) = shared, per_layer
  reference = per_layer_fn(params, batch)  # equal tables
  stacks = ("encoder", "decoder") if network == "encdec" else ("decoder",)
  rng = np.random.default_rng(1)
  for stack in stacks:
    # Change only the LAST layer's table, so reading one table for all
    # layers (or the stack's) would not notice.
    if scan:
      old = params[stack]["layers"]["relpos_bias"]["rel_embedding"]
      new = old.at[-1].add(rng.normal(0.0, 1.0, old.shape[1:]))
      layer = dict(params[stack]["layers"], relpos_bias={"rel_embedding": new})
      params = {**params, stack: {**params[stack], "layers": layer}}
    else:
      last = [k for k in params[stack] if k.startswith("layers_")][-1]
      old = params[stack][last]["relpos_bias"]["rel_embedding"]
      new = old + rng.normal(0.0, 1.0, old.shape)
      layer = dict(params[stack][last], relpos_bias={"rel_embedding": new})
      params = {**params, stack: {**params[stack], last: layer}}
    logits = per_layer_fn(params, batch)
    assert np.abs(np.asarray(logits - reference)).max() > 1e-3, stack
    reference = logits
  assert np.abs(np.asarray(reference - shared_fn(shared_params, batch))).max() > 1e-3
  # Distinct tables per layer still decode the same with and without the cache.
  _assert_same_decodes(_greedy_decode(per_layer_model, params, batch),
                       _greedy_decode(per_layer_model, params, batch, use_cache=False))


def test_a_model_checks_the_mesh_and_the_task_vocabulary():
  from t5lite import testing
  model = testing.tiny_encoder_decoder()
  byte = model.output_vocabulary
  model.validate_vocabulary("t", byte)
  with pytest.raises(ValueError, match=rf"^Task 't' uses PassThroughVocabulary with 10 tokens but "
                     rf"the model was configured with {type(byte).__name__} with "
                     rf"{byte.vocab_size}; set the model's vocabulary \(VOCABULARY\)"):
    model.validate_vocabulary("t", seqio.PassThroughVocabulary(10))
  small = testing.tiny_encoder_decoder(vocab_size=200)
  with pytest.raises(ValueError, match=rf"^Model vocab_size 200 is smaller than the task "
                     rf"vocabulary \({byte.vocab_size}\); raise the model's vocab_size"):
    small.validate_vocabulary("t", byte)
  model.validate_mesh({"data": 2, "expert": 4})  # no experts: any mesh
  experts = testing.tiny_encoder_decoder(num_experts=6)
  experts.validate_mesh({"data": 4, "expert": 2})
  with pytest.raises(ValueError, match=r"num_experts=6 does not divide evenly over the expert "
                                       r"mesh axis of size 4"):
    experts.validate_mesh({"data": 2, "expert": 4})
