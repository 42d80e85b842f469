"""Learners (optax transformations) and learning-rate schedules, gin-bindable.

Learners: `adafactor` (T5X's Adafactor, factored by logical axes: see
`t5lite.adafactor`), `adamw` (decoupled weight decay) and `adastar` (factored
second moment, update clipping, update momentum). `adafactor` needs the
parameters' logical axes, so it is a `ByLogicalAxes` learner that
`TrainState.create` turns into an optax transformation (`for_params`).
Wrappers that compose with any of them: `clip_by_global_norm`,
`skip_and_clip_by_global_norm` (drops steps whose gradient norm is too large
and counts them) and `scale_updates_by_path` (muP-style per-parameter update
scales chosen by regular expressions on parameter paths). Learning-rate
schedules include T5X's `create_learning_rate_scheduler`.

Every learner wraps its learning rate with `optax.inject_hyperparams`, so the
rate applied at a step lives in the optimizer state and the trainer logs
exactly that value (`learning_rate_from_state`), whatever wraps the learner.

Weight decay of `adamw` and `adastar` follows the learning rate: a step
subtracts `lr(step) * weight_decay * scale(path) * param` (the torch.optim.AdamW and
optax.adamw convention), so it decays with the schedule and is proportional
to the peak rate. For a decay of `d` per step at the peak, set
`weight_decay = d / peak_learning_rate`. `adafactor`'s `weight_decay_rate`
is T5X's: not scaled by the learning rate.

Parameter paths are '/'-joined keys such as
'encoder/layers_0/attention/query/kernel'. Path rules are ordered
(regex, scale) pairs (or a dict in that order); the first regex that matches
the whole path (`re.fullmatch`) gives the scale, and paths no regex matches get
1.0. A regex that matches no parameter at all is an error, so a typo cannot
silently do nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5lite import adafactor as adafactor_lib
from t5lite import tree_paths
from t5lite.errors import UserError


Schedule = optax.Schedule
PathScales = Union[Mapping[str, float], Sequence[tuple[str, float]]]


class ByLogicalAxes(NamedTuple):
  """A learner whose transformation depends on each parameter's logical axes
  (T5X's Adafactor factors by them); `for_params` builds it.

  Attributes:
    build: (params or their shapes, tree of logical PartitionSpecs or None)
      -> optax transformation.
  """

  build: Callable[[Any, Any | None], optax.GradientTransformation]


Learner = Union[optax.GradientTransformation, ByLogicalAxes]


def for_params(optimizer: Learner, params: Any, param_axes: Any | None
               ) -> optax.GradientTransformation:
  """The optax transformation of `optimizer` for these parameters.

  Args:
    optimizer: a learner of this module (or any optax transformation).
    params: the parameters, or their ShapeDtypeStructs.
    param_axes: a tree like `params` of logical PartitionSpecs; None when
      unknown (T5X's Adafactor then factors by size alone).

  Returns:
    An optax transformation.
  """
  if isinstance(optimizer, ByLogicalAxes):
    return optimizer.build(params, param_axes)
  return optimizer


def _wrap(optimizer: Learner, wrapper: Callable[[optax.GradientTransformation],
                                                optax.GradientTransformation]) -> Learner:
  """`wrapper(optimizer)`, deferred until the axes are known when it needs them."""
  if isinstance(optimizer, ByLogicalAxes):
    return ByLogicalAxes(lambda params, axes: wrapper(optimizer.build(params, axes)))
  return wrapper(optimizer)


def standard_logical_factor_rules(overrides: Mapping[str, str | None] | None = None
                                  ) -> dict[str, str]:
  """T5X's Adafactor factor rules by logical axis (see `t5lite.adafactor`).

  From gin: `optimizers.adafactor.logical_factor_rules =
  @optimizers.standard_logical_factor_rules()`, with
  `optimizers.standard_logical_factor_rules.overrides = {'expert': 'none'}`
  to change an entry.
  """
  return adafactor_lib.standard_logical_factor_rules(overrides)


# ---------------------------------------------------------------------------
# Schedules


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


_T5X_FACTORS = ("constant", "linear_warmup", "linear_decay", "rsqrt_decay",
                "rsqrt_normalized_decay", "decay_every", "cosine_decay")


def create_learning_rate_scheduler(factors: str = "constant * linear_warmup * rsqrt_decay",
                                   base_learning_rate: float = 0.5,
                                   warmup_steps: int = 1000,
                                   decay_factor: float = 0.5,
                                   steps_per_decay: int = 20000,
                                   steps_per_cycle: int = 100000,
                                   step_offset: int = 0,
                                   min_learning_rate: float = 1e-8) -> Schedule:
  """T5X's `utils.create_learning_rate_scheduler`: a product of named factors.

  Same names, defaults and values step for step as T5X, where the step is
  the number of updates already applied (0 for the first). With s =
  max(0, step - step_offset):

  - constant: base_learning_rate
  - linear_warmup: min(1, s / warmup_steps)
  - linear_decay: base_learning_rate * min(s / warmup_steps,
    1 + decay_factor * (warmup_steps - s)) (T5X: implies the warmup, use alone)
  - rsqrt_decay: 1 / sqrt(max(s, warmup_steps))
  - rsqrt_normalized_decay: sqrt(warmup_steps) / sqrt(max(s, warmup_steps))
  - decay_every: decay_factor ** (s // steps_per_decay)
  - cosine_decay: max(0, (1 + cos(pi * (p % 1))) / 2), p = max(0, (s -
    warmup_steps) / steps_per_cycle) (a cycle restarts at full rate)

  and the product is at least `min_learning_rate`.

  Args:
    factors: factor names joined by '*', e.g. 'constant * rsqrt_decay'.
    base_learning_rate: the constant.
    warmup_steps: see the factors.
    decay_factor: see linear_decay and decay_every.
    steps_per_decay: see decay_every.
    steps_per_cycle: see cosine_decay.
    step_offset: steps subtracted first (T5X: the step a fine-tune starts at).
    min_learning_rate: lower bound of the rate.

  Returns:
    A schedule mapping step -> float32 learning rate.

  Raises:
    ValueError: an unknown factor, or a step count that would divide by zero.
  """
  names = [name.strip() for name in factors.split("*")]
  unknown = [name for name in names if name not in _T5X_FACTORS]
  if unknown:
    raise UserError(f"create_learning_rate_scheduler factor(s) {unknown} in '{factors}' are "
                    f"unknown; choose from {', '.join(_T5X_FACTORS)}.")
  needs = {"linear_warmup": warmup_steps, "linear_decay": warmup_steps,
           "decay_every": steps_per_decay, "cosine_decay": steps_per_cycle}
  for name in names:
    if name in needs and needs[name] <= 0:
      raise UserError(f"create_learning_rate_scheduler factor '{name}' needs a positive "
                      f"step count; got warmup_steps={warmup_steps}, steps_per_decay="
                      f"{steps_per_decay}, steps_per_cycle={steps_per_cycle}.")

  def schedule(step):
    # The same operations as T5X, on an integer step, so the float32 values
    # are T5X's.
    step = jnp.maximum(0, jnp.asarray(step) - step_offset)
    value = 1.0
    for name in names:
      if name == "constant":
        value *= base_learning_rate
      elif name == "linear_warmup":
        value *= jnp.minimum(1.0, step / warmup_steps)
      elif name == "linear_decay":
        value *= base_learning_rate * jnp.minimum(step / warmup_steps,
                                                  1.0 + decay_factor * (warmup_steps - step))
      elif name == "rsqrt_decay":
        value /= jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "rsqrt_normalized_decay":
        value *= jnp.sqrt(warmup_steps)
        value /= jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "decay_every":
        value *= decay_factor ** (step // steps_per_decay)
      else:  # cosine_decay
        progress = jnp.maximum(0.0, (step - warmup_steps) / float(steps_per_cycle))
        value *= jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0))))
    return jnp.asarray(jnp.maximum(value, min_learning_rate), dtype=jnp.float32)
  return schedule


def _resolve_warmup(warmup_steps: int | None, warmup_fraction: float | None,
                    decay_steps: int | None) -> tuple[int, int]:
  """(warmup_steps, decay_steps) of `warmup_cosine`, checked."""
  if decay_steps is None:
    raise UserError("warmup_cosine needs decay_steps, the step the cosine ends at "
                    "(usually %TRAIN_STEPS).")
  if (warmup_steps is None) == (warmup_fraction is None):
    raise UserError(
        f"warmup_cosine got warmup_steps={warmup_steps} and warmup_fraction={warmup_fraction}; "
        "set exactly one of them (bind the other to None).")
  if warmup_fraction is not None:
    if not 0.0 <= warmup_fraction < 1.0:
      raise UserError(f"warmup_fraction={warmup_fraction} must be in [0, 1).")
    warmup_steps = int(warmup_fraction * decay_steps)
  if warmup_steps < 0 or decay_steps <= warmup_steps:
    raise UserError(f"decay_steps={decay_steps} must exceed warmup_steps={warmup_steps} "
                    "(and warmup_steps must not be negative).")
  return warmup_steps, decay_steps


def warmup_cosine(peak_value: float, warmup_steps: int | None = None,
                  decay_steps: int | None = None, alpha: float = 0.0, begin_value: float = 0.0,
                  warmup_fraction: float | None = None) -> Schedule:
  """Linear warmup from `begin_value` to `peak_value`, then cosine to alpha * peak.

  Args:
    peak_value: rate at the end of warmup.
    warmup_steps: length of the linear warmup.
    decay_steps: total steps of warmup + decay (required); the rate stays at
      the final value afterwards.
    alpha: final rate as a fraction of `peak_value`.
    begin_value: rate at step 0.
    warmup_fraction: instead of `warmup_steps`, the warmup as a fraction of
      `decay_steps` (rounded down), so one recipe fits runs of any length.

  Returns:
    A schedule mapping step -> learning rate.

  Raises:
    ValueError: decay_steps missing or not greater than the warmup, both or
      neither of warmup_steps and warmup_fraction set, a fraction outside
      [0, 1), or a negative alpha.
  """
  warmup_steps, decay_steps = _resolve_warmup(warmup_steps, warmup_fraction, decay_steps)
  if alpha < 0:
    raise UserError(f"alpha={alpha} (final rate as a fraction of the peak) must be >= 0.")
  return optax.warmup_cosine_decay_schedule(
      init_value=begin_value, peak_value=peak_value, warmup_steps=warmup_steps,
      decay_steps=decay_steps, end_value=alpha * peak_value)


def constant(value: float) -> Schedule:
  """The same rate at every step."""
  return optax.constant_schedule(value)


def linear_decay(init_value: float, end_value: float, decay_steps: int,
                 begin_step: int = 0) -> Schedule:
  """`init_value` until `begin_step`, then linear to `end_value` over `decay_steps`.

  As a factor of `multiply_schedules` this is T5X's linear cooldown, e.g.
  `linear_decay(1.0, 0.0, 1000, begin_step=9000)`.

  Args:
    init_value: value up to `begin_step`.
    end_value: value from `begin_step + decay_steps` on.
    decay_steps: length of the linear part.
    begin_step: step the decay starts at.

  Returns:
    A schedule mapping step -> value.

  Raises:
    ValueError: decay_steps not positive or begin_step negative.
  """
  if decay_steps <= 0 or begin_step < 0:
    raise UserError(f"linear_decay needs decay_steps > 0 and begin_step >= 0, got "
                    f"decay_steps={decay_steps}, begin_step={begin_step}.")
  return optax.linear_schedule(init_value, end_value, decay_steps, transition_begin=begin_step)


def multiply_schedules(schedules: Sequence[Schedule | float]) -> Schedule:
  """The product of schedules (and constant factors), step by step.

  From gin: `LEARNING_RATE = @optimizers.multiply_schedules()` with
  `optimizers.multiply_schedules.schedules = [@optimizers.rsqrt_with_warmup(),
  @optimizers.linear_decay()]`.

  Args:
    schedules: schedules or numbers; at least one.

  Returns:
    A schedule mapping step -> product of the factors at that step.

  Raises:
    ValueError: no factors, or a factor that is neither callable nor a number.
  """
  factors = list(schedules)
  if not factors:
    raise UserError("multiply_schedules needs at least one schedule or number.")
  for factor in factors:
    if not callable(factor) and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
      raise UserError(f"multiply_schedules factor {factor!r} must be a schedule or a number.")

  def schedule(step):
    value = jnp.ones((), jnp.float32)
    for factor in factors:
      value = value * (factor(step) if callable(factor) else factor)
    return value
  return schedule


# ---------------------------------------------------------------------------
# Per-parameter rules by path


class _PathRule(NamedTuple):
  pattern: re.Pattern
  scale: float


def _compile_path_rules(rules: PathScales | None, argument: str) -> tuple[_PathRule, ...]:
  """Checks and compiles (regex, scale) pairs; `argument` names them in errors."""
  if rules is None:
    return ()
  entries = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
  compiled = []
  for entry in entries:
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
      raise UserError(f"{argument} entry {entry!r} must be a (regex, scale) pair, e.g. "
                      "('.*/mlp/.*', 0.5).")
    regex, scale = entry
    try:
      pattern = re.compile(regex)
    except re.error as e:
      raise UserError(f"{argument} regex '{regex}' does not compile: {e}.") from None
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
        or not math.isfinite(scale) or scale < 0):
      raise UserError(f"{argument} scale for '{regex}' must be a finite number >= 0, "
                      f"got {scale!r}.")
    compiled.append(_PathRule(pattern, float(scale)))
  return tuple(compiled)


def _paths(tree: Any) -> list[str]:
  return [tree_paths.path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _scales_by_path(tree: Any, rules: tuple[_PathRule, ...]) -> Any:
  """A tree like `tree` of Python floats: the first matching rule's scale, else 1."""
  def scale(path, _):
    name = tree_paths.path_name(path)
    return next((r.scale for r in rules if r.pattern.fullmatch(name)), 1.0)
  return jax.tree_util.tree_map_with_path(scale, tree)


def _check_rules_match(tree: Any, rules: tuple[_PathRule, ...], argument: str) -> None:
  paths = _paths(tree)
  for rule in rules:
    if not any(rule.pattern.fullmatch(p) for p in paths):
      examples = ", ".join(f"'{p}'" for p in paths[:3])
      raise UserError(
          f"{argument} regex '{rule.pattern.pattern}' matches no parameter; it must match a "
          f"whole '/'-joined path such as {examples}.")


def _add_scaled_decayed_weights(weight_decay: float, rules: tuple[_PathRule, ...]
                                ) -> optax.GradientTransformation:
  """updates + weight_decay * scale(path) * params (before the learning rate)."""
  def init(params):
    _check_rules_match(params, rules, "weight_decay_scales")
    return optax.EmptyState()

  def update(updates, state, params=None):
    if not weight_decay:
      return updates, state
    if params is None:
      raise ValueError("Weight decay needs the parameters: call update(grads, state, params).")
    scales = _scales_by_path(params, rules)
    updates = jax.tree.map(lambda u, p, s: u + (weight_decay * s) * p, updates, params, scales)
    return updates, state
  return optax.GradientTransformation(init, update)


def _scale_by_path(rules: tuple[_PathRule, ...]) -> optax.GradientTransformation:
  def init(params):
    _check_rules_match(params, rules, "scale_updates_by_path scales")
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    scales = _scales_by_path(updates, rules)
    return jax.tree.map(lambda u, s: u * s if s != 1.0 else u, updates, scales), state
  return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------
# Adastar


class AdastarState(NamedTuple):
  """State of `scale_by_adastar`; None fields are disabled moments.

  v_row / v_col hold factored statistics and v the full second moment; each
  parameter uses one kind and keeps (1,)-shaped placeholders in the other
  (as optax's adafactor), so every field mirrors the parameter tree.
  """

  count: jax.Array
  gradient_ema: Any
  v_row: Any
  v_col: Any
  v: Any
  update_ema: Any


def _factored_dims(shape: Sequence[int], factored: bool, min_dim_size_to_factor: int
                   ) -> tuple[int, int] | None:
  """(second largest, largest) dimension, as optax's adafactor; None: not factored."""
  if not factored or len(shape) < 2:
    return None
  order = np.argsort(shape)
  if shape[order[-2]] < min_dim_size_to_factor:
    return None
  return int(order[-2]), int(order[-1])


def _init_second_moment(param: jax.Array, dims: tuple[int, int] | None) -> tuple:
  placeholder = jnp.zeros((1,), param.dtype)
  if dims is None:
    return placeholder, placeholder, jnp.zeros_like(param)
  d1, d0 = dims
  shape = np.asarray(param.shape)
  return (jnp.zeros(tuple(np.delete(shape, d0)), param.dtype),
          jnp.zeros(tuple(np.delete(shape, d1)), param.dtype), placeholder)


def _update_second_moment(g2: jax.Array, v_row: jax.Array, v_col: jax.Array, v: jax.Array,
                          decay: float, dims: tuple[int, int] | None) -> tuple:
  """EMA of squared gradients; returns (estimate shaped like g2, v_row, v_col, v)."""
  if dims is None:
    v = decay * v + (1 - decay) * g2
    return v, v_row, v_col, v
  d1, d0 = dims
  v_row = decay * v_row + (1 - decay) * jnp.mean(g2, axis=d0)  # d0 (largest) reduced
  v_col = decay * v_col + (1 - decay) * jnp.mean(g2, axis=d1)  # d1 reduced
  row_mean = jnp.mean(v_row, axis=d1 - 1 if d1 > d0 else d1, keepdims=True)
  # Rank-one reconstruction: row statistics times column statistics over their mean.
  estimate = jnp.expand_dims(v_row / row_mean, d0) * jnp.expand_dims(v_col, d1)
  return estimate, v_row, v_col, v


def _ema(values: Any, accumulator: Any, decay: float) -> Any:
  return jax.tree.map(lambda x, a: decay * a + (1 - decay) * x, values, accumulator)


def _debiased(tree: Any, decay: float, count: jax.Array) -> Any:
  correction = 1 - decay ** count.astype(jnp.float32)
  return jax.tree.map(lambda x: x / correction.astype(x.dtype), tree)


def _clip_by_block_rms(tree: Any, threshold: float | None) -> Any:
  """Scales each leaf so that its root-mean-square is at most `threshold`."""
  if threshold is None:
    return tree

  def clip(u):
    rms = jnp.sqrt(jnp.mean(jnp.square(u)))
    return u / jnp.maximum(1.0, rms / threshold)
  return jax.tree.map(clip, tree)


def _pick(results: Any, like: Any, index: int) -> Any:
  """Field `index` of a tree of tuples whose outer structure is `like`'s."""
  return jax.tree.map(lambda _, r: r[index], like, results)


def scale_by_adastar(gradient_ema_decay: float | None = None, gradient_ema_debias: bool = True,
                     gradient_square_ema_decay: float = 0.99,
                     gradient_square_ema_debias: bool = True, eps: float = 0.0,
                     eps_square: float = 1e-30, update_clipping_threshold: float | None = 1.0,
                     update_ema_decay: float | None = 0.9, update_ema_debias: bool = False,
                     factored: bool = True, min_dim_size_to_factor: int = 128
                     ) -> optax.GradientTransformation:
  """The normalised, clipped and smoothed update of `adastar` (no rate, no decay).

  m = ema(g), v = ema(g^2 + eps_square) (factored for large matrices),
  u = clip_rms(m / (sqrt(v) + eps)), update = ema(u); each EMA optionally
  debiased. Arguments are those of `adastar`.
  """
  def init(params):
    moments = jax.tree.map(lambda p: _init_second_moment(
        p, _factored_dims(p.shape, factored, min_dim_size_to_factor)), params)
    def zeros(decay):
      return None if decay is None else jax.tree.map(jnp.zeros_like, params)
    return AdastarState(jnp.zeros([], jnp.int32), zeros(gradient_ema_decay),
                        _pick(moments, params, 0), _pick(moments, params, 1),
                        _pick(moments, params, 2), zeros(update_ema_decay))

  def second_moment(grads, state, count):
    def leaf(g, v_row, v_col, v):
      dims = _factored_dims(g.shape, factored, min_dim_size_to_factor)
      return _update_second_moment(jnp.square(g) + eps_square, v_row, v_col, v,
                                   gradient_square_ema_decay, dims)
    results = jax.tree.map(leaf, grads, state.v_row, state.v_col, state.v)
    estimate = _pick(results, grads, 0)
    if gradient_square_ema_debias:
      estimate = _debiased(estimate, gradient_square_ema_decay, count)
    return estimate, [_pick(results, grads, i) for i in (1, 2, 3)]

  def update(grads, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    gradient_ema, smoothed = state.gradient_ema, grads
    if gradient_ema_decay is not None:
      gradient_ema = smoothed = _ema(grads, state.gradient_ema, gradient_ema_decay)
      if gradient_ema_debias:
        smoothed = _debiased(gradient_ema, gradient_ema_decay, count)
    estimate, (v_row, v_col, v) = second_moment(grads, state, count)
    raw = jax.tree.map(lambda m, s: m / (jnp.sqrt(s) + eps), smoothed, estimate)
    updates = update_ema = _clip_by_block_rms(raw, update_clipping_threshold)
    if update_ema_decay is not None:
      update_ema = updates = _ema(updates, state.update_ema, update_ema_decay)
      if update_ema_debias:
        updates = _debiased(update_ema, update_ema_decay, count)
    else:
      update_ema = None
    return updates, AdastarState(count, gradient_ema, v_row, v_col, v, update_ema)
  return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------
# Learners


def _inject_learning_rate(factory, learning_rate, **kwargs) -> optax.GradientTransformation:
  """Only the learning rate becomes state; other arguments stay static Python
  values (adafactor branches on some of them at trace time)."""
  def inner(learning_rate):
    return factory(learning_rate=learning_rate, **kwargs)
  return optax.inject_hyperparams(inner)(learning_rate=learning_rate)


def _check_decay(value: float | None, name: str) -> None:
  if value is not None and not 0.0 <= value < 1.0:
    raise UserError(f"{name}={value} must be in [0, 1) (or None where allowed).")


def _check_positive(value: float | None, name: str, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if value is None or not value > 0:
    raise UserError(f"{name}={value} must be a positive number"
                    + (" (or None to disable)." if allow_none else "."))


def adafactor(learning_rate: Schedule | float, *,
              factored: bool = True,
              multiply_by_parameter_scale: bool | Sequence[tuple[str, bool]] = True,
              beta1: float | None = None,
              decay_rate: float = 0.8,
              step_offset: int = 0,
              clipping_threshold: float | None = 1.0,
              weight_decay_rate: float | None = None,
              min_dim_size_to_factor: int = 128,
              epsilon1: float = 1e-30,
              epsilon2: float = 1e-3,
              dtype_momentum: str = "float32",
              logical_factor_rules: Mapping[str, str | None] | str | None = "standard",
              weight_decay_rate_lr_exponent: float | None = None,
              global_norm_clip_threshold: float | None = None,
              max_parameter_scale: float | None = None,
              skip_nan_updates: bool = False) -> ByLogicalAxes:
  """T5X's Adafactor (`t5x.adafactor.Adafactor`), with T5X's argument names.

  The algorithm and the factoring by logical axes are described in
  `t5lite.adafactor`. Every argument means what it means in T5X; a recipe
  moved from a T5X gin file keeps its values.

  Args:
    learning_rate: schedule or constant (T5X's `learning_rate_fn`).
    factored: factor second moments at all.
    multiply_by_parameter_scale: scale each update by max(rms(param),
      epsilon2); or T5X's HParamMap rules, ordered (regex, bool) pairs on
      '/'-joined parameter paths (the first that `re.search`es the path).
    beta1: momentum of the updates (None: no momentum, no memory for it).
    decay_rate: second-moment decay is 1 - (t + 1)^-decay_rate at step t.
    step_offset: steps before this one do not count towards the decay
      (T5X: set it to the pretraining steps to reset it for a fine-tune).
    clipping_threshold: clip each update to this root-mean-square; None
      disables.
    weight_decay_rate: param *= (1 - rate) each step (not scaled by the
      learning rate, as in T5X); None disables.
    min_dim_size_to_factor: the size heuristic factors a matrix only when
      its smaller dimension is at least this.
    epsilon1: added to squared gradients.
    epsilon2: smallest parameter scale.
    dtype_momentum: dtype of the momentum slots.
    logical_factor_rules: axis name -> 'row' / 'column' / 'batch' / 'none';
      'standard' (the default) is `standard_logical_factor_rules()`, which
      T5X's T5.1.1 gin files bind; None gives T5X's size heuristic alone
      (T5X's Python default), which cannot factor a parameter of rank above
      two.
    weight_decay_rate_lr_exponent: decay = (weight_decay_rate or 1) *
      lr ** exponent.
    global_norm_clip_threshold: clip gradients to this global norm first.
    max_parameter_scale: largest parameter scale.
    skip_nan_updates: keep a parameter's old value (and slots) wherever the
      update would make it NaN.

  Returns:
    A learner that becomes an optax transformation once the parameters'
    logical axes are known (`for_params`).

  Raises:
    ValueError: decay_rate not positive, a negative epsilon or offset, a
      beta1 outside [0, 1), a non-positive threshold, a malformed rule.
  """
  if decay_rate <= 0 or epsilon1 < 0 or epsilon2 < 0 or step_offset < 0:
    raise UserError(f"Adafactor needs decay_rate > 0 and epsilon1, epsilon2, step_offset >= 0; "
                    f"got decay_rate={decay_rate}, epsilon1={epsilon1}, epsilon2={epsilon2}, "
                    f"step_offset={step_offset}.")
  _check_decay(beta1, "beta1")
  _check_positive(clipping_threshold, "clipping_threshold", allow_none=True)
  _check_positive(global_norm_clip_threshold, "global_norm_clip_threshold", allow_none=True)
  _check_positive(max_parameter_scale, "max_parameter_scale", allow_none=True)
  _check_positive(min_dim_size_to_factor, "min_dim_size_to_factor")
  if logical_factor_rules == "standard":
    logical_factor_rules = adafactor_lib.standard_logical_factor_rules()
  rules = (None if logical_factor_rules is None
           else adafactor_lib.check_rules(logical_factor_rules))
  hp = adafactor_lib.Hyperparams(
      decay_rate=decay_rate, step_offset=step_offset, clipping_threshold=clipping_threshold,
      multiply_by_parameter_scale=_parameter_scale_rule(multiply_by_parameter_scale),
      beta1=beta1, epsilon1=epsilon1, epsilon2=epsilon2, weight_decay_rate=weight_decay_rate,
      weight_decay_rate_lr_exponent=weight_decay_rate_lr_exponent,
      global_norm_clip_threshold=global_norm_clip_threshold,
      max_parameter_scale=max_parameter_scale, skip_nan_updates=skip_nan_updates,
      dtype_momentum=jnp.dtype(dtype_momentum))

  def build(params: Any, param_axes: Any | None) -> optax.GradientTransformation:
    plans, names = adafactor_lib.plan_tree(params, param_axes, rules, factored,
                                           min_dim_size_to_factor)
    return _inject_learning_rate(adafactor_lib.scale_by_t5x_adafactor, learning_rate,
                                 plans=plans, names=names, hp=hp)
  return ByLogicalAxes(build)


def _parameter_scale_rule(value: bool | Sequence[tuple[str, bool]]) -> Any:
  """A bool, or T5X's HParamMap as a function of the parameter path."""
  if isinstance(value, bool):
    return value
  pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
  compiled = []
  for pair in pairs:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
            and isinstance(pair[1], bool)):
      raise UserError(f"multiply_by_parameter_scale rule {pair!r} must be a (regex, bool) "
                      "pair, e.g. ('.*/relpos_bias/.*', False).")
    try:
      compiled.append((re.compile(pair[0]), pair[1]))
    except re.error as e:
      raise UserError(f"multiply_by_parameter_scale regex '{pair[0]}' does not compile: "
                      f"{e}.") from None

  def rule(name: str) -> bool:
    for pattern, flag in compiled:
      if pattern.search(name):
        return flag
    raise UserError(f"multiply_by_parameter_scale has no rule for parameter {name}: add "
                    "a last ('.*', True) pair.")
  return rule


def _adamw_with_rate(learning_rate, *, b1, b2, eps, weight_decay, rules):
  return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                     _add_scaled_decayed_weights(weight_decay, rules),
                     optax.scale_by_learning_rate(learning_rate))


def adamw(learning_rate: Schedule | float,
          b1: float = 0.9,
          b2: float = 0.95,
          eps: float = 1e-8,
          weight_decay: float = 0.0,
          clip_norm: float | None = 1.0,
          weight_decay_scales: PathScales | None = None) -> optax.GradientTransformation:
  """AdamW with decoupled weight decay, optionally clipped by global norm.

  update = -lr(t) * (m_hat / (sqrt(v_hat) + eps) + weight_decay * scale(path) * param):
  the decay is decoupled from Adam's normalisation and multiplied by the
  learning rate (see the module docstring).

  Args:
    learning_rate: schedule or constant.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the debiased second moment.
    weight_decay: decoupled decay, multiplied by the learning rate.
    clip_norm: clip gradients to this global norm first; None disables.
    weight_decay_scales: (regex, scale) rules multiplying `weight_decay` per
      parameter, e.g. [('.*/scale', 0.0)] to leave norm scales undecayed.

  Returns:
    An optax transformation.

  Raises:
    ValueError: decays outside [0, 1), a negative weight decay or eps, a
      non-positive clip_norm, or malformed weight_decay_scales.
  """
  _check_decay(b1, "b1")
  _check_decay(b2, "b2")
  if eps < 0 or weight_decay < 0:
    raise UserError(f"eps={eps} and weight_decay={weight_decay} must be >= 0.")
  _check_positive(clip_norm, "clip_norm", allow_none=True)
  rules = _compile_path_rules(weight_decay_scales, "weight_decay_scales")
  inner = _inject_learning_rate(_adamw_with_rate, learning_rate, b1=b1, b2=b2, eps=eps,
                                weight_decay=weight_decay, rules=rules)
  if clip_norm is None:
    return inner
  return optax.chain(optax.clip_by_global_norm(clip_norm), inner)


def _adastar_with_rate(learning_rate, *, weight_decay, rules, **adastar_kwargs):
  return optax.chain(scale_by_adastar(**adastar_kwargs),
                     _add_scaled_decayed_weights(weight_decay, rules),
                     optax.scale_by_learning_rate(learning_rate))


def adastar(learning_rate: Schedule | float, *,
            gradient_ema_decay: float | None = None,
            gradient_ema_debias: bool = True,
            gradient_square_ema_decay: float = 0.99,
            gradient_square_ema_debias: bool = True,
            eps: float = 0.0,
            eps_square: float = 1e-30,
            update_clipping_threshold: float | None = 1.0,
            update_ema_decay: float | None = 0.9,
            update_ema_debias: bool = False,
            factored: bool = True,
            min_dim_size_to_factor: int = 128,
            weight_decay: float = 0.0,
            weight_decay_scales: PathScales | None = None) -> optax.GradientTransformation:
  """Adastar: Adam and Adafactor as special cases of one update rule.

  m = ema(g, gradient_ema_decay)            (or g when None)
  v = ema(g^2 + eps_square, gradient_square_ema_decay), factored into row
      and column statistics for parameters whose two largest dimensions are
      at least `min_dim_size_to_factor` (Adafactor's memory saving)
  u = m / (sqrt(v) + eps), each parameter's u clipped to RMS
      `update_clipping_threshold`
  s = ema(u, update_ema_decay)              (momentum on updates; u when None)
  update = -lr(t) * (s + weight_decay * scale(path) * param)

  Each EMA can be debiased (divided by 1 - decay^t). Adam is
  (gradient_ema_decay=b1, update_ema_decay=None, factored=False, no
  clipping); Adafactor with momentum is (gradient_ema_decay=None,
  update_ema_decay=b1, update_ema_debias=False).

  Args:
    learning_rate: schedule or constant.
    gradient_ema_decay: first-moment decay; None uses the raw gradient.
    gradient_ema_debias: debias the first moment.
    gradient_square_ema_decay: second-moment decay.
    gradient_square_ema_debias: debias the second moment.
    eps: added to sqrt(v).
    eps_square: added to g^2 before averaging.
    update_clipping_threshold: per-parameter RMS limit of u; None disables.
    update_ema_decay: momentum on the clipped updates; None disables.
    update_ema_debias: debias that momentum.
    factored: allow factored second moments.
    min_dim_size_to_factor: see above.
    weight_decay: decoupled decay, multiplied by the learning rate.
    weight_decay_scales: (regex, scale) rules multiplying `weight_decay`.

  Returns:
    An optax transformation.

  Raises:
    ValueError: decays outside [0, 1), negative eps or weight decay, a
      non-positive threshold or min_dim_size_to_factor, or malformed rules.
  """
  for name, value in (("gradient_ema_decay", gradient_ema_decay),
                      ("gradient_square_ema_decay", gradient_square_ema_decay),
                      ("update_ema_decay", update_ema_decay)):
    _check_decay(value, name)
  if eps < 0 or eps_square < 0 or weight_decay < 0:
    raise UserError(f"eps={eps}, eps_square={eps_square} and weight_decay={weight_decay} "
                    "must be >= 0.")
  _check_positive(update_clipping_threshold, "update_clipping_threshold", allow_none=True)
  _check_positive(min_dim_size_to_factor, "min_dim_size_to_factor")
  return _inject_learning_rate(
      _adastar_with_rate, learning_rate, weight_decay=weight_decay,
      rules=_compile_path_rules(weight_decay_scales, "weight_decay_scales"),
      gradient_ema_decay=gradient_ema_decay, gradient_ema_debias=gradient_ema_debias,
      gradient_square_ema_decay=gradient_square_ema_decay,
      gradient_square_ema_debias=gradient_square_ema_debias, eps=eps, eps_square=eps_square,
      update_clipping_threshold=update_clipping_threshold, update_ema_decay=update_ema_decay,
      update_ema_debias=update_ema_debias, factored=factored,
      min_dim_size_to_factor=min_dim_size_to_factor)


# ---------------------------------------------------------------------------
# Wrappers that compose with any learner


def clip_by_global_norm(optimizer: Learner, max_norm: float) -> Learner:
  """Scales gradients down to global norm `max_norm` before `optimizer`.

  Raises:
    ValueError: max_norm not positive.
  """
  _check_positive(max_norm, "max_norm")
  return _wrap(optimizer, lambda inner: optax.chain(optax.clip_by_global_norm(max_norm), inner))


class SkipClipState(NamedTuple):
  """State of `skip_and_clip_by_global_norm`.

  Attributes:
    inner_state: the wrapped optimizer's state, untouched by skipped steps.
    skipped_steps: int32 count of steps skipped since the start of training.
  """

  inner_state: Any
  skipped_steps: jax.Array


def skip_and_clip_by_global_norm(optimizer: Learner, drop_norm: float,
                                 max_norm: float | None = None) -> Learner:
  """Skips steps with exploding gradients; clips the others.

  A step whose gradient global norm exceeds `drop_norm` (or is not finite)
  returns zero updates and leaves the wrapped optimizer's state as it was,
  so its schedule does not advance either; `skipped_steps` counts it and
  the trainer logs `optimizer/skipped_steps`. Other steps are clipped to
  global norm `max_norm` and passed to `optimizer`.

  Args:
    optimizer: the learner to protect.
    drop_norm: gradient norm above which a step is skipped.
    max_norm: clip kept steps to this global norm; None does not clip.

  Returns:
    An optax transformation whose state is a `SkipClipState`.

  Raises:
    ValueError: drop_norm or max_norm not positive.
  """
  _check_positive(drop_norm, "drop_norm")
  _check_positive(max_norm, "max_norm", allow_none=True)

  return _wrap(optimizer, lambda inner: _skip_and_clip(inner, drop_norm, max_norm))


def _skip_and_clip(optimizer: optax.GradientTransformation, drop_norm: float,
                   max_norm: float | None) -> optax.GradientTransformation:
  def init(params):
    return SkipClipState(optimizer.init(params), jnp.zeros([], jnp.int32))

  def update(grads, state, params=None):
    norm = optax.global_norm(grads)
    keep = jnp.isfinite(norm) & (norm <= drop_norm)
    if max_norm is not None:
      factor = jnp.minimum(1.0, max_norm / norm)
      grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
    updates, inner_state = optimizer.update(grads, state.inner_state, params)
    # Both branches are computed and one selected, which keeps the step a
    # single straight-line program for the partitioner.
    updates = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), inner_state,
                               state.inner_state)
    skipped = state.skipped_steps + jnp.where(keep, 0, 1).astype(jnp.int32)
    return updates, SkipClipState(inner_state, skipped)
  return optax.GradientTransformation(init, update)


def scale_updates_by_path(optimizer: Learner, scales: PathScales) -> Learner:
  """Multiplies the final updates of matching parameters (muP-style rates).

  The scale multiplies everything `optimizer` would change the parameter
  by, weight decay included, like a per-parameter learning rate. The logged
  learning rate stays the unscaled one.

  Args:
    optimizer: any learner.
    scales: (regex, scale) rules, e.g. {'.*attention/.*/kernel': 0.5,
      '.*/mlp/.*/kernel': 0.5}; unmatched parameters keep scale 1.

  Returns:
    An optax transformation.

  Raises:
    ValueError: malformed rules (at construction) or a regex that matches no
      parameter (at init).
  """
  rules = _compile_path_rules(scales, "scale_updates_by_path scales")
  if not rules:
    raise UserError("scale_updates_by_path needs at least one (regex, scale) rule.")
  return _wrap(optimizer, lambda inner: optax.chain(inner, _scale_by_path(rules)))


# ---------------------------------------------------------------------------
# Reading the state


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


def skipped_steps_from_state(opt_state: Any) -> jax.Array | None:
  """Steps skipped so far by `skip_and_clip_by_global_norm` wrappers.

  Args:
    opt_state: state of an optimizer from this module.

  Returns:
    int32 scalar total; None when the optimizer skips no steps.
  """
  is_skip = lambda node: isinstance(node, SkipClipState)  # noqa: E731
  counts = [node.skipped_steps for node in jax.tree.leaves(opt_state, is_leaf=is_skip)
            if is_skip(node)]
  return sum(counts[1:], counts[0]) if counts else None


def adafactor_state(opt_state: Any) -> adafactor_lib.AdafactorState | None:
  """The state of the one T5X Adafactor in `opt_state`, or None if there is none.

  Raises:
    ValueError: more than one.
  """
  is_state = lambda node: isinstance(node, adafactor_lib.AdafactorState)  # noqa: E731
  found = [n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)]
  if len(found) > 1:
    raise UserError("The optimizer holds more than one Adafactor; cannot place one state.")
  return found[0] if found else None


def with_adafactor_state(opt_state: Any, slots: adafactor_lib.AdafactorState, step: int
                         ) -> Any:
  """`opt_state` continuing at `step` with these Adafactor slots: every
  counter of the optimizer (its schedule's and Adafactor's) is set to `step`,
  as when that many updates had been applied here."""
  is_state = lambda node: isinstance(node, adafactor_lib.AdafactorState)  # noqa: E731
  opt_state = jax.tree.map(lambda node: slots if is_state(node) else node, opt_state,
                           is_leaf=is_state)

  def set_count(path, leaf):
    named = path and getattr(path[-1], "name", None) == "count"
    return jnp.full_like(leaf, step) if named else leaf
  return jax.tree_util.tree_map_with_path(set_count, opt_state)
