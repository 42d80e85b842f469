"""Optimizer and learning-rate recipes built from optax.

Every optimizer wraps its learning rate with `optax.inject_hyperparams`, so
the rate applied at a step lives in the optimizer state and the trainer logs
exactly that value (`learning_rate_from_state`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

Schedule = optax.Schedule


def rsqrt_with_warmup(base_learning_rate: float = 1.0, warmup_steps: int = 10_000,
                      decay_factor: float | None = None) -> Schedule:
  """T5X default: base / sqrt(max(step, warmup_steps)).

  Args:
    base_learning_rate: multiplier of the schedule.
    warmup_steps: constant rate base / sqrt(warmup_steps) until this step.
    decay_factor: optional extra multiplier (T5X `factors` product).

  Returns:
    A schedule mapping step -> learning rate.
  """
  scale = base_learning_rate * (decay_factor or 1.0)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    return scale * jax.lax.rsqrt(jnp.maximum(step, float(warmup_steps)))
  return schedule


def warmup_cosine(peak_value: float, warmup_steps: int, decay_steps: int,
                  alpha: float = 0.0, begin_value: float = 0.0) -> Schedule:
  """Linear warmup from `begin_value` to `peak_value`, then cosine to alpha * peak.

  Args:
    peak_value: rate at the end of warmup.
    warmup_steps: length of the linear warmup.
    decay_steps: total steps of warmup + decay; the rate stays at the final
      value afterwards.
    alpha: final rate as a fraction of `peak_value`.
    begin_value: rate at step 0.

  Returns:
    A schedule mapping step -> learning rate.

  Raises:
    ValueError: decay_steps not greater than warmup_steps.
  """
  if decay_steps <= warmup_steps:
    raise ValueError(f"decay_steps={decay_steps} must exceed warmup_steps={warmup_steps}.")
  return optax.warmup_cosine_decay_schedule(
      init_value=begin_value, peak_value=peak_value, warmup_steps=warmup_steps,
      decay_steps=decay_steps, end_value=alpha * peak_value)


def constant(value: float) -> Schedule:
  return optax.constant_schedule(value)


def _inject_learning_rate(factory, learning_rate, **kwargs) -> optax.GradientTransformation:
  """Only the learning rate becomes state; other arguments stay static Python
  values (adafactor branches on some of them at trace time)."""
  def inner(learning_rate):
    return factory(learning_rate=learning_rate, **kwargs)
  return optax.inject_hyperparams(inner)(learning_rate=learning_rate)


def adafactor(learning_rate: Schedule | float,
              decay_rate: float = 0.8,
              clipping_threshold: float | None = 1.0,
              multiply_by_parameter_scale: bool = True,
              min_dim_size_to_factor: int = 128,
              momentum: float | None = None,
              weight_decay_rate: float | None = None) -> optax.GradientTransformation:
  """Adafactor (T5X default optimizer) with an injected learning rate."""
  return _inject_learning_rate(
      optax.adafactor, learning_rate, decay_rate=decay_rate,
      clipping_threshold=clipping_threshold,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      min_dim_size_to_factor=min_dim_size_to_factor, momentum=momentum,
      weight_decay_rate=weight_decay_rate)


def adamw(learning_rate: Schedule | float,
          b1: float = 0.9,
          b2: float = 0.95,
          eps: float = 1e-8,
          weight_decay: float = 0.0,
          clip_norm: float | None = 1.0) -> optax.GradientTransformation:
  """AdamW with decoupled weight decay, optionally clipped by global norm.

  Args:
    learning_rate: schedule or constant.
    b1, b2, eps: Adam moment decays and epsilon.
    weight_decay: decoupled decay, multiplied by the learning rate (optax).
    clip_norm: clip gradients to this global norm first; None disables.

  Returns:
    An optax transformation.
  """
  inner = _inject_learning_rate(
      optax.adamw, learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if clip_norm is None:
    return inner
  return optax.chain(optax.clip_by_global_norm(clip_norm), inner)


def learning_rate_from_state(opt_state: Any) -> jax.Array:
  """The learning rate most recently applied, found in injected hyperparams.

  Args:
    opt_state: state of an optimizer from this module.

  Returns:
    float32 scalar; NaN when no injected learning rate is found.
  """
  def injected(node):
    return isinstance(getattr(node, "hyperparams", None), dict)
  for node in jax.tree.leaves(opt_state, is_leaf=injected):
    if injected(node) and "learning_rate" in node.hyperparams:
      return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
  return jnp.asarray(jnp.nan, jnp.float32)
