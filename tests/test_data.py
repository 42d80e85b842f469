"""Embedded corpus, vocabularies, registered tasks and the per-host dataset pipeline."""

import gzip
import importlib
import itertools
import re
import sys
import threading

import numpy as np
import pytest
import seqio

from t5lite.data import build_corpus, datasets, tasks, vocabularies


CORPUS_TASKS = (tasks.SPAN_CORRUPTION, tasks.SPAN_CORRUPTION_SPM, tasks.LM, tasks.LM_SPM)
ARITHMETIC_TASKS = (tasks.ARITHMETIC, tasks.ARITHMETIC_SPM)
COMMON_WORDS = {"the", "of", "a", "to", "is", "and", "in", "if", "be", "for", "this"}


def _lengths(task_name):
  if task_name in (tasks.LM, tasks.LM_SPM):
    return {"targets": 32}
  # Span corruption of 32 inputs needs 8 targets (EOS included).
  return {"inputs": 32, "targets": 8}


def _config(task_name=tasks.ARITHMETIC, **overrides):
  fields = dict(
      mixture_or_task_name=task_name,
      task_feature_lengths=_lengths(task_name),
      split="train",
      batch_size=4,
      shuffle=False,
      seed=0,
  )
  fields.update(overrides)
  return datasets.DatasetConfig(**fields)


def _english_word_share(text):
  words = re.findall(r"[a-z]+", text.lower())
  return sum(word in COMMON_WORDS for word in words) / max(len(words), 1)


# ---------------------------------------------------------------- corpus, vocab


def test_corpus_is_shipped_english_with_disjoint_splits():
  lines = {}
  for split in build_corpus.SPLITS:
    with gzip.open(build_corpus.corpus_file(split), "rt", encoding="utf-8") as f:
      lines[split] = f.read().splitlines()
  total_bytes = sum(len(line) + 1 for split in lines.values() for line in split)
  assert 2_000_000 <= total_bytes <= 4_000_000
  assert len(lines["validation"]) * (build_corpus.VALIDATION_EVERY - 1) <= len(lines["train"])
  assert not set(lines["train"]) & set(lines["validation"])
  assert _english_word_share(" ".join(lines["validation"])) > 0.15


def test_prose_filter_keeps_sentences_and_drops_code():
  text = (
      "Return the sum of the two numbers given.\n\n"
      ">>> add(1, 2)\n3\n\n"
      "x = {k: v for k, v in d.items()}"
  )
  assert list(filter(build_corpus.is_prose, build_corpus.paragraphs(text))) == [
      "Return the sum of the two numbers given."
  ]


def test_vocab_sizes():
  assert vocabularies.byte_vocabulary().vocab_size == 359
  spm_vocab = vocabularies.sentencepiece_vocabulary()
  assert spm_vocab.vocab_size == 2100
  assert vocabularies.padded_vocab_size(vocabularies.byte_vocabulary()) == 384
  assert vocabularies.padded_vocab_size(spm_vocab, multiple=8) == 2104
  with pytest.raises(ValueError, match="multiple must be a positive integer, got 0"):
    vocabularies.padded_vocab_size(spm_vocab, multiple=0)


def test_sentencepiece_vocabulary_loads_from_package_and_round_trips():
  vocab = vocabularies.sentencepiece_vocabulary()
  assert str(vocab.sentencepiece_model_file).startswith(str(vocabularies.VOCAB_DIR))
  sentence = "Return the number of items in the list, as an integer."
  ids = vocab.encode(sentence)
  assert len(ids) < len(sentence) / 2  # pieces, not characters
  assert max(ids) < 2000 and vocab.decode(ids) == sentence
  with pytest.raises(ValueError, match=r"SentencePiece model '.*missing.model' does not exist"):
    vocabularies.sentencepiece_vocabulary("/nonexistent/missing.model")


