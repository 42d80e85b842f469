"""The gin file of an imported checkpoint's model, and of its training recipe.

`t5lite-import` writes it so that nobody types a dimension by hand: it
defines `MODEL` with the network, sizes, activations, logits, relative
positions, experts and vocabulary the checkpoint was found to have. Alone it
is used like any file of `gin/models/` (first on the command line, before a
run file such as `gin/runs/finetune.gin`). With a `Recipe` (a T5X run's
training settings, mapped by `t5x_recipe`) it is a headline config instead,
like `gin/finetune_dense.gin`: the model, then `include
'gin/runs/finetune.gin'`, then the recipe, and the T5X settings it could not
carry as comments.
"""

from __future__ import annotations

import dataclasses
import textwrap
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


_RUN_FILE = "gin/runs/finetune.gin"


@dataclasses.dataclass(frozen=True)
class Ref:
  """A gin reference written as is: '@optimizers.adafactor()', '%LEARNING_RATE'."""

  text: str


@dataclasses.dataclass(frozen=True)
class Setting:
  """`name = value` in the file, after its comment lines."""

  name: str  # a macro ('BATCH_SIZE') or a binding ('optimizers.adafactor.beta1')
  value: Any  # a Python literal or a `Ref`
  comment: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Omission:
  """A setting of the foreign run that the file does not carry, and why."""

  binding: str
  value: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A foreign run's training settings in t5lite's names."""

  config: str  # the file they were read from
  sections: tuple[tuple[str, tuple[Setting, ...]], ...]  # (title, settings)
  omitted: tuple[Omission, ...]


def literal(value: Any) -> str:
  """`value` as gin text: Python literals, and references (`Ref`, or any
  object with a `text` attribute) as written."""
  if isinstance(getattr(value, "text", None), str):
    return value.text
  if isinstance(value, tuple):
    return "(" + ", ".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  if isinstance(value, list):
    return "[" + ", ".join(literal(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
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


def _model_header(source: str) -> list[str]:
  return [f"# The model of {source}, as t5lite-import found it.",
          "# Use it like a file of gin/models/: first, then a run file, e.g.",
          f"#   t5lite-train --gin_file=<this file> --gin_file={_RUN_FILE} \\",
          f"#     --gin.INITIAL_CHECKPOINT_PATH=\"'{source}'\" ...",
          "from __gin__ import dynamic_registration",
          "from t5lite import optimizers",
          "from t5lite.data import vocabularies",
          "from t5lite.models import models",
          "from t5lite.models import transformer"]


def _headline_header(source: str, recipe: Recipe) -> list[str]:
  return [*_comment(f"The model of {source}, as t5lite-import found it, and the training "
                    f"recipe of the T5X run it belongs to ({recipe.config}). Use it alone; "
                    "MODEL_DIR and TRAIN_STEPS are yours to set (the T5X run's are not "
                    "carried over):"),
          "#   t5lite-train --gin_file=<this file> --gin.MODEL_DIR=\"'<dir>'\" \\",
          "#     --gin.TRAIN_STEPS=<last step>",
          "from __gin__ import dynamic_registration",
          "from t5lite import checkpoints",
          "from t5lite import optimizers",
          "from t5lite import train as train_lib",
          "from t5lite import trainer",
          "from t5lite.data import datasets",
          "from t5lite.data import vocabularies",
          "from t5lite.models import models",
          "from t5lite.models import transformer"]


def _model_lines(network: str, fields: dict[str, Any], vocabulary: tuple[str, str | None],
                 with_training: bool) -> list[str]:
  """MODEL; with `with_training`, also the training settings a model file
  alone needs (a recipe writes its own instead)."""
  is_encdec = network == ENCODER_DECODER
  model = "EncoderDecoderModel" if is_encdec else "DecoderOnlyModel"
  module = "EncoderDecoder" if is_encdec else "DecoderOnly"
  lines = ["", "DROPOUT_RATE = 0.0"] if with_training else [""]
  lines += _vocabulary_lines(vocabulary)
  if with_training:
    lines += ["OPTIMIZER = @optimizers.adafactor()",
              "# A constant rate, as T5X fine-tunes; pretraining files use rsqrt decay.",
              "LEARNING_RATE = 0.001"]
  lines += ["", f"MODEL = @models.{model}()", f"models.{model}:",
            f"  module = @transformer.{module}()", "  input_vocabulary = %VOCABULARY",
            "  output_vocabulary = %VOCABULARY", "  optimizer = %OPTIMIZER"]
  lines += ["  z_loss = 1e-4"] if with_training else []
  lines += ["", f"transformer.{module}.config = @transformer.TransformerConfig()",
            "transformer.TransformerConfig:"]
  lines += [f"  {name} = {literal(fields[name])}" for name in _FIELDS if name in fields]
  lines += ["  dropout_rate = %DROPOUT_RATE"]
  if with_training:
    lines += ["  dtype = 'float32'", "", "optimizers.adafactor.learning_rate = %LEARNING_RATE"]
  return lines + [""]


def _comment(text: str) -> list[str]:
  """Comment lines of at most 80 characters; indented text (code) is kept whole."""
  if text.startswith(" "):
    return [f"# {text}"]
  return textwrap.wrap(text, 78, initial_indent="# ", subsequent_indent="# ",
                       break_long_words=False, break_on_hyphens=False)


def _recipe_lines(recipe: Recipe) -> list[str]:
  lines = []
  for title, settings in recipe.sections:
    lines += ["", f"# {title}"]
    for setting in settings:
      lines += [line for text in setting.comment for line in _comment(text)]
      lines.append(f"{setting.name} = {literal(setting.value)}")
  if recipe.omitted:
    lines += [""] + _comment(f"The T5X settings of {recipe.config} that this file does not "
                             "carry; where they matter, training differs from the T5X run.")
    # One line each, so that a search for the T5X binding finds it whole.
    lines += [f"# Not carried over: {o.binding} = {o.value} ({o.reason})"
              for o in recipe.omitted]
  return lines + [""]


def model_gin(network: str, fields: dict[str, Any], vocabulary: tuple[str, str | None],
              source: str, recipe: Recipe | None = None) -> str:
  """Gin text defining MODEL for an imported checkpoint, and its recipe if any.

  Args:
    network: ENCODER_DECODER or DECODER_ONLY.
    fields: `TransformerConfig` fields found in the checkpoint.
    vocabulary: ('sentencepiece', model path), ('byte', None) or
      ('unknown', None).
    source: the checkpoint, named in the header comment.
    recipe: the training recipe of the run the checkpoint belongs to; with
      it the file is a headline config (model, run file, recipe), without it
      a model file.

  Returns:
    The file's text.
  """
  if recipe is None:
    return "\n".join(_model_header(source) + _model_lines(network, fields, vocabulary, True))
  lines = _headline_header(source, recipe) + _model_lines(network, fields, vocabulary, False)
  lines += [f"include '{_RUN_FILE}'"] + _recipe_lines(recipe)
  return "\n".join(lines)
