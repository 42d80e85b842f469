"""Train-eval per task, inference evaluation, and the eval / infer CLIs."""

import os

import pytest
from test_cli import SHALLOW, TINY, launch_cache, run_in_process, scalars, user_error_line


MIX_MODULE = """
import seqio
from t5lite.data import tasks  # registers the embedded tasks

if "tiny_eval_mix" not in seqio.MixtureRegistry.names():
  seqio.MixtureRegistry.add(
      "tiny_eval_mix", [("t5lite_span_corruption", 1.0), ("t5lite_arithmetic", 1.0)])
"""


@pytest.mark.slow
def test_train_eval_writes_the_mixture_and_each_task(tmp_path, monkeypatch):
  (tmp_path / "mix_tasks.py").write_text(MIX_MODULE)
  model_dir = str(tmp_path / "run")
  args = [*TINY, *SHALLOW, f"--gin.MODEL_DIR='{model_dir}'",
          "--gin.MIXTURE_OR_TASK_NAME='tiny_eval_mix'",
          "--gin.MIXTURE_OR_TASK_MODULE='mix_tasks'",
          "--gin.train_lib.train.run_eval_before_training=True", "--gin.TRAIN_STEPS=5"]
  run_in_process(args, str(tmp_path), monkeypatch)
  eval_dir = os.path.join(model_dir, "training_eval")
  assert sorted(os.listdir(eval_dir)) == ["t5lite_arithmetic", "t5lite_span_corruption",
                                          "tiny_eval_mix"]
  losses = {name: scalars(os.path.join(eval_dir, name), "loss") for name in os.listdir(eval_dir)}
  for name, by_step in losses.items():
    # Before training, every eval period and at the final step (off the period).
    assert sorted(by_step) == [0, 2, 4, 5], name
  # Different data, different numbers: each directory holds its own task.
  assert losses["t5lite_arithmetic"][5] != losses["t5lite_span_corruption"][5]
  assert not os.path.exists(os.path.join(model_dir, "inference_eval"))


# ---------------------------------------------------------------------------
# The inference evaluator's plumbing, with a model that echoes its inputs.


class EchoModel:
  """Predicts its inputs (so predictions equal targets iff order is kept) and
  scores each example with the sum of its input tokens."""

  import seqio as _seqio
  INFERENCE_FEATURE_CONVERTER_CLS = _seqio.EncDecFeatureConverter

  def __init__(self, vocabulary):
    self.input_vocabulary = self.output_vocabulary = vocabulary

  def predict_batch_with_aux(self, params, batch, rng=None):
    del params, rng
    length = batch["decoder_input_tokens"].shape[1]
    tokens = batch["encoder_input_tokens"][:, :length]
    return tokens, {"scores": tokens.sum(axis=1).astype("float32")}

  def score_batch(self, params, batch):
    del params
    return batch["encoder_input_tokens"].sum(axis=1).astype("float32")


def _expected_score(text):
  return float(sum(b + 3 for b in text.encode()) + 1)  # byte ids are offset by 3, EOS is 1


def score_order(targets, scores):
  return {"score_order": 100.0 * sum(
      abs(s - _expected_score(t)) < 1e-3 for t, s in zip(targets, scores)) / len(targets)}


def _register_echo_task(name, examples, targets=None):
  import seqio
  import tensorflow as tf

  from t5lite.data import tasks, vocabularies

  vocab = vocabularies.byte_vocabulary()

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": examples, "targets": examples if targets is None else targets})

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["validation"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
      output_features={k: seqio.Feature(vocab, add_eos=True) for k in ("inputs", "targets")},
      metric_fns=[tasks.exact_match_accuracy, score_order])
  return vocab


def _echo_evaluator(tmp_path, name, examples, targets, length, batch_size):
  """An InferenceEvaluator of EchoModel on a registered echo task."""
  from t5lite import inference, partitioning
  from t5lite.data.datasets import DatasetConfig
  vocab = _register_echo_task(name, examples, targets)
  cfg = DatasetConfig(mixture_or_task_name=name,
                      task_feature_lengths={"inputs": length, "targets": length},
                      split="validation", batch_size=batch_size, shuffle=False, seed=42,
                      pack=False)
  return inference.InferenceEvaluator(
      model=EchoModel(vocab), cfg=cfg, partitioner=partitioning.Partitioner(num_partitions=1),
      params_shardings={}, output_dir=str(tmp_path))