def test_train_sentencepiece_writes_a_loadable_model(tmp_path):
  text = build_corpus.corpus_file("validation")  # gzip input is read directly
  path = vocabularies.train_sentencepiece([text], tmp_path / "tiny", vocab_size=100)
  assert path == tmp_path / "tiny.model"
  vocab = seqio.SentencePieceVocabulary(str(path), extra_ids=10)
  assert vocab.vocab_size == 110
  assert vocab.decode(vocab.encode("Return the value.")) == "Return the value."
  with pytest.raises(ValueError, match="model_type 'wordpiece'. Allowed: unigram, bpe"):
    vocabularies.train_sentencepiece([text], tmp_path / "x", 100, model_type="wordpiece")
  with pytest.raises(ValueError, match=r"failed for vocab_size=5000.*Use a smaller vocab_size"):
    vocabularies.train_sentencepiece([text], tmp_path / "x", 5000)


# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("split", ["train", "validation"])
@pytest.mark.parametrize("task_name", CORPUS_TASKS)
def test_corpus_tasks_yield_english(task_name, split):
  task = seqio.get_mixture_or_task(task_name)
  lengths = _lengths(task_name)
  ds = task.get_dataset(lengths, split=split, shuffle=False, seed=0)
  examples = list(ds.take(20).as_numpy_iterator())
  assert len(examples) == 20
  vocab = task.output_features["targets"].vocabulary
  feature = "inputs" if "inputs" in lengths else "targets"
  for ex in examples:
    assert set(ex) == set(lengths)
    for key, length in lengths.items():
      assert 0 < len(ex[key]) <= length and ex[key].dtype == np.int32
  text = " ".join(vocab.decode(ex[feature].tolist()) for ex in examples)
  assert _english_word_share(text) > 0.1, text


def test_lm_chunks_are_full_and_eos_separates_paragraphs():
  task = seqio.get_mixture_or_task(tasks.LM)
  ds = task.get_dataset({"targets": 64}, split="validation", shuffle=False)
  examples = list(ds.take(30).as_numpy_iterator())
  assert all(len(ex["targets"]) == 64 for ex in examples[:-1])
  assert any(1 in ex["targets"][:-1] for ex in examples)  # EOS mid-chunk ends a paragraph


@pytest.mark.parametrize("task_name", ARITHMETIC_TASKS)
def test_arithmetic_answers_are_correct(task_name):
  task = seqio.get_mixture_or_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  ds = task.get_dataset({"inputs": 32, "targets": 8}, split="validation", shuffle=False)
  for ex in ds.take(50).as_numpy_iterator():
    question, answer = vocab.decode(ex["inputs"].tolist()), vocab.decode(ex["targets"].tolist())
    assert question == ex["inputs_pretokenized"].decode()
    match = re.fullmatch(r"(add|sub): (\d+) ([+-]) (\d+)", question)
    assert match and (match[1] == "add") == (match[3] == "+")
    a, b = int(match[2]), int(match[4])
    assert int(answer) == (a + b if match[3] == "+" else a - b)


def test_arithmetic_splits_are_disjoint_and_pinned():
  train, validation = tasks.arithmetic_examples("train"), tasks.arithmetic_examples("validation")
  assert (len(train), len(validation)) == (100_000, 1_000)
  assert len(set(train)) == len(train) and len(set(validation)) == len(validation)
  assert not {q for q, _ in train} & {q for q, _ in validation}
  # Pinned so any change to generation (which would change results) is deliberate.
  assert train[:2] == (("add: 9 + 256", "265"), ("sub: 830 - 2", "828"))
  assert validation[:2] == (("sub: 7031 - 14", "7017"), ("sub: 18 - 706", "-688"))


@pytest.mark.parametrize("task_name", [tasks.SORT, tasks.SORT_SPM])
def test_sort_answers_are_correct(task_name):
  task = seqio.get_mixture_or_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  ds = task.get_dataset({"inputs": 32, "targets": 24}, split="validation", shuffle=False)
  lengths = set()
  for ex in ds.take(200).as_numpy_iterator():
    question, answer = vocab.decode(ex["inputs"].tolist()), vocab.decode(ex["targets"].tolist())
    assert question == ex["inputs_pretokenized"].decode()
    match = re.fullmatch(r"sort: ((?:\d )*\d)", question)
    assert match, question
    digits = match[1].split()
    assert answer.split() == sorted(digits)
    lengths.add(len(digits))
  assert min(lengths) >= 3 and max(lengths) <= 10 and len(lengths) >= 6
  assert seqio.get_mixture_or_task(task_name).metric_fns == [tasks.exact_match_accuracy]


