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

from t5lite.data import autograph, build_corpus, preprocessors, vocabularies
from t5lite.errors import UserError


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
# Problems are generated this many at a time; the problems kept do not depend on it.
_BLOCK_SIZE = 1 << 16


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


def _first_distinct(
    in_split: Callable[[np.ndarray], tuple[np.ndarray, ...]], wanted: int
) -> tuple[np.ndarray, ...]:
  """Keeps the first `wanted` distinct problems, in order of first occurrence.

  Problems are numbered 0, 1, 2, ... and generated in blocks until enough
  distinct ones have been seen, exactly as a loop adding each problem to a
  dict in order (skipping duplicates) and stopping at `wanted` would.

  Args:
    in_split: maps a block of problem numbers to `(keys, *columns)` for the
      problems of that block in the split, in order; a key names a problem
      exactly (equal keys, equal problems).
    wanted: how many distinct problems to keep.

  Returns:
    The columns (without the keys), `wanted` rows each.
  """
  parts, start, block = [], 0, _BLOCK_SIZE
  first = np.zeros(0, dtype=np.int64)
  while not parts or len(first) < wanted:
    parts.append(in_split(np.arange(start, start + block, dtype=np.uint64)))
    start += block
    keys = np.concatenate([part[0] for part in parts])
    if len(keys) >= wanted:  # Else too few to hold `wanted` distinct ones.
      first = _first_occurrences(keys)
  first = np.sort(first)[:wanted]
  return tuple(np.concatenate(columns)[first] for columns in list(zip(*parts))[1:])


def _first_occurrences(keys: np.ndarray) -> np.ndarray:
  """Returns the index of the first occurrence of each distinct key, in no particular order."""
  order = np.argsort(keys)  # Quicker than a stable sort; equal keys end up in any order.
  ordered = keys[order]
  starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
  return np.minimum.reduceat(order, starts)  # The least index within each run of equal keys.


@functools.lru_cache(maxsize=None)
def _numerals(low: int, high: int) -> np.ndarray:
  """Returns `str(i)` as ASCII bytes for i in [low, high], as a numpy `S` array."""
  return np.array([str(i).encode("ascii") for i in range(low, high + 1)])


