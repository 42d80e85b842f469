"""How reproducible is T5X's own training run, and how fast does it diverge?

Replays encdec_a (30 steps) in-process with T5X's own code (see
`t5x_replay.py`), starting from encdec_a/checkpoint_0's full state
(parameters and Adafactor state) and consuming encdec_a/batches.npz in order:

  (a) unchanged: is every logged scalar bit-for-bit the one T5X logged, and
      is the state (parameters and Adafactor slots) after 10 and 30 steps
      that of checkpoint_10/30?
  (c) every initial parameter multiplied by (1 + 1e-7 * N(0, 1)) (float64
      noise from numpy's default_rng(seed), rounded back to float32; about a
      one-ulp change), optimizer state unchanged: how far do the loss and the
      parameters drift from (a) step by step?

Writes t5x_chaos.npz (load with allow_pickle=False):
  steps                      int64 [30]   1..30
  loss_logged                float64 [30] encdec_a/metrics.npz `loss`
  loss_rerun                 float64 [30] run (a)
  loss_perturbed             float64 [P, 30] run (c), one row per seed
  seeds                      int64 [P]
  param_rel_diff_perturbed   float64 [P, 30] after each step, max over tensors
                             of max|p_c - p_a| / max|p_a|
  param_rel_l2_perturbed     float64 [P, 30] after each step, ||p_c - p_a|| /
                             ||p_a|| over all parameters together
  ckpt_rel_diff_rerun        float64 [2] run (a) vs checkpoint_10, _30
  ckpt_unequal_leaves_rerun  int64 [2]   how many arrays of the whole state
                             (parameters, Adafactor slots, step) of run (a)
                             are not bitwise those of checkpoint_10, _30
  ckpt_rel_diff_perturbed    float64 [P, 2] run (c) vs checkpoint_10, _30

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x, and t5lite installed):
  JAX_PLATFORMS=cpu python tests/data/t5x_train/t5x_chaos.py
"""

import os
import sys

import jax
import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import t5x_replay as run  # noqa: E402


SEEDS = tuple(range(8))
CKPT_STEPS = (10, 30)


def perturb(train_state, seed):
  rng = np.random.default_rng(seed)

  def one(x):
    x = np.asarray(jax.device_get(x))
    noise = rng.standard_normal(x.shape)
    return (x.astype(np.float64) * (1.0 + 1e-7 * noise)).astype(x.dtype)

  params = jax.tree_util.tree_map(one, train_state.params)
  old = jax.tree_util.tree_leaves(train_state.params)
  new = jax.tree_util.tree_leaves(params)
  changed = sum(int(np.sum(np.asarray(a) != b)) for a, b in zip(old, new))
  rel = max(
    float(np.max(np.abs(b / np.asarray(a) - 1.0, where=np.asarray(a) != 0, out=np.zeros(b.shape))))
    for a, b in zip(old, new)
  )
  total = sum(b.size for b in new)
  print(f"seed {seed}: {changed} of {total} parameters changed, max relative change {rel:.3g}")
  return train_state.replace_params(params)


def losses(summaries):
  return np.array([s["loss"] for s in summaries], np.float64)


def main():
  setup = run.encdec_a_setup()
  batches = run.encdec_a_batches()
  steps = range(1, len(batches) + 1)
  logged = np.load(os.path.join(run.ENCDEC_A, "metrics.npz"))["loss"]
  all_logged = np.load(os.path.join(run.ENCDEC_A, "metrics.npz"))
  refs = {k: run.flat_state(run.encdec_a_restore(setup, k)) for k in CKPT_STEPS}

  summ_a, states_a = run.train(setup, run.encdec_a_restore(setup, 0), batches, steps)
  loss_a = losses(summ_a)
  ckpt_a = [run.max_rel_param_diff(states_a[k], refs[k])[0] for k in CKPT_STEPS]
  unequal_metrics = [
    tag
    for tag in summ_a[0]
    if not np.array_equal([s[tag] for s in summ_a], all_logged[tag.replace("/", "__")])
  ]
  unequal_state = [len(run.unequal_leaves(states_a[k], refs[k])) for k in CKPT_STEPS]
  print("(a) loss rel diff per step:", (loss_a - logged) / logged)
  print(f"(a) logged scalars not bitwise equal: {unequal_metrics} of {len(summ_a[0])}")
  print("(a) params vs checkpoint_10, _30:", ckpt_a)
  print(
    f"(a) state leaves (params and Adafactor slots, {len(refs[10])}) not bitwise equal to "
    f"checkpoint_10, _30: {unequal_state}"
  )

  loss_c, drift_c, l2_c, ckpt_c = [], [], [], []
  for seed in SEEDS:
    start = perturb(run.encdec_a_restore(setup, 0), seed)
    summ, states = run.train(setup, start, batches, steps)
    loss_c.append(losses(summ))
    drift_c.append([run.max_rel_param_diff(states[s], states_a[s])[0] for s in steps])
    l2_c.append([run.global_rel_l2(states[s], states_a[s]) for s in steps])
    ckpt_c.append([run.max_rel_param_diff(states[k], refs[k])[0] for k in CKPT_STEPS])
    print(f"(c) seed {seed} loss rel diff:", (loss_c[-1] - logged) / logged)
    print(f"(c) seed {seed} param drift (max-rel):", np.array(drift_c[-1]))
    print(f"(c) seed {seed} param drift (global L2):", np.array(l2_c[-1]))
    print(f"(c) seed {seed} params vs checkpoint_10, _30:", ckpt_c[-1])

  np.savez(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "t5x_chaos.npz"),
    steps=np.array(list(steps), np.int64),
    loss_logged=np.asarray(logged, np.float64),
    loss_rerun=loss_a,
    loss_perturbed=np.array(loss_c),
    seeds=np.array(SEEDS, np.int64),
    param_rel_diff_perturbed=np.array(drift_c),
    param_rel_l2_perturbed=np.array(l2_c),
    ckpt_rel_diff_rerun=np.array(ckpt_a),
    ckpt_unequal_leaves_rerun=np.array(unequal_state, np.int64),
    ckpt_rel_diff_perturbed=np.array(ckpt_c),
  )


if __name__ == "__main__":
  main()
