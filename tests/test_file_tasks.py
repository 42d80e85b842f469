"""Tasks from the user's TSV and JSON Lines files, declared in gin: examples,
tokens, the checks of every line, metrics, and the CLI end to end."""

import importlib.machinery
import json
import os
import sys
import types

import pytest
import seqio
from test_cli import REPO, SHALLOW, TINY, run_in_process, scalars, user_error_line

import gin
from t5lite import cli
from t5lite.data import file_tasks, tasks, vocabularies


LENGTHS = {"inputs": 16, "targets": 8}
BYTES = vocabularies.byte_vocabulary()


def _write(path, lines):
  path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
  return str(path)


def _examples(name, split="train"):
  ds = seqio.get_mixture_or_task(name).get_dataset(LENGTHS, split=split, shuffle=False,
                                                   use_cached=False)
  return list(ds.as_numpy_iterator())


@pytest.fixture
def qa_files(tmp_path):
  train = _write(tmp_path / "train.tsv", ["question\tanswer\tsource",
                                          " capital of France? \tParis\twiki",
                                          "",  # blank lines are skipped
                                          "2 + 2\t 4\tmath"])
  validation = _write(tmp_path / "dev.jsonl", [json.dumps({"answer": "cold", "question": "hot?"}),
                                               json.dumps({"question": "up?", "answer": "down",
                                                           "n": 3})])
  return {"train": train, "validation": validation}


def test_tsv_and_jsonl_give_the_examples_and_their_tokens(qa_files):
  name = file_tasks.register_file_task("ft_qa", qa_files, inputs_field="question",
                                       targets_field="answer", strip=False)
  assert name == "ft_qa"
  train = _examples(name)
  assert [(e["inputs_pretokenized"], e["targets_pretokenized"]) for e in train] == [
      (b" capital of France? ", b"Paris"), (b"2 + 2", b" 4")]
  # Tokens: the byte ids of the text, cut to the length with EOS (1) kept.
  assert list(train[1]["inputs"]) == [*BYTES.encode("2 + 2"), 1]
  assert list(train[0]["inputs"]) == [*BYTES.encode(" capital of Fra"), 1]
  assert list(train[0]["targets"]) == [*BYTES.encode("Paris"), 1]
  validation = _examples(name, "validation")
  assert [(e["inputs_pretokenized"], e["targets_pretokenized"]) for e in validation] == [
      (b"hot?", b"cold"), (b"up?", b"down")]
  task = seqio.get_mixture_or_task(name)
  assert task.metric_fns == [tasks.exact_match_accuracy]
  assert task.num_input_examples("train") == 2


def test_strip_and_prefix_apply(qa_files):
  file_tasks.register_file_task("ft_prefix", qa_files, inputs_field="question",
                                targets_field="answer", inputs_prefix="ask: ")
  assert [(e["inputs_pretokenized"], e["targets_pretokenized"])
          for e in _examples("ft_prefix")] == [(b"ask: capital of France?", b"Paris"),
                                               (b"ask: 2 + 2", b"4")]


def test_globs_formats_and_a_targets_only_task(tmp_path):
  (tmp_path / "data").mkdir()
  _write(tmp_path / "data" / "b.txt", ["text", "second"])
  _write(tmp_path / "data" / "a.txt", ["text", "first"])
  name = file_tasks.register_file_task("ft_lm", {"train": str(tmp_path / "data" / "*.txt")},
                                       inputs_field=None, targets_field="text", format="tsv",
                                       metrics=())
  task = seqio.get_mixture_or_task(name)
  assert sorted(task.output_features) == ["targets"] and task.metric_fns == []
  assert [e["targets_pretokenized"] for e in _examples(name)] == [b"first", b"second"]


def test_training_reads_every_example_once_an_epoch_in_shuffled_order(tmp_path):
  words = [f"w{i:02d}" for i in range(40)]  # sorted, as files often are
  path = _write(tmp_path / "sorted.tsv", ["inputs\ttargets", *(f"{w}\t{w}" for w in words)])
  file_tasks.register_file_task("ft_shuffle", {"train": path})
  task = seqio.get_mixture_or_task("ft_shuffle")

  def epoch(seed):
    ds = task.get_dataset(LENGTHS, split="train", shuffle=True, seed=seed, num_epochs=1,
                          use_cached=False, shuffle_buffer_size=1)  # only the source shuffles
    return [e["targets_pretokenized"].decode() for e in ds.as_numpy_iterator()]

  first = epoch(seed=1)
  assert sorted(first) == words and first != words
  assert epoch(seed=1) == first and epoch(seed=2) != first