def _read_only(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
  """Marks cached arrays read-only, so that no caller can change them for the others."""
  for array in arrays:
    array.flags.writeable = False
  return arrays


def _as_pairs(questions: np.ndarray, answers: np.ndarray) -> tuple[tuple[str, str], ...]:
  """Byte-string arrays as (question, answer) str pairs."""
  return tuple(zip(map(bytes.decode, questions.tolist()), map(bytes.decode, answers.tolist())))


@functools.lru_cache(maxsize=None)
def _arithmetic_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
  """`arithmetic_examples(split)` as read-only (questions, answers) `S` arrays."""
  if split not in ARITHMETIC_SIZES:
    raise UserError(
        f"Unknown arithmetic split '{split}'. Allowed: {', '.join(ARITHMETIC_SIZES)}."
    )

  def in_split(indices: np.ndarray) -> tuple[np.ndarray, ...]:
    op, a, b = _problems(indices)
    keep = _is_validation(op, a, b) == (split == "validation")
    op, a, b = op[keep], a[keep], b[keep]
    return op * 10**8 + a * 10**4 + b, op, a, b  # Operands are below 10**4.

  op, a, b = _first_distinct(in_split, ARITHMETIC_SIZES[split])
  limit = 10**_MAX_OPERAND_DIGITS
  numerals = _numerals(-limit, 2 * limit)  # Every operand and answer; numerals[limit] is b"0".
  names = np.array([f"{name}: ".encode() for name, _ in _ARITHMETIC_OPS])[op]
  symbols = np.array([f" {symbol} ".encode() for _, symbol in _ARITHMETIC_OPS])[op]
  questions = np.char.add(np.char.add(np.char.add(names, numerals[a + limit]), symbols),
                          numerals[b + limit])
  answers = numerals[np.where(op == _ARITHMETIC_OPS.index(("add", "+")), a + b, a - b) + limit]
  return _read_only(questions, answers)


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
  return _as_pairs(*_arithmetic_arrays(split))


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


def _spaced_digits(prefix: bytes, digits: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Renders rows of digits as b"<prefix>d d d", the first `lengths` of each, as `S` strings."""
  n, width = digits.shape
  used = (np.arange(width)[None, :] < lengths[:, None]).view(np.uint8)
  body = np.zeros((n, width, 2), dtype=np.uint8)  # A digit, then a space unless it is the last.
  body[:, :, 0] = (digits.astype(np.uint8) + np.uint8(ord("0"))) * used
  body[:, :-1, 1] = used[:, 1:] * np.uint8(ord(" "))
  head = np.broadcast_to(np.frombuffer(prefix, dtype=np.uint8), (n, len(prefix)))
  chars = np.concatenate([head, body.reshape(n, 2 * width)], axis=1)
  # NumPy drops the trailing NUL bytes of each fixed-width `S` string.
  return chars.view(f"S{chars.shape[1]}").reshape(n)


@functools.lru_cache(maxsize=None)
def _sort_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
  """`sort_examples(split)` as read-only (questions, answers) `S` arrays."""
  if split not in SORT_SIZES:
    raise UserError(f"Unknown sort split '{split}'. Allowed: {', '.join(SORT_SIZES)}.")
  powers = np.uint64(11) ** np.arange(_SORT_MAX_DIGITS, dtype=np.uint64)

  def in_split(indices: np.ndarray) -> tuple[np.ndarray, ...]:
    digits, lengths = _digit_lists(indices)
    used = np.arange(_SORT_MAX_DIGITS)[None, :] < lengths[:, None]
    # Each list as a base-11 number (digits + 1, 0 past the end) names it exactly.
    codes = ((digits.astype(np.uint64) + np.uint64(1)) * used * powers).sum(axis=1)
    keep = (_mix64(codes ^ _SPLIT_SALT) % np.uint64(_VALIDATION_ONE_IN) == 0) == (
        split == "validation")
    return codes[keep], digits[keep], lengths[keep]

  digits, lengths = _first_distinct(in_split, SORT_SIZES[split])
  used = np.arange(_SORT_MAX_DIGITS)[None, :] < lengths[:, None]
  ordered = np.sort(np.where(used, digits, 10), axis=1)  # Unused positions sort last.
  return _read_only(_spaced_digits(b"sort: ", digits, lengths),
                    _spaced_digits(b"", ordered, lengths))


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
  return _as_pairs(*_sort_arrays(split))


def _generated_dataset(questions: np.ndarray, answers: np.ndarray, shuffle_files: bool,
                       seed: int | None) -> tf.data.Dataset:
  """The {"inputs", "targets"} dataset of one split, from `S` arrays (far quicker than lists)."""
  ds = tf.data.Dataset.from_tensor_slices({"inputs": questions, "targets": answers})
  if shuffle_files and seed is not None:
    ds = ds.shuffle(len(questions), seed=seed, reshuffle_each_iteration=True)
  return ds


def _sort_dataset(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  """seqio `dataset_fn`: the generated sort problems; see `_arithmetic_dataset`."""
  return _generated_dataset(*_sort_arrays(split), shuffle_files, seed)


def _arithmetic_dataset(
    split: str, shuffle_files: bool, seed: int | None = None
) -> tf.data.Dataset:
  """seqio `dataset_fn`: the generated problems as {"inputs", "targets"} strings.

  The problems are already in random order. With a seed the whole split is
  reshuffled every epoch; without one it is left alone, so that every host
  sees the same order and seqio's per-host sharding stays disjoint.
  """
  return _generated_dataset(*_arithmetic_arrays(split), shuffle_files, seed)


def exact_match_accuracy(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """seqio metric fn: percentage (0-100) of predictions equal to their target.

  Args:
    targets: postprocessed target strings.
    predictions: postprocessed predicted strings, same length.

  Returns:
    {"exact_match": percent}: named apart from training's per-token
    `token_accuracy`, on the same 0-100 scale.

  Raises:
    ValueError: if the two sequences differ in length.
  """
  if len(targets) != len(predictions):
    raise UserError(
        f"Got {len(targets)} targets but {len(predictions)} predictions; "
        "they must pair up."
    )
  if not targets:
    return {"exact_match": 0.0}
  correct = sum(t == p for t, p in zip(targets, predictions))
  return {"exact_match": 100.0 * correct / len(targets)}


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
