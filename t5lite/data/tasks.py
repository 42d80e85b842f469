"""The embedded seqio Tasks, registered on import; none of them downloads anything.

Corpus tasks read the shipped English corpus (see `build_corpus`):

- `t5lite_span_corruption` / `_spm`: T5 span-corruption pretraining,
 features inputs + targets, bytes (vocab 359) or SentencePiece (vocab 2100).
- `t5lite_lm` / `_spm`: language modelling for decoder-only models, targets
 only, paragraphs EOS-separated and cut into chunks of the targets length.

Supervised tasks with exactly checkable answers, generated on the fly:

- `t5lite_arithmetic` / `_spm`: "add: 4821 + 77" -> "4898",
 "sub: 12 - 345" -> "-333"; `train` and `validation` are disjoint.
- `t5lite_sort` / `_spm`: "sort: 4 0 9 4" -> "0 4 4 9", 3 to 10 digits;
 `train` and `validation` are disjoint. A small T5 learns it to over 95%
 exact match in minutes on a CPU (multi-digit arithmetic takes far longer),
 which makes it the quick fine-tuning check.

All have splits `train` and `validation`. Re-importing (or reloading) this
module re-registers the same tasks without error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import seqio
import tensorflow as tf

from t5lite.data import autograph
from t5lite.data import build_corpus
from t5lite.data import preprocessors
from t5lite.data import vocabularies

SPAN_CORRUPTION = "t5lite_span_corruption"
SPAN_CORRUPTION_SPM = "t5lite_span_corruption_spm"
LM = "t5lite_lm"
LM_SPM = "t5lite_lm_spm"
ARITHMETIC = "t5lite_arithmetic"
ARITHMETIC_SPM = "t5lite_arithmetic_spm"
SORT = "t5lite_sort"
SORT_SPM = "t5lite_sort_spm"
EMBEDDED_TASKS = (SPAN_CORRUPTION, SPAN_CORRUPTION_SPM, LM, LM_SPM, ARITHMETIC, ARITHMETIC_SPM,
                  SORT, SORT_SPM)

ARITHMETIC_SIZES = {"train": 100_000, "validation": 1_000}
# One in this many (op, a, b) problems belongs to validation; train never
# contains them, so validation accuracy measures generalisation.
_VALIDATION_ONE_IN = 50
_MAX_OPERAND_DIGITS = 4
_ARITHMETIC_OPS = (("add", "+"), ("sub", "-"))
# Fixed salts make the generated problems a pure function of these numbers.
_PROBLEM_SALT = np.uint64(0x5EED_A817_0000_0001)
_SPLIT_SALT = np.uint64(0x5EED_A817_0000_0002)


def _mix64(values: np.ndarray) -> np.ndarray:
  """SplitMix64 finaliser: a fixed, platform-independent uint64 hash."""
  with np.errstate(over="ignore"):
    z = values.astype(np.uint64) + np.uint64(0x9E37_79B9_7F4A_7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58_476D_1CE4_E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D0_49BB_1331_11EB)
  return z ^ (z >> np.uint64(31))


def _problems(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Returns (op, a, b) for problem numbers; operands have 1-4 digits, evenly."""
  def operand(salt: int) -> np.ndarray:
    h = _mix64(indices * np.uint64(3) + np.uint64(salt) + _PROBLEM_SALT)
    digits = h % np.uint64(_MAX_OPERAND_DIGITS) + np.uint64(1)
    return ((h >> np.uint64(8)) % (np.uint64(10) ** digits)).astype(np.int64)

  op = (_mix64(indices * np.uint64(3) + _PROBLEM_SALT) >> np.uint64(40)) % np.uint64(2)
  return op.astype(np.int64), operand(1), operand(2)


