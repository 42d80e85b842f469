"""T5X's Adafactor as an optax transformation, factored by logical axis names.

The update is T5X's `adafactor.Adafactor` step for step (google-research/t5x,
`t5x/adafactor.py`), so a recipe moved from T5X trains the same model and a
T5X run's optimizer state continues here (`interop.t5x`):

  decay  = 1 - (count - step_offset + 1) ** -decay_rate
  v      = decay * v + (1 - decay) * (g^2 + epsilon1), factored into row and
           column statistics v_row, v_col where the factor rules say so
  y      = g / sqrt(v)    (factored: g * (v_row / mean(v_row))^-1/2 * v_col^-1/2)
  y      = y / max(1, rms(y) / clipping_threshold)
  u      = lr * max(rms(param), epsilon2) * y        (multiply_by_parameter_scale)
  m      = beta1 * m + (1 - beta1) * u; u = m        (optional momentum)
  param  = (1 - weight_decay_rate) * param - u

Which dimensions are factored follows each parameter's logical axes through
a rule map (`standard_logical_factor_rules`: `embed` is a row, `mlp`,
`heads`, `kv`, `vocab`, `expert_mlp` are columns, `layers` and `expert` are
batch dimensions that every statistic keeps, `relpos_buckets` is never
factored). T5X applies those rules only to parameters of rank above two or
with a batch axis; a matrix without one falls back to its size heuristic
(factor the two largest dimensions when the smaller is at least
`min_dim_size_to_factor`). t5lite keeps attention kernels as `[embed, heads,
kv]` where T5X's T5.1.1 network keeps `[embed, heads * kv]`, so a
`heads, kv` pair counts as the one `joined_kv` dimension T5X sees: the
same parameter is factored the same way in both.

The root-mean-squares of the parameter scale and of the update clipping
are taken per batch index (per scanned layer, per expert). Statistics keep
every dimension of their parameter (reduced ones with size 1), so they are
sharded like it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5lite import tree_paths
from t5lite.errors import UserError


ROW, COLUMN, BATCH, NONE = "row", "column", "batch", "none"
# T5X's spellings of the four kinds (its `factor_name_to_factordim`).
_KINDS = {"row": ROW, "col": COLUMN, "column": COLUMN, "batch": BATCH, "none": NONE,
          "unfactorized": NONE}
# The axis T5X's T5.1.1 network joins from t5lite's `heads` and `kv`.
_JOINED = ("heads", "kv")


def standard_logical_factor_rules(overrides: Mapping[str, str | None] | None = None
                                  ) -> dict[str, str]:
  """T5X's `standard_logical_factor_rules` plus its Mixture-of-Experts rules.

  The MoE entries are those of T5X's `contrib/moe/adafactor_utils`: an
  expert's weights are factored per expert (`expert` is a batch axis) with
  `expert_mlp` a column. A router kernel's expert dimension is unnamed in
  t5lite (as `unmodeled` in T5X's MoE layers) and is never factored.

  Args:
    overrides: axis name -> 'row', 'column' ('col'), 'batch' or 'none'
      (None), replacing or adding entries.

  Returns:
    axis name -> kind.

  Raises:
    ValueError: an override of another kind.
  """
  rules = {"vocab": COLUMN, "embed": ROW, "mlp": COLUMN, "heads": COLUMN, "kv": COLUMN,
           "joined_kv": COLUMN, "relpos_buckets": NONE, "layers": BATCH, "stack": BATCH,
           "q_wi_fused": COLUMN, "o_wo_fused": COLUMN, "multiquery_heads": COLUMN,
           "kv_fused": COLUMN, "layer_norm_scale": NONE, "mlp_activations": COLUMN,
           "expert": BATCH, "expert_mlp": COLUMN, "unmodeled": NONE, "mlp_embed": ROW}
  rules.update(check_rules(overrides or {}))
  return rules


def _kind(value: str | None, axis: str) -> str:
  if value is None:
    return NONE
  if isinstance(value, str) and value.lower() in _KINDS:
    return _KINDS[value.lower()]
  raise UserError(f"Adafactor factor rule for axis '{axis}' is {value!r}; use 'row', "
                  "'column', 'batch' or 'none'.")


def check_rules(rules: Mapping[str, str | None]) -> dict[str, str]:
  """Axis name -> one of the four kinds, T5X's spellings accepted.

  Raises:
    ValueError: not a mapping, or a kind of another name.
  """
  if not isinstance(rules, Mapping):
    raise UserError(f"Adafactor logical_factor_rules must map axis names to 'row', 'column', "
                    f"'batch' or 'none'; got {rules!r}.")
  return {axis: _kind(kind, axis) for axis, kind in dict(rules).items()}


@dataclasses.dataclass(frozen=True)
class Factoring:
  """How one parameter's second moment is kept.

  Attributes:
    averaging: dimensions the root-mean-squares (parameter scale, clipping)
      average over: all but the batch dimensions.
    rows: dimensions `v_row` keeps (T5X's d1); None when not factored.
    columns: dimensions `v_col` keeps (T5X's d0); None when not factored.
  """

  averaging: tuple[int, ...]
  rows: tuple[int, ...] | None = None
  columns: tuple[int, ...] | None = None

  @property
  def factored(self) -> bool:
    return self.rows is not None


def _joined_groups(axes: tuple[str | None, ...]) -> list[tuple[int, ...]]:
  """Dimensions as T5X's network has them: a `heads, kv` pair is one."""
  groups, i = [], 0
  while i < len(axes):
    if tuple(axes[i:i + 2]) == _JOINED:
      groups.append((i, i + 1))
      i += 2
    else:
      groups.append((i,))
      i += 1
  return groups


def _heuristic(shape: tuple[int, ...], axes: tuple[str | None, ...] | None,
               min_dim_size_to_factor: int) -> Factoring | None:
  """T5X's size heuristic on the parameter as T5X's network shapes it; None
  above rank two, where T5X has no heuristic."""
  everything = tuple(range(len(shape)))
  groups = _joined_groups(axes) if axes is not None else [(d,) for d in everything]
  if len(groups) > 2:
    return None
  if len(groups) < 2:
    return Factoring(everything)
  sizes = [int(np.prod([shape[d] for d in group])) for group in groups]
  order = np.argsort(sizes)  # as T5X: ties keep the first dimension as the row
  if sizes[order[-2]] < min_dim_size_to_factor:
    return Factoring(everything)
  return Factoring(everything, groups[order[-2]], groups[order[-1]])


def factoring(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...] | None,
              rules: Mapping[str, str] | None, factored: bool = True,
              min_dim_size_to_factor: int = 128) -> Factoring:
  """T5X's choice of factored and averaged dimensions for one parameter.

  Args:
    name: the parameter's path, for messages.
    shape: its shape.
    axes: its logical axis names (None for an unnamed dimension), or None
      when unknown (then only T5X's size heuristic is available).
    rules: axis name -> kind (`standard_logical_factor_rules`), or None for
      the heuristic alone (T5X's `logical_factor_rules=None`).
    factored: False keeps every second moment whole.
    min_dim_size_to_factor: the heuristic's smallest factored dimension.

  Returns:
    The parameter's `Factoring`.

  Raises:
    ValueError: an axis the rules do not name, rows and columns beside an
      unfactored dimension, or a parameter of rank above two without rules.
  """
  everything = tuple(range(len(shape)))
  if not factored:
    return Factoring(everything)
  if rules is None or axes is None:
    plan = _heuristic(shape, axes, min_dim_size_to_factor)
    if plan is None:
      raise UserError(
          f"Adafactor cannot factor {name} {shape} by size alone (rank above two): give it "
          "logical_factor_rules (optimizers.standard_logical_factor_rules()) and build the "
          "train state with the parameters' logical axes.")
    return plan
  kinds = []
  for axis in axes:
    if axis is None:
      kinds.append(NONE)  # an unnamed dimension, T5X's 'unmodeled'
    elif axis in rules:
      kinds.append(rules[axis])
    else:
      raise UserError(f"Adafactor has no factor rule for axis '{axis}' of {name} {axes}: add "
                      f"it to logical_factor_rules, e.g. {{'{axis}': 'none'}}.")
  if ROW in kinds and COLUMN in kinds and NONE in kinds:
    raise UserError(f"Adafactor factor rules give {name} {axes} rows, columns and an "
                    f"unfactored dimension ({kinds}); T5X refuses such a parameter.")
  if ROW not in kinds or COLUMN not in kinds:
    kinds = [NONE if kind in (ROW, COLUMN) else kind for kind in kinds]
  batch = tuple(d for d, kind in enumerate(kinds) if kind == BATCH)
  if not batch and len(_joined_groups(axes)) <= 2:
    return _heuristic(shape, axes, min_dim_size_to_factor)
  averaging = tuple(d for d in everything if d not in batch)
  rows = tuple(d for d, kind in enumerate(kinds) if kind == ROW)
  columns = tuple(d for d, kind in enumerate(kinds) if kind == COLUMN)
  if not rows:
    return Factoring(averaging)
  return Factoring(averaging, rows, columns)


class AdafactorState(NamedTuple):
  """State of `scale_by_t5x_adafactor`; each field but `count` mirrors the params.

  A parameter keeps `v_row`/`v_col` (its shape with the column / row
  dimensions of size 1) when factored, else `v` (its shape); the unused
  fields, and `m` without momentum, hold size-1 placeholders of the same
  rank.
  """

  count: jax.Array
  v_row: Any
  v_col: Any
  v: Any
  m: Any


def _reduced(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(1 if d in dims else n for d, n in enumerate(shape))


def _placeholder(param: jax.Array) -> jax.Array:
  return jnp.zeros((1,) * param.ndim, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Hyperparams:
  """T5X's Adafactor settings (see `optimizers.adafactor` for each)."""

  decay_rate: float = 0.8
  step_offset: int = 0
  clipping_threshold: float | None = 1.0
  multiply_by_parameter_scale: bool | Callable[[str], bool] = True
  beta1: float | None = None
  epsilon1: float = 1e-30
  epsilon2: float = 1e-3
  weight_decay_rate: float | None = None
  weight_decay_rate_lr_exponent: float | None = None
  global_norm_clip_threshold: float | None = None
  max_parameter_scale: float | None = None
  skip_nan_updates: bool = False
  dtype_momentum: Any = jnp.float32


def _second_moment(g: jax.Array, v_row, v_col, v, plan: Factoring, decay, epsilon1: float):
  """The normalised gradient y and the new statistics (T5X's formulas)."""
  mixing = 1.0 - decay
  grad_sqr = g * g + epsilon1
  if plan.factored:
    new_v_row = decay * v_row + mixing * jnp.mean(grad_sqr, axis=plan.columns, keepdims=True)
    new_v_col = decay * v_col + mixing * jnp.mean(grad_sqr, axis=plan.rows, keepdims=True)
    row_col_mean = jnp.mean(new_v_row, axis=plan.rows, keepdims=True)
    row_factor = (new_v_row / row_col_mean) ** -0.5
    col_factor = new_v_col ** -0.5
    return g * row_factor * col_factor, new_v_row, new_v_col, v
  new_v = decay * v + mixing * grad_sqr
  return g * new_v ** -0.5, v_row, v_col, new_v


def _global_norm_clip(grads: list[jax.Array], threshold: float | None) -> list[jax.Array]:
  if not threshold:
    return grads
  norm = jnp.sqrt(jnp.sum(jnp.array([jnp.sum(jnp.square(g)) for g in grads])))
  scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / norm)
  return [g * scale for g in grads]


def scale_by_t5x_adafactor(learning_rate: jax.Array | float, plans: Any, names: Any,
                           hp: Hyperparams) -> optax.GradientTransformation:
  """The whole T5X Adafactor step, learning rate included (T5X's momentum
  accumulates updates that already carry the rate, so it cannot be chained
  after a separate scale).

  Args:
    learning_rate: this step's rate.
    plans: a tree like the parameters of `Factoring`s.
    names: a tree like the parameters of their '/'-joined paths.
    hp: the settings.

  Returns:
    An optax transformation whose updates are `new_param - param`.
  """
  def init(params):
    def slots(param, plan):
      rows = _reduced(param.shape, plan.columns) if plan.factored else None
      cols = _reduced(param.shape, plan.rows) if plan.factored else None
      return (jnp.zeros(rows, jnp.float32) if rows else _placeholder(param),
              jnp.zeros(cols, jnp.float32) if cols else _placeholder(param),
              _placeholder(param) if plan.factored else jnp.zeros(param.shape, jnp.float32),
              jnp.zeros(param.shape, hp.dtype_momentum) if hp.beta1 is not None
              else _placeholder(param))
    flat = [slots(p, plan) for p, plan in zip(jax.tree.leaves(params), _leaves(plans))]
    treedef = jax.tree.structure(params)
    return AdafactorState(jnp.zeros([], jnp.int32),
                          *[jax.tree.unflatten(treedef, [s[i] for s in flat]) for i in range(4)])

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("Adafactor needs the parameters: call update(grads, state, params).")
    treedef = jax.tree.structure(params)
    leaves = [jax.tree.leaves(t) for t in (params, state.v_row, state.v_col, state.v, state.m)]
    grads = _global_norm_clip([g.astype(jnp.float32) for g in jax.tree.leaves(grads)],
                              hp.global_norm_clip_threshold)
    t = (state.count - hp.step_offset).astype(jnp.float32) + 1.0
    decay = 1.0 - t ** (-hp.decay_rate)
    weight_decay = hp.weight_decay_rate
    if hp.weight_decay_rate_lr_exponent:
      weight_decay = (weight_decay or 1.0) * learning_rate ** hp.weight_decay_rate_lr_exponent
    rates = _StepRates(decay, learning_rate, weight_decay)
    out = [_param_update(g, param, tuple(slots), plan, name, rates, hp)
           for g, param, *slots, plan, name in zip(grads, *leaves, _leaves(plans),
                                                   jax.tree.leaves(names))]
    tree = lambda i: jax.tree.unflatten(treedef, [o[i] for o in out])  # noqa: E731
    return tree(0), AdafactorState(state.count + 1, tree(1), tree(2), tree(3), tree(4))

  return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class _StepRates:
  """What one step applies to every parameter: the second-moment decay, the
  learning rate and the weight decay (None for none)."""

  decay: Any
  learning_rate: Any
  weight_decay: Any


def _param_update(g, param, slots: tuple, plan: Factoring, name: str, rates: _StepRates,
                  hp: Hyperparams) -> tuple:
  """One parameter's (update, v_row, v_col, v, m) from its slots (v_row,
  v_col, v, m), as T5X's apply_param_gradient."""
  v_row, v_col, v, m = slots
  decay, weight_decay = rates.decay, rates.weight_decay
  update_scale = rates.learning_rate
  by_scale = hp.multiply_by_parameter_scale
  if callable(by_scale):
    by_scale = by_scale(name)
  if by_scale:
    param_scale = jnp.sqrt(jnp.mean(param * param, axis=plan.averaging, keepdims=True))
    param_scale = jnp.maximum(param_scale, hp.epsilon2)
    if hp.max_parameter_scale is not None:
      param_scale = jnp.minimum(param_scale, hp.max_parameter_scale)
    update_scale = update_scale * param_scale
  y, new_v_row, new_v_col, new_v = _second_moment(g, v_row, v_col, v, plan, decay, hp.epsilon1)
  if hp.clipping_threshold is not None:
    rms = jnp.sqrt(jnp.mean(y * y, axis=plan.averaging, keepdims=True))
    y = y / jnp.maximum(1.0, rms / hp.clipping_threshold)
  subtrahend = update_scale * y
  new_m = m
  if hp.beta1 is not None:
    subtrahend = hp.beta1 * m + (1.0 - hp.beta1) * subtrahend
    new_m = subtrahend.astype(hp.dtype_momentum)
  # optax adds the update to the parameter. Without weight decay that is
  # `param + (-subtrahend)`, bitwise T5X's `param - subtrahend`.
  update = -subtrahend
  if weight_decay is not None:
    update = ((1.0 - weight_decay) * param - subtrahend) - param
  update = update.astype(param.dtype)
  if hp.skip_nan_updates:
    keep = lambda new, old: jnp.where(jnp.isnan(new), old, new)  # noqa: E731
    new_v_row, new_v_col, new_v, new_m = (keep(new_v_row, v_row), keep(new_v_col, v_col),
                                          keep(new_v, v), keep(new_m, m))
    update = jnp.where(jnp.isnan(param + update), jnp.zeros_like(update), update)
  return update, new_v_row, new_v_col, new_v, new_m


def _leaves(plans: Any) -> list[Factoring]:
  return jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, Factoring))


def plan_tree(params: Any, param_axes: Any | None, rules: Mapping[str, str] | None,
              factored: bool, min_dim_size_to_factor: int) -> tuple[Any, Any]:
  """(`Factoring` per parameter, '/'-joined name per parameter), trees like `params`.

  Args:
    params: parameters or their ShapeDtypeStructs.
    param_axes: a tree like `params` of logical PartitionSpecs, or None.
    rules: see `factoring`.
    factored: see `factoring`.
    min_dim_size_to_factor: see `factoring`.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  axes = ([None] * len(flat) if param_axes is None else
          jax.tree.leaves(param_axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  if len(axes) != len(flat):
    # The axes come from the same model as the parameters: a bug, not input.
    raise RuntimeError(f"{len(axes)} logical axis specs for {len(flat)} parameters.")
  names = [tree_paths.path_name(path) for path, _ in flat]
  plans = [factoring(name, tuple(leaf.shape), None if spec is None else tuple(spec), rules,
                     factored, min_dim_size_to_factor)
           for name, (_, leaf), spec in zip(names, flat, axes)]
  return jax.tree.unflatten(treedef, plans), jax.tree.unflatten(treedef, names)
