"""seqio preprocessors: T5 span corruption and turning paragraphs into chunks.

Span corruption (Raffel et al., 2020) drops ~15% of the tokens of a chunk in
spans of mean length 3. The inputs keep the other tokens with one sentinel in
place of each dropped span; the targets list each sentinel followed by the
tokens it stands for. Sentinels are the vocabulary's extra ids, counted down
from `vocab_size - 1`.

Random choices use seqio's stateless seeds (`seqio.map_over_dataset` with
`num_seeds`), so a Task built with a fixed seed corrupts identically on every
run and machine.
"""

from __future__ import annotations

from collections.abc import Mapping

import seqio
import tensorflow as tf

from t5lite.errors import UserError


# Paragraphs concatenated per step before cutting into chunks: enough that
# few chunks are cut short at a group's end, small enough to stay cheap.
_CONCAT_GROUP_SIZE = 128
# Longest document (in tokens) kept before chunking, as in T5.
_MAX_DOCUMENT_TOKENS = 65536


@seqio.map_over_dataset
def line_to_targets(line: tf.Tensor) -> dict[str, tf.Tensor]:
  """Wraps a raw text line (a scalar string) as `{"targets": line}`."""
  return {"targets": line}


def noise_span_counts(
    length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
  """Returns (noise tokens, noise spans) that span corruption uses for `length`.

  This is the Python twin of the counts `random_spans_noise_mask` computes
  in TensorFlow (same float64 arithmetic and round-half-to-even), used to
  size chunks before any data flows.

  Args:
    length: number of tokens to corrupt; lengths below 2 count as 2.
    noise_density: fraction of tokens to drop.
    mean_noise_span_length: average length of a dropped span.

  Returns:
    At least one noise token, one noise span and one kept token; never
    more spans than noise tokens or than kept tokens.
  """
  length = max(length, 2)
  num_noise = min(max(round(length * noise_density), 1), length - 1)
  num_spans = round(num_noise / mean_noise_span_length)
  num_spans = min(max(num_spans, 1), num_noise, length - num_noise)
  return num_noise, num_spans


def corrupted_lengths(
    raw_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    add_eos: bool = True,
) -> tuple[int, int]:
  """Returns the (inputs, targets) lengths span corruption makes of a chunk.

  Args:
    raw_length: tokens in the uncorrupted chunk.
    noise_density: fraction of tokens to drop.
    mean_noise_span_length: average length of a dropped span.
    add_eos: whether an EOS is appended to both features afterwards.

  Returns:
    inputs = kept tokens + one sentinel per span (+ EOS);
    targets = dropped tokens + one sentinel per span (+ EOS).
  """
  num_noise, num_spans = noise_span_counts(raw_length, noise_density, mean_noise_span_length)
  eos = int(add_eos)
  return raw_length - num_noise + num_spans + eos, num_noise + num_spans + eos


def raw_length_for_inputs(
    inputs_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    add_eos: bool = True,
) -> int:
  """Finds the longest chunk whose corrupted inputs fit `inputs_length`.

  Args:
    inputs_length: the task feature length of "inputs".
    noise_density: fraction of tokens to drop.
    mean_noise_span_length: average length of a dropped span.
    add_eos: whether an EOS is appended to the inputs afterwards.

  Returns:
    The chunk length to cut the token stream into (e.g. 568 for inputs
    512 at T5's defaults; the targets then need 114).

  Raises:
    ValueError: if even a 2-token chunk does not fit.
  """
  def inputs_fit(raw: int) -> bool:
    corrupted = corrupted_lengths(raw, noise_density, mean_noise_span_length, add_eos)
    return corrupted[0] <= inputs_length

  if not inputs_fit(2):
    minimum = corrupted_lengths(2, noise_density, mean_noise_span_length, add_eos)[0]
    raise UserError(
        f"inputs length {inputs_length} is too short for span corruption; "
        f"use at least {minimum}."
    )
  raw = 2
  # The inputs grow by at most one token per raw token, so stepping by one
  # finds the largest fitting length in about inputs_length steps.
  while inputs_fit(raw + 1):
    raw += 1
  return raw


def _random_segment_lengths(
    total: tf.Tensor, num_segments: tf.Tensor, seed: tf.Tensor
) -> tf.Tensor:
  """Splits `total` items into `num_segments` random positive lengths.

  The cut points are `num_segments - 1` distinct positions drawn uniformly
  from 1..total-1, which makes every composition equally likely.

  Args:
    total: scalar int32, >= num_segments.
    num_segments: scalar int32, >= 1.
    seed: stateless seed, shape [2].

  Returns:
    int32 [num_segments] lengths summing to `total`.
  """
  candidates = tf.random.stateless_uniform(tf.reshape(total - 1, [1]), seed)  # [total - 1]
  cuts = tf.sort(tf.argsort(candidates)[: num_segments - 1] + 1)  # [num_segments - 1]
  bounds = tf.concat([[0], tf.cast(cuts, tf.int32), [total]], axis=0)  # [num_segments + 1]
  return bounds[1:] - bounds[:-1]


def random_spans_noise_mask(
    length: int | tf.Tensor,
    noise_density: float,
    mean_noise_span_length: float,
    seeds: tf.Tensor,
) -> tf.Tensor:
  """Picks which tokens span corruption drops: alternating kept/noise spans.

  The mask always starts with kept tokens and, for length >= 2, ends with
  noise; the number of noise tokens and spans is exactly
  `noise_span_counts(length, ...)`. Lengths below 2 are computed as 2 and
  cut, so they contain no noise.

  Args:
    length: number of tokens (Python int or scalar int tensor).
    noise_density: fraction of tokens to drop.
    mean_noise_span_length: average length of a noise span.
    seeds: two stateless seeds, shape [2, 2] (kept and noise segmentation).

  Returns:
    bool [length], True where a token is noise.
  """
  length = tf.cast(length, tf.int32)
  padded = tf.maximum(length, 2)
  num_noise = tf.cast(tf.round(tf.cast(padded, tf.float64) * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, padded - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length), tf.int32)
  num_spans = tf.minimum(tf.maximum(num_spans, 1), tf.minimum(num_noise, padded - num_noise))
  seeds = tf.convert_to_tensor(seeds)
  kept_lengths = _random_segment_lengths(padded - num_noise, num_spans, seeds[0])
  noise_lengths = _random_segment_lengths(num_noise, num_spans, seeds[1])
  # Interleave as [kept_0, noise_0, kept_1, noise_1, ...] and expand.
  run_lengths = tf.reshape(tf.stack([kept_lengths, noise_lengths], axis=1), [-1])  # [2 * spans]
  run_is_noise = tf.tile([False, True], [num_spans])  # [2 * spans]
  return tf.repeat(run_is_noise, run_lengths)[:length]


def corrupt_spans(
    tokens: tf.Tensor, noise_mask: tf.Tensor, vocab_size: int
) -> dict[str, tf.Tensor]:
  """Applies a noise mask: sentinels replace noise spans in inputs, lead them in targets.

  Args:
    tokens: int32 [length] token ids.
    noise_mask: bool [length] from `random_spans_noise_mask`.
    vocab_size: vocabulary size; span k (0-based) gets sentinel
      `vocab_size - 1 - k`.

  Returns:
    {"inputs": int32 [kept + spans], "targets": int32 [noise + spans]}.
  """
  previous_is_noise = tf.concat([[False], noise_mask[:-1]], axis=0)  # [length]
  span_starts = noise_mask & ~previous_is_noise  # [length]
  span_number = tf.cumsum(tf.cast(span_starts, tf.int32))  # [length], 1-based inside spans
  sentinels = tf.cast(vocab_size - span_number, tokens.dtype)  # [length]
  inputs = tf.boolean_mask(tf.where(span_starts, sentinels, tokens), ~noise_mask | span_starts)
  # Each noise token becomes a [sentinel, token] pair whose sentinel is kept
  # only at a span start; flattening row-major yields "S0 a b S1 c ...".
  noise_sentinels = tf.boolean_mask(sentinels, noise_mask)  # [noise]
  noise_tokens = tf.boolean_mask(tokens, noise_mask)  # [noise]
  pairs = tf.stack([noise_sentinels, noise_tokens], axis=1)  # [noise, 2]
  starts = tf.boolean_mask(span_starts, noise_mask)  # [noise]
  keep = tf.stack([starts, tf.ones_like(starts)], axis=1)  # [noise, 2]
  return {"inputs": inputs, "targets": tf.boolean_mask(pairs, keep)}


@seqio.map_over_dataset(num_seeds=2)
def _corrupt_example(
    features: Mapping[str, tf.Tensor],
    seeds: tf.Tensor,
    vocab_size: int,
    noise_density: float,
    mean_noise_span_length: float,
) -> dict[str, tf.Tensor]:
  """Span-corrupts `features["targets"]` into new inputs and targets."""
  tokens = features["targets"]
  mask = random_spans_noise_mask(tf.size(tokens), noise_density, mean_noise_span_length, seeds)
  return corrupt_spans(tokens, mask, vocab_size)


@seqio.map_over_dataset(num_seeds=1)
def _random_window(
    features: Mapping[str, tf.Tensor], seed: tf.Tensor, feature_key: str, max_length: int
) -> dict[str, tf.Tensor]:
  """Keeps a uniformly placed window of at most `max_length` tokens."""
  tokens = features[feature_key]
  max_start = tf.maximum(tf.size(tokens) - max_length, 0)
  start = tf.random.stateless_uniform([], seed, minval=0, maxval=max_start + 1, dtype=tf.int32)
  return {feature_key: tokens[start : start + max_length]}


def select_random_chunk(
    dataset: tf.data.Dataset, feature_key: str = "targets", max_length: int = _MAX_DOCUMENT_TOKENS
) -> tf.data.Dataset:
  """Caps each document at a random window of `max_length` tokens.

  Keeps one very long document from dominating a stretch of training. Only
  `feature_key` survives, because the steps after it concatenate tokens.

  Args:
    dataset: examples with an int `feature_key` of rank 1.
    feature_key: the token feature to cut.
    max_length: longest window kept.

  Returns:
    A dataset of `{feature_key: tokens}`.
  """
  return _random_window(dataset, feature_key=feature_key, max_length=max_length)


def reduce_concat_tokens(
    dataset: tf.data.Dataset, feature_key: str = "targets", group_size: int = _CONCAT_GROUP_SIZE
) -> tf.data.Dataset:
  """Concatenates the tokens of each run of `group_size` consecutive examples.

  Args:
    dataset: examples with an int `feature_key` of rank 1.
    feature_key: the token feature to concatenate.
    group_size: examples joined into one.

  Returns:
    A dataset of `{feature_key: tokens}`, one element per group.
  """
  tokens = dataset.map(lambda features: features[feature_key])
  groups = tokens.ragged_batch(group_size)  # [group, (length)]
  return groups.map(lambda group: {feature_key: group.flat_values})


def split_tokens(
    dataset: tf.data.Dataset, max_tokens_per_segment: int, feature_key: str = "targets"
) -> tf.data.Dataset:
  """Cuts each example into consecutive segments of `max_tokens_per_segment`.

  The last segment of an example keeps the remainder (shorter, never empty).

  Args:
    dataset: examples with an int `feature_key` of rank 1.
    max_tokens_per_segment: segment length.
    feature_key: the token feature to cut.

  Returns:
    A dataset of `{feature_key: tokens}`.

  Raises:
    ValueError: if `max_tokens_per_segment` is not positive.
  """
  if max_tokens_per_segment < 1:
    raise UserError(f"max_tokens_per_segment must be positive, got {max_tokens_per_segment}.")

  def segments(features: Mapping[str, tf.Tensor]) -> tf.data.Dataset:
    tokens = features[feature_key]
    size = max_tokens_per_segment
    count = (tf.size(tokens, out_type=tf.int64) + size - 1) // size
    return tf.data.Dataset.range(count).map(
        lambda i: {feature_key: tokens[i * size : (i + 1) * size]}
    )

  return dataset.flat_map(segments)


def chunk_stream(
    dataset: tf.data.Dataset, sequence_length: Mapping[str, int], feature_key: str = "targets"
) -> tf.data.Dataset:
  """Language-model chunks: concatenates examples and cuts full-length pieces.

  Args:
    dataset: examples with an int `feature_key` of rank 1 (already
      EOS-terminated if documents should stay delimited).
    sequence_length: task feature lengths; `sequence_length[feature_key]`
      is the chunk length.
    feature_key: the token feature to chunk.

  Returns:
    A dataset of `{feature_key: tokens}` of exactly that length, except
    the last chunk of each concatenated group.

  Raises:
    ValueError: if `sequence_length` has no length for `feature_key`.
  """
  if not sequence_length or not sequence_length.get(feature_key):
    raise UserError(
        f"chunk_stream needs a task feature length for '{feature_key}', got "
        f"{sequence_length!r}; set TASK_FEATURE_LENGTHS."
    )
  grouped = reduce_concat_tokens(select_random_chunk(dataset, feature_key), feature_key)
  return split_tokens(grouped, sequence_length[feature_key], feature_key)


def span_corruption_chunk_length(
    sequence_length: Mapping[str, int] | None,
    output_features: Mapping[str, seqio.Feature],
    mean_noise_span_length: float = 3.0,
    noise_density: float = 0.15,
) -> int:
  """Checks that span corruption can fill the lengths; returns its chunk length.

  Cheap (no data): `datasets.validate_dataset_config` calls it for tasks
  that use `span_corruption`, so bad lengths fail before anything is built.

  Args:
    sequence_length: task feature lengths with "inputs" and "targets".
    output_features: the task's features ("inputs" decides about EOS,
      "targets" supplies the vocabulary).
    mean_noise_span_length: average length of a dropped span.
    noise_density: fraction of tokens dropped.

  Returns:
    Tokens per chunk before corruption.

  Raises:
    ValueError: if a length is missing, the inputs or targets length is too
      short, or the chunks need more sentinels than the vocabulary has.
  """
  if not sequence_length or not all(sequence_length.get(k) for k in ("inputs", "targets")):
    raise UserError(
        "span_corruption needs task feature lengths for 'inputs' and 'targets', "
        f"got {sequence_length!r}; set TASK_FEATURE_LENGTHS."
    )
  add_eos = output_features["inputs"].add_eos
  raw = raw_length_for_inputs(
      sequence_length["inputs"], noise_density, mean_noise_span_length, add_eos
  )
  needed = corrupted_lengths(raw, noise_density, mean_noise_span_length, add_eos)[1]
  if needed > sequence_length["targets"]:
    raise UserError(
        f"targets length {sequence_length['targets']} is too short for span "
        f"corruption with inputs length {sequence_length['inputs']} "
        f"(noise_density={noise_density}, mean_noise_span_length="
        f"{mean_noise_span_length}); use a targets length of at least {needed}."
    )
  extra_ids = output_features["targets"].vocabulary.extra_ids
  num_spans = noise_span_counts(raw, noise_density, mean_noise_span_length)[1]
  if num_spans > extra_ids:
    raise UserError(
        f"Span corruption of {raw}-token chunks needs {num_spans} sentinels but "
        f"the vocabulary has {extra_ids} extra ids; use a shorter inputs "
        "length or a larger mean_noise_span_length."
    )
  return raw


def span_corruption(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, seqio.Feature],
    mean_noise_span_length: float = 3.0,
    noise_density: float = 0.15,
) -> tf.data.Dataset:
  """T5's pretraining objective over a stream of tokenized documents.

  Documents (`"targets"` token ids) are capped, concatenated and cut into
  chunks sized so that, after corruption (and the EOS that
  `seqio.preprocessors.append_eos_after_trim` adds next), the inputs fit
  `sequence_length["inputs"]` exactly or nearly; the targets need
  `corrupted_lengths(...)[1]` tokens.

  Args:
    dataset: examples with a tokenized rank-1 `"targets"` feature.
    sequence_length: task feature lengths with "inputs" and "targets".
    output_features: the task's features; "targets" supplies the
      vocabulary whose extra ids become sentinels.
    mean_noise_span_length: average length of a dropped span.
    noise_density: fraction of tokens dropped.

  Returns:
    A dataset of `{"inputs", "targets"}` int32 token ids.

  Raises:
    ValueError: as `span_corruption_chunk_length` does.
  """
  raw = span_corruption_chunk_length(
      sequence_length, output_features, mean_noise_span_length, noise_density
  )
  vocab = output_features["targets"].vocabulary
  chunks = split_tokens(reduce_concat_tokens(select_random_chunk(dataset)), raw)
  return _corrupt_example(
      chunks,
      vocab_size=vocab.vocab_size,
      noise_density=noise_density,
      mean_noise_span_length=mean_noise_span_length,
  )