def test_inference_eval_keeps_input_order_with_a_padded_last_batch(tmp_path):
  import json

  from t5lite import inference, partitioning
  from t5lite.data.datasets import DatasetConfig

  examples = [f"example {i} " + "x" * (i % 5) for i in range(13)]
  vocab = _register_echo_task("t5lite_test_echo", examples)
  partitioner = partitioning.Partitioner(num_partitions=1)
  cfg = DatasetConfig(mixture_or_task_name="t5lite_test_echo",
                      task_feature_lengths={"inputs": 24, "targets": 24}, split="validation",
                      batch_size=4, shuffle=False, seed=42, pack=False)
  evaluator = inference.InferenceEvaluator(
      model=EchoModel(vocab), cfg=cfg, partitioner=partitioner, params_shardings={},
      output_dir=str(tmp_path))
  try:
    results = evaluator.evaluate(7, {})
  finally:
    evaluator.close()
  # 13 examples in batches of 4: the last batch is 3 real rows and 1 padding.
  assert results == {"t5lite_test_echo": {"exact_match": 100.0, "score_order": 100.0}}
  out = tmp_path / "inference_eval"
  rows = [json.loads(line) for line in (out / "t5lite_test_echo-000007.jsonl").open()]
  assert [r["prediction"] for r in rows] == examples
  assert [r["target"] for r in rows] == examples
  metrics = [json.loads(line) for line in (out / "t5lite_test_echo-metrics.jsonl").open()]
  assert metrics == [{"step": 7, "exact_match": 100.0, "score_order": 100.0}]
  assert scalars(str(out / "t5lite_test_echo"), "exact_match") == {7: 100.0}


# The whole validation split (1000 examples) is decoded in batches of 200: 5
# decode calls an evaluation instead of 250 at the training batch size.
INFER_BATCH = "--gin.infer_eval/datasets.DatasetConfig.batch_size=200"
FINETUNE_TINY = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/finetune.gin",
                 "--gin_file=gin/testing/local_tiny.gin", "--gin.INITIAL_CHECKPOINT_PATH=None",
                 "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'", INFER_BATCH, *SHALLOW]
EVAL_TINY = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/eval.gin",
             "--gin_file=gin/testing/local_tiny.gin",
             "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'", INFER_BATCH, *SHALLOW]


def test_inference_eval_weighs_each_example_once_not_each_batch(tmp_path):

  # 13 examples in batches of 4: the last batch holds example 12 alone, the
  # only one whose prediction (its input) misses its target. Per example:
  # 12/13 right; per batch it would be 3 of 4 batches, and with the padding
  # rows counted the last batch would weigh 4.
  examples = [f"example {i}" for i in range(13)]
  targets = examples[:12] + ["something else"]
  evaluator = _echo_evaluator(tmp_path, "t5lite_test_echo_weights", examples, targets,
                              length=24, batch_size=4)
  try:
    results = evaluator.evaluate(1, {})["t5lite_test_echo_weights"]
  finally:
    evaluator.close()
  assert results["exact_match"] == pytest.approx(100.0 * 12 / 13)


def test_failed_jsonl_write_is_a_write_error_naming_dir_and_step(tmp_path):
  from t5lite import write_errors

  evaluator = _echo_evaluator(tmp_path, "t5lite_test_echo_unwritable", ["a", "b"], None,
                              length=8, batch_size=2)
  # A directory where seqio writes the metrics file before renaming it.
  (tmp_path / "inference_eval" / "t5lite_test_echo_unwritable-metrics.jsonl.tmp").mkdir()
  try:
    with pytest.raises(write_errors.WriteError, match=(
        "^Could not write the inference results of t5lite_test_echo_unwritable to "
        f"{tmp_path}/inference_eval at step 3: ")):
      evaluator.evaluate(3, {})
  finally:
    evaluator.close()


def _read(path):
  with open(path) as f:
    return f.read()


# Trained with a learner whose schedule ends at TRAIN_STEPS, which infer.gin,
# given after the training files as the docs do, leaves unset.
LEARNER = "--gin_file=gin/learners/adamw_cosine.gin"


