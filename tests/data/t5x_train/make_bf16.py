"""Writes encdec_a_bf16_metrics.npz: encdec_a trained by T5X with bfloat16 activations.

Replays encdec_a in-process with T5X's own code (see `t5x_replay.py`):
the same start (encdec_a/checkpoint_0's parameters and Adafactor state), the
same 30 batches (encdec_a/batches.npz, in order) and the same recipe, except
`network.T5Config.dtype = 'bfloat16'` (parameters and optimizer stay float32;
`float32_attention_logits = True` as in encdec_a).

Output, in the convention of encdec_a/metrics.npz (load with
allow_pickle=False): every scalar T5X logs per step (timing aside), `<tag>`
float64 [30] and `<tag>__steps` int64 [30] (1..30), tags with `/` written as
`__`; among them `loss` (summed over target tokens, z-loss included),
`cross_ent_loss` and `z_loss`. Step s's value is measured on batch s-1 with
the parameters before that update.

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x, and t5lite installed):
  JAX_PLATFORMS=cpu python tests/data/t5x_train/make_bf16.py
"""

import os
import sys

import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import t5x_replay as run  # noqa: E402


def main():
  setup = run.encdec_a_setup(act_dtype="bfloat16")
  batches = run.encdec_a_batches()
  summaries, _ = run.train(setup, run.encdec_a_restore(setup, 0), batches)
  steps = np.arange(1, len(batches) + 1, dtype=np.int64)
  out = {}
  for tag in summaries[0]:
    key = tag.replace("/", "__")
    out[key] = np.array([s[tag] for s in summaries], np.float64)
    out[key + "__steps"] = steps
  np.savez(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "encdec_a_bf16_metrics.npz"),
    **out,
  )
  f32 = np.load(os.path.join(run.ENCDEC_A, "metrics.npz"))
  for name in ("loss", "cross_ent_loss", "z_loss"):
    rel = (out[name] - f32[name]) / f32[name]
    print(name, "relative difference from float32 run per step:")
    print(np.array2string(rel, precision=3, max_line_width=100))


if __name__ == "__main__":
  main()
