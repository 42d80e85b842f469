"""T5X's losses on one small batch, for every normalizing mode.

Calls T5X's own `losses.get_loss_normalizing_factor_and_weights` and
`losses.compute_weighted_cross_entropy` (google-research/t5x at cc342d41),
as T5X's `EncoderDecoderModel.loss_fn` does, and the gradient of the loss
with respect to the logits (T5X's custom gradient). Writes losses.npz (load
with allow_pickle=False):

  logits                 float32 [3, 7, 11]
  decoder_target_tokens, decoder_loss_weights, decoder_segment_ids,
  decoder_positions      int32 [3, 7]; row 0 packs two sequences, row 2 ends
                         in padding
  cases                  JSON: [{"name", "loss_normalizing_factor",
                         "label_smoothing", "z_loss", "packed"}]
  <name>/loss, <name>/z_loss   T5X's (normalized) loss and z-loss
  <name>/grad            float32 [3, 7, 11]: d loss / d logits

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x):
  JAX_PLATFORMS=cpu python tests/data/t5x_train/make_losses.py
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from t5x import losses


HERE = os.path.dirname(os.path.abspath(__file__))

MODES = [None, 4.0, "NUM_REAL_TARGET_TOKENS", "NUM_TOTAL_TARGET_TOKENS", "AVERAGE_PER_SEQUENCE"]


def _batch():
  rng = np.random.default_rng(0)
  targets = rng.integers(1, 11, size=(3, 7)).astype(np.int32)
  segments = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]],
                      np.int32)
  positions = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 0, 0]],
                       np.int32)
  weights = (segments > 0).astype(np.int32)
  weights[1, 0] = 0  # a real token without loss (e.g. a prompt)
  targets = targets * (segments > 0)
  logits = (rng.standard_normal((3, 7, 11)) * 3).astype(np.float32)
  return logits, {"decoder_target_tokens": targets, "decoder_loss_weights": weights,
                  "decoder_segment_ids": segments, "decoder_positions": positions}


def _loss(logits, batch, mode, label_smoothing, z_loss):
  factor, weights = losses.get_loss_normalizing_factor_and_weights(mode, batch)
  loss, z, _ = losses.compute_weighted_cross_entropy(
      logits, batch["decoder_target_tokens"], weights, label_smoothing, z_loss, factor)
  return loss, z


def main():
  logits, batch = _batch()
  arrays = {"logits": logits, **batch}
  cases = []
  for mode in MODES:
    for label_smoothing, z_loss in ((0.0, 1e-4), (0.1, 1e-2)):
      for packed in ((True, False) if mode == "AVERAGE_PER_SEQUENCE" else (True,)):
        name = f"{mode}-{label_smoothing}-{z_loss}-{'packed' if packed else 'unpacked'}"
        b = {k: jnp.asarray(v) for k, v in batch.items()
             if packed or k not in ("decoder_segment_ids", "decoder_positions")}
        fn = lambda x: _loss(x, b, mode, label_smoothing, z_loss)  # noqa: B023,E731
        (loss, z), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logits))
        arrays[f"{name}/loss"] = np.asarray(loss, np.float32)
        arrays[f"{name}/z_loss"] = np.asarray(z, np.float32)
        arrays[f"{name}/grad"] = np.asarray(grad, np.float32)
        cases.append({"name": name, "loss_normalizing_factor": mode,
                      "label_smoothing": label_smoothing, "z_loss": z_loss, "packed": packed})
  arrays["cases"] = np.asarray(json.dumps(cases))
  np.savez_compressed(os.path.join(HERE, "losses.npz"), **arrays)
  print(f"wrote {len(cases)} cases")


if __name__ == "__main__":
  main()
