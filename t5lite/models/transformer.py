"""T5.1.1 networks: Encoder, Decoder, EncoderDecoder and DecoderOnly.

Parameter tree (unscanned; `layers_{i}` becomes one `layers` subtree with a
leading LAYERS axis when `scan_layers=True`):

  token_embedder/embedding                       [vocab, embed], shared
  encoder/relpos_bias/rel_embedding              [heads, relpos_buckets]
  encoder/layers_{i}/pre_attention_layer_norm/scale
  encoder/layers_{i}/attention/{query,key,value,out}/kernel
  encoder/layers_{i}/pre_mlp_layer_norm/scale
  encoder/layers_{i}/mlp/{wi_0,wi_1,wo}/kernel   wi_* [embed, mlp], wo [mlp, embed]
  encoder/encoder_norm/scale
  decoder/relpos_bias/rel_embedding
  decoder/layers_{i}/pre_self_attention_layer_norm, self_attention,
      pre_cross_attention_layer_norm, encoder_decoder_attention (not in
      DecoderOnly), pre_mlp_layer_norm, mlp
  decoder/decoder_norm/scale
  decoder/logits_dense/kernel                    [embed, vocab], if untied

With `relpos_per_layer=True` (T5X scalable_t5) no stack has a `relpos_bias`;
every layer has its own, `{encoder,decoder}/layers_{i}/relpos_bias/
rel_embedding` [heads, relpos_buckets] (scanned: `layers/relpos_bias/...`
[layers, heads, relpos_buckets], or `layers/layers_{j}/relpos_bias/...` in a
scanned MoE stack).

Mixture-of-Experts (`num_experts > 0`): in every `moe_layer_interval`-th
layer, counting from 1 (layers_{N-1}, layers_{2N-1}, ... of each stack, as in
ST-MoE), `mlp` is replaced by `moe` (see `moe.MoeLayer`):

  .../layers_{i}/moe/router/kernel               [embed, experts]
  .../layers_{i}/moe/{wi_0,wi_1}                 [expert, embed, expert_mlp]
  .../layers_{i}/moe/wo                          [expert, expert_mlp, embed]

Variants are configuration, not forks. `mlp_activations` gives one input
kernel per activation, their activated outputs multiplied elementwise: the
default ('gelu', 'linear') is T5.1.1's gated GELU above; a single activation
names its kernel `wi` (`mlp/wi/kernel`, `moe/wi`), as T5X and Hugging Face
do. T5 v1.0 is `mlp_activations=('relu',)`. Switch Transformers (Hugging
Face) is ReLU experts, `num_selected_experts=1`, `moe_layer_interval=2`, a
fixed `expert_capacity` per sequence (`group_size=None`) and
`renormalize_router_weights=False`.

Scanned MoE stacks scan over blocks of `moe_layer_interval` layers whose last
layer is sparse: `layers/layers_{j}` for j < interval, each with a leading
LAYERS axis of `num_layers / interval` blocks.

T5 uses relative position biases only, so the `*_positions` inputs of
seqio's packed features are accepted and ignored: within a packed segment the
difference of two indices equals the difference of their positions.

Cached decoding (see `t5lite.decoding`) uses two more entry points per
network: a prefill (`EncoderDecoder.decode` / `DecoderOnly.__call__` with
`cache_length`), which is the teacher-forced pass that also stores every
attention's keys and values in the 'cache' collection, and `decode_step`,
which feeds one token per example at its own position. Cache leaves are
`[batch, length, heads, kv]`, or `[batch, layers or blocks, length, heads,
kv]` under `scan_layers`: the batch stays the leading axis so that a decoder
can repeat or reorder examples (beams) without knowing the layout.

MoE layers route tokens in groups whose capacity depends on the group's
token count, so a cached decode can route differently from a full forward
pass: a step routes only the current token of each example, a full pass the
whole sequence (padding included). The two agree exactly only when no token
is dropped: dropless (`eval_capacity_factor <= 0`) or a generous capacity
(an `expert_capacity` of at least the sequence length).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite import axis_names as ax
from t5lite.errors import UserError
from t5lite.models import layers, moe


Array = jax.Array

_DTYPES = ("float32", "bfloat16", "float16")
# What each layer keeps for the backward pass (see TransformerConfig.remat_policy).
REMAT_POLICIES = ("none", "full", "dots_saveable")
# Scanned cache leaves stack layers on axis 1 so the batch stays leading.
_CACHE_SCAN_AXIS = 1


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes and options of a T5.1.1-style transformer.

  Attributes:
    vocab_size: number of token ids (embedding rows and logits).
    emb_dim: model width d_model.
    num_heads: attention heads.
    num_encoder_layers: encoder depth (unused by DecoderOnly).
    num_decoder_layers: decoder depth.
    head_dim: per-head width d_kv.
    mlp_dim: MLP hidden width d_ff.
    dropout_rate: dropout after embeddings, on attention weights, in the MLP
      and on every residual branch.
    dtype: activation/compute dtype name; parameters are always float32.
    logits_via_embedding: tie the output layer to the token embedding.
    mlp_activations: activation of each MLP input projection (dense and
      expert MLPs alike), multiplied elementwise: ('gelu', 'linear') is
      T5.1.1's gated GELU (kernels `wi_0`, `wi_1`), ('relu',) T5 v1.0's and
      Switch Transformers' MLP (one kernel, `wi`). Names: 'gelu' (tanh
      approximation, Hugging Face 'gelu_new'), 'gelu_exact' (erf), 'relu',
      'silu', 'linear' (identity). A list (from gin) is stored as a tuple.
    relative_attention_num_buckets: relative-position buckets.
    relative_attention_max_distance: distance sharing the last bucket.
    relpos_per_layer: give every self-attention layer its own
      relative-position table (`layers_{i}/relpos_bias`), as T5X's
      scalable_t5 does, instead of one table per stack shared by all its
      layers (`relpos_bias`, T5 and Hugging Face).
    float32_attention_logits: compute attention softmax in float32.
    scan_layers: stack layers with `nn.scan` (one compiled layer body,
      params gain a leading LAYERS axis).
    num_experts: experts per MoE layer; 0 builds a dense model and ignores
      every field below.
    num_selected_experts: k of top-k routing (1 is Switch, 2 is ST-MoE).
    moe_layer_interval: every this-many-th layer, counting from 1, has an MoE
      MLP (2: layers 1, 3, 5, ... zero-based; 1: every layer). With
      `scan_layers` it must divide the encoder and decoder depths.
    train_capacity_factor: expert capacity factor in training; <= 0 is
      dropless.
    eval_capacity_factor: expert capacity factor without dropout (eval);
      <= 0 is dropless.
    min_expert_capacity: smallest per-group expert capacity.
    group_size: largest routing group in tokens; None routes each example as
      its own group.
    router_jitter_noise: multiplicative uniform noise on router inputs in
      training (0 disables).
    expert_mlp_dim: hidden width of each expert; None uses `mlp_dim`.
    batch_prioritized_routing: when experts overflow, keep the tokens the
      router is most confident about instead of the earliest ones.
    expert_capacity: fixed slots per expert per routing group (>= 1),
      clamped to the group's tokens; overrides the capacity factors and
      `min_expert_capacity`. With `group_size=None` it counts per sequence,
      like Hugging Face `SwitchTransformersConfig.expert_capacity`. None
      derives the capacity from the factors.
    renormalize_router_weights: weight each chosen expert's output by its
      router probability divided by the sum over the k chosen experts (top-1
      then gets weight 1.0). False (the default, T5X and Switch) uses the raw
      softmax probability: top-1 output is `p * expert(x)`.
    load_balancing_choices: which of a token's k choices the MoE
      load-balancing loss counts: 'all' (the default, T5X/flaxformer and
      MaxText; a balanced router gives k) or 'first' (GShard; a balanced
      router gives 1). See `moe.load_balancing_loss`.
    remat_policy: what each layer keeps for the backward pass: 'none' keeps
      every activation, 'full' only the layer's inputs and recomputes the
      rest, 'dots_saveable' keeps the matmul outputs and recomputes the
      elementwise work. Changes memory and speed, never the results.
    attention_impl: 'dot_product_attention' computes attention with
      `jax.nn.dot_product_attention` where that selects cuDNN flash attention
      (a GPU, and shapes and dtype that allow it) and with t5lite's own
      einsums and float32 logits elsewhere, which are faster than jax's XLA
      implementation; 'xla' uses the einsums always. Training with attention
      dropout (dropout_rate > 0) always uses the einsums, which support it
      (see `layers.MultiHeadDotProductAttention`).
  """

  vocab_size: int
  emb_dim: int
  num_heads: int
  num_encoder_layers: int
  num_decoder_layers: int
  head_dim: int
  mlp_dim: int
  dropout_rate: float = 0.1
  dtype: str = "float32"
  logits_via_embedding: bool = False
  mlp_activations: tuple[str, ...] = ("gelu", "linear")
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  relpos_per_layer: bool = False
  float32_attention_logits: bool = True
  scan_layers: bool = False
  num_experts: int = 0
  num_selected_experts: int = 2
  moe_layer_interval: int = 2
  train_capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  min_expert_capacity: int = 4
  group_size: int | None = None
  router_jitter_noise: float = 0.0
  expert_mlp_dim: int | None = None
  batch_prioritized_routing: bool = False
  expert_capacity: int | None = None
  renormalize_router_weights: bool = False
  load_balancing_choices: str = "all"
  remat_policy: str = "none"
  attention_impl: str = "dot_product_attention"

  def __post_init__(self):
    positive = ("vocab_size", "emb_dim", "num_heads", "num_decoder_layers",
                "head_dim", "mlp_dim", "relative_attention_num_buckets",
                "relative_attention_max_distance")
    for name in positive:
      if getattr(self, name) < 1:
        raise UserError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
    if self.num_encoder_layers < 0:
      raise UserError(
          f"TransformerConfig.num_encoder_layers must be >= 0, got {self.num_encoder_layers}.")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise UserError(
          f"TransformerConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}.")
    # Frozen, so set through object; a tuple keeps the config hashable.
    object.__setattr__(self, "mlp_activations", layers.validate_mlp_activations(
        self.mlp_activations, "TransformerConfig.mlp_activations"))
    if self.dtype not in _DTYPES:
      raise UserError(f"TransformerConfig.dtype {self.dtype!r} is not supported; "
                      f"use one of {_DTYPES}.")
    if self.remat_policy not in REMAT_POLICIES:
      raise UserError(f"TransformerConfig.remat_policy {self.remat_policy!r} is not "
                      f"supported; use one of {REMAT_POLICIES}.")
    if self.attention_impl not in layers.ATTENTION_IMPLS:
      raise UserError(f"TransformerConfig.attention_impl {self.attention_impl!r} is not "
                      f"supported; use one of {layers.ATTENTION_IMPLS}.")
    if self.num_experts < 0:
      raise UserError("TransformerConfig.num_experts must be >= 0 (0 is dense), got "
                      f"{self.num_experts}.")
    if self.num_experts:
      self._validate_moe()

  def _validate_moe(self) -> None:
    """Checks the MoE fields; only called for MoE models."""
    if not 1 <= self.num_selected_experts <= self.num_experts:
      raise UserError(
          "TransformerConfig.num_selected_experts must be in [1, num_experts="
          f"{self.num_experts}], got {self.num_selected_experts}.")
    at_least_one = ("moe_layer_interval", "min_expert_capacity")
    for name in at_least_one:
      if getattr(self, name) < 1:
        raise UserError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
    for name in ("group_size", "expert_mlp_dim", "expert_capacity"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise UserError(
            f"TransformerConfig.{name} must be >= 1 or None, got {getattr(self, name)}.")
    if not 0.0 <= self.router_jitter_noise < 1.0:
      raise UserError("TransformerConfig.router_jitter_noise must be in [0, 1), got "
                       f"{self.router_jitter_noise}.")
    moe.validate_load_balancing_choices(self.load_balancing_choices, "TransformerConfig")
    depths = {"num_encoder_layers": self.num_encoder_layers,
              "num_decoder_layers": self.num_decoder_layers}
    for name, depth in depths.items():
      if self.scan_layers and depth % self.moe_layer_interval:
        raise UserError(
            f"scan_layers=True scans blocks of moe_layer_interval={self.moe_layer_interval} "
            f"layers, which must divide {name}={depth}; change one of them or set "
            "scan_layers=False.")

  def is_moe_layer(self, index: int) -> bool:
    """Whether zero-based layer `index` of a stack has an MoE MLP."""
    return self.num_experts > 0 and (index + 1) % self.moe_layer_interval == 0

  @property
  def compute_dtype(self) -> jnp.dtype:
    """The activation dtype as a numpy dtype."""
    return jnp.dtype(self.dtype)


def _dropout(cfg: TransformerConfig, x: Array, deterministic: bool) -> Array:
  """Dropout as a child of whichever module is being called."""
  return nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)