def test_sort_splits_are_disjoint_and_pinned():
  train, validation = tasks.sort_examples("train"), tasks.sort_examples("validation")
  assert (len(train), len(validation)) == (100_000, 1_000)
  assert len(set(train)) == len(train) and len(set(validation)) == len(validation)
  assert not {q for q, _ in train} & {q for q, _ in validation}
  assert train[:2] == (("sort: 4 0 3 7 0 5 9 4 4 3", "0 0 3 3 4 4 4 5 7 9"),
                       ("sort: 1 2 3 9 1 8", "1 1 2 3 8 9"))
  assert validation[:2] == (("sort: 7 3 2 1 3 4 2 0", "0 1 2 2 3 3 4 7"),
                            ("sort: 3 5 1 4 8 0 8", "0 1 3 4 5 8 8"))
  with pytest.raises(ValueError, match="Unknown sort split 'test'"):
    tasks.sort_examples("test")


def _reference_arithmetic(split):
  """The plain per-problem loop: the first distinct problems of the split, in order."""
  wanted, seen, start = tasks.ARITHMETIC_SIZES[split], {}, 0
  while len(seen) < wanted:
    op, a, b = tasks._problems(np.arange(start, start + 1000, dtype=np.uint64))
    validation = tasks._is_validation(op, a, b)
    for o, x, y, v in zip(op.tolist(), a.tolist(), b.tolist(), validation.tolist()):
      if v == (split == "validation") and len(seen) < wanted:
        seen.setdefault((o, x, y), None)
    start += 1000
  return tuple((f"add: {x} + {y}", str(x + y)) if o == 0 else (f"sub: {x} - {y}", str(x - y))
               for o, x, y in seen)


def _reference_sort(split):
  """The plain per-list loop: the first distinct digit lists of the split, in order."""
  wanted, seen, start = tasks.SORT_SIZES[split], {}, 0
  while len(seen) < wanted:
    digits, lengths = tasks._digit_lists(np.arange(start, start + 1000, dtype=np.uint64))
    lists = [tuple(row[:length]) for row, length in zip(digits.tolist(), lengths.tolist())]
    codes = np.array([sum((d + 1) * 11**i for i, d in enumerate(digit_list))
                      for digit_list in lists], dtype=np.uint64)
    validation = tasks._mix64(codes ^ tasks._SPLIT_SALT) % np.uint64(50) == 0
    for digit_list, v in zip(lists, validation.tolist()):
      if v == (split == "validation") and len(seen) < wanted:
        seen.setdefault(digit_list, None)
    start += 1000
  return tuple(("sort: " + " ".join(str(d) for d in digit_list),
                " ".join(str(d) for d in sorted(digit_list))) for digit_list in seen)


def _clear_generated_caches():
  for fn in (tasks.sort_examples, tasks.arithmetic_examples, tasks._sort_arrays,
             tasks._arithmetic_arrays):
    fn.cache_clear()


@pytest.fixture
def small_generated_splits(monkeypatch):
  """Shrinks the generated splits; validation still needs more than one 65536-problem block."""
  monkeypatch.setattr(tasks, "SORT_SIZES", {"train": 3000, "validation": 1500})
  monkeypatch.setattr(tasks, "ARITHMETIC_SIZES", {"train": 3000, "validation": 1500})
  _clear_generated_caches()
  yield
  _clear_generated_caches()


@pytest.mark.parametrize("block_size", [1 << 16, 997])  # The result must not depend on it.
@pytest.mark.parametrize("examples, dataset_fn, reference", [
    (tasks.sort_examples, tasks._sort_dataset, _reference_sort),
    (tasks.arithmetic_examples, tasks._arithmetic_dataset, _reference_arithmetic),
], ids=["sort", "arithmetic"])
def test_generated_examples_match_a_plain_loop(small_generated_splits, monkeypatch, block_size,
                                               examples, dataset_fn, reference):
  monkeypatch.setattr(tasks, "_BLOCK_SIZE", block_size)
  for split in ("train", "validation"):
    expected = reference(split)
    assert len(expected) == {"train": 3000, "validation": 1500}[split]
    got = examples(split)
    assert type(got) is tuple and all(type(q) is str and type(a) is str for q, a in got)
    assert got == expected
    ds = dataset_fn(split, shuffle_files=False)
    assert tuple((ex["inputs"].decode(), ex["targets"].decode())
                 for ex in ds.as_numpy_iterator()) == expected


