"""t5lite's losses are T5X's: every `loss_normalizing_factor` mode, label
smoothing and z-loss, packed and unpacked, in value and gradient.

`tests/data/t5x_train/losses.npz` holds T5X's own losses and gradients on
one batch, written by T5X itself (`make_losses.py`).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite import trainer
from t5lite.models import models


DATA = os.path.join(os.path.dirname(__file__), "data", "t5x_train", "losses.npz")
with np.load(DATA, allow_pickle=False) as _f:
  REF = dict(_f)
CASES = {c["name"]: c for c in json.loads(str(REF["cases"]))}
FEATURES = ("decoder_target_tokens", "decoder_loss_weights", "decoder_segment_ids",
            "decoder_positions")


def _batch(packed):
  return {k: jnp.asarray(REF[k]) for k in FEATURES
          if packed or k in ("decoder_target_tokens", "decoder_loss_weights")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_z_loss_and_gradient_are_t5x_s(name):
  case = CASES[name]
  batch = _batch(case["packed"])
  mode = models.check_loss_normalizing_factor(case["loss_normalizing_factor"])

  def loss_fn(logits):
    return models.normalized_loss(logits, batch, z_loss=case["z_loss"],
                                  label_smoothing=case["label_smoothing"],
                                  loss_normalizing_factor=mode)
  (loss, sums), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(REF["logits"]))
  np.testing.assert_allclose(loss, REF[f"{name}/loss"], rtol=1e-6)
  # T5X's z_loss is normalized like its loss; the trainer reports it so.
  divisor = models.normalized_loss_weights(mode, batch)[1]
  normalizer = jnp.ones(()) if divisor is None else divisor
  z = trainer.summarize(loss, sums, normalizer)["z_loss"]
  np.testing.assert_allclose(z, REF[f"{name}/z_loss"], rtol=1e-6)
  want = REF[f"{name}/grad"]
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_average_per_sequence_weighs_each_packed_sequence_equally():
  batch = _batch(packed=True)
  weights, divisor = models.normalized_loss_weights(models.AVERAGE_PER_SEQUENCE, batch)
  weights = np.asarray(weights)
  # Row 0 packs sequences of 3 and 4 tokens, row 1 has 6 weighted tokens,
  # row 2 one sequence of 4 and padding: 4 sequences, each weighing 1.
  np.testing.assert_allclose(weights[0], [1 / 3] * 3 + [1 / 4] * 4, rtol=1e-6)
  np.testing.assert_allclose(weights[1], [0] + [1 / 6] * 6, rtol=1e-6)
  np.testing.assert_allclose(weights[2], [1 / 4] * 4 + [0] * 3, rtol=1e-6)
  assert float(divisor) == pytest.approx(4.0)


def test_microbatches_share_the_whole_batch_s_divisor_in_every_mode():
  logits = jnp.asarray(REF["logits"])
  batch = _batch(packed=True)
  modes = (None, 4.0, *models._SPECIAL_FACTORS)

  # Every mode in one compiled program: run op by op, each slice shape and
  # mode compiled programs of its own.
  @jax.jit
  def whole_and_parts(logits, batch):
    results = []
    for mode in modes:
      whole, _ = models.normalized_loss(logits, batch, z_loss=1e-4, label_smoothing=0.0,
                                        loss_normalizing_factor=mode)
      divisor = models.normalized_loss_weights(mode, batch)[1]
      parts = sum(models.normalized_loss(logits[rows], {k: v[rows] for k, v in batch.items()},
                                         z_loss=1e-4, label_smoothing=0.0,
                                         loss_normalizing_factor=mode,
                                         loss_normalizer=divisor)[0]
                  for rows in (slice(0, 1), slice(1, 3)))
      results.append((whole, parts))
    return results

  for mode, (whole, parts) in zip(modes, whole_and_parts(logits, batch)):
    np.testing.assert_allclose(parts, whole, rtol=1e-6, err_msg=str(mode))


def test_unknown_loss_normalizing_factor_names_the_choices():
  with pytest.raises(ValueError, match="'NUM_TOKENS' must be None .* 'NUM_REAL_TARGET_TOKENS'"):
    models.check_loss_normalizing_factor("NUM_TOKENS")
  assert models.check_loss_normalizing_factor("average_per_sequence") == "AVERAGE_PER_SEQUENCE"
