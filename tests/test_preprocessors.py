"""Span corruption and chunking preprocessors."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5lite.data import preprocessors, vocabularies


SEEDS = tf.constant([[1, 2], [3, 4]])


def _mask(length, density=0.15, mean=3.0, seeds=SEEDS):
  return preprocessors.random_spans_noise_mask(length, density, mean, seeds).numpy()


def _span_count(mask):
  previous = np.concatenate([[False], mask[:-1]])
  return int(np.sum(mask & ~previous))


@pytest.mark.parametrize(
    "length,density,mean,noise,spans",
    [
        (100, 0.15, 3.0, 15, 5),
        (568, 0.15, 3.0, 85, 28),
        (20, 0.5, 2.0, 10, 5),
        (7, 0.15, 3.0, 1, 1),
    ],
)
def test_noise_mask_has_exact_noise_and_span_counts(length, density, mean, noise, spans):
  mask = _mask(length, density, mean)
  assert mask.shape == (length,) and mask.dtype == bool
  assert mask.sum() == noise
  assert _span_count(mask) == spans
  assert not mask[0] and mask[-1]  # kept tokens first, noise last, as in T5


def test_noise_mask_counts_match_python_twin():
  for length in [*range(1, 40), 99, 100, 101, 513]:
    mask = _mask(length)
    noise, spans = preprocessors.noise_span_counts(length, 0.15, 3.0)
    if length < 2:
      assert not mask.any()
    else:
      assert (mask.sum(), _span_count(mask)) == (noise, spans), length


def test_noise_mask_is_deterministic_per_seed():
  np.testing.assert_array_equal(_mask(200), _mask(200))
  assert not np.array_equal(_mask(200), _mask(200, seeds=tf.constant([[5, 6], [7, 8]])))


def test_raw_length_matches_t5_defaults():
  # T5 pretrains on 568-token chunks for 512 inputs and 114 targets.
  assert preprocessors.raw_length_for_inputs(512, 0.15, 3.0) == 568
  assert preprocessors.corrupted_lengths(568, 0.15, 3.0) == (512, 114)
  assert preprocessors.corrupted_lengths(569, 0.15, 3.0)[0] > 512


def _documents(num_docs=12, seed=0):
  """Token documents of varied length whose ids never collide with sentinels."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 40, size=num_docs)
  return [rng.integers(3, 259, size=size).astype(np.int32) for size in sizes]


def _as_dataset(documents):
  return tf.data.Dataset.from_generator(
      lambda: ({"targets": doc} for doc in documents),
      output_signature={"targets": tf.TensorSpec([None], tf.int32)},
  )


def _corrupt(documents, lengths, seed=7):
  vocab = vocabularies.byte_vocabulary()
  features = {"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)}
  with seqio.utils.map_seed_manager(seed):
    ds = preprocessors.span_corruption(_as_dataset(documents), lengths, features)
  return list(ds.as_numpy_iterator())


def _reconstruct(inputs, targets, first_sentinel):
  """Puts each target span back in place of its sentinel."""
  spans, current = {}, None
  for token in targets:
    if token > first_sentinel - vocabularies.EXTRA_IDS:
      current = int(token)
      spans[current] = []
    else:
      spans[current].append(int(token))
  out = []
  for token in inputs:
    out.extend(spans[int(token)] if token in spans else [int(token)])
  return out


def test_span_corruption_round_trips_and_numbers_sentinels_down():
  documents, lengths = _documents(num_docs=30), {"inputs": 64, "targets": 24}
  examples = _corrupt(documents, lengths)
  first_sentinel = vocabularies.byte_vocabulary().vocab_size - 1
  assert first_sentinel == 358
  rebuilt, most_sentinels = [], 0
  for ex in examples:
    sentinels = [int(t) for t in ex["inputs"] if t > first_sentinel - vocabularies.EXTRA_IDS]
    assert sentinels == list(range(first_sentinel, first_sentinel - len(sentinels), -1))
    assert [int(t) for t in ex["targets"] if t in sentinels] == sentinels
    # A 1-token remainder chunk has no noise, hence no targets.
    assert list(ex["targets"][:1]) == [first_sentinel] or len(ex["inputs"]) == 1
    # One slot of each length is left for the EOS appended after corruption.
    assert len(ex["inputs"]) < lengths["inputs"] and len(ex["targets"]) < lengths["targets"]
    rebuilt.extend(_reconstruct(ex["inputs"], ex["targets"], first_sentinel))
    most_sentinels = max(most_sentinels, len(sentinels))
  assert most_sentinels == 3
  # Chunks come out in stream order, so together they rebuild the stream.
  assert rebuilt == [int(t) for doc in documents for t in doc]
  # Every chunk but the stream's last is full length, so its corrupted
  # inputs plus EOS fill the inputs length exactly.
  raw = preprocessors.raw_length_for_inputs(lengths["inputs"], 0.15, 3.0)
  expected = preprocessors.corrupted_lengths(raw, 0.15, 3.0, add_eos=False)
  assert expected[0] + 1 == lengths["inputs"]
  assert all((len(ex["inputs"]), len(ex["targets"])) == expected for ex in examples[:-1])


def test_span_corruption_is_deterministic_given_seqio_seed():
  # Long enough for several spans: a single span is always the chunk's tail.
  documents, lengths = _documents(num_docs=30), {"inputs": 64, "targets": 24}
  first, again, other = (_corrupt(documents, lengths, seed) for seed in (7, 7, 8))
  assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, again))
  assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def test_span_corruption_rejects_lengths_that_cannot_fit():
  with pytest.raises(ValueError, match=r"targets length 5 is too short .* at least 6"):
    _corrupt(_documents(), {"inputs": 24, "targets": 5})
  with pytest.raises(ValueError, match=r"inputs length 2 is too short .*; use at least 3"):
    _corrupt(_documents(), {"inputs": 2, "targets": 10})
  with pytest.raises(ValueError, match=r"needs task feature lengths for 'inputs' and 'targets'"):
    _corrupt(_documents(), {"targets": 10})
  with pytest.raises(ValueError, match=r"needs 150 sentinels but the vocabulary has 100 extra"):
    _corrupt(_documents(), {"inputs": 2700, "targets": 1000})


def test_chunk_stream_cuts_full_chunks_across_documents():
  documents = _documents(num_docs=20)
  with seqio.utils.map_seed_manager(1):
    ds = preprocessors.chunk_stream(_as_dataset(documents), {"targets": 16})
  chunks = list(ds.as_numpy_iterator())
  lengths = [len(c["targets"]) for c in chunks]
  assert all(n == 16 for n in lengths[:-1]) and 0 < lengths[-1] <= 16
  stream = np.concatenate(documents)
  np.testing.assert_array_equal(np.concatenate([c["targets"] for c in chunks]), stream)


def test_select_random_chunk_caps_long_documents():
  documents = [np.arange(3, 103, dtype=np.int32), np.arange(3, 8, dtype=np.int32)]
  with seqio.utils.map_seed_manager(1):
    ds = preprocessors.select_random_chunk(_as_dataset(documents), max_length=10)
  out = list(ds.as_numpy_iterator())
  assert len(out[0]["targets"]) == 10 and np.all(np.diff(out[0]["targets"]) == 1)
  np.testing.assert_array_equal(out[1]["targets"], documents[1])
