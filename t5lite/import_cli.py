"""`t5lite-import`: the gin file of a T5X checkpoint's or Hugging Face folder's model.

  t5lite-import --source=path/to/flan-t5-small --output=flan_t5_small.gin

checks that every array of the checkpoint is readable and has its place in
a t5lite model, then writes (or, without --output, prints) the gin file that
defines that model: sizes, activations, tied or separate logits, relative
positions, experts and vocabulary. Train, evaluate or serve it with that
file first on the command line and the checkpoint as INITIAL_CHECKPOINT_PATH
or CHECKPOINT_PATH (docs/checkpoints.md); the weights are read from the
checkpoint itself each time, straight into their shardings.

A T5X checkpoint whose model_dir holds the run's config.gin also gets the
run's training recipe (`interop.t5x_recipe`): the file is then a headline
config that trains as the T5X run did with only MODEL_DIR and TRAIN_STEPS
given, and the T5X settings it cannot carry are listed in it and named on
stderr.

Kept apart from `cli` so that t5lite-train's flags stay its own.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence

from absl import flags, logging

from t5lite import console, paths
from t5lite.errors import UserError


FLAGS = flags.FLAGS

flags.DEFINE_string("source", None, "A T5X checkpoint (checkpoint_<step>/ or the directory "
                    "holding them) or a Hugging Face folder (config.json + safetensors).")
flags.DEFINE_string("output", None, "Gin file to write; printed to stdout when not set.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --output file.")

USER_ERROR_EXIT = console.USER_ERROR_EXIT


def import_gin() -> str:
  """Describes --source and writes or returns its gin file.

  Returns:
    The message to print: the gin text, or where it was written.

  Raises:
    ValueError: no or unreadable source, an architecture t5lite does not
      have, a T5X config.gin that is not an operative config, or an
      existing --output without --overwrite (nothing is written).
  """
  from t5lite import interop
  if not FLAGS.source:
    raise UserError("--source is required: a T5X checkpoint or a Hugging Face folder.")
  paths.check_scheme("--source", FLAGS.source)
  paths.check_scheme("--output", FLAGS.output)
  source = paths.absolute(FLAGS.source)
  if not paths.Path(source).exists():
    raise UserError(f"--source {FLAGS.source} does not exist.")
  if FLAGS.output and paths.Path(FLAGS.output).exists() and not FLAGS.overwrite:
    raise UserError(f"--output {FLAGS.output} exists; pass --overwrite to replace it.")
  imported = interop.model_gin(source)
  recipe, text = imported.recipe, imported.text
  if FLAGS.output:
    paths.makedirs(paths.parent(paths.absolute(FLAGS.output)))
    paths.write_whole(FLAGS.output, text)
  if recipe is not None and recipe.omitted:
    # A warning (on stderr), so that a printed file stays valid gin.
    logging.warning("%d T5X setting(s) not carried over (listed in %s): %s", len(recipe.omitted),
                    FLAGS.output or "the file", ", ".join(o.binding for o in recipe.omitted))
  if not FLAGS.output:
    return text
  found = imported.found
  vocab = {"byte": "bytes", "sentencepiece": found.vocabulary[1]}.get(
      found.vocabulary[0], "unknown: set VOCABULARY in the file")
  model = (f"Wrote {FLAGS.output}: the {found.network.replace('_', '-')} model of the "
           f"{found.text} {source} (vocabulary {vocab})")
  if recipe is None:
    return (f"{model}.\nUse it first: t5lite-train --gin_file={FLAGS.output} "
            f"--gin_file=gin/runs/finetune.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{source}'\" ...")
  return (f"{model} and the training recipe of its T5X run ({recipe.config}).\nUse it alone: "
          f"t5lite-train --gin_file={FLAGS.output} --gin.MODEL_DIR=\"'<dir>'\" "
          "--gin.TRAIN_STEPS=<last step>")


def _main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    print(f"t5lite-import: unexpected arguments {list(argv[1:])}; flags look like "
          "--source=PATH.", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)
  console.exit_on_user_error("t5lite-import", import_gin)


def main() -> None:
  """`t5lite-import`."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  with console.ctrl_c_as_one_line(functools.partial(console.exit_interrupted, "t5lite-import")):
    console.run(_main, sys.argv, "t5lite-import")


if __name__ == "__main__":
  main()
