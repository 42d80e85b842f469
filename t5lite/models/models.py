"""Model API: a network plus vocabularies, feature converter and loss.

A model wraps a Flax network with what the trainer needs: initial variables
(boxed with logical axes), a loss whose statistics are plain sums so that
microbatches add up, and teacher-forced logits. The optimizer is held here,
not used here, so one gin binding on the model configures training.

For evaluation it also decodes (`predict_batch`, `predict_batch_with_aux`)
with its gin-configured `decode_fn` over a key/value cache, and scores
given targets (`score_batch`). All are pure functions of arrays, ready for
`jax.jit` with sharded params.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import seqio
from flax import traverse_util

from t5lite import decoding
from t5lite.errors import UserError
from t5lite.models import layers, moe, transformer


Array = jax.Array
Batch = Mapping[str, Array]
Params = Any


def token_loss_sums(logits: Array, targets: Array, weights: Array, z_loss: float = 0.0,
                    label_smoothing: float = 0.0, loss_weights: Array | None = None
                    ) -> dict[str, Array]:
  """Weighted sums of the per-token loss terms of a batch, in float32.

  Cross-entropy uses T5X-style label smoothing: the target gets
  `1 - label_smoothing` and the rest is spread over the other ids, and the
  entropy of that soft target is subtracted so a perfect prediction scores 0.
  The z-loss is T5X's `z_loss * logsumexp(logits)**2` per token.

  Args:
    logits: `[batch, length, vocab]`.
    targets: `[batch, length]` integer ids.
    weights: `[batch, length]` token weights (0 drops a token): the counts
      and the accuracy.
    z_loss: coefficient of the `logsumexp(logits)**2` auxiliary loss.
    label_smoothing: probability mass moved off the target id.
    loss_weights: `[batch, length]` weights of the loss terms when they
      differ from `weights` (T5X's AVERAGE_PER_SEQUENCE); None uses `weights`.

  Returns:
    float32 scalars: `cross_ent_sum`, `z_loss_sum`, `correct_sum`,
    `weight_sum`, `num_examples` (examples with any nonzero weight).
  """
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  loss_weights = weights if loss_weights is None else loss_weights.astype(jnp.float32)
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab_size - 1)
  # Entropy of the soft target; the 1e-20 keeps 0 * log(0) at 0.
  normalizing_constant = -(confidence * jnp.log(confidence + 1e-20)
                           + (vocab_size - 1) * low_confidence
                           * jnp.log(low_confidence + 1e-20))
  soft_targets = jax.nn.one_hot(targets, vocab_size, dtype=jnp.float32)
  soft_targets = soft_targets * (confidence - low_confidence) + low_confidence
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [batch, length]
  log_probs = logits - log_z[..., None]  # [batch, length, vocab]
  cross_ent = -jnp.sum(soft_targets * log_probs, axis=-1) - normalizing_constant
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return {
      "cross_ent_sum": jnp.sum(loss_weights * cross_ent),
      "z_loss_sum": jnp.sum(loss_weights * z_loss * jnp.square(log_z)),
      "correct_sum": jnp.sum(weights * correct),
      "weight_sum": jnp.sum(weights),
      "num_examples": jnp.sum(jnp.any(weights != 0, axis=-1)).astype(jnp.float32),
  }


def collect_moe_metrics(intermediates: Mapping[str, Any]) -> dict[str, Array]:
  """Averages each MoE statistic over every MoE layer that sowed it.

  Args:
    intermediates: the 'intermediates' collection of an apply; scanned
      stacks contribute one value per block.

  Returns:
    `{name: float32 scalar}` for the names in `moe.METRIC_NAMES` that were
    sown; empty for a dense network.
  """
  found: dict[str, list[Array]] = {}
  for path, values in traverse_util.flatten_dict(dict(intermediates)).items():
    if path[-1] in moe.METRIC_NAMES:
      found.setdefault(path[-1], []).extend(jnp.ravel(v) for v in values)
  return {name: jnp.mean(jnp.concatenate(v)) for name, v in found.items()}


# T5X's `SpecialLossNormalizingFactor` names.
NUM_REAL_TARGET_TOKENS = "NUM_REAL_TARGET_TOKENS"
NUM_TOTAL_TARGET_TOKENS = "NUM_TOTAL_TARGET_TOKENS"
AVERAGE_PER_SEQUENCE = "AVERAGE_PER_SEQUENCE"
_SPECIAL_FACTORS = (NUM_REAL_TARGET_TOKENS, NUM_TOTAL_TARGET_TOKENS, AVERAGE_PER_SEQUENCE)


def check_loss_normalizing_factor(value: Any) -> float | str | None:
  """T5X's `loss_normalizing_factor` values, checked: None (a plain sum), a
  positive number, or one of its special names (any case).

  Raises:
    ValueError: anything else.
  """
  if value is None:
    return None
  if isinstance(value, str) and value.upper() in _SPECIAL_FACTORS:
    return value.upper()
  if not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0:
    return float(value)
  raise UserError(f"loss_normalizing_factor={value!r} must be None (sum the loss, as T5X), "
                  f"a positive number, or one of {', '.join(repr(n) for n in _SPECIAL_FACTORS)}.")


def _per_sequence_weight_sums(weights: Array, segment_ids: Array | None) -> Array:
  """Each token's sequence total of `weights` `[batch, length]`: per packed
  segment when `segment_ids` are given (padding, segment 0, sums together)."""
  if segment_ids is None:
    return jnp.sum(weights, axis=-1, keepdims=True)
  rows, length = weights.shape
  # One group per (row, segment): segment ids are below `length + 1`.
  groups = segment_ids.astype(jnp.int32) + (length + 1) * jnp.arange(rows)[:, None]
  totals = jax.ops.segment_sum(weights.ravel(), groups.ravel(),
                               num_segments=rows * (length + 1))
  return totals[groups]


def normalized_loss_weights(mode: float | str | None, batch: Batch
                            ) -> tuple[Array, Array | None]:
  """T5X's `get_loss_normalizing_factor_and_weights`, for one batch.

  Args:
    mode: a value of `check_loss_normalizing_factor`.
    batch: with `decoder_target_tokens` and optionally
      `decoder_loss_weights` (else non-zero targets weigh 1, as in T5X) and
      `decoder_segment_ids` (packed).

  Returns:
    (per-token loss weights, float32 divisor or None for a plain sum).
    AVERAGE_PER_SEQUENCE divides each token's weight by its sequence's total
    and the loss by the number of sequences so weighted.
  """
  targets = batch["decoder_target_tokens"]
  weights = batch.get("decoder_loss_weights")
  weights = (targets > 0 if weights is None else weights).astype(jnp.float32)
  if mode is None:
    return weights, None
  if mode == NUM_REAL_TARGET_TOKENS:
    return weights, jnp.sum(weights)
  if mode == NUM_TOTAL_TARGET_TOKENS:
    return weights, jnp.asarray(np.prod(targets.shape), jnp.float32)
  if mode == AVERAGE_PER_SEQUENCE:
    totals = _per_sequence_weight_sums(weights, batch.get("decoder_segment_ids"))
    weights = jnp.nan_to_num(weights / totals, nan=0.0, posinf=0.0, neginf=0.0)
    return weights, jnp.sum(weights)
  return weights, jnp.asarray(mode, jnp.float32)


def normalized_loss(logits: Array, batch: Batch, *, z_loss: float, label_smoothing: float,
                    loss_normalizing_factor: float | str | None,
                    loss_normalizer: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """T5X's training loss of `logits` on `batch` and the statistics' sums.

  Args:
    logits: `[batch, length, vocab]`.
    batch: `decoder_target_tokens`, `decoder_loss_weights` (and for
      AVERAGE_PER_SEQUENCE of packed rows `decoder_segment_ids`).
    z_loss: see `token_loss_sums`.
    label_smoothing: see `token_loss_sums`.
    loss_normalizing_factor: see `normalized_loss_weights`.
    loss_normalizer: the divisor; None computes it from `batch` (a
      microbatch is given its whole batch's).

  Returns:
    (sum of the weighted cross-entropy and z-loss over the divisor, the
    sums of `token_loss_sums`). A zero divisor (no weighted token) gives 0.
  """
  loss_weights, divisor = normalized_loss_weights(loss_normalizing_factor, batch)
  sums = token_loss_sums(logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"],
                         z_loss, label_smoothing, loss_weights)
  if loss_normalizer is None:
    loss_normalizer = jnp.ones((), jnp.float32) if divisor is None else divisor
  loss_normalizer = jnp.asarray(loss_normalizer, jnp.float32)
  # With no weighted tokens the numerator is 0 too; dividing by 1 keeps the
  # loss and its gradient finite instead of 0/0.
  safe_normalizer = jnp.where(loss_normalizer == 0, 1.0, loss_normalizer)
  return (sums["cross_ent_sum"] + sums["z_loss_sum"]) / safe_normalizer, sums


@dataclasses.dataclass(frozen=True)
class DecodeStart:
  """What a decoder starts from (see `t5lite.decoding`).

  Attributes:
    tokens_to_logits: the model step `(tokens [n], cache) -> (logits [n,
      vocab], cache)`.
    initial_cache: its state, every leaf `[batch, ...]`.
    first_tokens: int32 `[batch]`, the token fed at the first step.
  """

  tokens_to_logits: decoding.TokensToLogits
  initial_cache: Any
  first_tokens: Array


def _logits_at(logits: Array, position: Array) -> Array:
  """`[n, length, vocab]` logits at one position per row -> `[n, vocab]`."""
  return jnp.take_along_axis(logits, position[:, None, None], axis=1)[:, 0]


class BaseModel(abc.ABC):
  """A network with its vocabularies, feature converter, optimizer and loss.

  Attributes:
    FEATURE_CONVERTER_CLS: seqio feature converter producing the batch keys
      this model reads in training.
    INFERENCE_FEATURE_CONVERTER_CLS: seqio feature converter producing the
      batches `predict_batch` and `score_batch` read.
    module: the Flax network.
    input_vocabulary: vocabulary of the inputs.
    output_vocabulary: vocabulary of the targets.
    optimizer: the learner the trainer uses; never called here.
    aux_loss_factor: weight of the MoE load-balancing loss.
    router_z_loss_factor: weight of the MoE router z-loss.
    decode_fn: the decoder `predict_batch` runs (see `t5lite.decoding`).
    max_decode_length: tokens decoded per example, or None for the length
      of the batch's `decoder_input_tokens`.
  """

  FEATURE_CONVERTER_CLS: type[seqio.FeatureConverter]
  INFERENCE_FEATURE_CONVERTER_CLS: type[seqio.FeatureConverter]

  def __init__(self, module: nn.Module, input_vocabulary: seqio.Vocabulary,
               output_vocabulary: seqio.Vocabulary,
               optimizer: Any, z_loss: float = 1e-4,
               label_smoothing: float = 0.0,
               loss_normalizing_factor: float | str | None = NUM_REAL_TARGET_TOKENS,
               aux_loss_factor: float = 1e-2, router_z_loss_factor: float = 1e-3,
               decode_fn: Callable[..., tuple[Array, Array]] | None = None,
               max_decode_length: int | None = None):
    """Builds the model.

    Args:
      module: Flax network, e.g. `transformer.EncoderDecoder`.
      input_vocabulary: vocabulary of the inputs.
      output_vocabulary: vocabulary of the targets.
      optimizer: a learner of `t5lite.optimizers` (or an optax
        transformation), stored for the trainer.
      z_loss: coefficient of the `logsumexp(logits)**2` auxiliary loss.
      label_smoothing: in [0, 1).
      loss_normalizing_factor: T5X's: None sums the loss over tokens; a
        number divides that sum by it; 'NUM_REAL_TARGET_TOKENS' (t5lite's
        default) by the batch's sum of loss weights;
        'NUM_TOTAL_TARGET_TOKENS' by batch * target length;
        'AVERAGE_PER_SEQUENCE' averages each sequence's tokens (per packed
        segment), then the sequences.
      aux_loss_factor: weight of the load-balancing loss of MoE layers
        (averaged over layers); unused by dense networks.
      router_z_loss_factor: weight of the router z-loss of MoE layers (averaged
        over layers); unused by dense networks.
      decode_fn: a decoder with the signature of `decoding.greedy` (the
        default when None), e.g. `decoding.beam_search` or
        `decoding.temperature_sample` with their knobs bound by gin.
      max_decode_length: tokens to decode per example; None decodes as many
        as the batch's `decoder_input_tokens` has positions.

    Raises:
      ValueError: for a negative z_loss or MoE loss weight, a
        label_smoothing outside [0, 1), a loss_normalizing_factor T5X does
        not have, a non-positive max_decode_length, or a decode_fn that is
        not callable.
    """
    for name, value in (("z_loss", z_loss), ("aux_loss_factor", aux_loss_factor),
                        ("router_z_loss_factor", router_z_loss_factor)):
      if value < 0:
        raise UserError(f"{name} must be >= 0, got {value}.")
    if not 0.0 <= label_smoothing < 1.0:
      raise UserError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    loss_normalizing_factor = check_loss_normalizing_factor(loss_normalizing_factor)
    if max_decode_length is not None and max_decode_length < 1:
      raise UserError(f"max_decode_length must be >= 1 or None (the length of the batch's "
                      f"decoder_input_tokens), got {max_decode_length}.")
    if decode_fn is not None and not callable(decode_fn):
      raise UserError(f"decode_fn must be a function such as decoding.beam_search, got "
                      f"{decode_fn!r}; in gin, reference it as @decoding.beam_search.")
    self.module = module
    self.input_vocabulary = input_vocabulary
    self.output_vocabulary = output_vocabulary
    self.optimizer = optimizer
    self.z_loss = z_loss
    self.label_smoothing = label_smoothing
    self.loss_normalizing_factor = loss_normalizing_factor
    self.aux_loss_factor = aux_loss_factor
    self.router_z_loss_factor = router_z_loss_factor
    self.decode_fn = decode_fn or decoding.greedy
    self.max_decode_length = max_decode_length

  @abc.abstractmethod
  def _module_inputs(self, batch: Batch) -> dict[str, Array]:
    """Selects and renames the batch features the module's `__call__` takes."""

  @abc.abstractmethod
  def _dummy_batch(self, input_shapes: Mapping[str, tuple[int, ...]],
                   input_types: Mapping[str, jnp.dtype] | None) -> dict[str, Array]:
    """A batch of ones with the given shapes, enough to initialise the module."""

  def validate_mesh(self, mesh_shape: Mapping[str, int]) -> None:
    """Checks that the model's layers split over a mesh of this shape.

    Raises:
      ValueError: experts that the `expert` axis does not divide evenly.
    """
    num_experts = getattr(getattr(self.module, "config", None), "num_experts", 0)
    if num_experts:
      moe.validate_expert_partitioning(num_experts, mesh_shape.get("expert", 1))

  def validate_vocabulary(self, task: str, targets_vocabulary: seqio.Vocabulary) -> None:
    """Checks that `task`'s targets are in the vocabulary the model was built for.

    Raises:
      ValueError: another vocabulary, or more tokens than the embedding holds.
    """
    model_vocab = self.output_vocabulary
    if (type(targets_vocabulary) is not type(model_vocab)
        or targets_vocabulary.vocab_size != model_vocab.vocab_size):
      raise UserError(
          f"Task '{task}' uses {type(targets_vocabulary).__name__} with "
          f"{targets_vocabulary.vocab_size} tokens but the model was configured with "
          f"{type(model_vocab).__name__} with {model_vocab.vocab_size}; set the model's "
          "vocabulary (VOCABULARY) to the task's.")
    embed = getattr(getattr(self.module, "config", None), "vocab_size", None)
    if embed is not None and embed < targets_vocabulary.vocab_size:
      raise UserError(
          f"Model vocab_size {embed} is smaller than the task vocabulary "
          f"({targets_vocabulary.vocab_size}); raise the model's vocab_size.")

  def input_shapes_and_types(self, task_feature_lengths: Mapping[str, int], pack: bool
                             ) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """Batch-1 shapes and dtypes of the features this model trains on.

    What `FEATURE_CONVERTER_CLS` makes of tasks with these feature lengths,
    read from the converter alone (no data is built); every feature is
    int32, as `datasets.get_dataset` casts them. Training, the dry run,
    `t5lite-eval` and `t5lite-infer` all initialise from this.
    """
    converter = self.FEATURE_CONVERTER_CLS(pack=pack)
    lengths = converter.get_model_feature_lengths(dict(task_feature_lengths))
    return {k: (1, n) for k, n in lengths.items()}, {k: np.int32 for k in lengths}

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, tuple[int, ...]],
                            input_types: Mapping[str, jnp.dtype] | None = None) -> dict:
    """Initialises the network's variables.

    Parameters stay boxed as `nn.LogicallyPartitioned`, so callers can
    `jax.eval_shape` this and read `nn.get_partition_spec` of the result.

    Args:
      rng: PRNG key for the parameters.
      input_shapes: feature name -> shape, e.g. `{'encoder_input_tokens':
        (8, 512), 'decoder_input_tokens': (8, 114)}`.
      input_types: feature name -> dtype; int32 by default.

    Returns:
      The unchanged output of `module.init`.
    """
    batch = self._dummy_batch(input_shapes, input_types)
    return self.module.init({"params": rng}, **self._module_inputs(batch),
                            enable_dropout=False)

  def train_flops_per_step(self, input_shapes: Mapping[str, tuple[int, ...]]) -> float | None:
    """Model FLOPs of one training step on batches of `input_shapes`.

    Forward plus backward, counted as 3 forward passes of
    `transformer.forward_flops` (matmuls only; see there for what counts).

    Args:
      input_shapes: feature name -> `[batch, length]`; reads
        `decoder_input_tokens` and, for an encoder-decoder,
        `encoder_input_tokens`.

    Returns:
      The FLOPs, or None when the module is not a t5lite transformer.
    """
    config = getattr(self.module, "config", None)
    if not isinstance(config, transformer.TransformerConfig):
      return None
    _require(input_shapes, "decoder_input_tokens")
    batch, decoder_length = input_shapes["decoder_input_tokens"][:2]
    encoder_length = 0
    if isinstance(self.module, transformer.EncoderDecoder):
      _require(input_shapes, "encoder_input_tokens")
      encoder_length = input_shapes["encoder_input_tokens"][1]
    return 3 * transformer.forward_flops(config, batch, decoder_length, encoder_length)["total"]

  def compute_dtype(self) -> str | None:
    """The dtype of the model's matmul inputs ('float32', 'bfloat16', ...),
    whose peak rate its MFU counts against; None when the module is not a
    t5lite transformer."""
    config = getattr(self.module, "config", None)
    if not isinstance(config, transformer.TransformerConfig):
      return None
    return jnp.dtype(config.dtype).name

  def as_compiled_for(self, backend: str) -> BaseModel:
    """This model as XLA on `backend` keeps its activations, for estimates.

    XLA on the CPU removes optimization barriers before it merges common
    subexpressions, so the recomputation of a rematerialised layer outside
    a scan is merged back into the forward pass, and the step keeps what it
    would without remat (a scan's backward loop keeps the recomputation
    apart). On the CPU such a model is estimated without its remat policy;
    otherwise, and for modules other than t5lite transformers, the model is
    returned as it is.

    Args:
      backend: 'cpu', 'gpu' or 'tpu' (`jax.default_backend()`).

    Returns:
      This model, or a copy whose module has `remat_policy='none'`.
    """
    config = getattr(self.module, "config", None)
    if backend != "cpu" or getattr(config, "scan_layers", True):
      return self
    return self.without_remat()

  def without_remat(self) -> BaseModel:
    """This model with `remat_policy='none'` (itself if it has no remat or
    is not a t5lite transformer): what a rematerialised layer holds while
    it is recomputed, for estimates."""
    config = getattr(self.module, "config", None)
    if not isinstance(config, transformer.TransformerConfig) or config.remat_policy == "none":
      return self
    model = copy.copy(self)
    model.module = self.module.clone(config=dataclasses.replace(config, remat_policy="none"))
    return model

  def validate_num_microbatches(self, num_microbatches: int | None) -> None:
    """Checks that microbatches of a batch give the full batch's results.

    The trainer's microbatch i takes examples i, i + n, i + 2n, ... MoE
    layers with one routing group per example (`group_size=None`) route
    every example alike in a microbatch and in the full batch, so the sums
    match exactly (up to float reassociation). A `group_size` forms groups
    of consecutive tokens that can span examples, which a microbatch would
    regroup (other capacity, other dropped tokens, another loss), so that
    combination is refused.

    Args:
      num_microbatches: the trainer's setting (None or 1: no microbatches).

    Raises:
      ValueError: an MoE network with `group_size` set and more than one
        microbatch.
    """
    config = getattr(self.module, "config", None)
    group_size = getattr(config, "group_size", None) if getattr(config, "num_experts", 0) else None
    if (num_microbatches or 1) > 1 and group_size is not None:
      raise UserError(
          f"MoE group_size={group_size} cannot be used with num_microbatches="
          f"{num_microbatches}: microbatch i takes examples i, i + {num_microbatches}, "
          f"i + {2 * num_microbatches}, ..., so routing groups that span examples would "
          "differ from the full batch's. Set GROUP_SIZE=None (one group per example, which "
          "microbatches keep) or num_microbatches=None.")

  def loss_normalizer(self, batch: Batch) -> Array:
    """The divisor of the summed loss for `batch` (see `normalized_loss_weights`).

    Args:
      batch: the whole batch's features (for microbatches, the divisor is the
        full batch's).

    Returns:
      float32 scalar; 1 for a plain sum (`loss_normalizing_factor=None`).
    """
    divisor = normalized_loss_weights(self.loss_normalizing_factor, batch)[1]
    return jnp.ones((), jnp.float32) if divisor is None else divisor

  def _logits(self, params: Params, batch: Batch, dropout_rng: Array | None
              ) -> tuple[Array, dict[str, Array]]:
    """Teacher-forced float32 logits, with dropout iff `dropout_rng` is
    given, and the MoE statistics averaged over layers (empty if dense)."""
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    logits, state = self.module.apply({"params": params}, **self._module_inputs(batch),
                                      enable_dropout=dropout_rng is not None, rngs=rngs,
                                      mutable=["intermediates"])
    return logits.astype(jnp.float32), collect_moe_metrics(state.get("intermediates", {}))

  def _add_moe_losses(self, loss: Array, sums: dict[str, Array],
                      moe_metrics: Mapping[str, Array],
                      num_microbatches: int) -> Array:
    """Adds the weighted MoE losses to `loss` and `experts/...` to `sums`.

    Both are batch means, so each microbatch contributes 1/num_microbatches
    of its own and the trainer's sum over microbatches is their mean.
    """
    if not moe_metrics:
      return loss
    aux = (self.aux_loss_factor * moe_metrics[moe.AUXILIARY_LOSS]
           + self.router_z_loss_factor * moe_metrics[moe.ROUTER_Z_LOSS])
    for name, value in moe_metrics.items():
      sums[f"experts/{name}"] = value / num_microbatches
    return loss + aux / num_microbatches

  def loss_fn(self, params: Params, batch: Batch, dropout_rng: Array | None,
              loss_normalizer: Array | None = None,
              num_microbatches: int = 1) -> tuple[Array, dict[str, Array]]:
    """Normalized training loss and summed statistics.

    loss = sum(weight * (cross_ent + z_loss * logsumexp(logits)**2))
    / loss_normalizer, plus for MoE networks `(aux_loss_factor *
    auxiliary_loss + router_z_loss_factor * router_z_loss) / num_microbatches`
    with both averaged over MoE layers. Passing the full batch's normalizer to each
    microbatch makes the microbatch losses (and gradients) add up to the
    full batch's.

    Args:
      params: unboxed parameter tree (what goes under 'params').
      batch: feature-converter outputs; keys the module does not take are
        ignored.
      dropout_rng: PRNG key for dropout; None disables dropout.
      loss_normalizer: divisor; None means `self.loss_normalizer(batch)`.
        A zero normalizer (no target tokens) yields loss 0, not NaN.
      num_microbatches: how many microbatches the trainer splits the batch
        into. Loss terms that are means over the batch (e.g. MoE auxiliary
        losses) are divided by it, so the summed microbatch losses hold their
        mean; namespaced statistics ('experts/...') follow the same rule.
        The dense token loss does not need it.

    Returns:
      `(loss, sums)` where `sums` holds the float32 sums of
      `token_loss_sums` and, for MoE networks, `experts/auxiliary_loss`,
      `experts/router_z_loss`, `experts/fraction_tokens_left_behind`,
      `experts/expert_usage` and `experts/router_confidence`, each averaged
      over MoE layers and divided by `num_microbatches`.
    """
    logits, moe_metrics = self._logits(params, batch, dropout_rng)
    loss, sums = normalized_loss(logits, batch, z_loss=self.z_loss,
                                 label_smoothing=self.label_smoothing,
                                 loss_normalizing_factor=self.loss_normalizing_factor,
                                 loss_normalizer=loss_normalizer)
    loss = self._add_moe_losses(loss, sums, moe_metrics, num_microbatches)
    return loss, sums

  def eval_fn(self, params: Params, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """`loss_fn` without dropout and with the batch's own normalizer."""
    return self.loss_fn(params, batch, dropout_rng=None)

  def predict_logits(self, params: Params, batch: Batch) -> Array:
    """Teacher-forced float32 logits `[batch, length, vocab]`, no dropout."""
    return self._logits(params, batch, dropout_rng=None)[0]

  def score_batch(self, params: Params, batch: Batch) -> Array:
    """Teacher-forced log-likelihood of each example's targets.

    Args:
      params: unboxed parameter tree.
      batch: `INFERENCE_FEATURE_CONVERTER_CLS` features with
        `decoder_target_tokens` and `decoder_loss_weights`.

    Returns:
      float32 `[batch]`: sum over positions of `decoder_loss_weights *
      log p(decoder_target_tokens)`.
    """
    log_probs = jax.nn.log_softmax(self.predict_logits(params, batch))
    targets = jnp.asarray(batch["decoder_target_tokens"], jnp.int32)
    target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    weights = jnp.asarray(batch["decoder_loss_weights"], jnp.float32)
    return jnp.sum(target_log_probs * weights, axis=-1)

  def predict_batch(self, params: Params, batch: Batch, rng: Array | None = None) -> Array:
    """The best decode of each example with `decode_fn`.

    Args:
      params: unboxed parameter tree.
      batch: `INFERENCE_FEATURE_CONVERTER_CLS` features (see the subclass).
      rng: PRNG key for sampling decoders; None uses a fixed key.

    Returns:
      int32 `[batch, max_decode_length]`: the decoded targets (for
      decoder-only models, the continuation after the prompt), EOS
      included, 0 after it.
    """
    return self.predict_batch_with_aux(params, batch, rng)[0]

  def predict_batch_with_aux(self, params: Params, batch: Batch, rng: Array | None = None, *,
                             return_all_decodes: bool = False,
                             num_decodes: int | None = None) -> tuple[Array, dict[str, Array]]:
    """Decodes like `predict_batch` and also returns the decodes' scores.

    Args:
      params: unboxed parameter tree.
      batch: `INFERENCE_FEATURE_CONVERTER_CLS` features.
      rng: PRNG key for sampling decoders; None uses a fixed key.
      return_all_decodes: return every decode instead of the best one.
      num_decodes: decodes per example (samples, or the best beams); None is
        the decoder's default (1 sample, all beams).

    Returns:
      `(tokens, aux)`: tokens int32 `[batch, max_decode_length]`, or `[batch,
      num_decodes, max_decode_length]` sorted by score with the best LAST
      when `return_all_decodes`; `aux['scores']` float32 `[batch]` or
      `[batch, num_decodes]`: summed log-probabilities, length-normalised
      for beam search.
    """
    tokens, scores = self.decode_batch(params, batch, rng, num_decodes=num_decodes)
    if return_all_decodes:
      return tokens, {"scores": scores}
    return tokens[:, -1], {"scores": scores[:, -1]}

  def decode_batch(self, params: Params, batch: Batch, rng: Array | None = None, *,
                   num_decodes: int | None = None,
                   use_cache: bool = True) -> tuple[Array, Array]:
    """Runs `decode_fn` with or without the key/value cache.

    The uncached path recomputes the full teacher-forced forward pass over
    everything decoded so far at every step; it gives the same tokens (up to
    floating-point reassociation) and is the reference and benchmark
    baseline. MoE layers route per group of tokens, so the two agree only
    when no token is dropped for capacity (e.g. eval_capacity_factor <= 0).

    Args:
      params: unboxed parameter tree.
      batch: `INFERENCE_FEATURE_CONVERTER_CLS` features.
      rng: PRNG key for sampling decoders; None uses a fixed key.
      num_decodes: decodes per example; None is the decoder's default.
      use_cache: decode over the key/value cache.

    Returns:
      tokens int32 `[batch, num_decodes, max_decode_length]` and scores
      float32 `[batch, num_decodes]`, both sorted by score, best last.

    Raises:
      ValueError: the batch lacks a feature decoding needs.
    """
    length = self._decode_length(batch)
    start = self._decode_start(params, batch, length, use_cache)
    return self.decode_fn(start.tokens_to_logits, start.initial_cache, start.first_tokens,
                          rng, max_decode_length=length,
                          eos_id=self.output_vocabulary.eos_id, num_decodes=num_decodes)

  def _decode_length(self, batch: Batch) -> int:
    if self.max_decode_length is not None:
      return self.max_decode_length
    if "decoder_input_tokens" not in batch:
      raise UserError("Decoding needs max_decode_length or a 'decoder_input_tokens' feature "
                      f"to take the length from; the batch has {sorted(batch)}.")
    return batch["decoder_input_tokens"].shape[-1]

  @abc.abstractmethod
  def _decode_start(self, params: Params, batch: Batch, length: int,
                    use_cache: bool) -> DecodeStart:
    """The step function, its initial state and first tokens for `length` steps."""

  def _uncached_step(self, params: Params, length: int) -> decoding.TokensToLogits:
    """A step that reruns the teacher-forced forward pass on the whole sequence.

    Its state holds `decoder_input_tokens` `[n, length]` (prompt and tokens
    decoded so far), `position` int32 `[n]` (where the fed token goes) and
    any other module input (encoder tokens, prefix flags), all `[n, ...]`.
    """
    def tokens_to_logits(tokens: Array, state: dict[str, Array]
                         ) -> tuple[Array, dict[str, Array]]:
      position = state["position"]
      inputs = layers.write_at_positions(state["decoder_input_tokens"], tokens[:, None],
                                         position)
      # The model reads padding from the targets; mark what exists so far.
      seen = (jnp.arange(length)[None, :] <= position[:, None]).astype(jnp.int32)
      batch = {**state, "decoder_input_tokens": inputs, "decoder_target_tokens": seen}
      logits = self.module.apply({"params": params}, **self._module_inputs(batch),
                                 enable_dropout=False)
      new_state = {**state, "decoder_input_tokens": inputs, "position": position + 1}
      return _logits_at(logits.astype(jnp.float32), position), new_state

    return tokens_to_logits


def _ones(shape: tuple[int, ...], name: str,
          input_types: Mapping[str, jnp.dtype] | None) -> Array:
  dtype = (input_types or {}).get(name, jnp.int32)
  return jnp.ones(shape, dtype)


def _require(input_shapes: Mapping[str, tuple[int, ...]], *names: str) -> None:
  missing = [n for n in names if n not in input_shapes]
  if missing:
    raise ValueError(f"input_shapes lacks {missing}; got keys {sorted(input_shapes)}.")


class EncoderDecoderModel(BaseModel):
  """Encoder-decoder (T5) model fed by `seqio.EncDecFeatureConverter`.

  Decoding reads `encoder_input_tokens` (unpacked) and starts every target
  from BOS id 0.
  """

  FEATURE_CONVERTER_CLS = seqio.EncDecFeatureConverter
  INFERENCE_FEATURE_CONVERTER_CLS = seqio.EncDecFeatureConverter

  def _module_inputs(self, batch: Batch) -> dict[str, Array]:
    keys = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
            "encoder_segment_ids", "decoder_segment_ids", "encoder_positions",
            "decoder_positions")
    return {k: batch[k] for k in keys if k in batch}

  def _dummy_batch(self, input_shapes: Mapping[str, tuple[int, ...]],
                   input_types: Mapping[str, jnp.dtype] | None) -> dict[str, Array]:
    _require(input_shapes, "encoder_input_tokens", "decoder_input_tokens")
    decoder_shape = input_shapes["decoder_input_tokens"]
    return {
        "encoder_input_tokens": _ones(input_shapes["encoder_input_tokens"],
                                      "encoder_input_tokens", input_types),
        "decoder_input_tokens": _ones(decoder_shape, "decoder_input_tokens", input_types),
        "decoder_target_tokens": _ones(input_shapes.get("decoder_target_tokens", decoder_shape),
                                       "decoder_target_tokens", input_types),
    }

  def _decode_start(self, params: Params, batch: Batch, length: int,
                    use_cache: bool) -> DecodeStart:
    if "encoder_input_tokens" not in batch:
      raise UserError("EncoderDecoderModel decodes from 'encoder_input_tokens', which the "
                      f"batch lacks (it has {sorted(batch)}); build it with "
                      "seqio.EncDecFeatureConverter.")
    encoder_tokens = jnp.asarray(batch["encoder_input_tokens"], jnp.int32)
    n = encoder_tokens.shape[0]
    bos = jnp.zeros((n,), jnp.int32)
    state = {"encoder_input_tokens": encoder_tokens, "position": jnp.zeros((n,), jnp.int32)}
    if not use_cache:
      state["decoder_input_tokens"] = jnp.zeros((n, length), jnp.int32)
      return DecodeStart(self._uncached_step(params, length), state, bos)
    variables = {"params": params}
    encoded = self.module.apply(variables, encoder_tokens, enable_dropout=False,
                                method="encode")
    # A prefill of BOS alone: it creates the self-attention cache and stores
    # the encoder's keys and values for cross-attention.
    _, filled = self.module.apply(variables, encoded, encoder_tokens, bos[:, None],
                                  jnp.ones_like(bos[:, None]), enable_dropout=False,
                                  cache_length=length, method="decode", mutable=["cache"])

    def tokens_to_logits(tokens: Array, state: dict[str, Any]) -> tuple[Array, dict[str, Any]]:
      logits, new = self.module.apply(
          {"params": params, "cache": state["cache"]}, state["encoder_input_tokens"],
          tokens[:, None], state["position"], length, method="decode_step", mutable=["cache"])
      return logits[:, 0], {**state, "cache": new["cache"], "position": state["position"] + 1}

    return DecodeStart(tokens_to_logits, {**state, "cache": filled["cache"]}, bos)


