"""Pure train/eval steps and the Trainer that compiles them on the mesh.

The model's `loss_fn` returns a loss already divided by a normalizer that the
step computes once from the full batch, plus plain sums. Summing microbatch
losses and gradients therefore gives exactly the full-batch values, and the
sums add up the same way for metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from t5lite import metrics as metrics_lib
from t5lite import optimizers
from t5lite.errors import UserError
from t5lite.partitioning import Partitioner
from t5lite.train_state import TrainState


Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
# Token accuracy is a percentage, the scale of the inference eval's
# `exact_match`, so every accuracy a run shows reads the same way (T5X logs
# a fraction; docs/evaluation.md).
TOKEN_ACCURACY_SCALE = 100.0


class Model(Protocol):
  """The part of `models.BaseModel` the trainer uses."""

  def loss_normalizer(self, batch: Batch) -> jax.Array: ...
  def validate_num_microbatches(self, num_microbatches: int | None) -> None: ...
  def loss_fn(self, params: Any, batch: Batch, dropout_rng: jax.Array | None,
              loss_normalizer: jax.Array | None = None,
              num_microbatches: int = 1) -> tuple[jax.Array, Metrics]: ...


def _microbatch(batch: Batch, index: jax.Array, num_microbatches: int) -> Batch:
  """Rows index, index + n, index + 2n, ...: strided, so each microbatch is
  spread over every data-parallel device instead of living on a few."""
  def take(x):
    rows = x.shape[0] // num_microbatches
    x = x.reshape((rows, num_microbatches) + x.shape[1:])  # [rows, micro, ...]
    return jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)
  return jax.tree.map(take, batch)


def accumulate_gradients(model: Model, params: Any, batch: Batch, dropout_rng: jax.Array,
                         num_microbatches: int | None) -> tuple[Any, jax.Array, Metrics]:
  """Loss, gradients and sums over the batch, optionally in microbatches.

  Args:
    model: provides loss_fn and loss_normalizer.
    params: parameter tree.
    batch: [batch, ...] arrays.
    dropout_rng: base key; microbatch i uses fold_in(key, i).
    num_microbatches: None or 1 for one pass; otherwise must divide the batch.

  Returns:
    (gradients, loss, sums), equal to the one-pass values up to float
    reassociation.
  """
  normalizer = model.loss_normalizer(batch)
  grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)

  if not num_microbatches or num_microbatches == 1:
    (loss, sums), grads = grad_fn(params, batch, dropout_rng, normalizer)
    return grads, loss, sums

  def body(i, carry):
    grads, loss, sums = carry
    micro = _microbatch(batch, i, num_microbatches)
    (m_loss, m_sums), m_grads = grad_fn(params, micro, jax.random.fold_in(dropout_rng, i),
                                        normalizer, num_microbatches)
    return (jax.tree.map(jnp.add, grads, m_grads), loss + m_loss,
            jax.tree.map(jnp.add, sums, m_sums))

  first = _microbatch(batch, 0, num_microbatches)
  sums_shape = jax.eval_shape(
      lambda: model.loss_fn(params, first, dropout_rng, normalizer, num_microbatches)[1])
  zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))
  return jax.lax.fori_loop(0, num_microbatches, body, zeros)


def _safe(normalizer: jax.Array) -> jax.Array:
  """The normalizer, or 1 where it is 0: a batch without weighted tokens has
  zero sums too, so its per-token metrics are 0 instead of 0/0."""
  return jnp.where(normalizer == 0, 1.0, normalizer)


def summarize(loss: jax.Array, sums: Metrics, normalizer: jax.Array) -> Metrics:
  """Per-step metrics from the loss and the model's sums."""
  metrics = {"loss": loss}
  if "cross_ent_sum" in sums:
    metrics["cross_ent_loss"] = sums["cross_ent_sum"] / _safe(normalizer)
  if "z_loss_sum" in sums:
    metrics["z_loss"] = sums["z_loss_sum"] / _safe(normalizer)
  if "correct_sum" in sums and "weight_sum" in sums:
    metrics["token_accuracy"] = (TOKEN_ACCURACY_SCALE * sums["correct_sum"]
                                 / jnp.maximum(sums["weight_sum"], 1.0))
  for name, value in sums.items():
    # Namespaced extras from the model (e.g. experts/...) arrive already
    # divided per microbatch, so their sum is the batch mean: pass through.
    if "/" in name:
      metrics[name] = value
  return metrics


