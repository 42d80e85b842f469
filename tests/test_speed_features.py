"""Speed features change speed or memory, never results.

Each feature is switched on and off on the same tiny model, params and batch,
and the losses and gradients compared. Tolerances follow the dtype: float32
features that only reorder or recompute the same operations agree to float32
rounding; bfloat16 activations are compared against float32 at bfloat16
precision.
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5lite import metrics, testing
from t5lite.models import layers, transformer


B, ENC_LEN, DEC_LEN = 3, 10, 6


def _batch():
  """Padding in both the inputs and the targets, so masks matter."""
  rng = np.random.default_rng(0)
  targets = rng.integers(3, 300, (B, DEC_LEN)).astype(np.int32)
  targets[1, 4:] = 0
  inputs = rng.integers(3, 300, (B, ENC_LEN)).astype(np.int32)
  inputs[2, 7:] = 0
  return {"encoder_input_tokens": inputs, "decoder_target_tokens": targets,
          "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
          "decoder_loss_weights": (targets > 0).astype(np.float32)}


def _shapes():
  return {k: (1,) + v.shape[1:] for k, v in _batch().items()}


def _init_params(model, rng):
  return nn.unbox(model.get_initial_variables(rng, _shapes())["params"])


def _params(scan_layers=False):
  return _params_of_layout(bool(scan_layers))  # one cache entry per layout


@functools.lru_cache(maxsize=None)
def _params_of_layout(scan_layers):
  """The tiny model's initial params in either layout. Compiling an
  initialisation costs several seconds, so the model is initialised once,
  unscanned; the scanned layout stacks those layers (every comparison runs
  both sides on the same params, whatever their values)."""
  if not scan_layers:
    model = testing.tiny_encoder_decoder()
    return jax.jit(functools.partial(_init_params, model))(jax.random.key(0))
  params = testing.stack_layers(_params())
  # The tree the scanned model initialises, traced without compiling.
  want = jax.eval_shape(functools.partial(
      _init_params, testing.tiny_encoder_decoder(scan_layers=True)), jax.random.key(0))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(params)] == [
      (x.shape, x.dtype) for x in jax.tree.leaves(want)]
  return params


@functools.lru_cache(maxsize=None)
def _loss_and_grads(**overrides):
  """Loss and gradients at the same initial params (those of the layout)."""
  params = _params(scan_layers=overrides.get("scan_layers", False))
  model = testing.tiny_encoder_decoder(**overrides)
  fn = jax.jit(jax.value_and_grad(lambda p, b: model.loss_fn(p, b, None)[0]))
  return fn(params, _batch())


def _assert_same(got, want, rtol):
  """Equal loss and gradients up to float32 reassociation.

  A sum taken in another order errs by a fraction of its terms, not of its
  result, so a gradient element that cancels to near zero keeps the error
  of the terms: each element may differ by `rtol` of itself plus `rtol` of
  its leaf's largest magnitude (the scale of those terms). Which elements
  land near zero, and how XLA orders their sums, varies with the CPU's
  vector units, so an absolute floor would hold on one machine only.
  """
  (loss, grads), (want_loss, want_grads) = got, want
  np.testing.assert_allclose(loss, want_loss, rtol=rtol)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()))
  # Non-trivial gradients, so that agreement means something.
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads)) > 1e-3


# ---------------------------------------------------------------------------
# Rematerialisation.


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_policies_equal_no_remat(policy, scan_layers):
  want = _loss_and_grads(scan_layers=scan_layers)
  # Recomputation runs the same float32 operations again; only XLA's fusion
  # of them may differ, hence float32 rounding tolerances.
  got = _loss_and_grads(scan_layers=scan_layers, remat_policy=policy)
  _assert_same(got, want, rtol=1e-5)


def _jaxpr_text(**overrides):
  model = testing.tiny_encoder_decoder(**overrides)
  grad = jax.grad(lambda p, b: model.loss_fn(p, b, None)[0])
  return str(jax.make_jaxpr(grad)(_params(), _batch()))


def test_remat_policy_reaches_the_jaxpr():
  assert "remat" not in _jaxpr_text()
  full = _jaxpr_text(remat_policy="full")
  dots = _jaxpr_text(remat_policy="dots_saveable")
  # One per layer: 2 encoder + 2 decoder.
  assert full.count("remat2[") == full.count("policy=None") == 4
  assert dots.count("remat2[") == dots.count("policy=DotsSaveable") == 4


def test_bad_remat_policy_and_attention_impl_are_named():
  with pytest.raises(ValueError, match=r"remat_policy 'dots' is not supported; use one of "
                                       r"\('none', 'full', 'dots_saveable'\)"):
    testing.tiny_config(remat_policy="dots")
  with pytest.raises(ValueError, match=r"attention_impl 'flash' is not supported; use one of "
                                       r"\('xla', 'dot_product_attention'\)"):
    testing.tiny_config(attention_impl="flash")


# ---------------------------------------------------------------------------
# Attention through jax.nn.dot_product_attention.


@pytest.fixture
def fused_calls(monkeypatch):
  """Records the calls that reach jax.nn.dot_product_attention; each runs
  its XLA implementation, whichever one the caller asked for (so a call
  meant for cuDNN runs on the CPU)."""
  calls = []
  real = jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  return calls


def _cudnn_applies(monkeypatch):
  """As on a GPU where cuDNN flash attention fits every attention call."""
  monkeypatch.setattr(layers, "fused_attention_backend", lambda *args, **kwargs: "cudnn")


@pytest.fixture
def cudnn_applies(monkeypatch):
  _cudnn_applies(monkeypatch)


def _loss_fn(**overrides):
  model = testing.tiny_encoder_decoder(**overrides)
  return lambda p, b: model.loss_fn(p, b, None)[0]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_dot_product_attention_equals_xla_attention(fused_calls, monkeypatch, scan_layers):
  params = _params(scan_layers)
  # Where cuDNN does not apply (this CPU), the default implementation runs
  # the 'xla' einsums: the same program, so the module's cached loss and
  # gradients (compiled once, shared with the remat tests) are the 'xla' ones.
  xla_jaxpr = jax.make_jaxpr(jax.grad(_loss_fn(scan_layers=scan_layers, attention_impl="xla")))
  default_jaxpr = jax.make_jaxpr(jax.grad(_loss_fn(scan_layers=scan_layers)))
  assert str(xla_jaxpr(params, _batch())) == str(default_jaxpr(params, _batch()))
  want = _loss_and_grads(scan_layers=scan_layers)
  _cudnn_applies(monkeypatch)
  fused_calls.clear()
  # Tracing shows what reaches jax.nn.dot_product_attention; no need to compile.
  jax.eval_shape(jax.value_and_grad(_loss_fn(scan_layers=scan_layers, attention_impl="xla")),
                 params, _batch())
  assert not fused_calls
  # The uncached function traces again, under the spy; the cache keeps what
  # other tests compiled (clearing it would have them compile again).
  got = _loss_and_grads.__wrapped__(scan_layers=scan_layers,
                                    attention_impl="dot_product_attention")
  # Encoder self, decoder self and cross attention of every layer (a scanned
  # body is traced more than once, so count in thirds).
  assert fused_calls and len(fused_calls) % 3 == 0
  # T5 does not scale logits; the relative-position bias arrives as `bias`,
  # except in cross-attention, which has none.
  assert all(c["scale"] == 1.0 and c["implementation"] == "cudnn" for c in fused_calls)
  assert 3 * sum(c["bias"] is None for c in fused_calls) == len(fused_calls)
  assert all(c["mask"].dtype == jnp.bool_ for c in fused_calls)
  # Same float32 math, summed in another order.
  _assert_same(got, want, rtol=1e-5)


def _numpy_variables(module, *args, seed=0):
  """`module`'s variables with values drawn by NumPy, for checks that hold
  whatever the weights: a Flax init compiles a random program per parameter
  shape, seconds for a layer."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
  return jax.tree.map(lambda s: np.asarray(rng.normal(size=s.shape) / np.sqrt(s.shape[0]),
                                           s.dtype), shapes)