def _attention(cfg: TransformerConfig, name: str) -> layers.MultiHeadDotProductAttention:
  return layers.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads, head_dim=cfg.head_dim, dtype=cfg.compute_dtype,
      dropout_rate=cfg.dropout_rate, float32_logits=cfg.float32_attention_logits,
      attention_impl=cfg.attention_impl, name=name)


def _moe(cfg: TransformerConfig) -> moe.MoeLayer:
  return moe.MoeLayer(
      num_experts=cfg.num_experts, num_selected_experts=cfg.num_selected_experts,
      expert_mlp_dim=cfg.expert_mlp_dim or cfg.mlp_dim,
      train_capacity_factor=cfg.train_capacity_factor,
      eval_capacity_factor=cfg.eval_capacity_factor,
      min_expert_capacity=cfg.min_expert_capacity, group_size=cfg.group_size,
      router_jitter_noise=cfg.router_jitter_noise,
      batch_prioritized_routing=cfg.batch_prioritized_routing, dtype=cfg.compute_dtype,
      dropout_rate=cfg.dropout_rate, activations=cfg.mlp_activations,
      expert_capacity=cfg.expert_capacity,
      renormalize_router_weights=cfg.renormalize_router_weights,
      load_balancing_choices=cfg.load_balancing_choices, name="moe")