def test_arithmetic_metric_and_postprocessing():
  task = seqio.get_mixture_or_task(tasks.ARITHMETIC)
  assert task.postprocess_fn(" 42 \n", example={}, is_target=False) == "42"
  assert task.postprocess_fn(b"-7", example={}, is_target=True) == "-7"
  (metric_fn,) = task.metric_fns
  assert metric_fn(["1", "2", "3", "4"], ["1", "2", "0", "4"]) == {"exact_match": 75.0}
  with pytest.raises(ValueError, match="Got 2 targets but 1 predictions"):
    metric_fn(["1", "2"], ["1"])


def test_tasks_reregister_on_reload():
  importlib.reload(tasks)
  importlib.reload(tasks)
  for name in tasks.EMBEDDED_TASKS:
    assert name in seqio.TaskRegistry.names()
  assert seqio.get_mixture_or_task(tasks.SPAN_CORRUPTION).splits == ("train", "validation")


# ---------------------------------------------------------------- get_dataset


def _batches(cfg, converter, shard_id=0, num_shards=1, num_epochs=None, take=2):
  ds = datasets.get_dataset(cfg, shard_id, num_shards, converter, num_epochs=num_epochs)
  if take is not None:
    ds = ds.take(take)
  return list(ds.as_numpy_iterator())


@pytest.mark.parametrize(
    "task_name,converter,pack",
    [
        (tasks.SPAN_CORRUPTION, seqio.EncDecFeatureConverter, False),
        (tasks.SPAN_CORRUPTION, seqio.EncDecFeatureConverter, True),
        (tasks.LM, seqio.DecoderFeatureConverter, False),
        (tasks.LM, seqio.DecoderFeatureConverter, True),
        (tasks.ARITHMETIC, seqio.DecoderFeatureConverter, True),  # prefix LM
    ],
)
def test_batch_shapes(task_name, converter, pack):
  cfg = _config(task_name, batch_size=8, pack=pack, shuffle=True)
  lengths = converter(pack=pack).get_model_feature_lengths(cfg.task_feature_lengths)
  for batch in _batches(cfg, converter, shard_id=1, num_shards=2):
    assert set(batch) == set(lengths)
    for key, value in batch.items():
      assert value.shape == (4, lengths[key]) and value.dtype == np.int32, key


def _rows(batches, key="encoder_input_tokens"):
  return [tuple(row) for batch in batches for row in batch[key]]


def test_two_shards_partition_a_finite_split():
  cfg = _config(split="validation")
  whole = _rows(_batches(cfg, seqio.EncDecFeatureConverter, num_epochs=1, take=None))
  halves = [
      _rows(_batches(cfg, seqio.EncDecFeatureConverter, i, 2, num_epochs=1, take=None))
      for i in range(2)
  ]
  assert len(whole) == 1_000 and [len(h) for h in halves] == [500, 500]
  assert not set(halves[0]) & set(halves[1])
  assert sorted(halves[0] + halves[1]) == sorted(whole)


@pytest.mark.parametrize("task_name", [tasks.SPAN_CORRUPTION, tasks.ARITHMETIC])
def test_same_seed_same_batches(task_name):
  def run(seed):
    cfg = _config(task_name, shuffle=True, seed=seed)
    return _batches(cfg, seqio.EncDecFeatureConverter, take=2)

  first, again, other = run(3), run(3), run(4)
  for a, b in zip(first, again):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  key = "encoder_input_tokens"
  assert any(not np.array_equal(a[key], b[key]) for a, b in zip(first, other))


def test_get_vocabulary():
  byte_vocab = vocabularies.byte_vocabulary()
  assert datasets.get_vocabulary(_config(tasks.LM)) == (byte_vocab, byte_vocab)
  inputs, targets = datasets.get_vocabulary(_config(tasks.SPAN_CORRUPTION_SPM))
  assert inputs.vocab_size == targets.vocab_size == 2100