def _is_validation(op: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Assigns each distinct problem to one split by hashing the problem itself."""
  key = (op * 10**8 + a * 10**4 + b).astype(np.uint64)
  return _mix64(key ^ _SPLIT_SALT) % np.uint64(_VALIDATION_ONE_IN) == 0


@functools.lru_cache(maxsize=None)
def arithmetic_examples(split: str) -> tuple[tuple[str, str], ...]:
  """Returns the deterministic (question, answer) pairs of one split.

  Problems are numbered 0, 1, 2, ...; each number hashes to an operation and
  two operands. A problem belongs to validation iff a hash of (op, a, b)
  says so, which keeps the splits disjoint; duplicates are skipped.

  Args:
    split: "train" or "validation".

  Returns:
    `ARITHMETIC_SIZES[split]` pairs like ("add: 4821 + 77", "4898").

  Raises:
    ValueError: for an unknown split.
  """
  if split not in ARITHMETIC_SIZES:
    raise ValueError(
        f"Unknown arithmetic split '{split}'. Allowed: {', '.join(ARITHMETIC_SIZES)}."
    )
  wanted, seen, start = ARITHMETIC_SIZES[split], {}, 0
  block = 1 << 16
  while len(seen) < wanted:
    op, a, b = _problems(np.arange(start, start + block, dtype=np.uint64))
    in_split = _is_validation(op, a, b) == (split == "validation")
    for o, x, y in zip(op[in_split].tolist(), a[in_split].tolist(), b[in_split].tolist()):
      seen.setdefault((o, x, y), None)
      if len(seen) == wanted:
        break
    start += block
  return tuple(_format_problem(*problem) for problem in seen)


def _format_problem(op: int, a: int, b: int) -> tuple[str, str]:
  """Renders one problem as (question, answer) text."""
  name, symbol = _ARITHMETIC_OPS[op]
  answer = a + b if symbol == "+" else a - b
  return f"{name}: {a} {symbol} {b}", str(answer)


SORT_SIZES = {"train": 100_000, "validation": 1_000}
_SORT_MIN_DIGITS, _SORT_MAX_DIGITS = 3, 10
_SORT_SALT = np.uint64(0x5EED_5087_0000_0001)


def _digit_lists(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Returns ([n, max] digits, [n] lengths) for problem numbers."""
  positions = np.arange(_SORT_MAX_DIGITS, dtype=np.uint64)
  keys = indices[:, None] * np.uint64(_SORT_MAX_DIGITS + 1) + positions[None, :]
  digits = (_mix64(keys + _SORT_SALT) >> np.uint64(16)) % np.uint64(10)
  span = _SORT_MAX_DIGITS - _SORT_MIN_DIGITS + 1
  lengths = _mix64(indices * np.uint64(_SORT_MAX_DIGITS + 1) + np.uint64(_SORT_MAX_DIGITS)
                   + _SORT_SALT) % np.uint64(span) + np.uint64(_SORT_MIN_DIGITS)
  return digits.astype(np.int64), lengths.astype(np.int64)


@functools.lru_cache(maxsize=None)
def sort_examples(split: str) -> tuple[tuple[str, str], ...]:
  """Returns the deterministic (question, answer) pairs of one sort split.

  A digit list belongs to validation iff a hash of the list says so, so no
  list appears in both splits; duplicates are skipped.

  Args:
    split: "train" or "validation".

  Returns:
    `SORT_SIZES[split]` pairs like ("sort: 4 0 9 4", "0 4 4 9").

  Raises:
    ValueError: for an unknown split.
  """
  if split not in SORT_SIZES:
    raise ValueError(f"Unknown sort split '{split}'. Allowed: {', '.join(SORT_SIZES)}.")
  wanted, seen, start, block = SORT_SIZES[split], {}, 0, 1 << 16
  powers = np.uint64(11) ** np.arange(_SORT_MAX_DIGITS, dtype=np.uint64)
  while len(seen) < wanted:
    digits, lengths = _digit_lists(np.arange(start, start + block, dtype=np.uint64))
    used = np.arange(_SORT_MAX_DIGITS)[None, :] < lengths[:, None]
    # Each list as a base-11 number (digits + 1, 0 past the end) names it exactly.
    codes = ((digits.astype(np.uint64) + np.uint64(1)) * used * powers).sum(axis=1)
    in_split = (_mix64(codes ^ _SPLIT_SALT) % np.uint64(_VALIDATION_ONE_IN) == 0) == (
        split == "validation")
    for row, length in zip(digits[in_split].tolist(), lengths[in_split].tolist()):
      seen.setdefault(tuple(row[:length]), None)
      if len(seen) == wanted:
        break
    start += block
  return tuple(("sort: " + " ".join(map(str, key)), " ".join(map(str, sorted(key))))
               for key in seen)


def _sort_dataset(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  """seqio `dataset_fn`: the generated sort problems; see `_arithmetic_dataset`."""
  questions, answers = zip(*sort_examples(split))
  ds = tf.data.Dataset.from_tensor_slices({"inputs": list(questions), "targets": list(answers)})
  if shuffle_files and seed is not None:
    ds = ds.shuffle(len(questions), seed=seed, reshuffle_each_iteration=True)
  return ds


def _arithmetic_dataset(
    split: str, shuffle_files: bool, seed: int | None = None
) -> tf.data.Dataset:
  """seqio `dataset_fn`: the generated problems as {"inputs", "targets"} strings.

  The problems are already in random order. With a seed the whole split is
  reshuffled every epoch; without one it is left alone, so that every host
  sees the same order and seqio's per-host sharding stays disjoint.
  """
  questions, answers = zip(*arithmetic_examples(split))
  ds = tf.data.Dataset.from_tensor_slices({"inputs": list(questions), "targets": list(answers)})
  if shuffle_files and seed is not None:
    ds = ds.shuffle(len(questions), seed=seed, reshuffle_each_iteration=True)
  return ds


def exact_match_accuracy(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """seqio metric fn: percentage (0-100) of predictions equal to their target.

  Args:
    targets: postprocessed target strings.
    predictions: postprocessed predicted strings, same length.

  Returns:
    {"accuracy": percent}.

  Raises:
    ValueError: if the two sequences differ in length.
  """
  if len(targets) != len(predictions):
    raise ValueError(
        f"Got {len(targets)} targets but {len(predictions)} predictions; "
        "they must pair up."
    )
  if not targets:
    return {"accuracy": 0.0}
  correct = sum(t == p for t, p in zip(targets, predictions))
  return {"accuracy": 100.0 * correct / len(targets)}


def strip_whitespace(output: str | bytes, example: object = None, is_target: bool = False) -> str:
  """seqio postprocess_fn: decoded text without surrounding whitespace."""
  del example, is_target  # Targets and predictions are treated alike.
  if isinstance(output, bytes):
    output = output.decode("utf-8")
  return output.strip()


def _read_gzip_lines(path: tf.Tensor) -> tf.data.Dataset:
  """seqio `read_file_fn` for the gzip-compressed corpus files."""
  return tf.data.TextLineDataset(path, compression_type="GZIP")


def _corpus_source() -> seqio.FileDataSource:
  return seqio.FileDataSource(
      read_file_fn=_read_gzip_lines,
      split_to_filepattern={
          split: str(build_corpus.corpus_file(split)) for split in build_corpus.SPLITS
      },
  )


class _GeneratedDataSource(seqio.FunctionDataSource):
  """A FunctionDataSource for data generated in random order.

  seqio's FunctionDataSource warns on every shuffled read that uncached
  function data is poorly shuffled; generated problems are random already,
  so this source reads the same way without the misleading warning. seqio
  shards its examples per host, as for any single-shard source.
  """

  def __init__(self, dataset_fn: Callable[..., tf.data.Dataset], sizes: dict[str, int]):
    super().__init__(dataset_fn=dataset_fn, splits=tuple(sizes), num_input_examples=sizes)
    self._generate = dataset_fn

  def get_dataset(
      self,
      split: str = "train",
      shuffle: bool = True,
      seed: int | None = None,
      shard_info: seqio.ShardInfo | None = None,
      **unused_kwargs,
  ) -> tf.data.Dataset:
    if shard_info and shard_info.num_shards > 1:
      # Unreachable through seqio.Task, which shards single-shard sources itself.
      raise ValueError("Generated data is sharded by seqio.Task, not by its source.")
    return self._generate(split=split, shuffle_files=shuffle, seed=seed)


def _tokenize_lines() -> list[Callable[..., tf.data.Dataset]]:
  """Steps that turn corpus lines into token ids (the cacheable prefix)."""
  return [
      preprocessors.line_to_targets,
      functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
  ]


def _register(name: str, **task_kwargs) -> seqio.Task:
  """Adds a task, replacing any earlier registration so re-imports are harmless."""
  seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(name, **task_kwargs)


def _register_span_corruption(name: str, vocab: seqio.Vocabulary) -> None:
  _register(
      name,
      source=_corpus_source(),
      output_features={
          "inputs": seqio.Feature(vocab, add_eos=True),
          "targets": seqio.Feature(vocab, add_eos=True),
      },
      preprocessors=[
          *_tokenize_lines(),
          seqio.CacheDatasetPlaceholder(),
          preprocessors.span_corruption,
          seqio.preprocessors.append_eos_after_trim,
      ],
      metric_fns=[],
  )


def _register_lm(name: str, vocab: seqio.Vocabulary) -> None:
  # EOS goes after every paragraph *before* chunking, so it marks document
  # boundaries inside the stream instead of ending each chunk.
  _register(
      name,
      source=_corpus_source(),
      output_features={"targets": seqio.Feature(vocab, add_eos=True)},
      preprocessors=[
          *_tokenize_lines(),
          seqio.preprocessors.append_eos,
          seqio.CacheDatasetPlaceholder(),
          preprocessors.chunk_stream,
      ],
      metric_fns=[],
  )


def _register_generated(name: str, vocab: seqio.Vocabulary,
                        dataset_fn: Callable[..., tf.data.Dataset], sizes: dict[str, int]) -> None:
  _register(
      name,
      source=_GeneratedDataSource(dataset_fn, sizes),
      output_features={
          "inputs": seqio.Feature(vocab, add_eos=True),
          "targets": seqio.Feature(vocab, add_eos=True),
      },
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      postprocess_fn=strip_whitespace,
      metric_fns=[exact_match_accuracy],
  )


def register_tasks() -> None:
  """Registers (or re-registers) every embedded task."""
  byte_vocab, spm_vocab = vocabularies.byte_vocabulary(), vocabularies.sentencepiece_vocabulary()
  _register_span_corruption(SPAN_CORRUPTION, byte_vocab)
  _register_span_corruption(SPAN_CORRUPTION_SPM, spm_vocab)
  _register_lm(LM, byte_vocab)
  _register_lm(LM_SPM, spm_vocab)
  _register_generated(ARITHMETIC, byte_vocab, _arithmetic_dataset, ARITHMETIC_SIZES)
  _register_generated(ARITHMETIC_SPM, spm_vocab, _arithmetic_dataset, ARITHMETIC_SIZES)
  _register_generated(SORT, byte_vocab, _sort_dataset, SORT_SIZES)
  _register_generated(SORT_SPM, spm_vocab, _sort_dataset, SORT_SIZES)


autograph.skip_known_code()  # before any pipeline is traced
register_tasks()
