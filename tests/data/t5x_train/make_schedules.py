"""Writes schedules.npz: T5X's learning-rate schedules at fixed steps.

Evaluates `t5x.utils.create_learning_rate_scheduler` (google-research/t5x at
cc342d41, unmodified) for a handful of configurations covering every factor it
knows (constant, linear_warmup, rsqrt_decay, rsqrt_normalized_decay,
linear_decay, cosine_decay, decay_every), a non-zero step_offset and a
non-default min_learning_rate.

The schedule is evaluated on an int32 scalar step (the optimizer's
`state/step`) in two ways, because XLA's compiled arithmetic rounds differently
from op-by-op execution (up to a few float32 ulps; up to ~4e-5 relative where
cosine_decay takes the cosine of a large argument):
    values        inside a jitted function, as T5X's Trainer uses it (the
                                schedule is traced into the jitted train step)
    values_eager  calling the returned function directly, op by op

Output (load with `np.load(path, allow_pickle=False)`):
    configs  str [C]       JSON object per configuration: every keyword argument
                                                  of create_learning_rate_scheduler
    steps    int64 [S]     the steps evaluated
    values   float32 [C,S] learning rate of configuration c at step s (jitted)
    values_eager float32 [C,S] the same, evaluated op by op

Rerun (needs T5X importable, e.g. PYTHONPATH=/path/to/t5x):
    python tests/data/t5x_train/make_schedules.py
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from t5x import utils


STEPS = [0, 1, 5, 99, 100, 101, 500, 1000, 1001, 5000, 20000, 100000]

_DEFAULTS = dict(
  factors="constant * linear_warmup * rsqrt_decay",
  base_learning_rate=0.5,
  warmup_steps=1000,
  decay_factor=0.5,
  steps_per_decay=20000,
  steps_per_cycle=100000,
  step_offset=0,
  min_learning_rate=1e-8,
)

CONFIGS = [
  # The recipe of the encdec_a training run.
  dict(factors="constant * rsqrt_decay", base_learning_rate=1.0, warmup_steps=100),
  # T5X's defaults.
  dict(),
  dict(factors="constant * rsqrt_normalized_decay", base_learning_rate=0.01, warmup_steps=100),
  # linear_decay turns negative after step 2000; min_learning_rate clamps it.
  dict(
    factors="linear_decay",
    base_learning_rate=0.1,
    warmup_steps=1000,
    decay_factor=0.001,
    min_learning_rate=1e-5,
  ),
  dict(
    factors="constant * linear_warmup * cosine_decay",
    base_learning_rate=0.01,
    warmup_steps=100,
    steps_per_cycle=1000,
  ),
  dict(
    factors="constant * decay_every", base_learning_rate=0.1, decay_factor=0.5, steps_per_decay=1000
  ),
  dict(
    factors="constant * linear_warmup * rsqrt_decay",
    base_learning_rate=1.0,
    warmup_steps=100,
    step_offset=1000,
  ),
  # The cosine drops below min_learning_rate between cycles.
  dict(
    factors="constant * cosine_decay",
    base_learning_rate=0.01,
    warmup_steps=1000,
    steps_per_cycle=8000,
    min_learning_rate=2e-3,
  ),
  dict(
    factors="constant * linear_warmup * rsqrt_decay * decay_every",
    base_learning_rate=2.0,
    warmup_steps=500,
    decay_factor=0.8,
    steps_per_decay=3000,
    step_offset=100,
    min_learning_rate=1e-4,
  ),
]


def main():
  configs, rows, eager_rows = [], [], []
  for overrides in CONFIGS:
    kwargs = dict(_DEFAULTS, **overrides)
    fn = utils.create_learning_rate_scheduler(**kwargs)
    jitted = jax.jit(fn)
    steps = [jnp.asarray(s, jnp.int32) for s in STEPS]
    rows.append([np.float32(jitted(s)) for s in steps])
    eager_rows.append([np.float32(fn(s)) for s in steps])
    configs.append(json.dumps(kwargs, sort_keys=True))
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedules.npz")
  np.savez(
    out,
    configs=np.array(configs),
    steps=np.array(STEPS, np.int64),
    values=np.array(rows, np.float32),
    values_eager=np.array(eager_rows, np.float32),
  )
  for c, r in zip(configs, rows):
    print(c)
    print("  ", " ".join("%.6g" % v for v in r))


if __name__ == "__main__":
  main()
