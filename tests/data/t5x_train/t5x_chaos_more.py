"""How far is T5X from the stored references on the CPU it runs on now?

`t5x_chaos.py` measured, for encdec_a in float32, how far T5X departs from
itself under a one-ulp perturbation of its start. This script does the same
for the other two references, and rechecks on the current machine whether T5X
still reproduces the references exactly (they were made on another CPU, and
XLA's CPU kernels depend on the instruction set, e.g. AVX-512 / AVX512_BF16).
Everything that trains is T5X's own code, driven by `t5x_replay.py`; the
perturbation is `t5x_chaos.perturb` (every initial parameter multiplied by
1 + 1e-7 * N(0, 1), numpy default_rng(seed), seeds 0..7; optimizer state
unchanged).

  (a) deconly_b replayed unchanged from deconly_b/checkpoint_0 on
      deconly_b/batches.npz (20 steps): losses vs deconly_b/metrics.npz, state
      vs checkpoint_10 and checkpoint_20.
  (b) (a) from the 8 perturbed starts: losses, drift from (a), and distance
      to checkpoint_10 and checkpoint_20.
  (c) encdec_a with `T5Config.dtype = 'bfloat16'` (as `make_bf16.py`)
      replayed unchanged (30 steps): losses vs encdec_a_bf16_metrics.npz.
  (d) (c) from the 8 perturbed starts.
  (e) encdec_a in float32 replayed unchanged: every logged scalar and the
      whole state of checkpoint_10 and checkpoint_30, bit for bit?

Relative parameter distances are those of `t5x_replay`: `max_rel` = max over
parameter tensors of max|p - ref| / max|ref|; `rel_l2` = ||p - ref|| / ||ref||
over all parameters together. A loss "spread" is, per step, the max over the
seeds of |loss - ref| / |ref|.

Writes t5x_chaos_more.npz, or the file named by its one argument (load with
allow_pickle=False):
  cpu                                  str     /proc/cpuinfo model name, flags
                                               avx512f / avx512_bf16, cores
  versions                             str     jax, jaxlib, flax, orbax, seqio
  seeds                                int64 [P]
  deconly_steps                        int64 [20]  1..20
  deconly_loss_logged                  float64 [20] deconly_b/metrics.npz loss
  deconly_loss_rerun                   float64 [20] (a)
  deconly_loss_bitwise                 bool        (a) loss == logged, every step
  deconly_scalars_unequal              str [k]     (a) logged tags not bitwise equal
  deconly_ckpt_rel_diff_rerun          float64 [2] (a) vs checkpoint_10, _20, max_rel
  deconly_ckpt_rel_l2_rerun            float64 [2] (a) vs checkpoint_10, _20, rel_l2
  deconly_ckpt_unequal_leaves_rerun    int64 [2]   (a) arrays of the whole state
                                                   (params, Adafactor slots, step)
                                                   not bitwise those of the checkpoint
  deconly_state_leaves                 int64       how many arrays the state has
  deconly_loss_perturbed               float64 [P, 20] (b)
  deconly_loss_spread_vs_rerun         float64 [20] (b) vs (a)
  deconly_loss_spread_vs_logged        float64 [20] (b) vs metrics.npz
  deconly_ckpt_rel_diff_perturbed      float64 [P, 2] (b) vs checkpoint_10, _20, max_rel
  deconly_ckpt_rel_l2_perturbed        float64 [P, 2] (b) vs checkpoint_10, _20, rel_l2
  deconly_drift_rel_diff_perturbed     float64 [P, 20] (b) vs (a) after each step, max_rel
  deconly_drift_rel_l2_perturbed       float64 [P, 20] (b) vs (a) after each step, rel_l2
  bf16_steps                           int64 [30]  1..30
  bf16_loss_logged                     float64 [30] encdec_a_bf16_metrics.npz loss
  bf16_loss_rerun                      float64 [30] (c)
  bf16_loss_bitwise                    bool        (c) loss == logged, every step
  bf16_scalars_unequal                 str [k]     (c) logged tags not bitwise equal
  bf16_loss_perturbed                  float64 [P, 30] (d)
  bf16_loss_spread_vs_rerun            float64 [30] (d) vs (c)
  bf16_loss_spread_vs_logged           float64 [30] (d) vs encdec_a_bf16_metrics.npz
  f32_loss_rerun                       float64 [30] (e)
  f32_rerun_bitwise                    bool        (e) all scalars and both states bitwise
  f32_scalars_unequal                  str [k]     (e) logged tags not bitwise equal
  f32_loss_rel_diff_rerun              float64 [30] (e) (loss - logged) / logged
  f32_ckpt_rel_diff_rerun              float64 [2] (e) vs checkpoint_10, _30, max_rel
  f32_ckpt_unequal_leaves_rerun        int64 [2]   (e) as for deconly
  seconds_per_replay                   float64 [3] wall time of one replay of
                                                   deconly_b, bf16, f32 (compile included)

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x, and t5lite installed),
from the repository root; takes about a minute on CPU:
  JAX_PLATFORMS=cpu python tests/data/t5x_train/t5x_chaos_more.py
"""

