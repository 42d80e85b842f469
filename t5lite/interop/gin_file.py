"""The gin file of an imported checkpoint's model.

`t5lite-import` writes it so that nobody types a dimension by hand: it
defines `MODEL` with the network, sizes, activations, logits, relative
positions, experts and vocabulary the checkpoint was found to have, and is
used like any file of `gin/models/` (first on the command line, before a
run file such as `gin/runs/finetune.gin`).
"""

from __future__ import annotations

from typing import Any

ENCODER_DECODER = "encoder_decoder"
DECODER_ONLY = "decoder_only"

# TransformerConfig fields written, in this order, when present.
_FIELDS = ("vocab_size", "emb_dim", "num_heads", "num_encoder_layers", "num_decoder_layers",
           "head_dim", "mlp_dim", "mlp_activations", "logits_via_embedding",
           "relative_attention_num_buckets", "relative_attention_max_distance",
           "relpos_per_layer",
           "num_experts", "num_selected_experts", "moe_layer_interval", "expert_capacity",
           "renormalize_router_weights", "group_size", "expert_mlp_dim",
           "router_jitter_noise")


def _literal(value: Any) -> str:
  if isinstance(value, tuple):
    return "(" + ", ".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  if isinstance(value, str):
    return repr(value)
  return repr(value)


def _vocabulary_lines(vocabulary: tuple[str, str | None]) -> list[str]:
  kind, path = vocabulary
  if kind == "sentencepiece":
    return ["VOCABULARY = @vocabularies.sentencepiece_vocabulary()",
            f"vocabularies.sentencepiece_vocabulary.model_path = {path!r}",
            "vocabularies.sentencepiece_vocabulary.extra_ids = 100"]
  if kind == "byte":
    return ["VOCABULARY = @vocabularies.byte_vocabulary()"]
  return ["# The checkpoint does not say which vocabulary it was trained with: set it.",
          "VOCABULARY = %gin.REQUIRED"]


def model_gin(network: str, fields: dict[str, Any], vocabulary: tuple[str, str | None],
              source: str) -> str:
  """Gin text defining MODEL for an imported checkpoint.

  Args:
    network: ENCODER_DECODER or DECODER_ONLY.
    fields: `TransformerConfig` fields found in the checkpoint.
    vocabulary: ('sentencepiece', model path), ('byte', None) or
      ('unknown', None).
    source: the checkpoint, named in the header comment.

  Returns:
    The file's text.
  """
  is_encdec = network == ENCODER_DECODER
  model = "EncoderDecoderModel" if is_encdec else "DecoderOnlyModel"
  module = "EncoderDecoder" if is_encdec else "DecoderOnly"
  lines = [
      f"# The model of {source}, as t5lite-import found it.",
      "# Use it like a file of gin/models/: first, then a run file, e.g.",
      "#   t5lite-train --gin_file=<this file> --gin_file=gin/runs/finetune.gin \\",
      f"#     --gin.INITIAL_CHECKPOINT_PATH=\"'{source}'\" ...",
      "from __gin__ import dynamic_registration",
      "from t5lite import optimizers",
      "from t5lite.data import vocabularies",
      "from t5lite.models import models",
      "from t5lite.models import transformer",
      "",
      "DROPOUT_RATE = 0.0",
      *_vocabulary_lines(vocabulary),
      "OPTIMIZER = @optimizers.adafactor()",
      "# A constant rate, as T5X fine-tunes; pretraining files use rsqrt decay.",
      "LEARNING_RATE = 0.001",
      "",
      f"MODEL = @models.{model}()",
      f"models.{model}:",
      f"  module = @transformer.{module}()",
      "  input_vocabulary = %VOCABULARY",
      "  output_vocabulary = %VOCABULARY",
      "  optimizer = %OPTIMIZER",
      "  z_loss = 1e-4",
      "",
      f"transformer.{module}.config = @transformer.TransformerConfig()",
      "transformer.TransformerConfig:",
  ]
  lines += [f"  {name} = {_literal(fields[name])}" for name in _FIELDS if name in fields]
  lines += ["  dropout_rate = %DROPOUT_RATE", "  dtype = 'float32'", "",
            "optimizers.adafactor.learning_rate = %LEARNING_RATE", ""]
  return "\n".join(lines)
