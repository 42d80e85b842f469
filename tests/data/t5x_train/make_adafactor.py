"""T5X's Adafactor on small parameters of every kind, three updates each.

Builds T5X's own `adafactor.Adafactor` (google-research/t5x at cc342d41),
gives it the parameters' logical axes with `set_param_axes` (as T5X's train
state initialiser does) and applies three fixed gradients with
`apply_gradient`, for several settings. Writes adafactor.npz (load with
allow_pickle=False):

  cases                  JSON: [{"name", "settings", "learning_rate"}]
  params/<name>          float32 initial parameters (shared by every case)
  axes                   JSON: parameter name -> logical axis names
  grads/<step>/<name>    float32 gradient of update <step> (0, 1, 2); a NaN
                         in one entry of the last for the skip_nan case
  <case>/<step>/<name>/<field>   float32 after update <step>: the parameter
                         (field `param`) and T5X's slots v_row, v_col, v, m
  <case>/<step>/count    the optimizer step after the update

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x):
  JAX_PLATFORMS=cpu python tests/data/t5x_train/make_adafactor.py
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import freeze, unfreeze
from t5x import adafactor
from t5x.contrib.moe import adafactor_utils


HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (shape, logical axes): each kind of parameter T5X's rules treat
# differently. `attention` is T5X's joined [embed, heads * kv] kernel.
# Most cases factor by size from 16 (min_dim_size_to_factor) to keep the
# file small; `defaults` keeps T5X's 128, under which only the rules factor.
PARAMS = {
    "wide": ((16, 32), ("embed", "mlp")),              # factored by size
    "tall": ((32, 16), ("mlp", "embed")),              # factored, larger dim first
    "square": ((16, 16), ("embed", "joined_kv")),      # a tie: the first dim is the row
    "attention": ((8, 32), ("embed", "joined_kv")),    # too small to factor by size
    "embedding": ((48, 16), ("vocab", "embed")),
    "scanned": ((16, 3, 24), ("embed", "layers", "mlp")),        # batch axis: by rules
    "heads": ((16, 4, 8), ("embed", "heads", "kv")),             # rank 3: by rules
    "experts": ((4, 16, 24), ("expert", "embed", "expert_mlp")),  # per expert
    "router": ((16, 4), ("embed", "unmodeled")),
    "scale": ((16,), ("embed",)),
    "scanned_scale": ((3, 16), ("layers", "embed")),
    "relpos": ((4, 32), ("heads", "relpos_buckets")),
}

SMALL = {"min_dim_size_to_factor": 16}
CASES = [
    ("defaults", {}, 0.05),
    ("by_size", dict(SMALL), 0.05),
    ("momentum_decay", {**SMALL, "beta1": 0.9, "weight_decay_rate": 0.01, "step_offset": 1,
                        "decay_rate": 0.5}, 0.02),
    ("unclipped_unscaled", {**SMALL, "clipping_threshold": None,
                            "multiply_by_parameter_scale": False, "epsilon1": 1e-20}, 0.01),
    ("bounded", {**SMALL, "max_parameter_scale": 0.05, "epsilon2": 0.1,
                 "global_norm_clip_threshold": 0.5, "weight_decay_rate_lr_exponent": 1.0,
                 "clipping_threshold": 0.5}, 0.1),
    ("no_rules", {**SMALL, "logical_factor_rules": None}, 0.05),
    ("unfactored", {**SMALL, "factored": False}, 0.05),
    ("skip_nan", {**SMALL, "skip_nan_updates": True, "beta1": 0.5}, 0.05),
]


def _rules(settings):
  if "logical_factor_rules" in settings:
    return settings["logical_factor_rules"]
  return adafactor_utils.logical_factor_rules()  # standard + T5X's MoE rules


def _subset(tree, names):
  return freeze({n: v for n, v in unfreeze(tree).items() if n in names})


def _run(settings, learning_rate, params, axes, grads):
  kwargs = dict(settings, logical_factor_rules=_rules(settings))
  if "factored" in settings:
    kwargs.pop("logical_factor_rules")
  optimizer = adafactor.Adafactor(**kwargs)
  if kwargs.get("logical_factor_rules") is not None:
    optimizer.set_param_axes(axes)
  state = optimizer.init_state(params)
  hyper_params = optimizer.hyper_params.replace(learning_rate=learning_rate)
  apply = jax.jit(lambda p, s, g: optimizer.apply_gradient(hyper_params, p, s, g))
  out = []
  for g in grads:
    params, state = apply(params, state, g)
    out.append((params, state))
  return out


def main():
  rng = np.random.default_rng(0)
  params = {n: (rng.standard_normal(shape) * rng.uniform(0.01, 1.0)).astype(np.float32)
            for n, (shape, _) in PARAMS.items()}
  grads = []
  for _ in range(3):
    g = {n: (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32)
         for n, (shape, _) in PARAMS.items()}
    g["router"][0, 0] = 0.0  # an exact zero gradient
    grads.append(g)
  nan_grads = [dict(g) for g in grads]
  nan_grads[2]["wide"] = nan_grads[2]["wide"].copy()
  nan_grads[2]["wide"][3, 5] = np.nan  # the step T5X keeps the old values for
  # T5X's set_param_axes maps over the tree with tuples as leaves.
  axes = freeze({n: jax.sharding.PartitionSpec(*a) for n, (_, a) in PARAMS.items()})
  arrays = {f"params/{n}": v for n, v in params.items()}
  for step, g in enumerate(grads):
    arrays.update({f"grads/{step}/{n}": v for n, v in g.items()})
  arrays["grads_nan_wide"] = nan_grads[2]["wide"]
  for name, settings, lr in CASES:
    use = nan_grads if name == "skip_nan" else grads
    # Without rules T5X refuses parameters of rank above two.
    names = [n for n, (shape, _) in PARAMS.items()
             if name != "no_rules" or len(shape) <= 2]
    frozen = [_subset({n: jnp.asarray(v) for n, v in g.items()}, names) for g in use]
    results = _run(settings, lr, _subset({n: jnp.asarray(v) for n, v in params.items()}, names),
                   _subset(axes, names), frozen)
    for step, (new_params, state) in enumerate(results):
      arrays[f"{name}/{step}/count"] = np.asarray(state.step)
      slots = unfreeze(state.param_states)
      for n in names:
        arrays[f"{name}/{step}/{n}/param"] = np.asarray(new_params[n])
        for field in ("v_row", "v_col", "v", "m"):
          arrays[f"{name}/{step}/{n}/{field}"] = np.asarray(getattr(slots[n], field))
  cases = [{"name": n, "settings": dict(s), "learning_rate": lr} for n, s, lr in CASES]
  arrays["cases"] = np.asarray(json.dumps(cases))
  arrays["axes"] = np.asarray(json.dumps({n: list(a) for n, (_, a) in PARAMS.items()}))
  np.savez_compressed(os.path.join(HERE, "adafactor.npz"), **arrays)
  print(f"wrote {len(arrays)} arrays")


if __name__ == "__main__":
  main()
