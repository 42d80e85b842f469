"""Builds t5lite models of the committed foreign checkpoints, for the interop tests."""

import os

import flax.linen as nn
import jax
import numpy as np
import optax

from t5lite.data import vocabularies
from t5lite.models import models, transformer


DATA = os.path.join(os.path.dirname(__file__), "data")
T5X = os.path.join(DATA, "t5x")
HF = os.path.join(DATA, "hf")

ENCDEC_A = os.path.join(T5X, "t5x_encdec_a")
DECONLY_C = os.path.join(T5X, "t5x_deconly_c")
# (folder, format) -> step directory
T5X_CHECKPOINTS = {
    ("a", "orbax"): os.path.join(ENCDEC_A, "checkpoint_20"),
    ("a", "legacy"): os.path.join(ENCDEC_A, "legacy", "checkpoint_20"),
    ("c", "orbax"): os.path.join(DECONLY_C, "checkpoint_20"),
    ("c", "legacy"): os.path.join(DECONLY_C, "legacy", "checkpoint_20"),
}
_T5X_SIZES = dict(vocab_size=384, emb_dim=64, num_heads=2, head_dim=16, mlp_dim=128,
                  dropout_rate=0.0)


def t5x_model(network: str, **overrides):
  """The t5lite model of T5X fixture `network` ('a' encoder-decoder, 'c' decoder-only)."""
  vocab = vocabularies.byte_vocabulary()
  if network == "a":
    cfg = transformer.TransformerConfig(**{**_T5X_SIZES, "num_encoder_layers": 2,
                                           "num_decoder_layers": 2, **overrides})
    return models.EncoderDecoderModel(transformer.EncoderDecoder(cfg), vocab, vocab,
                                      optax.sgd(1.0), z_loss=1e-4)
  cfg = transformer.TransformerConfig(**{**_T5X_SIZES, "num_encoder_layers": 0,
                                         "num_decoder_layers": 2, "logits_via_embedding": True,
                                         **overrides})
  return models.DecoderOnlyModel(transformer.DecoderOnly(cfg), vocab, vocab, optax.sgd(1.0),
                                 z_loss=1e-4)


def t5x_reference(network: str) -> dict[str, np.ndarray]:
  folder = ENCDEC_A if network == "a" else DECONLY_C
  with np.load(os.path.join(folder, "reference.npz"), allow_pickle=False) as ref:
    return dict(ref)


def t5x_batch(network: str) -> dict[str, np.ndarray]:
  ref = t5x_reference(network)
  keys = ["decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights"]
  keys += ["encoder_input_tokens"] if network == "a" else ["decoder_causal_attention"]
  return {k: ref[k] for k in keys}


def abstract_params(model, batch):
  """The model's parameter tree as ShapeDtypeStructs (no memory)."""
  shapes = {k: (1,) + v.shape[1:] for k, v in batch.items()
            if k in ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens")}
  boxed = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))
  return nn.unbox(boxed["params"])