# ---------------------------------------------------------------- errors


def test_unknown_task_suggests_a_close_match():
  with pytest.raises(
      ValueError,
      match=r"Unknown mixture or task 't5lite_span_corupton'\. "
      r"Did you mean 't5lite_span_corruption'\? Registered: .*t5lite_arithmetic.*"
      r"Register it in a module and pass --gin\.MIXTURE_OR_TASK_MODULE=",
  ):
    datasets.get_mixture_or_task("t5lite_span_corupton")


def test_batch_not_divisible_by_shards():
  with pytest.raises(
      ValueError,
      match=r"batch_size 6 is not divisible by the number of data shards 4; "
      r"use a multiple of 4 such as 8",
  ):
    datasets.validate_dataset_config(_config(batch_size=6), num_shards=4)
  with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
    datasets.validate_dataset_config(_config(batch_size=0))


def test_bad_split_and_feature_lengths():
  with pytest.raises(
      ValueError, match=r"Split 'test' is not available for 't5lite_lm'\. Available: train, val"
  ):
    datasets.validate_dataset_config(_config(tasks.LM, split="test"))
  with pytest.raises(
      ValueError, match=r"keys \['targets'\] do not match .*: \['inputs', 'targets'\]"
  ):
    datasets.validate_dataset_config(_config(task_feature_lengths={"targets": 8}))
  with pytest.raises(ValueError, match=r"targets length 4 is too short .* at least 8"):
    datasets.validate_dataset_config(
        _config(tasks.SPAN_CORRUPTION, task_feature_lengths={"inputs": 32, "targets": 4})
    )


def test_module_that_fails_to_import(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / "t5lite_broken_tasks.py").write_text("raise RuntimeError('boom')\n")
  with pytest.raises(ValueError, match=r"module 't5lite_broken_tasks'.*RuntimeError: boom"):
    datasets.get_mixture_or_task(tasks.LM, module="t5lite_broken_tasks")
  with pytest.raises(ValueError, match=r"module 't5lite_no_such_module'.*ModuleNotFoundError"):
    datasets.validate_dataset_config(_config(module="t5lite_no_such_module"))


USER_TASK_MODULE = '''
import seqio
import tensorflow as tf
from t5lite.data import vocabularies

def _numbers(split, shuffle_files, seed=None):
  start = 0 if split == "train" else 1000
  return tf.data.Dataset.from_tensor_slices(
    {"targets": [f"number {i}" for i in range(start, start + 40)]})

seqio.TaskRegistry.remove("user_numbers")
seqio.TaskRegistry.add(
  "user_numbers",
  source=seqio.FunctionDataSource(_numbers, splits=("train", "validation")),
  output_features={"targets": seqio.Feature(vocabularies.byte_vocabulary())},
  preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
)
'''


def test_user_task_in_own_module(tmp_path, monkeypatch):
  # Only the current directory leads to the module, as for a console script
  # started where the user keeps their tasks.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
  (tmp_path / "t5lite_user_tasks.py").write_text(USER_TASK_MODULE)
  monkeypatch.delitem(sys.modules, "t5lite_user_tasks", raising=False)
  try:
    with pytest.raises(ValueError, match="Unknown mixture or task 'user_numbers'"):
      datasets.get_mixture_or_task("user_numbers")
    task = datasets.get_mixture_or_task("user_numbers", module="t5lite_user_tasks")
    assert task.name == "user_numbers"
    cfg = _config(
        "user_numbers", task_feature_lengths={"targets": 16}, module="t5lite_user_tasks"
    )
    (batch,) = _batches(cfg, seqio.DecoderFeatureConverter, take=1)
    assert batch["decoder_target_tokens"].shape == (4, 16)
    first_row = batch["decoder_target_tokens"][0]
    assert vocabularies.byte_vocabulary().decode(first_row.tolist()).startswith("number ")
  finally:
    seqio.TaskRegistry.remove("user_numbers")


def _batch_rows(batch):
  return np.asarray(batch["encoder_input_tokens"]).tolist()


