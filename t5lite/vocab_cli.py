"""`t5lite-vocab`: trains a SentencePiece vocabulary from text files.

  t5lite-vocab --input='my_corpus/*.txt' --model_prefix=vocab/my --vocab_size=8000

writes `vocab/my.model` with T5's id layout (pad 0, eos 1, unk 2, no BOS;
see `vocabularies.train_sentencepiece`) and prints the gin flags that make a
model use it, with `VOCAB_SIZE` (the embedding rows) padded up to a
multiple of 128 over the vocabulary plus seqio's 100 extra ids. A task
whose features use the same vocabulary is still needed (docs/data.md).

Kept apart from `cli` so that t5lite-train's flags stay its own.
"""

from __future__ import annotations

import functools
import glob
import os
import pathlib
import shlex
import sys
from collections.abc import Sequence

from absl import flags

from t5lite import console
from t5lite.errors import UserError


FLAGS = flags.FLAGS

flags.DEFINE_multi_string("input", [], "Text file or glob, one sentence or paragraph a line "
                          "(plain or .gz); repeatable.")
flags.DEFINE_string("model_prefix", None, "Output: the model is written to PREFIX.model "
                    "(a trailing .model is accepted).")
flags.DEFINE_integer("vocab_size", None, "Pieces in the model, specials included (seqio adds "
                     "100 extra ids on top).")
flags.DEFINE_enum("model_type", "unigram", ["unigram", "bpe", "char", "word"],
                  "SentencePiece algorithm.")
flags.DEFINE_float("character_coverage", 1.0, "Share of characters the pieces must cover; "
                   "e.g. 0.9995 for text with very many distinct characters.")
flags.DEFINE_integer("max_sentences", None, "Train on the first this many non-empty lines; "
                     "all of them by default.")

USER_ERROR_EXIT = console.USER_ERROR_EXIT


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Files named by `--input` values, each a path or a glob, in order.

  Raises:
    ValueError: no --input, or a value that names no existing file.
  """
  if not patterns:
    raise UserError("No --input given; pass --input=FILE_OR_GLOB (repeatable).")
  files = []
  for pattern in patterns:
    matched = sorted(glob.glob(os.path.expanduser(pattern)))
    matched = [m for m in matched if os.path.isfile(m)]
    if not matched:
      raise UserError(f"--input '{pattern}' matches no file; check the path (quote globs "
                      "so the shell passes them through).")
    files += [m for m in matched if m not in files]
  return files


def model_prefix(value: str | None) -> str:
  """The prefix SentencePiece writes `<prefix>.model` to."""
  if not value:
    raise UserError("No --model_prefix given; pass e.g. --model_prefix=vocab/my to write "
                    "vocab/my.model.")
  return value[:-len(".model")] if value.endswith(".model") else value


def gin_flags(model_path: str, vocab_size: int) -> str:
  """The t5lite-train flags that select this model and its embedding rows."""
  binding = f"--gin.vocabularies.sentencepiece_vocabulary.model_path='{model_path}'"
  # Double quotes read best and are safe unless the path has shell specials.
  name, value = binding.split("=", 1)
  plain = not any(c in model_path for c in "'\"$`\\!")
  path = f'{name}="{value}"' if plain else shlex.quote(binding)
  return (f"--gin.VOCABULARY=\"@vocabularies.sentencepiece_vocabulary()\" {path} "
          f"--gin.VOCAB_SIZE={vocab_size}")


def train_vocabulary() -> str:
  """Trains the model the flags describe; returns the text to print.

  Raises:
    ValueError: bad flags, missing files, or text SentencePiece rejects.
  """
  from t5lite.data import vocabularies
  if FLAGS.vocab_size is None:
    raise UserError("No --vocab_size given; pass e.g. --vocab_size=8000 (the pieces, "
                    "specials included).")
  files = expand_inputs(FLAGS.input)
  path = vocabularies.train_sentencepiece(
      files, model_prefix(FLAGS.model_prefix), FLAGS.vocab_size, model_type=FLAGS.model_type,
      character_coverage=FLAGS.character_coverage, max_sentences=FLAGS.max_sentences)
  path = pathlib.Path(path).resolve()
  import seqio
  vocab = seqio.SentencePieceVocabulary(str(path), extra_ids=vocabularies.EXTRA_IDS)
  rows = vocabularies.padded_vocab_size(vocab)
  return (f"Wrote {path}: {FLAGS.vocab_size} {FLAGS.model_type} pieces from {len(files)} "
          f"file(s).\nWith seqio's {vocabularies.EXTRA_IDS} extra ids it has "
          f"{vocab.vocab_size} ids; VOCAB_SIZE (embedding rows) {rows} pads that to a "
          "multiple of 128.\nTrain on a task whose features use this vocabulary "
          f"(docs/data.md) with:\n  {gin_flags(str(path), rows)}")


def _main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    print(f"t5lite-vocab: unexpected arguments {list(argv[1:])}; flags look like "
          "--input=FILE.", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)
  console.exit_on_user_error("t5lite-vocab", train_vocabulary)


def main() -> None:
  """`t5lite-vocab`."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # seqio imports TensorFlow
  with console.ctrl_c_as_one_line(functools.partial(console.exit_interrupted, "t5lite-vocab")):
    console.run(_main, sys.argv, "t5lite-vocab")


if __name__ == "__main__":
  main()
