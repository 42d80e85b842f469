"""t5lite's Adafactor is T5X's: the same updates and slots as T5X's own
`adafactor.Adafactor` on every kind of parameter and setting.

`tests/data/t5x_train/adafactor.npz` holds T5X's parameters and slots after
each of three updates, written by T5X itself (`make_adafactor.py`).
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from t5lite import adafactor, optimizers
from t5lite.train_state import TrainState, state_logical_axes


DATA = os.path.join(os.path.dirname(__file__), "data", "t5x_train", "adafactor.npz")
with np.load(DATA, allow_pickle=False) as _f:
  REF = dict(_f)
CASES = {c["name"]: c for c in json.loads(str(REF["cases"]))}
AXES = json.loads(str(REF["axes"]))
# T5X's T5.1.1 network joins t5lite's [embed, heads, kv] attention kernels into
# [embed, heads * kv]; t5lite factors them as that joined matrix.
AS_HEADS = {"attention": (8, 4, 8), "square": (16, 4, 4)}
# T5X factors a rank-3 [embed, heads, kv] kernel (its scalable_t5 network) by
# its rules at any size; t5lite counts heads and kv as one dimension, as T5X's
# T5.1.1 network has it, so below min_dim_size_to_factor it keeps the whole
# second moment. That is the one deliberate difference (docs/from_t5x.md).
DIFFERS = {("defaults", "heads")}


def _names(case):
  return sorted({k.split("/")[2] for k in REF if k.startswith(f"{case}/0/") and
                 not k.endswith("/count")})


def _settings(case):
  settings = dict(CASES[case]["settings"])
  if "logical_factor_rules" in settings:
    assert settings["logical_factor_rules"] is None
  return settings


def _train(case, heads):
  """t5lite's Adafactor through three updates on T5X's gradients (computed
  once for all cases; the states are immutable, so tests can share them)."""
  return _train_all()[case, heads]


@functools.cache
def _train_all():
  """The states of every case and layout after each of the three updates.
  Every case's optimizer updates its own state: one jitted program creates
  them all and one applies an update to each, as one compiled program costs
  a third of the CPU time of a program per case and layout."""
  runs = [(case, heads) for case in sorted(CASES) for heads in (False, True)]

  def shaped(heads, name, value):
    return value.reshape(AS_HEADS[name]) if heads and name in AS_HEADS else value

  def axes(heads, name):
    return P("embed", "heads", "kv") if heads and name in AS_HEADS else P(*AXES[name])

  def create(params):
    return [TrainState.create(
        p, optimizers.adafactor(CASES[case]["learning_rate"], **_settings(case)),
        {n: axes(heads, n) for n in p}) for (case, heads), p in zip(runs, params)]

  params = [{n: shaped(heads, n, REF[f"params/{n}"]) for n in _names(case)}
            for case, heads in runs]
  states = jax.jit(create)(params)
  update = jax.jit(lambda ss, gs: [s.apply_gradients(g) for s, g in zip(ss, gs)])
  trained = {run: [] for run in runs}
  for step in range(3):
    grads = []
    for case, heads in runs:
      g = {n: REF[f"grads/{step}/{n}"] for n in _names(case)}
      if case == "skip_nan" and step == 2:
        g["wide"] = REF["grads_nan_wide"]
      grads.append({n: shaped(heads, n, value) for n, value in g.items()})
    states = update(states, grads)
    for run, state in zip(runs, states):
      trained[run].append(state)
  return trained


@pytest.mark.parametrize("heads", [False, True], ids=["joined", "heads_kv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_updates_and_slots_are_t5x_s(case, heads):
  states = _train(case, heads)
  for step, state in enumerate(states):
    slots = optimizers.adafactor_state(state.opt_state)
    assert int(slots.count) == int(REF[f"{case}/{step}/count"]) == step + 1
    for name in _names(case):
      if (case, name) in DIFFERS:
        continue
      prefix = f"{case}/{step}/{name}"
      want = REF[f"{prefix}/param"]
      got = np.asarray(state.params[name]).reshape(want.shape)
      # One float32 rounding of the last update, at most.
      np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7 * np.abs(want).max(),
                                 err_msg=f"{prefix} parameter")
      for field in ("v_row", "v_col", "v", "m"):
        want = REF[f"{prefix}/{field}"]
        value = np.asarray(getattr(slots, field)[name])
        assert value.size == want.size, f"{prefix}/{field}: {value.shape} vs T5X {want.shape}"
        # Momentum sums terms of both signs: near zero, one rounding of the
        # largest term is the bound.
        np.testing.assert_allclose(value.reshape(want.shape), want, rtol=2e-6,
                                   atol=2e-7 * np.abs(want).max(), err_msg=f"{prefix}/{field}")


def test_the_skipped_nan_keeps_the_parameter_and_t5x_does_too():
  states = _train("skip_nan", False)
  state, before = states[-1], states[1]
  assert np.isnan(REF["grads_nan_wide"][3, 5])
  # The NaN gradient entry leaves that parameter where the previous step left it.
  assert float(state.params["wide"][3, 5]) == float(before.params["wide"][3, 5])
  assert np.isfinite(np.asarray(state.params["wide"])).all()


@pytest.mark.parametrize("case", ["defaults", "by_size"])
def test_what_is_factored_follows_the_logical_axes(case):
  settings = _settings(case)
  rules = optimizers.standard_logical_factor_rules()
  minimum = settings.get("min_dim_size_to_factor", 128)
  factored = {}
  for name in _names(case):
    shape = REF[f"params/{name}"].shape
    plan = adafactor.factoring(name, shape, tuple(AXES[name]), rules, True, minimum)
    factored[name] = plan.factored
    t5x_factored = REF[f"{case}/0/{name}/v"].size == 1
    if (case, name) not in DIFFERS:
      assert plan.factored == t5x_factored, name
  # The rules, not the sizes: scanned and expert weights factor per layer or
  # expert whatever their size; a router's unnamed expert dimension never does.
  assert factored["scanned"] and factored["experts"] and not factored["router"]
  assert factored["wide"] == (minimum <= 16)


def test_statistics_shard_like_their_parameter_and_keep_the_batch_axis():
  params = {"scanned": jnp.zeros((3, 16, 24)), "experts": jnp.zeros((4, 16, 24)),
            "heads": jnp.zeros((16, 4, 8)), "scale": jnp.zeros((3, 16))}
  axes = {"scanned": P("layers", "embed", "mlp"), "experts": P("expert", "embed", "expert_mlp"),
          "heads": P("embed", "heads", "kv"), "scale": P("layers", "embed")}
  tx = optimizers.adafactor(0.1, min_dim_size_to_factor=16)
  state = jax.eval_shape(lambda: TrainState.create(params, tx, axes))
  logical = optimizers.adafactor_state(state_logical_axes(state, axes).opt_state)
  shapes = optimizers.adafactor_state(state.opt_state)
  assert shapes.v_row["scanned"].shape == (3, 16, 1)
  assert logical.v_row["scanned"] == P("layers", "embed", None)
  assert logical.v_col["scanned"] == P("layers", None, "mlp")
  assert logical.v_col["experts"] == P("expert", None, "expert_mlp")
  # [embed, heads, kv] is factored as [embed, heads * kv]: columns keep both.
  assert shapes.v_col["heads"].shape == (1, 4, 8)
  assert logical.v_col["heads"] == P(None, "heads", "kv")
  assert logical.v["scale"] == P("layers", "embed")  # a vector per layer, not factored


def test_bad_settings_and_axes_are_one_clear_error():
  with pytest.raises(ValueError, match="no factor rule for axis 'embedz'"):
    TrainState.create({"w": jnp.zeros((4, 4, 4))}, optimizers.adafactor(0.1),
                      {"w": P("embedz", "heads", "kv")})
  with pytest.raises(ValueError, match="cannot factor w .* by size alone"):
    TrainState.create({"w": jnp.zeros((4, 4, 4))}, optimizers.adafactor(0.1))
  with pytest.raises(ValueError, match="rule for axis 'embed' is 'rows'"):
    optimizers.adafactor(0.1, logical_factor_rules={"embed": "rows"})
  with pytest.raises(ValueError, match="beta1=1.0 must be in"):
    optimizers.adafactor(0.1, beta1=1.0)
  with pytest.raises(ValueError, match="rows, columns and an unfactored"):
    TrainState.create({"w": jnp.zeros((4, 4, 4))}, optimizers.adafactor(0.1),
                      {"w": P("embed", "mlp", "relpos_buckets")})