def test_dot_product_attention_layer_matches_einsums_with_bias_and_mask():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, 5, 4, 3)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 7, 4, 3)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 7, 4, 3)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(1, 4, 5, 7)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 5, 7)) > 0.3).at[0, 0, 2].set(False)  # a dead row
  weights = layers.attention_weights(q, k, layers.combine_biases(mask, bias))
  want = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
  got = layers.dot_product_attention(q, k, v, mask, bias)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dot_product_attention_takes_the_einsums_where_cudnn_does_not_apply(fused_calls, dtype):
  """Where jax.nn.dot_product_attention would run XLA (here, the CPU), the
  module computes the same float32-logit attention with its einsums: no
  call reaches it, and the result equals the 'xla' implementation with
  float32 logits exactly, whatever `float32_logits` says."""
  def attention(impl, float32_logits):
    return layers.MultiHeadDotProductAttention(num_heads=4, head_dim=8, dtype=dtype,
                                               attention_impl=impl,
                                               float32_logits=float32_logits)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 6, 16)), dtype)
  mask = jnp.asarray(rng.random((2, 1, 6, 6)) > 0.3)
  bias = jnp.asarray(rng.normal(size=(1, 4, 6, 6)), jnp.float32)
  variables = _numpy_variables(attention("xla", True), x, x)
  fused_calls.clear()
  got = attention("dot_product_attention", False).apply(variables, x, x, mask, bias)
  assert not fused_calls
  want = attention("xla", True).apply(variables, x, x, mask, bias)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  if dtype == jnp.bfloat16:  # the logits' dtype shows in the result
    low = attention("xla", False).apply(variables, x, x, mask, bias)
    assert not np.array_equal(np.asarray(low, np.float32), np.asarray(want, np.float32))


