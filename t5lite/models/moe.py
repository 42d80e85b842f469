"""Mixture-of-Experts feed-forward layer: router, capacity, dispatch and combine.

`MoeLayer` replaces the dense `MlpBlock` of a transformer layer with
`num_experts` MLPs of the same activations (gated GELU with `wi_0`, `wi_1`
by default; ReLU with a single `wi` for Switch Transformers) and a learned
router that sends each token to its top-k experts (k=1 is Switch routing,
k=2 the ST-MoE default).

Tokens are processed in groups, and groups are the unit of capacity: each
expert takes at most `capacity` tokens from each group, so the computation
has static shapes. The capacity follows from a capacity factor (see
`expert_capacity`), or is a fixed `MoeLayer.expert_capacity` (Hugging Face
`SwitchTransformersConfig.expert_capacity`, which counts per sequence: the
default one group per example). Routing is expressed with one-hot
dispatch/combine tensors and einsums, which are simple to read and shard:

  inputs    [batch, length, embed] -> [groups, tokens, embed]
  dispatch  [groups, tokens, experts, capacity]  (0/1)
  slots     [groups, experts, capacity, embed]   (on the group's devices)
  experts'  [experts, groups, capacity, embed]   (on the expert's devices)
  combine   [groups, tokens, experts, capacity]  (router probabilities)
  outputs   [groups, tokens, embed] -> [batch, length, embed]

Expert parallelism is a sharding choice: the experts' weights carry the
EXPERT logical axis and the experts' inputs are constrained to
`(EXPERT, BATCH, None, EMBED)`, so under a mesh with an `expert` axis each
device keeps its own experts, and the transpose from slots to experts'
layout becomes an all-to-all that moves tokens to them (and back after).
This needs rules in which EXPERT claims the `expert` mesh axis before BATCH
does, with a BATCH fallback to the remaining batch axes, as
`partitioning.standard_logical_axis_rules` has: (expert, 'expert'),
(batch, ('data', 'fsdp', 'expert')), (batch, ('data', 'fsdp')).

Overflow priority. When more tokens choose an expert than it has slots,
slots go first to top-1 choices of every token, then to top-2 choices, and
so on; among choices of the same rank, to tokens earlier in the group, or,
with `batch_prioritized_routing`, to tokens whose top-1 router probability is
higher (V-MoE "batch prioritized routing"). A token none of whose choices
found a slot gets exactly zero output from this layer, so the residual
connection carries it through unchanged. (Hugging Face Switch Transformers
releases differ on overflow: 4.x passes such a token's normalized input
through, scaled by its router probability, and its later rewrite enforces no
capacity. Outputs match Hugging Face exactly when no token overflows.)

Combine weights. Each chosen expert's output is scaled by its router
probability, as in T5X and Switch (with k=1 the output is `p * expert(x)`);
with `renormalize_router_weights` the k probabilities are first divided by
their sum (so top-1 gets weight 1.0). The router always runs in float32,
inputs and kernel cast up, since the softmax is sensitive to rounding.

Padding tokens are routed like any other token (as in T5X and Hugging
Face): they take capacity and count in the statistics below.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite import axis_names as ax
from t5lite.errors import UserError
from t5lite.models import layers


Array = jax.Array
DType = Any

# Names under which every MoE layer sows its scalars into 'intermediates';
# the model wrapper averages each over layers.
AUXILIARY_LOSS = "auxiliary_loss"
ROUTER_Z_LOSS = "router_z_loss"
FRACTION_TOKENS_LEFT_BEHIND = "fraction_tokens_left_behind"
EXPERT_USAGE = "expert_usage"
ROUTER_CONFIDENCE = "router_confidence"
METRIC_NAMES = (AUXILIARY_LOSS, ROUTER_Z_LOSS, FRACTION_TOKENS_LEFT_BEHIND, EXPERT_USAGE,
                ROUTER_CONFIDENCE)


def validate_expert_partitioning(num_experts: int, expert_axis_size: int) -> None:
  """Checks that experts split evenly over the `expert` mesh axis.

  Each device on the `expert` axis holds `num_experts / expert_axis_size`
  whole experts; an expert is never split across devices. With fewer
  experts than expert-axis devices, the extra devices belong on the `data`
  axis instead: the rules replicate experts along `data`, and the batch is
  split over `data` and `expert` alike, so throughput is the same.

  Args:
    num_experts: experts per MoE layer (> 0).
    expert_axis_size: size of the mesh's `expert` axis.

  Raises:
    ValueError: a non-positive argument, fewer experts than expert-axis
      devices, or an expert count the axis size does not divide.
  """
  if num_experts < 1 or expert_axis_size < 1:
    raise UserError(f"num_experts ({num_experts}) and the expert mesh axis size "
                    f"({expert_axis_size}) must both be >= 1.")
  divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
  if num_experts < expert_axis_size:
    raise UserError(
        f"num_experts={num_experts} is fewer than the expert mesh axis of size "
        f"{expert_axis_size}; experts are never split across devices. Use an expert axis "
        f"size that divides {num_experts} ({divisors}) and put the remaining devices on "
        "the 'data' axis, where experts are replicated.")
  if num_experts % expert_axis_size:
    raise UserError(
        f"num_experts={num_experts} does not divide evenly over the expert mesh axis of "
        f"size {expert_axis_size}; use a multiple of {expert_axis_size} experts or an "
        f"expert axis size in {divisors} (with the remaining devices on 'data').")


def validate_load_balancing_choices(choices: str, owner: str) -> None:
  """Raises a ValueError naming `owner` unless `choices` is 'all' or 'first'."""
  if choices not in LOAD_BALANCING_CHOICES:
    raise UserError(f"{owner}.load_balancing_choices={choices!r} is not supported; use "
                    "'all' (every chosen expert, as T5X and MaxText) or 'first' (each "
                    "token's first choice, as GShard).")


def expert_capacity(tokens_per_group: int, num_experts: int, num_selected_experts: int,
                    capacity_factor: float, min_expert_capacity: int) -> int:
  """Slots per expert per group.

  `ceil(capacity_factor * tokens_per_group * k / num_experts)`, at least
  `min_expert_capacity`, and never more than `tokens_per_group`: an expert
  cannot receive more tokens than a group has, since a token's k choices
  are distinct experts. A `capacity_factor <= 0` means dropless: every
  expert gets `tokens_per_group` slots, so no token is ever dropped.

  Args:
    tokens_per_group: tokens in each group.
    num_experts: experts in the layer.
    num_selected_experts: k of top-k routing.
    capacity_factor: slots per expert relative to a perfectly even split.
    min_expert_capacity: lower bound, so tiny groups still route.

  Returns:
    The capacity, in `[1, tokens_per_group]`.
  """
  if capacity_factor <= 0:
    return tokens_per_group
  capacity = math.ceil(capacity_factor * tokens_per_group * num_selected_experts / num_experts)
  return max(1, min(max(capacity, min_expert_capacity), tokens_per_group))


def num_groups(batch_size: int, length: int, group_size: int | None) -> int:
  """How many routing groups the `batch_size * length` tokens form.

  None gives one group per example. Otherwise the tokens, in batch-major
  order, are cut into the fewest equal groups of at most `group_size`
  tokens, so groups may merge whole examples or split one. For the grouping
  to be free under data parallelism, pick `group_size` so the group count is
  a multiple of the number of batch shards.

  Args:
    batch_size: examples.
    length: tokens per example.
    group_size: largest group, in tokens, or None.

  Returns:
    A divisor of `batch_size * length`.
  """
  if group_size is None:
    return batch_size
  num_tokens = batch_size * length
  groups = max(1, math.ceil(num_tokens / group_size))
  while num_tokens % groups:
    groups += 1
  return groups


def router_z_loss(router_logits: Array) -> Array:
  """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)**2`.

  Keeps router logits small, which keeps the softmax numerically stable.

  Args:
    router_logits: float32 `[groups, tokens, experts]`.

  Returns:
    float32 scalar.
  """
  log_z = jax.nn.logsumexp(router_logits, axis=-1)  # [groups, tokens]
  return jnp.mean(jnp.square(log_z))


# Which of a token's k choices the load-balancing loss counts: every choice
# (T5X/flaxformer and MaxText, the default) or the first only (GShard, and
# the Switch Transformer's k=1 loss applied to top-k routing).
LOAD_BALANCING_CHOICES = ("all", "first")


def load_balancing_loss(router_probs: Array, expert_index: Array) -> Array:
  """Load-balancing loss of the given choices, averaged over groups.

  Per group: `num_experts * sum_e f_e * P_e`, where `f_e` is the fraction of
  the group's tokens that chose expert e among the choices in
  `expert_index` and `P_e` the mean router probability of e. Passing every
  token's k choices gives the T5X/flaxformer and MaxText loss (their
  `num_experts**2 * mean(f * P)`); passing the first choice only
  (`expert_index[..., :1]`) gives the GShard / Switch loss. A balanced
  router (each expert chosen equally often, mean probability 1/E) gives the
  number of choices counted: 1 for the first choice, k for all k.

  Args:
    router_probs: float32 `[groups, tokens, experts]`.
    expert_index: int `[groups, tokens, choices]`, distinct experts per token.

  Returns:
    float32 scalar.
  """
  num_experts = router_probs.shape[-1]
  # [groups, tokens, choices, experts] -> [groups, tokens, experts]: 1 where
  # one of the token's counted choices is the expert.
  chosen = jnp.sum(jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32), axis=-2)
  fraction_tokens = jnp.mean(chosen, axis=1)  # [groups, experts]
  mean_probs = jnp.mean(router_probs, axis=1)  # [groups, experts]
  return jnp.mean(num_experts * jnp.sum(fraction_tokens * mean_probs, axis=-1))


@dataclasses.dataclass(frozen=True)
class Routing:
  """Where each token goes and with what weight, plus routing statistics.

  Attributes:
    dispatch: float32 0/1 `[groups, tokens, experts, capacity]`; 1 where the
      token fills that slot of that expert.
    combine: float32 `[groups, tokens, experts, capacity]`; `dispatch` times
      the router probability of the expert, which weights its output.
    fraction_tokens_left_behind: scalar; tokens none of whose choices got a
      slot, over all tokens.
    expert_usage: scalar; filled slots over all slots
      (`groups * experts * capacity`). 1.0 means every expert was full.
    router_confidence: scalar; mean over tokens of the summed router
      probabilities of the token's k chosen experts (kept or dropped).
    expert_index: int `[groups, tokens, k]`; each token's chosen experts,
      best first (kept or dropped).
  """

  dispatch: Array
  combine: Array
  fraction_tokens_left_behind: Array
  expert_usage: Array
  router_confidence: Array
  expert_index: Array


def _top_k(probs: Array, k: int) -> tuple[Array, Array]:
  """`jax.lax.top_k` over the last axis, as k rounds of argmax.

  The partitioner gathers the whole batch onto every device for a sharded
  `lax.top_k`, but splits argmax/max over the batch axes like any reduction;
  k is 1 or 2 in practice, so the loop costs nothing.

  Args:
    probs: `[..., experts]`.
    k: choices per token.

  Returns:
    `(values, indices)`, each `[..., k]`, best first; ties go to the lower
    expert index.
  """
  values, indices = [], []
  remaining = probs
  for _ in range(k):
    index = jnp.argmax(remaining, axis=-1)  # [...]
    values.append(jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0])
    indices.append(index)
    taken = jax.nn.one_hot(index, probs.shape[-1], dtype=jnp.bool_)  # [..., experts]
    remaining = jnp.where(taken, -jnp.inf, remaining)
  return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def _priority_order(gates: Array) -> Array:
  """Token order for batch-prioritized routing: highest top-1 gate first.

  Args:
    gates: `[groups, tokens, k]` router probabilities of the chosen experts.

  Returns:
    int `[groups, tokens]`: a permutation of each group's tokens.
  """
  return jnp.argsort(-gates[..., 0], axis=-1, stable=True)


def _positions_in_experts(expert_index: Array, num_experts: int,
                          order: Array | None) -> Array:
  """Each choice's arrival rank at its expert, in priority order.

  Args:
    expert_index: int `[groups, tokens, k]` chosen experts, best first.
    num_experts: number of experts.
    order: int `[groups, tokens]` token priority (a permutation), or None
      for position order.

  Returns:
    int32 `[groups, tokens, k]`: how many higher-priority choices picked
    the same expert before this one (a slot index if below capacity).
  """
  groups, tokens, k = expert_index.shape
  if order is not None:
    expert_index = jnp.take_along_axis(expert_index, order[..., None], axis=1)
  # [groups, tokens, k, experts]
  mask = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32)
  # Choice-major: every token's first choice queues before any second choice.
  # [groups, k * tokens, experts]
  mask = jnp.swapaxes(mask, 1, 2).reshape(groups, k * tokens, num_experts)
  rank = jnp.sum((jnp.cumsum(mask, axis=1) - 1) * mask, axis=-1)  # [groups, k * tokens]
  rank = jnp.swapaxes(rank.reshape(groups, k, tokens), 1, 2)  # [groups, tokens, k]
  if order is not None:
    rank = jnp.take_along_axis(rank, jnp.argsort(order, axis=-1)[..., None], axis=1)
  return rank


def route_top_k(router_probs: Array, num_selected_experts: int, capacity: int,
                batch_prioritized_routing: bool = False, renormalize: bool = False) -> Routing:
  """Tokens-choose top-k routing with a per-expert capacity.

  By default the gates are the router probabilities of the chosen experts,
  not renormalised over the k choices (T5X), so with k=1 the output is the
  expert's output scaled by its probability, as in Switch.

  Args:
    router_probs: float32 `[groups, tokens, experts]`.
    num_selected_experts: k.
    capacity: slots per expert per group.
    batch_prioritized_routing: give slots to confident tokens first instead
      of to earlier tokens (see the module docstring).
    renormalize: divide the k chosen probabilities by their sum before they
      weight the experts' outputs (dropped choices included in the sum).
      Priorities and `router_confidence` use the raw probabilities.

  Returns:
    The dispatch/combine tensors and statistics.
  """
  num_experts = router_probs.shape[-1]
  gates, expert_index = _top_k(router_probs, num_selected_experts)  # [groups, tokens, k]
  weights = gates / jnp.sum(gates, axis=-1, keepdims=True) if renormalize else gates
  order = _priority_order(gates) if batch_prioritized_routing else None
  rank = _positions_in_experts(expert_index, num_experts, order)
  kept = rank < capacity  # [groups, tokens, k]
  # [groups, tokens, k, experts], zero for choices that found no slot.
  chosen = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32) * kept[..., None]
  # An out-of-range rank one-hots to all zeros, but `kept` already masks it.
  slot = jax.nn.one_hot(rank, capacity, dtype=jnp.float32)  # [groups, tokens, k, capacity]
  # [groups, tokens, k, experts] x [groups, tokens, k, capacity]
  #   -> [groups, tokens, experts, capacity]
  dispatch = jnp.einsum("gtke,gtkc->gtec", chosen, slot)
  combine = jnp.einsum("gtke,gtkc->gtec", chosen * weights[..., None], slot)
  left_behind = jnp.logical_not(jnp.any(kept, axis=-1))  # [groups, tokens]
  return Routing(
      dispatch=dispatch, combine=combine,
      fraction_tokens_left_behind=jnp.mean(left_behind.astype(jnp.float32)),
      expert_usage=jnp.mean(jnp.sum(dispatch, axis=1)),
      router_confidence=jnp.mean(jnp.sum(gates, axis=-1)), expert_index=expert_index)


def _to_experts(x: Array) -> Array:
  """`[groups, experts, capacity, embed]` -> `[experts, groups, capacity, embed]`.

  With experts sharded over `expert` and groups over the batch axes, this
  transpose is where the partitioner moves each token to the devices that
  hold its expert: an all-to-all, because both sides are sharded.
  """
  x = jnp.swapaxes(x, 0, 1)  # [experts, groups, capacity, embed]
  return nn.with_logical_constraint(x, (ax.EXPERT, ax.BATCH, None, ax.EMBED))


def _to_groups(x: Array) -> Array:
  """`[experts, groups, capacity, embed]` -> `[groups, experts, capacity, embed]`:
  the all-to-all that brings the experts' outputs back to their groups."""
  x = jnp.swapaxes(x, 0, 1)  # [groups, experts, capacity, embed]
  return nn.with_logical_constraint(x, (ax.BATCH, None, None, ax.EMBED))


def _expert_kernel_init() -> nn.initializers.Initializer:
  """Per-expert fan-in init: each expert's matrix is scaled like DenseGeneral's."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                          in_axis=1, out_axis=2, batch_axis=0)


class MoeLayer(nn.Module):
  """Top-k routed Mixture-of-Experts feed-forward layer.

  Parameters: `router/kernel [embed, experts]` with axes (EMBED, None): the
  experts dimension is never split, and the embed dimension follows the
  rules like every other parameter's (replicated under
  `standard_logical_axis_rules`, split over `fsdp` under
  `fsdp_logical_axis_rules`, over `data` with parameter_partitioning_dims=2),
  as flaxformer's router kernel does; one input kernel per activation,
  `[experts, embed, expert_mlp]` with axes (EXPERT, EMBED, EXPERT_MLP), named
  `wi` alone or `wi_0`, `wi_1`, ... (see `layers.mlp_input_names`); and `wo`
  `[experts, expert_mlp, embed]` with axes (EXPERT, EXPERT_MLP, EMBED). Each
  expert computes what a `layers.MlpBlock` of the same activations does.

  Sows float32 scalars under `intermediates` (collect them with
  `mutable=['intermediates']`): auxiliary_loss, router_z_loss,
  fraction_tokens_left_behind, expert_usage, router_confidence (see
  `load_balancing_loss`, `router_z_loss` and `Routing`).

  Attributes:
    num_experts: experts (>= 1).
    num_selected_experts: k of top-k routing, in [1, num_experts].
    expert_mlp_dim: hidden width of each expert.
    train_capacity_factor: capacity factor when not deterministic; <= 0 is
      dropless.
    eval_capacity_factor: capacity factor when deterministic; <= 0 is dropless.
    min_expert_capacity: smallest capacity when not dropless.
    group_size: largest routing group in tokens; None is one group per
      example (see `num_groups`).
    router_jitter_noise: when not deterministic, router inputs are multiplied
      by uniform noise in [1 - eps, 1 + eps] drawn from the 'dropout' rng.
    batch_prioritized_routing: overflow priority by router confidence
      instead of by position.
    dtype: compute dtype of the experts; the router always runs in float32.
    dropout_rate: dropout on the experts' hidden activations.
    activations: the experts' activations, one name of
      `layers.MLP_ACTIVATIONS` per input kernel (('relu',) for Switch).
    expert_capacity: fixed slots per expert per group, clamped to the
      group's tokens; overrides both capacity factors and
      `min_expert_capacity`. None derives the capacity from the factors.
    renormalize_router_weights: weight the chosen experts' outputs by their
      router probabilities divided by the sum over the k choices, instead of
      by the raw probabilities (T5X and Switch).
    load_balancing_choices: which choices the load-balancing loss counts:
      'all' k of them (T5X/flaxformer and MaxText; a balanced router gives
      k) or 'first' only (GShard; a balanced router gives 1). The two agree
      for k=1. See `load_balancing_loss`.
  """

  num_experts: int
  num_selected_experts: int
  expert_mlp_dim: int
  train_capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  min_expert_capacity: int = 4
  group_size: int | None = None
  router_jitter_noise: float = 0.0
  batch_prioritized_routing: bool = False
  dtype: DType = jnp.float32
  dropout_rate: float = 0.0
  activations: tuple[str, ...] = ("gelu", "linear")
  expert_capacity: int | None = None
  renormalize_router_weights: bool = False
  load_balancing_choices: str = "all"

  def _validate(self) -> None:
    if self.num_experts < 1:
      raise UserError(f"MoeLayer.num_experts must be >= 1, got {self.num_experts}.")
    if not 1 <= self.num_selected_experts <= self.num_experts:
      raise UserError(
          f"MoeLayer.num_selected_experts must be in [1, num_experts={self.num_experts}], "
          f"got {self.num_selected_experts}.")
    for name in ("group_size", "expert_capacity"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise UserError(f"MoeLayer.{name} must be >= 1 or None, got {getattr(self, name)}.")
    layers.validate_mlp_activations(self.activations, "MoeLayer.activations")
    validate_load_balancing_choices(self.load_balancing_choices, "MoeLayer")
    if not 0.0 <= self.router_jitter_noise < 1.0:
      raise UserError("MoeLayer.router_jitter_noise must be in [0, 1), got "
                       f"{self.router_jitter_noise}.")

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """Routes each token to its experts and combines their outputs.

    Args:
      x: `[batch, length, embed]`.
      deterministic: eval mode: eval capacity factor, no jitter, no dropout.

    Returns:
      `[batch, length, embed]` in `dtype`; zero for tokens left behind.

    Raises:
      ValueError: an attribute is out of range or names an unknown activation.
    """
    self._validate()
    batch, length, embed = x.shape
    groups = num_groups(batch, length, self.group_size)
    tokens = batch * length // groups
    grouped = x.reshape(groups, tokens, embed)  # [groups, tokens, embed]
    grouped = nn.with_logical_constraint(grouped, (ax.BATCH, None, ax.EMBED))
    router_logits = self._router_logits(grouped, deterministic)
    router_probs = jax.nn.softmax(router_logits, axis=-1)  # [groups, tokens, experts]
    routing = route_top_k(router_probs, self.num_selected_experts,
                          self._capacity(tokens, deterministic),
                          self.batch_prioritized_routing, self.renormalize_router_weights)
    self._sow_metrics(router_logits, router_probs, routing)
    grouped = jnp.asarray(grouped, self.dtype)
    # Dispatch where the group lives: [groups, tokens, experts, capacity] x
    # [groups, tokens, embed] -> [groups, experts, capacity, embed].
    expert_inputs = layers.einsum("gtec,gtd->gecd", routing.dispatch, grouped, self.dtype)
    expert_inputs = nn.with_logical_constraint(expert_inputs, (ax.BATCH, None, None, ax.EMBED))
    expert_inputs = _to_experts(expert_inputs)
    expert_outputs = self._experts(expert_inputs, deterministic)
    expert_outputs = _to_groups(expert_outputs)
    # Combine where the group lives: [groups, experts, capacity, embed] x
    # [groups, tokens, experts, capacity] -> [groups, tokens, embed].
    out = layers.einsum("gecd,gtec->gtd", expert_outputs, routing.combine, self.dtype)
    out = nn.with_logical_constraint(out, (ax.BATCH, None, ax.EMBED))
    out = out.reshape(batch, length, embed)  # [batch, length, embed]
    return nn.with_logical_constraint(out, (ax.BATCH, ax.LENGTH, ax.EMBED))

  def _capacity(self, tokens: int, deterministic: bool) -> int:
    """Slots per expert in a group of `tokens` tokens.

    The fixed `expert_capacity` when set, clamped to the group like a
    factor-derived capacity (slots beyond the group's tokens stay empty);
    otherwise derived from the capacity factor of the mode.
    """
    if self.expert_capacity is not None:
      return min(self.expert_capacity, tokens)
    factor = self.eval_capacity_factor if deterministic else self.train_capacity_factor
    return expert_capacity(tokens, self.num_experts, self.num_selected_experts, factor,
                           self.min_expert_capacity)

  def _router_logits(self, grouped: Array, deterministic: bool) -> Array:
    """float32 `[groups, tokens, experts]` logits; float32 because the softmax
    and the z-loss are sensitive to rounding in bfloat16 (ST-MoE)."""
    inputs = grouped.astype(jnp.float32)
    if self.router_jitter_noise > 0 and not deterministic:
      eps = self.router_jitter_noise
      noise = jax.random.uniform(self.make_rng("dropout"), inputs.shape, jnp.float32,
                                 1.0 - eps, 1.0 + eps)
      inputs = inputs * noise
    return layers.DenseGeneral(self.num_experts, kernel_axes=(ax.EMBED, None),
                               dtype=jnp.float32, name="router")(inputs)

  def _sow_metrics(self, router_logits: Array, router_probs: Array, routing: Routing) -> None:
    counted = routing.expert_index  # [groups, tokens, k]
    if self.load_balancing_choices == "first":
      counted = counted[..., :1]
    values = {
        AUXILIARY_LOSS: load_balancing_loss(router_probs, counted),
        ROUTER_Z_LOSS: router_z_loss(router_logits),
        FRACTION_TOKENS_LEFT_BEHIND: routing.fraction_tokens_left_behind,
        EXPERT_USAGE: routing.expert_usage,
        ROUTER_CONFIDENCE: routing.router_confidence,
    }
    for name, value in values.items():
      self.sow("intermediates", name, value)

  def _kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> Array:
    kernel = self.param(name, nn.with_logical_partitioning(_expert_kernel_init(), axes),
                        shape, jnp.float32)
    return jnp.asarray(kernel, self.dtype)

  def _experts(self, x: Array, deterministic: bool) -> Array:
    """Every expert's MLP on its own slots.

    Args:
      x: `[experts, groups, capacity, embed]`.
      deterministic: disables dropout.

    Returns:
      `[experts, groups, capacity, embed]`.
    """
    embed = x.shape[-1]
    in_shape = (self.num_experts, embed, self.expert_mlp_dim)
    in_axes = (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP)
    hidden_axes = (ax.EXPERT, ax.BATCH, None, ax.EXPERT_MLP)
    # [experts, groups, capacity, embed] x [experts, embed, expert_mlp]
    #   -> [experts, groups, capacity, expert_mlp], one per input kernel.
    projections = [_per_expert_matmul(x, self._kernel(name, in_shape, in_axes), self.dtype)
                   for name in layers.mlp_input_names(len(self.activations))]
    hidden = layers.activate_and_multiply(projections, self.activations)
    hidden = nn.with_logical_constraint(hidden, hidden_axes)
    hidden = nn.Dropout(rate=self.dropout_rate)(hidden, deterministic=deterministic)
    wo = self._kernel("wo", (self.num_experts, self.expert_mlp_dim, embed),
                      (ax.EXPERT, ax.EXPERT_MLP, ax.EMBED))
    # [experts, groups, capacity, expert_mlp] x [experts, expert_mlp, embed]
    #   -> [experts, groups, capacity, embed]
    out = _per_expert_matmul(hidden, wo, self.dtype)
    return nn.with_logical_constraint(out, (ax.EXPERT, ax.BATCH, None, ax.EMBED))


def _per_expert_matmul(x: Array, kernel: Array, dtype: Any) -> Array:
  """`[experts, groups, capacity, in] x [experts, in, out]` ->
  `[experts, groups, capacity, out]`, as one batched matmul over
  `[experts, groups * capacity, in]`: with a single row axis per expert, XLA
  on the CPU differentiates the kernel as fast as a plain matmul's (see
  `layers.DenseGeneral`); the values are the same."""
  experts, groups, capacity, width = x.shape
  out = layers.einsum("emd,edh->emh", x.reshape(experts, groups * capacity, width), kernel,
                      dtype)
  return out.reshape(experts, groups, capacity, kernel.shape[-1])