def test_restarted_training_data_continues_the_uninterrupted_order(tmp_path):
  # The shipped pretraining pipeline: shuffled, span-corrupted and packed.
  import jax
  import jax.numpy as jnp

  from t5lite import checkpoints, feeder, partitioning, testing
  cfg = _config(tasks.SPAN_CORRUPTION, shuffle=True, pack=True)

  def train_data():
    return feeder.TrainData(testing.tiny_encoder_decoder(), cfg, partitioning.Partitioner(),
                               prefetch_batches=0)

  want = [_batch_rows(b) for b in itertools.islice(train_data(), 6)]
  # A restart without a saved iterator fast-forwards a freshly built pipeline
  # (a second pass over the first run's tf.data shuffle would draw another order).
  resumed = train_data()
  resumed.skip(3)
  assert [_batch_rows(next(resumed)) for _ in range(2)] == want[3:5]
  # With save_dataset the iterator is saved and restored, also after a fast-forward.
  checkpointer = checkpoints.Checkpointer(str(tmp_path), checkpoints.SaveCheckpointConfig(
      save_dataset=True))
  state = {"step": jnp.zeros((), jnp.int32)}
  checkpointer.save(5, state, resumed.iterator)
  checkpointer.wait_until_finished()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  restored = train_data()
  assert checkpointer.restore(5, abstract, restored.iterator)[1]
  assert _batch_rows(next(restored)) == want[5]
  # An iterator saved from another pipeline is refused (the caller then
  # fast-forwards), not a crash.
  other = iter(datasets.get_dataset(cfg, 0, 1, seqio.EncDecFeatureConverter))
  assert not checkpointer.restore(5, abstract, other)[1]


def test_training_batches_are_declared_before_the_pipeline_is_built_and_checked_after():
  import numpy as np

  from t5lite import feeder, partitioning, testing
  cfg = _config(tasks.SPAN_CORRUPTION, pack=True)
  model = testing.tiny_encoder_decoder()
  data = feeder.TrainData(model, cfg, partitioning.Partitioner(), prefetch_batches=0)
  abstract = data.abstract_batch()  # from the model's feature converter alone
  assert data._ds is None
  batch = next(data)
  assert {k: (v.shape, v.dtype) for k, v in abstract.items()} == {
      k: (v.shape, v.dtype) for k, v in batch.items()}
  assert data.global_shapes() == {k: v.shape for k, v in batch.items()}

  declare = model.input_shapes_and_types

  def misdeclared(task_feature_lengths, pack):
    shapes, types = declare(task_feature_lengths, pack)
    return {**shapes, "encoder_input_tokens": (1, 7)}, {**types, "decoder_positions": np.int64}

  model.input_shapes_and_types = misdeclared
  wrong = feeder.TrainData(model, cfg, partitioning.Partitioner(), prefetch_batches=0)
  with pytest.raises(ValueError, match=r"yields features \[.*encoder_input_tokens int32\[\d+\]"
                                       r".*declares \[.*decoder_positions int64.*"
                                       r"encoder_input_tokens int32\[7\]"):
    next(wrong)


def test_pipelines_traced_at_once_on_threads_give_the_batches_each_gives_alone():
  """SeqIO seeds its random preprocessors (span corruption here) from one
  process-wide counter while tracing; t5lite traces on background threads,
  so without `datasets.TRACING` concurrent traces would swap seeds."""
  train = _config(tasks.SPAN_CORRUPTION, pack=True, shuffle=True, seed=3)
  held_out = _config(tasks.SPAN_CORRUPTION, pack=True, split="validation", seed=42)

  def first_batch(cfg):
    ds = datasets.get_dataset(cfg, 0, 1, seqio.EncDecFeatureConverter, num_epochs=None)
    return {k: np.asarray(v) for k, v in next(iter(ds)).items()}

  alone = {name: first_batch(cfg) for name, cfg in (("train", train), ("held_out", held_out))}
  for _ in range(3):
    got: dict = {}
    threads = [threading.Thread(
        target=lambda n=n, c=c, got=got: got.setdefault(n, first_batch(c)))
               for n, c in (("train", train), ("held_out", held_out))]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    for name, batch in alone.items():
      assert all(np.array_equal(batch[k], got[name][k]) for k in batch), name