def eval_metrics(loss: jax.Array, sums: Metrics, normalizer: jax.Array, num_rows: int
                 ) -> dict[str, Any]:
  """One batch's evaluation metrics, to be merged with other batches'.

  Each is a `metrics.Average` weighted so that merging batches gives what
  one batch holding all of their examples would: the losses by the loss
  normalizer (the weighted target tokens, or `loss_normalizing_factor` per
  batch), token accuracy by the weighted tokens (T5X's masked `Accuracy`,
  in percent), and the
  model's batch means (`experts/...`) by the batch's rows. `num_tokens` is
  the total of weighted tokens.

  Args:
    loss: the batch's normalized loss.
    sums: the model's sums (see `models.token_loss_sums`).
    normalizer: the divisor `loss` was computed with.
    num_rows: examples in the batch, padding rows included.

  Returns:
    name -> `metrics.Average` or `metrics.Sum`.
  """
  rows = jnp.asarray(num_rows, jnp.float32)
  out: dict[str, Any] = {"loss": metrics_lib.Average(total=loss * normalizer, count=normalizer)}
  if "cross_ent_sum" in sums:
    out["cross_ent_loss"] = metrics_lib.Average(total=sums["cross_ent_sum"], count=normalizer)
  if "z_loss_sum" in sums:
    out["z_loss"] = metrics_lib.Average(total=sums["z_loss_sum"], count=normalizer)
  if "correct_sum" in sums and "weight_sum" in sums:
    out["token_accuracy"] = metrics_lib.Average(total=TOKEN_ACCURACY_SCALE * sums["correct_sum"],
                                                count=sums["weight_sum"])
  for name, value in sums.items():
    if "/" in name:
      out[name] = metrics_lib.Average(total=value * rows, count=rows)
  out["num_tokens"] = metrics_lib.Sum(total=sums.get("weight_sum", jnp.zeros((), jnp.float32)))
  return out


def optimizer_metrics(old_opt_state: Any, new_opt_state: Any) -> Metrics:
  """What the optimizer did this step: its learning rate and any skipped step.

  Args:
    old_opt_state: optimizer state before the update.
    new_opt_state: optimizer state after it.

  Returns:
    {"learning_rate": rate applied}, plus "optimizer/skipped_steps" (1.0 when
    `skip_and_clip_by_global_norm` dropped this step, else 0.0) for
    optimizers that can skip; the stats period reports its sum.
  """
  metrics = {"learning_rate": optimizers.learning_rate_from_state(new_opt_state)}
  before = optimizers.skipped_steps_from_state(old_opt_state)
  if before is not None:
    after = optimizers.skipped_steps_from_state(new_opt_state)
    metrics["optimizer/skipped_steps"] = (after - before).astype(jnp.float32)
  return metrics