def test_attention_dropout_in_training_uses_the_einsums(fused_calls, cudnn_applies):
  attention = layers.MultiHeadDotProductAttention(
      num_heads=4, head_dim=3, dropout_rate=0.5, attention_impl="dot_product_attention")
  x = jnp.ones((2, 5, 8))
  variables = _numpy_variables(attention, x, x)
  fused_calls.clear()
  attention.apply(variables, x, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  assert not fused_calls  # jax.nn.dot_product_attention has no dropout
  attention.apply(variables, x, x, deterministic=True)
  assert len(fused_calls) == 1


def test_fused_attention_backend_picks_cudnn_only_where_it_applies(monkeypatch):
  def qk(dtype, head_dim=64, q_len=8, kv_len=8):
    return jnp.zeros((1, q_len, 2, head_dim), dtype), jnp.zeros((1, kv_len, 2, head_dim), dtype)

  bias, mask = jnp.zeros((1, 2, 8, 8)), jnp.ones((1, 1, 8, 8), bool)
  backend = layers.fused_attention_backend
  assert backend(*qk(jnp.bfloat16), bias) == "xla"  # on this CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert backend(*qk(jnp.bfloat16), bias, mask) == "cudnn"
  assert backend(*qk(jnp.float16), None) == "cudnn"
  assert backend(*qk(jnp.float32), bias) == "xla"
  assert backend(*qk(jnp.bfloat16, head_dim=12), bias) == "xla"
  # Training: cuDNN cannot give the gradient of a bias with a batch axis,
  # which a per-example mask becomes, nor of a bias at an odd length.
  assert backend(*qk(jnp.bfloat16), bias, None, training=True) == "cudnn"
  assert backend(*qk(jnp.bfloat16), bias, mask, training=True) == "xla"
  assert backend(*qk(jnp.bfloat16), jnp.zeros((2, 2, 8, 8)), None, training=True) == "xla"
  assert backend(*qk(jnp.bfloat16, q_len=7), bias, None, training=True) == "xla"
  assert backend(*qk(jnp.bfloat16, q_len=7), None, None, training=True) == "cudnn"


# ---------------------------------------------------------------------------
# bfloat16 activations, float32 parameters and optimizer state.


def test_bfloat16_activations_keep_float32_state_and_match_float32():
  from t5lite import trainer
  from t5lite.train_state import TrainState
  want_loss, want_grads = _loss_and_grads()
  loss, grads = _loss_and_grads(dtype="bfloat16")
  # bfloat16 keeps 8 significant bits (relative rounding 2**-9 per op);
  # through four layers the loss stays within 1% and each gradient points
  # the same way (a wrong cast or a lost bias would be far off).
  np.testing.assert_allclose(loss, want_loss, rtol=1e-2)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert g.dtype == jnp.float32
    cosine = jnp.vdot(g, w) / (jnp.linalg.norm(g) * jnp.linalg.norm(w))
    assert cosine > 0.99
  model = testing.tiny_encoder_decoder(dtype="bfloat16")
  step = functools.partial(trainer.train_step, model=model, dropout_seed=0,
                           num_microbatches=None)
  # The dtypes of a step's output state, without compiling it.
  new_state, _ = jax.eval_shape(
      step, TrainState.create(_params(), model.optimizer, testing.param_axes(model, _shapes())),
      _batch())
  for leaf in jax.tree.leaves((new_state.params, new_state.opt_state)):
    assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype


# ---------------------------------------------------------------------------
# Model FLOPs.


def test_forward_flops_by_hand():
  cfg = testing.tiny_config(num_encoder_layers=1, num_decoder_layers=1, vocab_size=32)
  d, inner, f, v = 8, 12, 16, 32  # emb, heads * head_dim, mlp, vocab
  flops = transformer.forward_flops(cfg, batch_size=2, decoder_length=5, encoder_length=7)
  assert flops["attention_projections"] == 2 * (7 * 8 * d * inner + 5 * 8 * d * inner
                                                + (5 + 7) * 4 * d * inner)
  assert flops["attention_scores"] == 2 * 4 * inner * (7 * 7 + 5 * 5 + 5 * 7)
  assert flops["mlp"] == 2 * (7 + 5) * 6 * d * f
  assert flops["logits"] == 2 * 5 * 2 * d * v
  assert flops["total"] == sum(v for k, v in flops.items() if k != "total")
  decoder_only = transformer.forward_flops(cfg, batch_size=2, decoder_length=5)
  assert decoder_only["attention_scores"] == 2 * 4 * inner * 5 * 5


def test_moe_flops_count_the_selected_experts_and_the_router():
  dense = testing.tiny_config(num_encoder_layers=2, num_decoder_layers=2)
  sparse = testing.tiny_config(num_encoder_layers=2, num_decoder_layers=2, num_experts=4,
                               num_selected_experts=2, moe_layer_interval=2,
                               expert_mlp_dim=32)
  a = transformer.forward_flops(dense, 3, 5, 7)
  b = transformer.forward_flops(sparse, 3, 5, 7)
  tokens = 3 * (5 + 7)  # one MoE layer in each stack
  assert b["moe_experts"] == tokens * 2 * 6 * 8 * 32
  assert b["moe_router"] == tokens * 2 * 8 * 4
  assert b["mlp"] == a["mlp"] / 2
  assert b["attention_projections"] == a["attention_projections"]


def test_flops_agree_with_xla_where_matmuls_dominate():
  model = testing.tiny_encoder_decoder(emb_dim=256, num_heads=4, head_dim=64, mlp_dim=1024,
                                       vocab_size=384)
  shapes = {"encoder_input_tokens": (2, 32), "decoder_input_tokens": (2, 16)}
  batch = {k: jnp.ones(s, jnp.int32) for k, s in shapes.items()}
  batch["decoder_target_tokens"] = batch["decoder_input_tokens"]
  params = jax.eval_shape(lambda: nn.unbox(
      model.get_initial_variables(jax.random.key(0), shapes))["params"])
  compiled = jax.jit(model.predict_logits).lower(params, batch).compile()
  xla = compiled.cost_analysis()["flops"]
  ours = model.train_flops_per_step(shapes) / 3
  # XLA also counts elementwise work (softmax, GELU, norms, bias one-hots):
  # a few percent on top of the matmuls at this width.
  assert ours < xla < 1.1 * ours


# ---------------------------------------------------------------------------
# The training loop: prefetching and host syncs.


def _train_data(prefetch_batches):
  from t5lite import feeder, partitioning
  from t5lite.data.datasets import DatasetConfig
  testing.register_in_memory_task(
      "t5lite_speed_numbers", [{"inputs": f"number {i}", "targets": str(i)} for i in range(40)])
  cfg = DatasetConfig("t5lite_speed_numbers", {"inputs": 16, "targets": 8}, "train", 2,
                      shuffle=False, seed=0)
  return feeder.TrainData(testing.tiny_encoder_decoder(), cfg, partitioning.Partitioner(),
                             prefetch_batches)


def _tokens(batch):
  return np.asarray(batch["encoder_input_tokens"]).tolist()


def test_prefetched_batches_equal_built_ones_and_leave_the_iterator_exact():
  want = [_tokens(b) for b in itertools.islice(_train_data(0), 9)]
  data = _train_data(prefetch_batches=2)
  data.prefetch(3)
  got = [_tokens(next(data)) for _ in range(3)]
  # The thread stopped after the 3 batches asked for: the iterator, which a
  # checkpoint would save, stands exactly after them.
  got.append(_tokens(data._build()))
  assert got[3] == want[3]
  data.prefetch(5)
  got.append(_tokens(next(data)))
  # Stopping hands back what was already taken from the iterator, in order.
  left = data.stop_prefetch()
  assert 1 <= len(left) <= 3  # the queue (2) and the batch in hand
  got += [_tokens(b) for b in left]
  got.append(_tokens(next(data)))  # built on demand after the stop
  assert got == want[:len(got)]


def test_prefetch_passes_errors_on_and_refuses_to_overlap():
  from t5lite import feeder

  def broken():
    raise OSError("disk gone")

  prefetcher = feeder._Prefetcher(broken, count=3, depth=2)
  with pytest.raises(OSError, match="disk gone"):
    prefetcher.get()
  data = _train_data(prefetch_batches=1)
  data.prefetch(2)
  with pytest.raises(RuntimeError, match="before the previous batches were used"):
    data.prefetch(2)
  data.stop_prefetch()
  with pytest.raises(ValueError, match=r"prefetch_batches must be >= 0 .* got -1"):
    _train_data(prefetch_batches=-1)


@pytest.mark.slow
def test_the_loop_waits_for_the_device_only_at_stats_periods(tmp_path, monkeypatch):
  from jax._src import array
  from test_cli import SHALLOW_BINDINGS

  import gin
  from t5lite import cli
  from t5lite import train as train_lib
  gin.clear_config(clear_constants=True)
  cli.parse_gin(["gin/pretrain_dense.gin", "gin/testing/local_tiny.gin"],
                [f"MODEL_DIR = '{tmp_path}'", "TRAIN_STEPS = 9", "STATS_PERIOD = 3",
                 "EVAL_PERIOD = 0", "CHECKPOINT_PERIOD = 9",
                 # Where the loop waits does not depend on depth.
                 *SHALLOW_BINDINGS],
                cli.gin_search_paths([]))
  phase, syncs = ["setup"], []

  def in_phase(name, fn):
    def wrapped(*args, **kwargs):
      outer, phase[0] = phase[0], name
      try:
        return fn(*args, **kwargs)
      finally:
        phase[0] = outer
    return wrapped

  # Every read of a device value (float(x), np.asarray(x), jax.device_get,
  # a Python branch on x) goes through ArrayImpl._value; waiting without
  # reading goes through block_until_ready.
  real_value, real_block = array.ArrayImpl._value, array.ArrayImpl.block_until_ready
  monkeypatch.setattr(array.ArrayImpl, "_value", property(
      lambda x: (syncs.append(phase[0]), real_value.fget(x))[1]))
  monkeypatch.setattr(array.ArrayImpl, "block_until_ready",
                      lambda x: (syncs.append(phase[0]), real_block(x))[1])
  monkeypatch.setattr(train_lib, "run_epochs", in_phase("loop", train_lib.run_epochs))
  monkeypatch.setattr(train_lib, "_write_stats", in_phase("stats", train_lib._write_stats))
  monkeypatch.setattr(train_lib, "_end_of_epoch", in_phase("epoch end", train_lib._end_of_epoch))
  stats_steps, real_fetch = [], metrics.fetch
  monkeypatch.setattr(train_lib.metrics_lib, "fetch", lambda pending: (
      stats_steps.append(len(pending)), real_fetch(pending))[1])
  try:
    # On accelerators this also refuses implicit transfers outright (on the
    # CPU there is nothing to transfer, hence the counting above).
    with jax.transfer_guard_device_to_host("disallow"):
      end, _ = gin.get_configurable(train_lib.train)()
  finally:
    gin.clear_config(clear_constants=True)
  assert end == 9 and stats_steps == [3, 3, 3]
  assert "stats" in syncs  # the counting works
  assert "loop" not in syncs, "the hot loop waited for the device between stats periods"


def test_progress_line_shows_model_flops_and_mfu_where_the_peak_is_known():
  progress = metrics.Progress(10, 0, flops_per_step=2e12, peak_flops_per_second=8e12)
  scalars = progress.timing(4, {"num_tokens": 100.0, "num_examples": 2.0})
  rate = scalars["timing/steps_per_second"]
  np.testing.assert_allclose(scalars["timing/model_flops_per_second"], 2e12 * rate)
  np.testing.assert_allclose(scalars["timing/mfu"], 2e12 * rate / 8e12)
  line = progress.line(4, {**scalars, "timing/steps_per_second": 1.0,
                           "timing/model_flops_per_second": 2e12, "timing/mfu": 0.25})
  assert "2 TFLOP/s  MFU 25.0%" in line
  without = metrics.Progress(10, 0).timing(4, {})
  assert "timing/mfu" not in without and "timing/model_flops_per_second" not in without


def test_peak_flops_by_device_kind_and_the_dtype_the_model_computes_in():
  class Device:
    def __init__(self, kind):
      self.device_kind = kind

  h100 = [Device("NVIDIA H100 80GB HBM3")] * 8
  assert metrics.peak_flops_per_second(h100, compute_dtype="bfloat16") == 8 * 989e12
  assert metrics.peak_flops_per_second(h100, compute_dtype="float16") == 8 * 989e12
  assert metrics.peak_flops_per_second(h100, compute_dtype="float32") == 8 * 494e12
  assert metrics.peak_flops_per_second(h100) == 8 * 494e12  # unknown dtype: float32
  pcie = [Device("NVIDIA H100 PCIe")]
  assert metrics.peak_flops_per_second(pcie, compute_dtype="bfloat16") == 756e12
  assert metrics.peak_flops_per_second(pcie, compute_dtype="float32") == 378e12
  assert metrics.peak_flops_per_second([Device("cpu")], compute_dtype="bfloat16") is None
  # A figure the user binds (train.peak_flops_per_device) wins over the table.
  assert metrics.peak_flops_per_second([Device("cpu")] * 2, per_device=5e11) == 1e12
  assert metrics.peak_flops_per_second(pcie, per_device=1e12, compute_dtype="bfloat16") == 1e12


def test_the_progress_mfu_counts_against_the_peak_of_the_models_dtype(monkeypatch):
  from t5lite import report
  from t5lite.models import models, transformer

  class Data:
    def global_shapes(self):
      return {"decoder_input_tokens": (8, 16), "encoder_input_tokens": (8, 32)}

  class H100:
    device_kind = "NVIDIA H100 80GB HBM3"

  def mfu_peak(dtype):
    config = transformer.TransformerConfig(
        vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32, num_encoder_layers=1,
        num_decoder_layers=1, dtype=dtype)
    model = models.EncoderDecoderModel(transformer.EncoderDecoder(config), None, None,
                                       optax.sgd(1.0))
    assert model.compute_dtype() == dtype
    progress = report.progress(model, Data(), 0, 10)
    return progress._peak  # noqa: SLF001

  monkeypatch.setattr(jax, "devices", lambda *unused: [H100()] * 2)
  assert mfu_peak("bfloat16") == 2 * 989e12
  assert mfu_peak("float32") == 2 * 494e12


def test_a_peak_that_is_not_positive_is_refused_before_anything_runs(tmp_path):
  from t5lite import train as train_lib
  model_dir = tmp_path / "never-written"
  with pytest.raises(ValueError, match="peak_flops_per_device must be a positive"):
    train_lib.train(model=None, train_dataset_cfg=None, partitioner=None, trainer_cls=None,
                    model_dir=str(model_dir), total_steps=1, peak_flops_per_device=0.0)
  assert not model_dir.exists()


# ---------------------------------------------------------------------------
# Low-precision matmuls.


def test_bfloat16_matmuls_accumulate_in_float32_on_the_cpu_only(monkeypatch):
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.normal(size=(5, 7)), jnp.bfloat16)
  b = jnp.asarray(rng.normal(size=(7, 3)), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda a, b: layers.einsum("ik,kj->ij", a, b, jnp.bfloat16))(a, b))
  assert "preferred_element_type=float32" in jaxpr
  got = layers.einsum("ik,kj->ij", a, b, jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  # The same as widening first: products of bfloat16 values are exact in
  # float32, so only the final rounding to bfloat16 remains.
  want = (a.astype(jnp.float32) @ b.astype(jnp.float32)).astype(jnp.bfloat16)
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2**-8)
  # Accelerators keep bfloat16 results (they accumulate in float32 inside).
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  jaxpr = str(jax.make_jaxpr(lambda a, b: layers.einsum("ik,kj->ij", a, b, jnp.bfloat16))(a, b))
  assert "preferred_element_type=bfloat16" in jaxpr
  dense = layers.DenseGeneral(3, kernel_axes=("embed", "mlp"), dtype=jnp.bfloat16)
  variables = jax.eval_shape(dense.init, jax.random.key(0), a)  # a jaxpr needs no values
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert "preferred_element_type=float32" in str(jax.make_jaxpr(dense.apply)(variables, a))