@pytest.mark.slow
def test_eval_cli_reproduces_training_and_infer_cli_writes_predictions_for_a_file_and_a_task(
    tmp_path, monkeypatch):
  # One test, so that the eval and infer commands read the programs the
  # fine-tuning run compiled (the same model and shapes) from the test's
  # compilation cache instead of compiling them again.
  import json

  # Fine-tuning that saved and decoded the validation split at steps 2 and 4.
  model_dir, eval_dir = str(tmp_path / "run"), str(tmp_path / "eval")
  run_in_process([*FINETUNE_TINY, LEARNER, f"--gin.MODEL_DIR='{model_dir}'"], str(tmp_path),
                 monkeypatch)
  trained = os.path.join(model_dir, "inference_eval")
  assert scalars(os.path.join(trained, "t5lite_arithmetic"), "exact_match").keys() == {2, 4}

  # No learner: evaluation reads the parameters of a checkpoint trained with any.
  args = [*EVAL_TINY, f"--gin.CHECKPOINT_PATH='{model_dir}'", f"--gin.EVAL_OUTPUT_DIR='{eval_dir}'"]
  run_in_process(args, str(tmp_path), monkeypatch, script="t5lite-eval")
  evaluated = os.path.join(eval_dir, "inference_eval")
  # Same checkpoints, same decodes, same metrics as training logged.
  for name in ("t5lite_arithmetic-000002.jsonl", "t5lite_arithmetic-000004.jsonl",
               "t5lite_arithmetic-metrics.jsonl"):
    assert _read(os.path.join(evaluated, name)) == _read(os.path.join(trained, name)), name
  assert len(_read(os.path.join(evaluated, "t5lite_arithmetic-000004.jsonl")).splitlines()) \
      == 1000  # every validation example
  assert scalars(os.path.join(evaluated, "t5lite_arithmetic"), "exact_match") == \
      scalars(os.path.join(trained, "t5lite_arithmetic"), "exact_match")

  # A second pass over the directory skips both steps.
  out = run_in_process(args, str(tmp_path), monkeypatch, script="t5lite-eval")
  assert "Skipping steps already evaluated: [2, 4]" in out

  # One step directory evaluates that checkpoint only, even if done before.
  one = [*EVAL_TINY, f"--gin.CHECKPOINT_PATH='{model_dir}/checkpoints/2'",
         f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 'one'}'"]
  run_in_process(one, str(tmp_path), monkeypatch, script="t5lite-eval")
  assert sorted(os.listdir(tmp_path / "one" / "inference_eval")) == [
      "evaluated_steps.json", "t5lite_arithmetic", "t5lite_arithmetic-000002.jsonl",
      "t5lite_arithmetic-metrics.jsonl"]

  # The training files' learner, without TRAIN_STEPS: inference reads the
  # parameters only and builds no optimizer. An empty line and one longer
  # than the inputs length (32 tokens) are kept.
  long = "add: " + "1 + " * 20 + "1"
  (tmp_path / "questions.txt").write_text(f"add: 1 + 2\n\nsub: 10 - 3\n{long}\nadd: 7 + 7\n")
  common = ["--gin_file=gin/models/t5_tiny.gin", LEARNER, "--gin_file=gin/testing/local_tiny.gin",
            "--gin_file=gin/runs/infer.gin", INFER_BATCH, f"--gin.CHECKPOINT_PATH='{model_dir}'",
            f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'out'}'", *SHALLOW]
  out = run_in_process([*common, f"--gin.INPUT_FILE='{tmp_path / 'questions.txt'}'"],
                       str(tmp_path), monkeypatch, script="t5lite-infer")
  assert out.count("Truncated 1 of 5 inputs to the inputs length of 32 tokens") == 1
  rows = [json.loads(line) for line in (tmp_path / "out" / "questions-4.jsonl").open()]
  assert [r["inputs"] for r in rows] == ["add: 1 + 2", "", "sub: 10 - 3", long[:31], "add: 7 + 7"]
  assert all(isinstance(r["prediction"], str) and r["score"] <= 0 for r in rows)

  # Invalid UTF-8: named with file and line, exit 2, nothing written.
  (tmp_path / "latin1.txt").write_bytes("add: 1 + 2\nadd: caf\u00e9\n".encode("latin-1"))
  line = user_error_line([*common, f"--gin.INPUT_FILE='{tmp_path / 'latin1.txt'}'"],
                         str(tmp_path), monkeypatch, script="t5lite-infer")
  assert f"{tmp_path / 'latin1.txt'}:2 is not valid UTF-8" in line
  assert os.listdir(tmp_path / "out") == ["questions-4.jsonl"]

  run_in_process([*common, "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'",
                  "--gin.NUM_EXAMPLES=5"], str(tmp_path), monkeypatch, script="t5lite-infer")
  rows = [json.loads(line) for line in (tmp_path / "out" / "t5lite_arithmetic-4.jsonl").open()]
  assert len(rows) == 5 and all(set(r) == {"inputs", "targets", "prediction", "score"}
                                for r in rows)

  # Neither a task nor a file: one line, exit 2.
  line = user_error_line(common, str(tmp_path), monkeypatch, script="t5lite-infer")
  assert "Give exactly one of MIXTURE_OR_TASK_NAME" in line