def _relpos_bias(cfg: TransformerConfig, in_layer: bool, q_length: int, bidirectional: bool,
                 cache: layers.DecodeCache | None = None) -> Array | None:
  """The self-attention relative-position bias, if the caller owns the table.

  The one place that decides where the table lives: in the stack, one shared
  by all its layers (T5, Hugging Face), or with `cfg.relpos_per_layer` in
  every layer (T5X scalable_t5). Stacks and layers both ask; whichever owns
  it creates the `relpos_bias` child, so it must be called inside a compact
  method. Cross-attention never has a bias.

  Args:
    cfg: model config.
    in_layer: whether the caller is a layer (True) or a stack (False).
    q_length: query positions of this call (1 in a cached step).
    bidirectional: encoder buckets (True) or causal decoder ones (False).
    cache: None, a prefill or a step (see `layers.DecodeCache`); a step gets
      only the rows of its positions, over the whole cache.

  Returns:
    None if the caller does not own the table; else the bias `[1, heads,
    q_length, q_length]`, in a cached step `[batch, heads, q_length,
    cache.length]`.
  """
  if cfg.relpos_per_layer != in_layer:
    return None
  relpos = layers.RelativePositionBiases(
      num_buckets=cfg.relative_attention_num_buckets,
      max_distance=cfg.relative_attention_max_distance, num_heads=cfg.num_heads,
      dtype=cfg.compute_dtype, name="relpos_bias")
  if cache is not None and cache.is_step:
    return relpos(q_length, cache.length, bidirectional=bidirectional, q_offset=cache.position)
  return relpos(q_length, q_length, bidirectional=bidirectional)


