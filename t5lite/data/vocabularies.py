"""Vocabularies for the embedded tasks: bytes, and a small shipped SentencePiece model.

Both add T5's 100 sentinel ids ("extra ids") at the top of the id range, which
span corruption counts down from `vocab_size - 1`.
"""

from __future__ import annotations

import functools
import gzip
import io
import itertools
import os
import pathlib
from collections.abc import Iterator, Sequence

import sentencepiece as spm
import seqio

from t5lite.errors import UserError


EXTRA_IDS = 100
VOCAB_DIR = pathlib.Path(__file__).resolve().parent / "vocab"
# Trained by `python -m t5lite.data.build_corpus` on the training split of the
# embedded corpus, so it never has to be downloaded.
DEFAULT_SPM_MODEL = VOCAB_DIR / "stdlib_docs_unigram_2000.model"

_MODEL_TYPES = ("unigram", "bpe", "char", "word")
# T5's id layout, which seqio's SentencePieceVocabulary assumes: no BOS.
_PAD_ID, _EOS_ID, _UNK_ID, _BOS_ID = 0, 1, 2, -1


@functools.lru_cache(maxsize=None)
def byte_vocabulary(extra_ids: int = EXTRA_IDS) -> seqio.ByteVocabulary:
  """Returns the UTF-8 byte vocabulary (3 specials + 256 bytes + extra ids).

  Args:
    extra_ids: number of sentinel ids appended after the byte ids.

  Returns:
    A `seqio.ByteVocabulary`; with the default 100 extra ids its
    `vocab_size` is 359.
  """
  return seqio.ByteVocabulary(extra_ids=extra_ids)


@functools.lru_cache(maxsize=None)
def sentencepiece_vocabulary(
    model_path: str | os.PathLike[str] | None = None,
    extra_ids: int = EXTRA_IDS,
) -> seqio.SentencePieceVocabulary:
  """Returns a SentencePiece vocabulary, by default the small shipped model.

  Args:
    model_path: a `.model` file; None selects the shipped 2000-piece
      unigram model trained on the embedded corpus.
    extra_ids: number of sentinel ids seqio appends after the model's
      pieces.

  Returns:
    A `seqio.SentencePieceVocabulary`; for the shipped model its
    `vocab_size` is 2000 + `extra_ids`.

  Raises:
    ValueError: if the model file does not exist.
  """
  path = pathlib.Path(model_path) if model_path is not None else DEFAULT_SPM_MODEL
  if not path.is_file():
    fix = ("regenerate it with `python -m t5lite.data.build_corpus`" if model_path is None
           else "pass an existing .model file (a Hugging Face T5 folder has it as "
           "spiece.model)")
    raise UserError(f"SentencePiece model '{path}' does not exist; {fix}.")
  return seqio.SentencePieceVocabulary(str(path), extra_ids=extra_ids)


def padded_vocab_size(vocab: seqio.Vocabulary, multiple: int = 128) -> int:
  """Rounds a vocabulary size up so embedding tables shard and tile evenly.

  Args:
    vocab: the vocabulary whose `vocab_size` (extra ids included) is padded.
    multiple: the size is rounded up to a multiple of this.

  Returns:
    The smallest multiple of `multiple` that is >= `vocab.vocab_size`,
    e.g. 384 for the byte vocabulary and 2176 for the shipped
    SentencePiece one.

  Raises:
    ValueError: if `multiple` is not a positive integer.
  """
  if not isinstance(multiple, int) or multiple < 1:
    raise UserError(f"multiple must be a positive integer, got {multiple!r}.")
  return -(-vocab.vocab_size // multiple) * multiple


def _read_lines(text_files: Sequence[str | os.PathLike[str]]) -> Iterator[str]:
  """Yields the non-empty lines of plain or gzip-compressed text files."""
  for name in text_files:
    path = pathlib.Path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
      for line in f:
        line = line.strip()
        if line:
          yield line


def _check_train_args(
    text_files: Sequence[str | os.PathLike[str]], vocab_size: int, model_type: str
) -> None:
  """Raises ValueError for arguments SentencePiece would reject obscurely."""
  if model_type not in _MODEL_TYPES:
    raise UserError(
        f"Unknown SentencePiece model_type '{model_type}'. Allowed: "
        f"{', '.join(_MODEL_TYPES)}."
    )
  if not isinstance(vocab_size, int) or vocab_size < 4:
    raise UserError(
        "vocab_size must be an integer >= 4 (pad, eos, unk and at least one "
        f"piece), got {vocab_size!r}."
    )
  if not text_files:
    raise UserError("text_files is empty; pass at least one text file.")
  missing = [os.fspath(f) for f in text_files if not pathlib.Path(f).is_file()]
  if missing:
    raise UserError(f"Text files do not exist: {', '.join(missing)}.")


def train_sentencepiece(
    text_files: Sequence[str | os.PathLike[str]],
    model_prefix: str | os.PathLike[str],
    vocab_size: int,
    *,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    split_digits: bool = True,
    max_sentence_length: int = 1 << 15,
    max_sentences: int | None = None,
) -> pathlib.Path:
  """Trains a SentencePiece model with T5's id layout (pad 0, eos 1, unk 2).

  Training is single-threaded and reads every line (no sampling), and the
  text is streamed rather than named by path (a path would be recorded in
  the model), so identical text gives a byte-identical model everywhere.

  Args:
    text_files: plain or `.gz` text files, one sentence or paragraph a line.
    model_prefix: the model is written to `<model_prefix>.model`.
    vocab_size: number of pieces, specials included (seqio adds extra ids
      on top of this).
    model_type: one of unigram, bpe, char, word.
    character_coverage: fraction of characters the pieces must cover.
    split_digits: split numbers into single digits, which keeps arithmetic
      tokenisation regular.
    max_sentence_length: longest line, in bytes, used for training;
      SentencePiece skips longer lines.
    max_sentences: train on the first this many non-empty lines (in file
      order); None reads them all.

  Returns:
    The path of the written `.model` file.

  Raises:
    ValueError: for an unknown model type, a too small vocab_size, missing
      files, a max_sentences below 1, or when SentencePiece rejects the
      corpus (e.g. too little text for vocab_size).
  """
  _check_train_args(text_files, vocab_size, model_type)
  if max_sentences is not None and (not isinstance(max_sentences, int) or max_sentences < 1):
    raise UserError(f"max_sentences must be a positive integer or None, got {max_sentences!r}.")
  buffer = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=itertools.islice(_read_lines(text_files), max_sentences),
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        split_digits=split_digits,
        max_sentence_length=max_sentence_length,
        pad_id=_PAD_ID,
        eos_id=_EOS_ID,
        unk_id=_UNK_ID,
        bos_id=_BOS_ID,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
  except RuntimeError as e:
    raise UserError(
        f"SentencePiece training failed for vocab_size={vocab_size}, "
        f"model_type='{model_type}': {str(e).rstrip('.')}. Use a smaller vocab_size or more "
        "text."
    ) from e
  model_path = pathlib.Path(f"{os.fspath(model_prefix)}.model")
  model_path.parent.mkdir(parents=True, exist_ok=True)
  model_path.write_bytes(buffer.getvalue())
  return model_path