def _global_norm(tree: Any) -> jax.Array:
  """The L2 norm of all leaves together, accumulated in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def norm_metrics(grads: Any, old_params: Any, new_params: Any) -> Metrics:
  """The global norms that show a step going wrong, for the divergence checks.

  The loss of a step measures the parameters it started from; only these
  measure the parameters it produced, which are what a checkpoint saves. An
  update that is large against the parameters (e.g. a learning rate far
  too high) can leave a finite loss and an exploded state.

  Args:
    grads: the step's raw gradients (before any clipping).
    old_params: parameters before the update.
    new_params: parameters after it.

  Returns:
    {"grad_norm", "param_norm" (after the update), "update_ratio" (norm of
    the update over the norm of the parameters before it)}.
  """
  update = jax.tree.map(lambda new, old: new.astype(jnp.float32) - old.astype(jnp.float32),
                        new_params, old_params)
  old_norm = _global_norm(old_params)
  return {"grad_norm": _global_norm(grads), "param_norm": _global_norm(new_params),
          "update_ratio": _global_norm(update) / jnp.maximum(old_norm, 1e-30)}


def train_step(state: TrainState, batch: Batch, *, model: Model, dropout_seed: int,
               num_microbatches: int | None) -> tuple[TrainState, Metrics]:
  """One optimizer update; pure, so the partitioner can jit and donate it."""
  # Keys come from the step number, so a resumed run draws the same dropout.
  rng = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  grads, loss, sums = accumulate_gradients(model, state.params, batch, rng, num_microbatches)
  new_state = state.apply_gradients(grads)
  metrics = summarize(loss, sums, model.loss_normalizer(batch))
  metrics.update(optimizer_metrics(state.opt_state, new_state.opt_state))
  metrics.update(norm_metrics(grads, state.params, new_state.params))
  metrics["num_tokens"] = sums.get("weight_sum", jnp.zeros((), jnp.float32))
  metrics["num_examples"] = sums.get("num_examples", jnp.zeros((), jnp.float32))
  return new_state, metrics


def eval_step(params: Any, batch: Batch, *, model: Model) -> dict[str, Any]:
  """Teacher-forced metrics without dropout, as mergeable `clu.metrics`
  (see `eval_metrics`; `metrics.merge_and_compute` turns a list of them into
  numbers)."""
  normalizer = model.loss_normalizer(batch)
  loss, sums = model.loss_fn(params, batch, None, normalizer)
  num_rows = next(iter(jax.tree.leaves(batch))).shape[0]
  return eval_metrics(loss, sums, normalizer, num_rows)


@dataclasses.dataclass
class Trainer:
  """Compiles the train and eval steps for one model on one partitioner.

  Args:
    model: the model wrapper (loss_fn, loss_normalizer).
    partitioner: gives the shardings and the mesh.
    num_microbatches: gradient accumulation steps per update; must divide the
      per-step batch.
    dropout_seed: seed of the dropout keys (folded with the step).
  """

  model: Model
  partitioner: Partitioner
  num_microbatches: int | None = None
  dropout_seed: int = 0

  def validate(self, batch_size: int) -> None:
    """Cheap checks before anything compiles."""
    n = self.num_microbatches
    if n is not None and (n <= 0 or batch_size % n):
      raise UserError(
          f"num_microbatches={n} must be a positive divisor of the batch size {batch_size}.")
    if n and n > 1 and (batch_size // n) % self.partitioner.batch_size_divisor():
      raise UserError(
          f"Each microbatch ({batch_size} / {n} = {batch_size // n} examples) must split "
          f"over the {self.partitioner.batch_size_divisor()} data-parallel devices; "
          "use fewer microbatches or a larger batch.")
    self.model.validate_num_microbatches(n)

  def compile_train_step(self, state_shardings: Any, batch_shardings: Any) -> Any:
    """Returns `step(state, batch) -> (state, metrics)`, jitted with donated state."""
    def step(state, batch):
      return train_step(state, batch, model=self.model, dropout_seed=self.dropout_seed,
                        num_microbatches=self.num_microbatches)
    return self.partitioner.partition(step, in_shardings=(state_shardings, batch_shardings),
                                      out_shardings=(state_shardings, None),
                                      donate_argnums=(0,))

  def compile_eval_step(self, params_shardings: Any, batch_shardings: Any) -> Any:
    """Returns `step(params, batch) -> {name: clu metric}`, jitted."""
    def step(params, batch):
      return eval_step(params, batch, model=self.model)
    return self.partitioner.partition(step, in_shardings=(params_shardings, batch_shardings),
                                      out_shardings=None)