class DecoderOnlyModel(BaseModel):
  """Decoder-only language model, optionally prefix-LM.

  With `inputs_bidirectional_attention=True` the model uses
  `seqio.PrefixLMFeatureConverter` and passes its `decoder_causal_attention`
  feature, so the inputs (prefix) attend to each other bidirectionally.

  Decoding always reads the PrefixLM layout: the prompt is the positions
  where `decoder_causal_attention` is 1 (BOS, the inputs and their EOS), and
  the rest of `decoder_input_tokens` is ignored. The prompt attends as in
  training (bidirectionally only with `inputs_bidirectional_attention`), and
  the continuation of up to `max_decode_length` tokens is returned
  left-aligned, without the prompt.
  """

  FEATURE_CONVERTER_CLS = seqio.DecoderFeatureConverter
  INFERENCE_FEATURE_CONVERTER_CLS = seqio.PrefixLMFeatureConverter

  def __init__(self, module: nn.Module, input_vocabulary: seqio.Vocabulary,
               output_vocabulary: seqio.Vocabulary,
               optimizer: Any, z_loss: float = 1e-4,
               label_smoothing: float = 0.0,
               loss_normalizing_factor: float | str | None = NUM_REAL_TARGET_TOKENS,
               inputs_bidirectional_attention: bool = False,
               aux_loss_factor: float = 1e-2, router_z_loss_factor: float = 1e-3,
               decode_fn: Callable[..., tuple[Array, Array]] | None = None,
               max_decode_length: int | None = None):
    """Builds the model; arguments as in `BaseModel`.

    Args:
      module: Flax network, e.g. `transformer.DecoderOnly`.
      input_vocabulary: vocabulary of the inputs.
      output_vocabulary: vocabulary of the targets.
      optimizer: a learner of `t5lite.optimizers` (or an optax
        transformation), stored for the trainer.
      z_loss: coefficient of the `logsumexp(logits)**2` auxiliary loss.
      label_smoothing: in [0, 1).
      loss_normalizing_factor: see `BaseModel`.
      inputs_bidirectional_attention: prefix-LM: bidirectional attention over
        the inputs part of each example.
      aux_loss_factor: weight of the MoE load-balancing loss.
      router_z_loss_factor: weight of the MoE router z-loss.
      decode_fn: decoder for `predict_batch`; None is `decoding.greedy`.
      max_decode_length: continuation tokens to decode; None is the length
        of the batch's `decoder_input_tokens`.
    """
    super().__init__(module, input_vocabulary, output_vocabulary, optimizer, z_loss,
                     label_smoothing, loss_normalizing_factor,
                     aux_loss_factor=aux_loss_factor,
                     router_z_loss_factor=router_z_loss_factor, decode_fn=decode_fn,
                     max_decode_length=max_decode_length)
    self.inputs_bidirectional_attention = inputs_bidirectional_attention
    if inputs_bidirectional_attention:
      # Per instance: the class default stays the plain decoder converter.
      self.FEATURE_CONVERTER_CLS = seqio.PrefixLMFeatureConverter

  def _module_inputs(self, batch: Batch) -> dict[str, Array]:
    keys = ["decoder_input_tokens", "decoder_target_tokens", "decoder_segment_ids",
            "decoder_positions"]
    if self.inputs_bidirectional_attention:
      keys.append("decoder_causal_attention")
    return {k: batch[k] for k in keys if k in batch}

  def _dummy_batch(self, input_shapes: Mapping[str, tuple[int, ...]],
                   input_types: Mapping[str, jnp.dtype] | None) -> dict[str, Array]:
    _require(input_shapes, "decoder_input_tokens")
    shape = input_shapes["decoder_input_tokens"]
    batch = {
        "decoder_input_tokens": _ones(shape, "decoder_input_tokens", input_types),
        "decoder_target_tokens": _ones(input_shapes.get("decoder_target_tokens", shape),
                                       "decoder_target_tokens", input_types),
    }
    if self.inputs_bidirectional_attention:
      batch["decoder_causal_attention"] = _ones(shape, "decoder_causal_attention",
                                                input_types)
    return batch

  def _prompt(self, batch: Batch) -> tuple[Array, Array]:
    """The PrefixLM prompt: tokens `[n, L]` zeroed after the prompt, and its
    int32 length `[n]` (at least 1: an empty prompt is BOS alone)."""
    if "decoder_causal_attention" not in batch or "decoder_input_tokens" not in batch:
      raise UserError(
          "DecoderOnlyModel decodes from the PrefixLM layout ('decoder_input_tokens' and "
          f"'decoder_causal_attention'); the batch has {sorted(batch)}. Build it with "
          "INFERENCE_FEATURE_CONVERTER_CLS (seqio.PrefixLMFeatureConverter).")
    tokens = jnp.asarray(batch["decoder_input_tokens"], jnp.int32)
    lengths = jnp.sum(jnp.asarray(batch["decoder_causal_attention"]) > 0, axis=-1)
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    in_prompt = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return jnp.where(in_prompt, tokens, 0), lengths

  def _decode_start(self, params: Params, batch: Batch, length: int,
                    use_cache: bool) -> DecodeStart:
    prompt, prompt_lengths = self._prompt(batch)
    n, prompt_capacity = prompt.shape
    # Room for the longest prompt and `length` more tokens; the first step
    # refeeds the last prompt token, whose logits predict the continuation.
    total = prompt_capacity + length
    in_prompt = (jnp.arange(prompt_capacity)[None, :] < prompt_lengths[:, None]).astype(jnp.int32)
    position = prompt_lengths - 1
    first = jnp.take_along_axis(prompt, position[:, None], axis=1)[:, 0]
    if not use_cache:
      pad = ((0, 0), (0, length))
      state = {"decoder_input_tokens": jnp.pad(prompt, pad), "position": position,
               "decoder_causal_attention": jnp.pad(in_prompt, pad)}
      return DecodeStart(self._uncached_step(params, total), state, first)
    prefix = in_prompt if self.inputs_bidirectional_attention else None
    _, filled = self.module.apply({"params": params}, prompt, in_prompt,
                                  decoder_causal_attention=prefix, enable_dropout=False,
                                  cache_length=total, mutable=["cache"])

    def tokens_to_logits(tokens: Array, state: dict[str, Any]) -> tuple[Array, dict[str, Any]]:
      logits, new = self.module.apply(
          {"params": params, "cache": state["cache"]}, tokens[:, None], state["position"],
          total, method="decode_step", mutable=["cache"])
      return logits[:, 0], {**state, "cache": new["cache"], "position": state["position"] + 1}

    return DecodeStart(tokens_to_logits, {"cache": filled["cache"], "position": position},
                       first)