import os
import sys
import time

import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import t5x_chaos as chaos  # noqa: E402
import t5x_replay as run  # noqa: E402
from cpu_class import cpu_description  # noqa: E402


SEEDS = chaos.SEEDS
DECONLY_B = os.path.join(run._HERE, "deconly_b")
DECONLY_CKPTS = (10, 20)
ENCDEC_CKPTS = (10, 30)


def versions():
  import flax
  import jax
  import jaxlib
  import orbax.checkpoint
  import seqio

  return (
    f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, "
    f"orbax-checkpoint {orbax.checkpoint.__version__}, seqio {seqio.__version__}"
  )


def spread(perturbed, reference):
  return np.max(np.abs(perturbed - reference) / np.abs(reference), axis=0)


def unequal_scalars(summaries, metrics):
  return [
    tag
    for tag in summaries[0]
    if not np.array_equal([s[tag] for s in summaries], metrics[tag.replace("/", "__")])
  ]


def timed_train(*args):
  start = time.perf_counter()
  out = run.train(*args)
  return out, time.perf_counter() - start


def deconly(out):
  batches = run.load_batches(os.path.join(DECONLY_B, "batches.npz"))
  setup = run.make_setup(run.build_deconly_b_model(), batches[0])
  steps = range(1, len(batches) + 1)

  def ckpt(step):
    return run.restore(setup, os.path.join(DECONLY_B, f"checkpoint_{step}"), step)

  metrics = np.load(os.path.join(DECONLY_B, "metrics.npz"))
  logged = metrics["loss"]
  refs = {k: run.flat_state(ckpt(k)) for k in DECONLY_CKPTS}

  (summ_a, states_a), seconds = timed_train(setup, ckpt(0), batches, steps)
  loss_a = chaos.losses(summ_a)
  out["deconly_steps"] = np.array(list(steps), np.int64)
  out["deconly_loss_logged"] = np.asarray(logged, np.float64)
  out["deconly_loss_rerun"] = loss_a
  out["deconly_loss_bitwise"] = np.bool_(np.array_equal(loss_a, logged))
  out["deconly_scalars_unequal"] = np.array(unequal_scalars(summ_a, metrics), np.str_)
  out["deconly_ckpt_rel_diff_rerun"] = np.array(
    [run.max_rel_param_diff(states_a[k], refs[k])[0] for k in DECONLY_CKPTS]
  )
  out["deconly_ckpt_rel_l2_rerun"] = np.array(
    [run.global_rel_l2(states_a[k], refs[k]) for k in DECONLY_CKPTS]
  )
  out["deconly_ckpt_unequal_leaves_rerun"] = np.array(
    [len(run.unequal_leaves(states_a[k], refs[k])) for k in DECONLY_CKPTS], np.int64
  )
  out["deconly_state_leaves"] = np.int64(len(refs[DECONLY_CKPTS[0]]))
  print(f"(a) deconly_b replay: {seconds:.1f} s")
  print("(a) loss rel diff vs logged:", (loss_a - logged) / logged)
  print("(a) scalars not bitwise equal:", list(out["deconly_scalars_unequal"]))
  for i, k in enumerate(DECONLY_CKPTS):
    worst = run.max_rel_param_diff(states_a[k], refs[k])
    print(
      f"(a) vs checkpoint_{k}: max_rel {worst[0]:.3g} ({worst[1]}), "
      f"rel_l2 {out['deconly_ckpt_rel_l2_rerun'][i]:.3g}, "
      f"unequal leaves {out['deconly_ckpt_unequal_leaves_rerun'][i]} of {len(refs[k])}"
    )

  loss_b, ckpt_b, ckpt_l2_b, drift_b, drift_l2_b = [], [], [], [], []
  for seed in SEEDS:
    summ, states = run.train(setup, chaos.perturb(ckpt(0), seed), batches, steps)
    loss_b.append(chaos.losses(summ))
    ckpt_b.append([run.max_rel_param_diff(states[k], refs[k])[0] for k in DECONLY_CKPTS])
    ckpt_l2_b.append([run.global_rel_l2(states[k], refs[k]) for k in DECONLY_CKPTS])
    drift_b.append([run.max_rel_param_diff(states[s], states_a[s])[0] for s in steps])
    drift_l2_b.append([run.global_rel_l2(states[s], states_a[s]) for s in steps])
    print(f"(b) seed {seed}: vs checkpoint_10, _20 max_rel {ckpt_b[-1]}, rel_l2 {ckpt_l2_b[-1]}")
  out["deconly_loss_perturbed"] = np.array(loss_b)
  out["deconly_loss_spread_vs_rerun"] = spread(np.array(loss_b), loss_a)
  out["deconly_loss_spread_vs_logged"] = spread(np.array(loss_b), logged)
  out["deconly_ckpt_rel_diff_perturbed"] = np.array(ckpt_b)
  out["deconly_ckpt_rel_l2_perturbed"] = np.array(ckpt_l2_b)
  out["deconly_drift_rel_diff_perturbed"] = np.array(drift_b)
  out["deconly_drift_rel_l2_perturbed"] = np.array(drift_l2_b)
  print("(b) loss spread vs (a):", out["deconly_loss_spread_vs_rerun"])
  print("(b) loss spread vs logged:", out["deconly_loss_spread_vs_logged"])
  return seconds