def _mlp_residual(cfg: TransformerConfig, x: Array, deterministic: bool,
                  use_moe: bool = False) -> Array:
  """Pre-norm MLP (dense or MoE) with a residual connection."""
  y = layers.RMSNorm(dtype=cfg.compute_dtype, name="pre_mlp_layer_norm")(x)
  if use_moe:
    y = _moe(cfg)(y, deterministic)
  else:
    y = layers.MlpBlock(mlp_dim=cfg.mlp_dim, dtype=cfg.compute_dtype,
                        dropout_rate=cfg.dropout_rate, activations=cfg.mlp_activations,
                        name="mlp")(y, deterministic)
  x = x + _dropout(cfg, y, deterministic)
  return nn.with_logical_constraint(x, (ax.BATCH, ax.LENGTH, ax.EMBED))


class EncoderLayer(nn.Module):
  """Pre-norm self-attention and MLP block of the encoder.

  Attributes:
    config: model sizes.
    scanned: return `(x, None)` as `nn.scan` expects of a carry function.
    use_moe: replace the MLP with an MoE layer.
  """

  config: TransformerConfig
  scanned: bool = False
  use_moe: bool = False

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, bias: Array | None,
               deterministic: bool) -> Array | tuple[Array, None]:
    """Applies the layer.

    Args:
      x: `[batch, length, embed]`.
      mask: boolean `[batch, 1, length, length]`.
      bias: the stack's relative-position bias `[1, heads, length, length]`,
        or None when the layer has its own (`relpos_per_layer`).
      deterministic: disables dropout.

    Returns:
      `[batch, length, embed]` (paired with None when scanned).
    """
    cfg = self.config
    own = _relpos_bias(cfg, True, x.shape[1], bidirectional=True)
    bias = bias if own is None else own
    y = layers.RMSNorm(dtype=cfg.compute_dtype, name="pre_attention_layer_norm")(x)
    y = _attention(cfg, "attention")(y, y, mask, bias, deterministic)
    x = x + _dropout(cfg, y, deterministic)
    x = _mlp_residual(cfg, x, deterministic, self.use_moe)
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention, optional cross-attention, and MLP.

  Attributes:
    config: model sizes.
    scanned: return `(x, None)` as `nn.scan` expects of a carry function.
    use_moe: replace the MLP with an MoE layer.
  """

  config: TransformerConfig
  scanned: bool = False
  use_moe: bool = False

  @nn.compact
  def __call__(self, x: Array, encoded: Array | None, self_mask: Array,
               cross_mask: Array | None, bias: Array | None, deterministic: bool,
               cache: layers.DecodeCache | None = None) -> Array | tuple[Array, None]:
    """Applies the layer.

    Args:
      x: `[batch, length, embed]` decoder activations.
      encoded: `[batch, encoder_length, embed]`, or None for a decoder-only
        network (no cross-attention sub-layer is created) and in cached
        steps, whose cross-attention reads the keys and values of the
        prefill.
      self_mask: boolean `[batch, 1, length, length]`; in a cached step
        `[batch, 1, 1, cache_length]`.
      cross_mask: boolean `[batch, 1, length, encoder_length]` or None. In a
        cached step, given iff the network has cross-attention.
      bias: the stack's relative-position bias `[1, heads, length, length]`;
        in a cached step `[batch, heads, 1, cache_length]`. None when the
        layer has its own (`relpos_per_layer`).
      deterministic: disables dropout.
      cache: None, a prefill or a step (see `layers.DecodeCache`).

    Returns:
      `[batch, length, embed]` (paired with None when scanned).
    """
    cfg = self.config
    own = _relpos_bias(cfg, True, x.shape[1], bidirectional=False, cache=cache)
    bias = bias if own is None else own
    y = layers.RMSNorm(dtype=cfg.compute_dtype, name="pre_self_attention_layer_norm")(x)
    y = _attention(cfg, "self_attention")(y, y, self_mask, bias, deterministic, cache)
    x = x + _dropout(cfg, y, deterministic)
    in_step = cache is not None and cache.is_step
    if encoded is not None or (in_step and cross_mask is not None):
      cross_cache = cache
      if cache is not None and not in_step:
        cross_cache = layers.DecodeCache(length=encoded.shape[1])
      y = layers.RMSNorm(dtype=cfg.compute_dtype, name="pre_cross_attention_layer_norm")(x)
      y = _attention(cfg, "encoder_decoder_attention")(y, encoded, cross_mask, None,
                                                       deterministic, cross_cache)
      x = x + _dropout(cfg, y, deterministic)
    x = _mlp_residual(cfg, x, deterministic, self.use_moe)
    return (x, None) if self.scanned else x


def _layer_stack(layer_cls: type[nn.Module], cfg: TransformerConfig, num_layers: int,
                 x: Array, *shared_args) -> Array:
  """Applies `num_layers` layers, as a Python loop or one `nn.scan`.

  Must be called inside a compact method: the layers become children of the
  calling module, named `layers_{i}` or, scanned, `layers`.

  Args:
    layer_cls: EncoderLayer or DecoderLayer.
    cfg: model config; `cfg.scan_layers` picks the layout.
    num_layers: depth.
    x: `[batch, length, embed]` input of the first layer.
    *shared_args: the same for every layer (masks, biases, flags).

  Returns:
    `[batch, length, embed]` output of the last layer.
  """
  layer_cls = _remat(layer_cls, cfg, shared_args)
  if not cfg.scan_layers:
    for i in range(num_layers):
      x = layer_cls(config=cfg, use_moe=cfg.is_moe_layer(i), name=f"layers_{i}")(
          x, *shared_args)
    return x
  if cfg.num_experts:
    return _scan_moe_blocks(layer_cls, cfg, num_layers, x, *shared_args)
  scanned_cls = nn.scan(
      layer_cls,
      variable_axes={"params": 0, "cache": _CACHE_SCAN_AXIS},
      split_rngs={"params": True, "dropout": True},
      in_axes=(nn.broadcast,) * len(shared_args),
      length=num_layers,
      metadata_params={nn.PARTITION_NAME: ax.LAYERS})
  x, _ = scanned_cls(config=cfg, scanned=True, name="layers")(x, *shared_args)
  return x


def _remat(layer_cls: type[nn.Module], cfg: TransformerConfig,
           shared_args: tuple) -> type[nn.Module]:
  """`layer_cls` under `nn.remat` with the config's policy, or unchanged.

  Cached decoding has no backward pass, so it is never rematerialised. The
  non-array arguments (flags, an absent encoder output) are static; the
  layer's arguments are (self, x, *shared_args).
  """
  if cfg.remat_policy == "none" or any(isinstance(a, layers.DecodeCache) for a in shared_args):
    return layer_cls
  policy = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}
  static = tuple(2 + i for i, a in enumerate(shared_args) if not isinstance(a, jax.Array))
  # Common-subexpression protection only matters outside a scan, whose loop
  # already keeps XLA from merging the recomputation into the forward pass.
  return nn.remat(layer_cls, policy=policy[cfg.remat_policy], static_argnums=static,
                  prevent_cse=not cfg.scan_layers)


class _MoeBlock(nn.Module):
  """`moe_layer_interval` layers whose last one is sparse: the unit that a
  scanned MoE stack repeats, since dense and MoE layers differ in params.

  Attributes:
    layer_cls: EncoderLayer or DecoderLayer.
    config: model sizes.
  """

  layer_cls: type[nn.Module]
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, *shared_args) -> tuple[Array, None]:
    interval = self.config.moe_layer_interval
    for j in range(interval):
      x = self.layer_cls(config=self.config, use_moe=j == interval - 1,
                         name=f"layers_{j}")(x, *shared_args)
    return x, None


def _scan_moe_blocks(layer_cls: type[nn.Module], cfg: TransformerConfig, num_layers: int,
                     x: Array, *shared_args) -> Array:
  """`nn.scan` over `num_layers / moe_layer_interval` blocks of layers.

  The MoE layers' sown statistics gain a leading blocks axis, like params.
  """
  scanned_cls = nn.scan(
      _MoeBlock,
      variable_axes={"params": 0, "intermediates": 0, "cache": _CACHE_SCAN_AXIS},
      split_rngs={"params": True, "dropout": True},
      in_axes=(nn.broadcast,) * len(shared_args),
      length=num_layers // cfg.moe_layer_interval,
      metadata_params={nn.PARTITION_NAME: ax.LAYERS})
  x, _ = scanned_cls(layer_cls=layer_cls, config=cfg, name="layers")(x, *shared_args)
  return x


class Encoder(nn.Module):
  """Embeds and encodes input tokens.

  Attributes:
    config: model sizes.
    shared_embedding: the token Embed owned by the parent network.
  """

  config: TransformerConfig
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, encoder_mask: Array | None,
               deterministic: bool) -> Array:
    """Encodes tokens.

    Args:
      encoder_input_tokens: `[batch, length]` ids.
      encoder_mask: boolean `[batch, 1, length, length]`.
      deterministic: disables dropout.

    Returns:
      `[batch, length, embed]` in the compute dtype.
    """
    cfg = self.config
    length = encoder_input_tokens.shape[-1]
    x = self.shared_embedding(encoder_input_tokens).astype(cfg.compute_dtype)
    x = _dropout(cfg, x, deterministic)
    # One bias for all layers, computed once, as in T5; None if per layer.
    bias = _relpos_bias(cfg, False, length, bidirectional=True)
    x = _layer_stack(EncoderLayer, cfg, cfg.num_encoder_layers, x, encoder_mask, bias,
                     deterministic)
    x = layers.RMSNorm(dtype=cfg.compute_dtype, name="encoder_norm")(x)
    return _dropout(cfg, x, deterministic)


class Decoder(nn.Module):
  """Embeds decoder inputs, runs the decoder stack, and returns logits.

  Attributes:
    config: model sizes.
    shared_embedding: the token Embed owned by the parent network.
  """

  config: TransformerConfig
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded: Array | None, decoder_input_tokens: Array,
               self_mask: Array, cross_mask: Array | None,
               deterministic: bool, cache: layers.DecodeCache | None = None) -> Array:
    """Decodes with teacher forcing, or one cached step.

    Args:
      encoded: `[batch, encoder_length, embed]`, or None for decoder-only
        and for cached steps.
      decoder_input_tokens: `[batch, length]` ids (length 1 in a step).
      self_mask: boolean `[batch, 1, length, length]`, in a step
        `[batch, 1, 1, cache.length]`.
      cross_mask: boolean `[batch, 1, length, encoder_length]` or None.
      deterministic: disables dropout.
      cache: None, a prefill or a step (see `layers.DecodeCache`).

    Returns:
      float32 logits `[batch, length, vocab]`.
    """
    cfg = self.config
    length = decoder_input_tokens.shape[-1]
    x = self.shared_embedding(decoder_input_tokens).astype(cfg.compute_dtype)
    x = _dropout(cfg, x, deterministic)
    bias = _relpos_bias(cfg, False, length, bidirectional=False, cache=cache)
    x = _layer_stack(DecoderLayer, cfg, cfg.num_decoder_layers, x, encoded, self_mask,
                     cross_mask, bias, deterministic, cache)
    x = layers.RMSNorm(dtype=cfg.compute_dtype, name="decoder_norm")(x)
    x = _dropout(cfg, x, deterministic)
    return self._logits(x)

  def _logits(self, x: Array) -> Array:
    """Projects `[batch, length, embed]` to float32 `[batch, length, vocab]`,
    in float32 whatever the activation dtype (as T5X does, for stability)."""
    cfg = self.config
    if cfg.logits_via_embedding:
      # The table is initialised with stddev 1, so tied logits are rescaled
      # to keep their scale independent of the width, as in T5.
      logits = self.shared_embedding.attend(x) / math.sqrt(cfg.emb_dim)
    else:
      logits = layers.DenseGeneral(cfg.vocab_size, kernel_axes=(ax.EMBED, ax.VOCAB),
                                   dtype=jnp.float32, name="logits_dense")(x)
    return nn.with_logical_constraint(logits, (ax.BATCH, ax.LENGTH, ax.VOCAB))


def forward_flops(cfg: TransformerConfig, batch_size: int, decoder_length: int,
                  encoder_length: int = 0) -> dict[str, float]:
  """Model FLOPs of one teacher-forced forward pass, by component.

  Counts the matrix multiplications the model needs, at 2 FLOPs per
  multiply-add, as in the usual model-FLOPs-utilisation definition:

    attention_projections  q, k, v, out of every attention: 8 * d * H per
                           token, except that cross-attention projects its
                           queries and outputs per decoder token (4 * d * H)
                           and its keys and values per encoder token (4 * d * H)
    attention_scores       QK^T and AV: 4 * q_length * kv_length * H per
                           example, for encoder self-, decoder self- and
                           cross-attention; causal attention is counted over
                           the whole square, which is what is computed
    mlp                    dense MLP layers: 2 * (a + 1) * d * f per token
                           (6 * d * f for gated GELU, 4 * d * f for ReLU)
    moe_experts            only the k selected experts: k * 2 * (a + 1) * d * f_e
                           per token (not the capacity slots actually computed)
    moe_router             2 * d * E per token
    logits                 2 * d * V per decoder token

  with d = emb_dim, H = num_heads * head_dim, f = mlp_dim, a =
  len(mlp_activations) input projections, f_e =
  expert_mlp_dim (or mlp_dim), E = num_experts, k = num_selected_experts and
  V = vocab_size. Embedding lookups, relative-position biases, norms,
  softmaxes, the loss and MoE dispatch/combine are not model FLOPs. A
  training step costs 3 times the forward pass (the backward pass computes
  two products for each one of the forward).

  Args:
    cfg: the network config.
    batch_size: examples per step.
    decoder_length: decoder (target) positions per example.
    encoder_length: encoder positions per example; 0 for a decoder-only
      network, which has neither an encoder nor cross-attention.

  Returns:
    FLOPs per component and their 'total', for the whole batch.
  """
  d, v = cfg.emb_dim, cfg.vocab_size
  inner = cfg.num_heads * cfg.head_dim
  flops = dict.fromkeys(("attention_projections", "attention_scores", "mlp", "moe_experts",
                         "moe_router", "logits"), 0.0)

  # FLOPs per token and hidden unit: a multiply-add in each input projection and wo.
  mlp_matmuls = 2 * (len(cfg.mlp_activations) + 1) * d

  def add_mlp(index: int, tokens: int) -> None:
    if cfg.is_moe_layer(index):
      expert_mlp = cfg.expert_mlp_dim or cfg.mlp_dim
      flops["moe_experts"] += tokens * cfg.num_selected_experts * mlp_matmuls * expert_mlp
      flops["moe_router"] += tokens * 2 * d * cfg.num_experts
    else:
      flops["mlp"] += tokens * mlp_matmuls * cfg.mlp_dim

  enc, dec = encoder_length, decoder_length
  if enc:
    for i in range(cfg.num_encoder_layers):
      flops["attention_projections"] += enc * 8 * d * inner
      flops["attention_scores"] += 4 * enc * enc * inner
      add_mlp(i, enc)
  for i in range(cfg.num_decoder_layers):
    flops["attention_projections"] += dec * 8 * d * inner
    flops["attention_scores"] += 4 * dec * dec * inner
    if enc:
      flops["attention_projections"] += (dec + enc) * 4 * d * inner
      flops["attention_scores"] += 4 * dec * enc * inner
    add_mlp(i, dec)
  flops["logits"] += dec * 2 * d * v
  flops = {name: float(batch_size * value) for name, value in flops.items()}
  flops["total"] = sum(flops.values())
  return flops


def _embedder(cfg: TransformerConfig) -> layers.Embed:
  return layers.Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                      dtype=cfg.compute_dtype, name="token_embedder")


class EncoderDecoder(nn.Module):
  """T5 encoder-decoder network.

  `encode` and `decode` are separately applicable (`method=`), which is the
  seam for cached autoregressive decoding.

  Attributes:
    config: model sizes.
  """

  config: TransformerConfig

  def setup(self):
    self.token_embedder = _embedder(self.config)
    self.encoder = Encoder(self.config, self.token_embedder)
    self.decoder = Decoder(self.config, self.token_embedder)

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids: Array | None = None,
             encoder_positions: Array | None = None, enable_dropout: bool = True) -> Array:
    """Encodes inputs.

    Args:
      encoder_input_tokens: `[batch, encoder_length]` ids, 0 is padding.
      encoder_segment_ids: `[batch, encoder_length]` packing ids, or None.
      encoder_positions: ignored (relative positions only).
      enable_dropout: apply dropout (needs a 'dropout' rng).

    Returns:
      `[batch, encoder_length, embed]`.
    """
    del encoder_positions
    mask = layers.padding_mask(encoder_input_tokens, encoder_input_tokens)
    if encoder_segment_ids is not None:
      mask = layers.combine_masks(
          mask, layers.segment_mask(encoder_segment_ids, encoder_segment_ids))
    return self.encoder(encoder_input_tokens, mask, deterministic=not enable_dropout)

  def decode(self, encoded: Array, encoder_input_tokens: Array,
             decoder_input_tokens: Array, decoder_target_tokens: Array,
             encoder_segment_ids: Array | None = None,
             decoder_segment_ids: Array | None = None,
             decoder_positions: Array | None = None,
             enable_dropout: bool = True, cache_length: int | None = None) -> Array:
    """Decodes with teacher forcing given the encoder output.

    Args:
      encoded: `[batch, encoder_length, embed]` from `encode`.
      encoder_input_tokens: `[batch, encoder_length]`, for the padding mask.
      decoder_input_tokens: `[batch, length]` shifted targets.
      decoder_target_tokens: `[batch, length]`, for the padding mask.
      encoder_segment_ids: packing ids of the inputs, or None.
      decoder_segment_ids: packing ids of the targets, or None.
      decoder_positions: ignored (relative positions only).
      enable_dropout: apply dropout (needs a 'dropout' rng).
      cache_length: if set, a prefill: also stores the keys and values of
        the `length` decoder positions in a self-attention cache of this
        many positions, and the encoder's for cross-attention (needs
        `mutable=['cache']`).

    Returns:
      float32 logits `[batch, length, vocab]`.

    Raises:
      ValueError: if only one of the two segment-id arrays is given.
    """
    del decoder_positions
    if (encoder_segment_ids is None) != (decoder_segment_ids is None):
      raise UserError("Packed inputs need both encoder_segment_ids and "
                      "decoder_segment_ids, or neither; got only one.")
    self_mask = layers.decoder_self_mask(decoder_target_tokens, decoder_segment_ids)
    cross_mask = layers.padding_mask(decoder_target_tokens, encoder_input_tokens)
    if encoder_segment_ids is not None:
      cross_mask = layers.combine_masks(
          cross_mask, layers.segment_mask(decoder_segment_ids, encoder_segment_ids))
    cache = None if cache_length is None else layers.DecodeCache(cache_length)
    return self.decoder(encoded, decoder_input_tokens, self_mask, cross_mask,
                        deterministic=not enable_dropout, cache=cache)

  def decode_step(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
                  decode_position: Array, cache_length: int) -> Array:
    """One cached decoding step, after a prefill with `decode(cache_length=...)`.

    Args:
      encoder_input_tokens: `[batch, encoder_length]`, for the padding mask.
      decoder_input_tokens: `[batch, 1]`, the token at each example's position.
      decode_position: int32 `[batch]`, where each token sits in the sequence.
      cache_length: the prefill's `cache_length`.

    Returns:
      float32 logits `[batch, 1, vocab]` for the next position.
    """
    cache = layers.DecodeCache(cache_length, decode_position)
    self_mask = layers.decode_step_mask(decode_position, cache_length)
    cross_mask = layers.padding_mask(jnp.ones_like(decoder_input_tokens), encoder_input_tokens)
    return self.decoder(None, decoder_input_tokens, self_mask, cross_mask,
                        deterministic=True, cache=cache)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array, encoder_segment_ids: Array | None = None,
               decoder_segment_ids: Array | None = None,
               encoder_positions: Array | None = None,
               decoder_positions: Array | None = None,
               enable_dropout: bool = True) -> Array:
    """Teacher-forced logits; arguments as in `encode` and `decode`.

    Returns:
      float32 logits `[batch, target_length, vocab]`.
    """
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                          enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                       decoder_positions, enable_dropout)


class DecoderOnly(nn.Module):
  """Decoder-only language model, optionally prefix-LM.

  Attributes:
    config: model sizes (`num_encoder_layers` is unused).
  """

  config: TransformerConfig

  def setup(self):
    self.token_embedder = _embedder(self.config)
    self.decoder = Decoder(self.config, self.token_embedder)

  def __call__(self, decoder_input_tokens: Array, decoder_target_tokens: Array,
               decoder_segment_ids: Array | None = None,
               decoder_positions: Array | None = None,
               decoder_causal_attention: Array | None = None,
               enable_dropout: bool = True, cache_length: int | None = None) -> Array:
    """Teacher-forced logits.

    Args:
      decoder_input_tokens: `[batch, length]` shifted targets.
      decoder_target_tokens: `[batch, length]`, 0 is padding.
      decoder_segment_ids: `[batch, length]` packing ids, or None.
      decoder_positions: ignored (relative positions only).
      decoder_causal_attention: `[batch, length]`, 1 on prefix positions,
        which attend to each other bidirectionally (seqio PrefixLM feature).
      enable_dropout: apply dropout (needs a 'dropout' rng).
      cache_length: if set, a prefill: also stores the keys and values of
        the `length` positions in a cache of this many positions (needs
        `mutable=['cache']`).

    Returns:
      float32 logits `[batch, length, vocab]`.
    """
    del decoder_positions
    mask = layers.decoder_self_mask(decoder_target_tokens, decoder_segment_ids,
                                    decoder_causal_attention)
    cache = None if cache_length is None else layers.DecodeCache(cache_length)
    return self.decoder(None, decoder_input_tokens, mask, None,
                        deterministic=not enable_dropout, cache=cache)

  def decode_step(self, decoder_input_tokens: Array, decode_position: Array,
                  cache_length: int) -> Array:
    """One cached decoding step, after a prefill with `cache_length` set.

    Args:
      decoder_input_tokens: `[batch, 1]`, the token at each example's position.
      decode_position: int32 `[batch]`, where each token sits in the sequence.
      cache_length: the prefill's `cache_length`.

    Returns:
      float32 logits `[batch, 1, vocab]` for the next position.
    """
    cache = layers.DecodeCache(cache_length, decode_position)
    self_mask = layers.decode_step_mask(decode_position, cache_length)
    return self.decoder(None, decoder_input_tokens, self_mask, None, deterministic=True,
                        cache=cache)