@pytest.mark.slow
@pytest.mark.fast_compile(
    "it checks how a job's processes stop together and that 1 and 2 processes evaluate "
    "alike: runs compared with runs of the same programs, whose numbers at the default "
    "level the evaluation tests above check")
def test_two_processes_stop_together_and_evaluate_like_one(tmp_path):
  from multihost import start_job

  def job(args, name, count, script="t5lite-train"):
    log_dir = str(tmp_path / "logs" / name)
    if count == 1:
      return start_job(lambda i: args, cwd=str(tmp_path), log_dir=log_dir, count=1,
                       devices_per_process=8, with_distributed_flags=False, script=script)
    return start_job(lambda i: args, cwd=str(tmp_path), log_dir=log_dir, count=2, script=script)

  def finished(running):
    results = running.wait(timeout=600)
    assert all(r.returncode == 0 for r in results), running.describe()
    return results

  # Early stopping decided on process 0 ends both processes at step 6.
  model_dir = tmp_path / "run"
  finished(job([*FINETUNE_TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.BATCH_SIZE=8",
                "--gin.TRAIN_STEPS=20",
                "--gin.train_lib.train.actions={'TRAIN_EVAL': [@actions.EarlyStopping()]}",
                "--gin.actions.EarlyStopping.task='t5lite_arithmetic'",
                "--gin.actions.EarlyStopping.metric='loss'",
                "--gin.actions.EarlyStopping.patience=2",
                "--gin.actions.EarlyStopping.tolerance=1000.0"], "train", 2))
  assert max(int(s) for s in os.listdir(model_dir / "checkpoints")) == 6
  trained = model_dir / "inference_eval"
  assert scalars(str(trained / "t5lite_arithmetic"), "exact_match").keys() == {2, 4, 6}

  # The same checkpoint evaluated by 1 process and by 2 gives the decodes
  # training wrote, in input order, and the same teacher-forced loss.
  def eval_args(out):
    return [*EVAL_TINY, f"--gin.CHECKPOINT_PATH='{model_dir}/checkpoints/6'",
            f"--gin.EVAL_OUTPUT_DIR='{out}'", "--gin.BATCH_SIZE=8",
            "--gin.TRAIN_EVAL_DATASET_CFG=@train_eval/datasets.DatasetConfig()",
            # Unpacked, the first batches hold the same examples however many
            # processes read their shards (packing groups them per process).
            "--gin.train_eval/datasets.DatasetConfig.pack=False", "--gin.EVAL_STEPS=2"]
  one, two = tmp_path / "one", tmp_path / "two"
  runs = [job(eval_args(one), "eval1", 1, "t5lite-eval"),
          job(eval_args(two), "eval2", 2, "t5lite-eval")]
  for running in runs:
    finished(running)
  name = "t5lite_arithmetic-000006.jsonl"
  assert _read(one / "inference_eval" / name) == _read(trained / name)
  assert _read(two / "inference_eval" / name) == _read(trained / name)
  losses = [scalars(str(d / "training_eval" / "t5lite_arithmetic"), "loss")[6] for d in (one, two)]
  assert losses[0] == pytest.approx(losses[1], rel=1e-5)


# ---------------------------------------------------------------------------
# t5lite-infer's input file: every line kept, long ones cut as in training