def test_declaring_again_reuses_until_a_file_changes(qa_files, monkeypatch):
  args = dict(name="ft_again", splits=qa_files, inputs_field="question", targets_field="answer")
  file_tasks.register_file_task(**args)
  reads = []
  monkeypatch.setattr(file_tasks, "_read_split",
                      lambda *a, real=file_tasks._read_split: reads.append(a[1]) or real(*a))
  file_tasks.register_file_task(**args)  # as gin does at each use of the name
  assert reads == []
  with open(qa_files["train"], "a", encoding="utf-8") as f:
    f.write("3 + 3\t6\tmath\n")
  os.utime(qa_files["train"], ns=(1, 1))
  file_tasks.register_file_task(**args)
  assert reads == ["train", "validation"] and len(_examples("ft_again")) == 3
  with pytest.raises(ValueError, match=r"^File task 'ft_again' is already declared with other "
                                       r"settings \(inputs_prefix was ''\); give this one"):
    file_tasks.register_file_task(**args, inputs_prefix="q: ")
  with pytest.raises(ValueError, match="'t5lite_sort' is already a registered task"):
    file_tasks.register_file_task(**{**args, "name": tasks.SORT})


def _error(tmp_path, lines, name="bad.tsv", **kwargs):
  path = _write(tmp_path / name, lines)
  kwargs = {"inputs_field": "q", "targets_field": "a", **kwargs}
  with pytest.raises(ValueError) as error:
    file_tasks.register_file_task(f"ft_bad_{len(lines)}", {"train": path}, **kwargs)
  assert path in str(error.value)
  return str(error.value).replace(path, "FILE")


def test_each_bad_line_is_named_by_file_and_line(tmp_path):
  rows = ["q\ta"] + [f"{i}\t{i}" for i in range(2, 40)]
  rows[36] = "no tab here"
  assert _error(tmp_path, rows) == (
      "FILE, line 37: 1 tab-separated value(s) but the header (line 1) names 2 fields "
      "(missing: 'a'); give every line one value per field, separated by tabs.")
  assert _error(tmp_path, ["question\tanswer", "x\ty"]).startswith(
      "FILE, line 1: the header names no field 'q', 'a' (it names 'question', 'answer')")
  good = json.dumps({"q": "x", "a": "y"})
  assert _error(tmp_path, [good, good, '{"q": "x", "a": '], "b.jsonl").startswith(
      "FILE, line 3: not valid JSON: Expecting value at column 17;")
  assert _error(tmp_path, [good, json.dumps({"q": "x"})], "c.jsonl").startswith(
      "FILE, line 2: no field 'a' (the line has 'q');")
  assert _error(tmp_path, [json.dumps({"q": "x", "a": 42})], "d.jsonl") == (
      "FILE, line 1: field 'a' is a number (42), not a string; quote it.")
  assert _error(tmp_path, ["[", good, "]"], "e.json").startswith(
      "FILE, line 1: not valid JSON (a JSON array is not JSON Lines)")
  assert _error(tmp_path, ['["x", "y"]'], "f.jsonl").startswith("FILE, line 1: an array, not")
  (tmp_path / "g.tsv").write_bytes(b"q\ta\n\xff\tb\n")
  with pytest.raises(ValueError, match=r"g.tsv, line 2: not UTF-8 text \(byte 1 of the line\)"):
    file_tasks.register_file_task("ft_utf8", {"train": str(tmp_path / "g.tsv")},
                                  inputs_field="q", targets_field="a")
  assert _error(tmp_path, ["q\ta"], "h.tsv").startswith(
      "Split 'train' of task 'ft_bad_1' has no examples (files: FILE)")
  assert "format" in _error(tmp_path, ["q\ta", "x\ty"], "i.csv")


def test_missing_files_and_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"Data file '.*nope.tsv' \(split 'train'\) does not exist"):
    file_tasks.register_file_task("ft_args", {"train": str(tmp_path / "nope.tsv")})
  with pytest.raises(ValueError, match=r"Pattern '.*\*.tsv' \(split 'dev'\) matches no file"):
    file_tasks.register_file_task("ft_args", {"dev": str(tmp_path / "*.tsv")})
  with pytest.raises(ValueError, match=r"splits must be a non-empty dict"):
    file_tasks.register_file_task("ft_args", {})
  with pytest.raises(ValueError, match=r"Unknown file format 'csv'; use one of tsv, jsonl"):
    file_tasks.register_file_task("ft_args", {"train": "x"}, format="csv")
  with pytest.raises(ValueError, match=r"inputs_field and targets_field are both 'x'"):
    file_tasks.register_file_task("ft_args", {"train": "x"}, inputs_field="x", targets_field="x")
  with pytest.raises(ValueError, match=r"vocabulary must be a seqio vocabulary such as %VOCAB"):
    file_tasks.register_file_task("ft_args", {"train": "x"}, vocabulary="bytes")
  with pytest.raises(ValueError, match=r"^Metric 'accuracy' is unknown; available: exact_match"):
    file_tasks.register_file_task("ft_args", {"train": "x"}, metrics=("accuracy",))