def bf16(out):
  setup = run.encdec_a_setup(act_dtype="bfloat16")
  batches = run.encdec_a_batches()
  metrics = np.load(os.path.join(run._HERE, "encdec_a_bf16_metrics.npz"))
  logged = metrics["loss"]

  (summ_c, _), seconds = timed_train(setup, run.encdec_a_restore(setup, 0), batches)
  loss_c = chaos.losses(summ_c)
  out["bf16_steps"] = np.arange(1, len(batches) + 1, dtype=np.int64)
  out["bf16_loss_logged"] = np.asarray(logged, np.float64)
  out["bf16_loss_rerun"] = loss_c
  out["bf16_loss_bitwise"] = np.bool_(np.array_equal(loss_c, logged))
  out["bf16_scalars_unequal"] = np.array(unequal_scalars(summ_c, metrics), np.str_)
  print(f"(c) bf16 replay: {seconds:.1f} s")
  print("(c) loss rel diff vs logged:", (loss_c - logged) / logged)
  print("(c) scalars not bitwise equal:", list(out["bf16_scalars_unequal"]))

  loss_d = []
  for seed in SEEDS:
    summ, _ = run.train(setup, chaos.perturb(run.encdec_a_restore(setup, 0), seed), batches)
    loss_d.append(chaos.losses(summ))
  out["bf16_loss_perturbed"] = np.array(loss_d)
  out["bf16_loss_spread_vs_rerun"] = spread(np.array(loss_d), loss_c)
  out["bf16_loss_spread_vs_logged"] = spread(np.array(loss_d), logged)
  print("(d) loss spread vs (c):", out["bf16_loss_spread_vs_rerun"])
  print("(d) loss spread vs logged:", out["bf16_loss_spread_vs_logged"])
  return seconds


def f32(out):
  setup = run.encdec_a_setup()
  batches = run.encdec_a_batches()
  metrics = np.load(os.path.join(run.ENCDEC_A, "metrics.npz"))
  logged = metrics["loss"]
  refs = {k: run.flat_state(run.encdec_a_restore(setup, k)) for k in ENCDEC_CKPTS}

  (summ, states), seconds = timed_train(
    setup, run.encdec_a_restore(setup, 0), batches, ENCDEC_CKPTS
  )
  loss = chaos.losses(summ)
  unequal = unequal_scalars(summ, metrics)
  leaves = [len(run.unequal_leaves(states[k], refs[k])) for k in ENCDEC_CKPTS]
  out["f32_loss_rerun"] = loss
  out["f32_scalars_unequal"] = np.array(unequal, np.str_)
  out["f32_rerun_bitwise"] = np.bool_(not unequal and not any(leaves))
  out["f32_loss_rel_diff_rerun"] = (loss - logged) / logged
  out["f32_ckpt_rel_diff_rerun"] = np.array(
    [run.max_rel_param_diff(states[k], refs[k])[0] for k in ENCDEC_CKPTS]
  )
  out["f32_ckpt_unequal_leaves_rerun"] = np.array(leaves, np.int64)
  print(f"(e) f32 replay: {seconds:.1f} s")
  print(f"(e) bitwise: {bool(out['f32_rerun_bitwise'])}; scalars not bitwise equal: {unequal}")
  print("(e) loss rel diff vs logged:", out["f32_loss_rel_diff_rerun"])
  print("(e) vs checkpoint_10, _30:", out["f32_ckpt_rel_diff_rerun"], "unequal leaves", leaves)
  return seconds


def main(argv):
  name = argv[1] if len(argv) > 1 else "t5x_chaos_more.npz"
  out = {"cpu": np.str_(cpu_description()), "versions": np.str_(versions())}
  out["seeds"] = np.array(SEEDS, np.int64)
  print("cpu:", out["cpu"])
  seconds = [deconly(out), bf16(out), f32(out)]
  out["seconds_per_replay"] = np.array(seconds)
  np.savez(os.path.join(run._HERE, name), **out)


if __name__ == "__main__":
  main(sys.argv)