def test_input_file_keeps_every_line_in_order(tmp_path):
  from t5lite import evaluate
  path = tmp_path / "in.txt"
  path.write_bytes("\ufeffa\r\n\n  \nb\nlast".encode())
  assert evaluate._input_texts(str(path)) == ["a", "", "  ", "b", "last"]  # noqa: SLF001
  path = tmp_path / "in.jsonl"
  path.write_text('{"inputs": "a"}\n\n{"inputs": ""}\n')
  assert evaluate._input_texts(str(path)) == ["a", "", ""]  # noqa: SLF001


def test_invalid_utf8_names_the_file_and_line(tmp_path):
  from t5lite import evaluate
  path = tmp_path / "in.txt"
  path.write_bytes(b"ok\nstill ok\nbad \xff here\n")
  with pytest.raises(ValueError, match=rf"^{path}:3 is not valid UTF-8 \(byte 5 of the line is "
                     r"b'\\xff'\); save the file as UTF-8\.$"):
    evaluate._input_texts(str(path))  # noqa: SLF001


def test_long_inputs_are_cut_like_training_and_counted_once(capsys):
  import seqio

  from t5lite import inference
  vocab = seqio.ByteVocabulary()
  texts = ["x" * 20, "", "short", "y" * 7, "z" * 8]
  examples = inference.examples_from_texts(texts, vocab, inputs_length=8)
  out = capsys.readouterr().out
  assert out.count("Truncated") == 1
  assert "Truncated 2 of 5 inputs to the inputs length of 8 tokens, as in training" in out
  inputs = [list(ex["inputs"]) for ex in examples.as_numpy_iterator()]
  assert [len(x) for x in inputs] == [8, 1, 6, 8, 8]
  assert all(x[-1] == vocab.eos_id for x in inputs)
  assert vocab.decode(inputs[0]) == "x" * 7
  # The inference feature converter takes them all (too long ones used to fail it).
  converted = seqio.EncDecFeatureConverter(pack=False)(examples, {"inputs": 8, "targets": 4})
  assert len(list(converted.as_numpy_iterator())) == 5


def _train_with_train_eval(model_dir, eval_cfg=None):
  """Two tiny steps, train-eval at step 2; returns the final step."""
  from t5lite import testing
  from t5lite import train as train_lib
  from t5lite.checkpoints import CheckpointConfig
  from t5lite.data.datasets import DatasetConfig
  from t5lite.partitioning import Partitioner
  from t5lite.trainer import Trainer
  cfg = DatasetConfig("t5lite_span_corruption", {"inputs": 32, "targets": 16}, "train", 4,
                      False, 0, pack=True)
  step, _ = train_lib.train(
      model=testing.tiny_encoder_decoder(), train_dataset_cfg=cfg,
      train_eval_dataset_cfg=eval_cfg or cfg, checkpoint_cfg=CheckpointConfig(save=None),
      partitioner=Partitioner(), trainer_cls=Trainer, model_dir=str(model_dir), total_steps=2,
      eval_period=2, eval_steps=1, random_seed=0)
  return step


def test_evaluators_are_built_off_the_training_thread_and_one_failing_to_build_stops_the_run(
    tmp_path, monkeypatch):
  # Their pipelines are built while the first steps compile and run; the
  # evaluation at step 2 then uses them.
  import threading

  from t5lite import train_eval
  built_on = []

  class Recording(train_eval.TrainEvaluator):
    def __init__(self, **kwargs):
      built_on.append(threading.current_thread().name)
      super().__init__(**kwargs)

  def failing(**kwargs):
    raise ValueError("no such split")

  # Both runs through the test's compilation cache: the second compiles
  # nothing the first did not.
  with launch_cache():
    monkeypatch.setattr(train_eval, "TrainEvaluator", Recording)
    assert _train_with_train_eval(tmp_path / "built") == 2
    assert built_on == ["t5lite-evaluators"]
    assert scalars(os.path.join(tmp_path, "built", "training_eval", "t5lite_span_corruption"),
                   "loss")

    # An evaluator that fails to build stops the run at its first evaluation.
    monkeypatch.setattr(train_eval, "TrainEvaluator", failing)
    with pytest.raises(ValueError, match="no such split"):
      _train_with_train_eval(tmp_path / "failing")