def test_bleu_and_rouge_need_their_packages(monkeypatch, qa_files):
  monkeypatch.setattr(file_tasks.importlib.util, "find_spec",
                      lambda name: None if name in ("sacrebleu", "rouge_score") else True)
  assert file_tasks.available_metrics() == ("exact_match",)
  with pytest.raises(ValueError, match=r"^Metric 'bleu' needs the sacrebleu package, which is "
                                       r"not installed; available: exact_match\.$"):
    file_tasks.register_file_task("ft_bleu", qa_files, metrics=("bleu",))
  # With the package, the metric is BLEU over the decoded validation split.
  fake = types.ModuleType("sacrebleu")
  fake.__spec__ = importlib.machinery.ModuleSpec("sacrebleu", None)
  fake.corpus_bleu = lambda predictions, references, tokenize: types.SimpleNamespace(
      score=float(len(predictions) * 10 + len(references[0]) + (tokenize == "intl")))
  monkeypatch.setitem(sys.modules, "sacrebleu", fake)
  monkeypatch.setattr(file_tasks.importlib.util, "find_spec", lambda name: True)
  file_tasks.register_file_task("ft_bleu", qa_files, inputs_field="question",
                                targets_field="answer", metrics=("exact_match", "bleu"))
  metric_fns = seqio.get_mixture_or_task("ft_bleu").metric_fns
  assert metric_fns[1](["a", "b"], ["a", "c"]) == {"bleu": 23.0}


def test_gin_declares_the_task_for_every_dataset_with_the_models_vocabulary(clean_gin,
                                                                          monkeypatch):
  monkeypatch.chdir(REPO)  # the shipped file names its data relative to a checkout
  cli.parse_gin(["gin/finetune_dense.gin", "gin/tasks/reverse_words.gin"],
                ["MODEL_DIR = '/tmp/x'",
                 "VOCABULARY = @vocabularies.sentencepiece_vocabulary()"],
                cli.gin_search_paths([]))
  from t5lite import train as train_lib
  bindings = gin.get_bindings(train_lib.train)
  configs = [bindings[k] for k in ("train_dataset_cfg", "train_eval_dataset_cfg",
                                   "infer_eval_dataset_cfg")]
  assert [c.mixture_or_task_name for c in configs] == ["reverse_words"] * 3
  task = seqio.get_mixture_or_task("reverse_words")
  assert task.output_features["inputs"].vocabulary == vocabularies.sentencepiece_vocabulary()
  assert task.num_input_examples("validation") == 40


def _bad_line_37(tmp_path):
  rows = ["question\tanswer"] + [f"q{i}\ta{i}" for i in range(2, 50)]
  rows[36] = "q37 without its answer"
  return _write(tmp_path / "train.tsv", rows)


def _task_flags(train, validation, inputs="question", targets="answer"):
  return ["--gin_file=gin/tasks/reverse_words.gin",
          f"--gin.file_tasks.register_file_task.splits={{'train': '{train}', "
          f"'validation': '{validation}'}}",
          f"--gin.file_tasks.register_file_task.inputs_field='{inputs}'",
          f"--gin.file_tasks.register_file_task.targets_field='{targets}'"]


def test_training_stops_on_a_missing_field_before_writing_anything(tmp_path, monkeypatch):
  train = _bad_line_37(tmp_path)
  model_dir = tmp_path / "run"
  # A name of its own: this process may have declared reverse_words already.
  line = user_error_line([*TINY, *_task_flags(train, train), f"--gin.MODEL_DIR='{model_dir}'",
                          "--gin.file_tasks.register_file_task.name='reverse_words_line_37'"],
                         REPO, monkeypatch)
  assert line.startswith(f"ValueError: {train}, line 37: 1 tab-separated value(s)"), line
  assert not model_dir.exists()


@pytest.mark.slow
def test_cli_fine_tunes_on_files_and_writes_predictions(tmp_path, monkeypatch):
  train = _write(tmp_path / "train.tsv", ["word\treversed"]
                 + [f"w{i}x\tx{i}w" for i in range(40)])
  validation = _write(tmp_path / "dev.jsonl", [json.dumps({"word": f"v{i}", "reversed": f"{i}v"})
                                               for i in range(6)])
  model_dir = tmp_path / "run"
  # A name of its own: this process may have declared reverse_words already.
  name = "reverse_words_cli"
  run_in_process(["--gin_file=gin/finetune_dense.gin", "--gin_file=gin/testing/local_tiny.gin",
                  *_task_flags(train, validation, "word", "reversed"),
                  f"--gin.file_tasks.register_file_task.name='{name}'",
                  f"--gin.MODEL_DIR='{model_dir}'",
                  # What the file task feeds and writes does not depend on depth.
                  *SHALLOW], REPO, monkeypatch)
  assert sorted(scalars(str(model_dir / "train"), "loss")) == [2, 4]
  assert sorted(scalars(str(model_dir / "training_eval" / name), "loss")) == [2, 4]
  rows = [json.loads(line) for line in
          (model_dir / "inference_eval" / f"{name}-000004.jsonl").read_text().splitlines()]
  assert [r["target"] for r in rows] == [f"{i}v" for i in range(6)]
  assert all(r["input"]["inputs_pretokenized"].startswith("reverse: v") for r in rows)
  assert all(isinstance(r["prediction"], str) for r in rows)
  metrics = [json.loads(line) for line in
             (model_dir / "inference_eval" / f"{name}-metrics.jsonl").read_text()
             .splitlines()]
  assert [m["step"] for m in metrics] == [2, 4] and all("exact_match" in m for m in metrics)
