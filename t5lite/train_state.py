"""TrainState (step, params, optimizer state) and the logical axes of each leaf.

Optimizer-state shardings are derived from the parameters' logical axes, so a
model that names its parameter dimensions never has to describe the state of
the optimizer that trains it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from t5lite import optimizers


@flax.struct.dataclass
class TrainState:
  """Everything a training step reads and writes.

  Attributes:
    step: int32 scalar, number of updates applied.
    params: parameter tree (plain arrays, no logical-partitioning boxes).
    opt_state: optax state of `tx`.
    tx: the optax transformation; static, not saved in checkpoints.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, params: Any, tx: optimizers.Learner, param_axes: Any | None = None
             ) -> "TrainState":
    """A state at step 0 with `tx`'s fresh optimizer state.

    Args:
      params: parameter tree.
      tx: an optax transformation, or a learner that factors by logical axes
        (`optimizers.adafactor`).
      param_axes: the parameters' logical PartitionSpecs, for such a learner;
        without them it can factor by size only.
    """
    tx = optimizers.for_params(tx, params, param_axes)
    return cls(step=jnp.zeros((), jnp.int32), params=params,
               opt_state=tx.init(params), tx=tx)

  def apply_gradients(self, grads: Any) -> "TrainState":
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                        opt_state=opt_state)

  def state_dict(self) -> dict[str, Any]:
    """The checkpointed part of the state."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state}

  def restore_state(self, state: dict[str, Any]) -> "TrainState":
    return self.replace(step=state["step"], params=state["params"], opt_state=state["opt_state"])


def _drop(axes: tuple, dim: int) -> tuple:
  return axes[:dim] + axes[dim + 1:]


def _factored_dims(shape: Sequence[int]) -> tuple[int, int]:
  # Same choice as optax's adafactor: the two largest dimensions, larger last.
  order = np.argsort(shape)
  return int(order[-2]), int(order[-1])


def _leaf_axes(leaf_shape: tuple, param_shape: tuple, axes: tuple, field: str) -> PartitionSpec:
  """Logical axes of one optimizer-state leaf that mirrors one parameter."""
  if leaf_shape == param_shape:
    return PartitionSpec(*axes)
  if len(leaf_shape) == len(param_shape) and len(axes) == len(param_shape):
    # Statistics that keep every dimension (T5X's Adafactor here): a reduced
    # one has size 1 and is not sharded; the others shard like the parameter.
    kept = [axis if n == m else None for axis, n, m in zip(axes, leaf_shape, param_shape)]
    return PartitionSpec(*kept) if any(a is not None for a in kept) else PartitionSpec()
  if len(leaf_shape) == len(param_shape) - 1 and len(param_shape) >= 2:
    d1, d0 = _factored_dims(param_shape)
    # Adafactor's row statistics drop the largest dim, column statistics the next.
    dropped = {"v_row": d0, "v_col": d1}.get(field)
    candidates = [dropped] if dropped is not None else range(len(param_shape))
    for dim in candidates:
      if tuple(np.delete(np.asarray(param_shape), dim)) == leaf_shape:
        return PartitionSpec(*_drop(axes, dim))
  return PartitionSpec()  # scalars, (1,)-shaped placeholders: replicated


def _mirror_axes(subtree: Any, params: Any, param_axes: Any, field: str) -> Any:
  """Axes for a params-shaped subtree of the optimizer state."""
  def one(leaf, param, spec):
    return _leaf_axes(tuple(np.shape(leaf)), tuple(np.shape(param)), tuple(spec), field)
  return jax.tree.map(one, subtree, params, param_axes)


def _opt_state_axes(node: Any, params: Any, param_axes: Any, field: str = "") -> Any:
  """Walks optimizer state; params-shaped subtrees mirror the params' axes."""
  params_def = jax.tree.structure(params)
  if jax.tree.structure(node) == params_def and params_def.num_leaves > 0:
    return _mirror_axes(node, params, param_axes, field)
  if isinstance(node, tuple) and hasattr(node, "_fields"):  # optax NamedTuple states
    return type(node)(*[_opt_state_axes(getattr(node, f), params, param_axes, f)
                        for f in node._fields])
  if isinstance(node, (tuple, list)):
    return type(node)(_opt_state_axes(n, params, param_axes, field) for n in node)
  if isinstance(node, dict):
    return {k: _opt_state_axes(v, params, param_axes, str(k)) for k, v in node.items()}
  return jax.tree.map(lambda _: PartitionSpec(), node)


def state_logical_axes(state: TrainState, param_axes: Any) -> TrainState:
  """Logical PartitionSpecs for every leaf of `state` (abstract or concrete).

  Args:
    state: a TrainState (e.g. from `jax.eval_shape`).
    param_axes: tree like `state.params` of logical `PartitionSpec`s.

  Returns:
    A TrainState of logical PartitionSpecs: params keep their axes, optimizer
    moments copy them, factored statistics drop the reduced dimension, and
    counters are replicated.
  """
  return state.replace(
      step=PartitionSpec(),
      params=param_axes,
      opt_state=_opt_state_axes(state.opt_state, state.params, param_axes))
