"""`evaluate()` and `infer()`: the entry points of t5lite-eval and t5lite-infer.

`evaluate` runs the inference evaluation of training (decode every example
of the eval split, apply the tasks' seqio metrics) on one checkpoint, the
latest, or every checkpoint of a directory, writing to the same places
training does: `<output_dir>/inference_eval/<task>/` (TensorBoard) and
`<output_dir>/inference_eval/*.jsonl`. Optionally it also computes the
teacher-forced metrics (`training_eval/<task>/`).

`infer` writes predictions for a task's split, or for a file of inputs, as
JSONL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import seqio

from t5lite import checkpoints as ckpt_lib
from t5lite import inference, interop, paths, state_init
from t5lite import metrics as metrics_lib
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.errors import UserError
from t5lite.partitioning import Partitioner
from t5lite.train_eval import TrainEvaluator


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


EVALUATED_STEPS_FILE = "evaluated_steps.json"
_MODES = ("specific", "latest", "all")


def _steps_to_evaluate(cfg: ckpt_lib.RestoreCheckpointConfig
                       ) -> tuple[ckpt_lib.OpenedCheckpoint, list[int]]:
  """(the checkpoint, steps to evaluate) named by the restore config.

  Raises:
    ValueError: no path, an unknown mode, or no checkpoint there.
  """
  if not cfg.path:
    raise UserError("No checkpoint to evaluate; set CHECKPOINT_PATH (e.g. "
                    "--gin.CHECKPOINT_PATH=\"'<model_dir>/checkpoints'\").")
  if cfg.mode not in _MODES:
    raise UserError(f"Unknown checkpoint mode '{cfg.mode}' for evaluation; use one of "
                    f"{list(_MODES)}.")
  # 'all' on one step directory, or on a foreign checkpoint, means that checkpoint.
  opened = ckpt_lib.open_checkpoint(cfg.path, "auto" if cfg.mode == "all" else cfg.mode)
  if cfg.mode == "all" and opened.kind == ckpt_lib.RUN_DIR:
    return opened, ckpt_lib.list_steps(opened.directory)[1]
  return opened, [opened.step]


def _read_evaluated(output_dir: str) -> set[int]:
  path = paths.Path(paths.join(output_dir, inference.INFERENCE_EVAL_DIR, EVALUATED_STEPS_FILE))
  if not path.exists():
    return set()
  return set(json.loads(path.read_text()))


def _mark_evaluated(output_dir: str, steps: set[int]) -> None:
  """Records evaluated steps (atomically, process 0 only)."""
  if jax.process_index() != 0:
    return
  folder = paths.join(output_dir, inference.INFERENCE_EVAL_DIR)
  paths.makedirs(folder)
  paths.write_whole(paths.join(folder, EVALUATED_STEPS_FILE), json.dumps(sorted(steps)))


def params_restorer(model: BaseModel, partitioner: Partitioner, lengths: Mapping[str, int],
                     opened: ckpt_lib.OpenedCheckpoint):
  """Returns (params shardings, restore(step) -> params) for the checkpoint(s) `opened`.

  Only parameters are read; the model's optimizer is not built into the
  state, so a checkpoint trained with any optimizer serves.
  """
  specs, _ = state_init.state_specs(model, partitioner,
                                   *model.input_shapes_and_types(lengths, pack=False),
                                   with_optimizer=False)
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.params, specs.shardings.params)

  def restore(step: int) -> Any:
    if opened.foreign:
      return interop.load_params(opened.path, abstract)
    config = ckpt_lib.RestoreCheckpointConfig(path=paths.join(opened.directory, str(step)),
                                              mode="specific")
    return ckpt_lib.restore_params(config, abstract)[0]
  return specs.shardings.params, restore


def evaluate(*, model: BaseModel, dataset_cfg: DatasetConfig, partitioner: Partitioner,
             restore_checkpoint_cfg: ckpt_lib.RestoreCheckpointConfig, output_dir: str,
             train_eval_dataset_cfg: DatasetConfig | None = None,
             trainer_cls: Any = None, eval_steps: int = 20,
             num_examples: int | None = None) -> dict[int, dict[str, dict[str, float]]]:
  """Inference metrics (and optionally teacher-forced ones) of checkpoints.

  Args:
    model: the model the checkpoints were trained with.
    dataset_cfg: inference-eval data (usually the validation split, not
      packed); `batch_size` is the global decode batch.
    partitioner: mesh and rules to restore and run on (any mesh works: the
      checkpoint is resharded on restore).
    restore_checkpoint_cfg: `path` and `mode`: 'specific' (a step directory
      such as `<model_dir>/checkpoints/1000`), 'latest' or 'all' (every
      checkpoint under a model_dir or checkpoints directory; steps already
      recorded in `inference_eval/evaluated_steps.json` are skipped).
    output_dir: where results go (the training MODEL_DIR puts them next to
      the ones training wrote).
    train_eval_dataset_cfg: if set, also teacher-forced metrics on
      `eval_steps` batches of it (needs `trainer_cls`).
    trainer_cls: compiles the teacher-forced eval step.
    eval_steps: batches of teacher-forced evaluation.
    num_examples: inference-evaluate only the first this many examples.

  Returns:
    step -> task -> metric -> value, for the steps evaluated now.

  Raises:
    ValueError: no checkpoint, an unknown mode, or an invalid dataset config,
      before anything is written.
  """
  paths.check_scheme("EVAL_OUTPUT_DIR", output_dir)
  partitioner.validate()
  if dataset_cfg.pack:
    raise UserError("Inference evaluation decodes examples one by one; set "
                    "infer_eval/DatasetConfig.pack = False.")
  opened, steps = _steps_to_evaluate(restore_checkpoint_cfg)
  done = _read_evaluated(output_dir) if restore_checkpoint_cfg.mode == "all" else set()
  todo = [s for s in steps if s not in done]
  if train_eval_dataset_cfg is not None and trainer_cls is None:
    raise UserError("Teacher-forced evaluation needs trainer_cls (e.g. @trainer.Trainer).")
  datasets.validate_dataset_config(dataset_cfg, num_shards=partitioner.get_data_layout(
      dataset_cfg.batch_size).num_shards)
  params_shardings, restore = params_restorer(model, partitioner,
                                               dataset_cfg.task_feature_lengths, opened)
  infer_eval = inference.InferenceEvaluator(
      model=model, cfg=dataset_cfg, partitioner=partitioner,
      params_shardings=params_shardings, output_dir=output_dir, num_examples=num_examples)
  train_eval = None
  if train_eval_dataset_cfg is not None:
    train_eval = TrainEvaluator(
        model=model, cfg=train_eval_dataset_cfg, partitioner=partitioner,
        trainer=trainer_cls(model=model, partitioner=partitioner),
        params_shardings=params_shardings, eval_steps=eval_steps, model_dir=output_dir)
  if len(todo) < len(steps):
    metrics_lib.log_line(f"Skipping steps already evaluated: {sorted(set(steps) - set(todo))}")
  results = {}
  try:
    for step in todo:
      params = restore(step)
      results[step] = infer_eval.evaluate(step, params)
      if train_eval is not None:
        for task, metrics in train_eval.evaluate(step, params).items():
          results[step].setdefault(task, {}).update(
              {f"teacher_forced/{k}": v for k, v in metrics.items()})
      done.add(step)
      _mark_evaluated(output_dir, done)
  finally:
    infer_eval.close()
    if train_eval is not None:
      train_eval.close()
    jax.effects_barrier()
  return results


def _input_texts(path: str) -> list[str]:
  """Inputs from a text file (one per line) or JSONL (an "inputs" field per line).

  Every line is an input, an empty one included (as the empty string), so
  the predictions line up with the file line for line.

  Raises:
    ValueError: a missing file, a line that is not UTF-8, or a JSONL line
      that is not an object with a string "inputs" (named by line number).
  """
  if not paths.Path(path).is_file():
    raise UserError(f"Input file '{path}' does not exist.")
  lines = paths.Path(path).read_bytes().split(b"\n")
  if lines[-1] == b"":
    lines.pop()  # the newline that ends the last line starts no new one
  texts = [_decode_line(path, number, line) for number, line in enumerate(lines, 1)]
  if texts:
    texts[0] = texts[0].removeprefix("\ufeff")  # a UTF-8 byte order mark
  if not path.endswith(".jsonl"):
    return texts
  return [_jsonl_inputs(path, number, line) for number, line in enumerate(texts, 1)]


def _decode_line(path: str, number: int, line: bytes) -> str:
  try:
    return line.decode("utf-8").removesuffix("\r")
  except UnicodeDecodeError as error:
    raise UserError(f"{path}:{number} is not valid UTF-8 (byte {error.start + 1} of the line is "
                    f"{line[error.start:error.start + 1]!r}); save the file as UTF-8.") from None


def _jsonl_inputs(path: str, number: int, line: str) -> str:
  if not line.strip():
    return ""
  try:
    inputs = json.loads(line)["inputs"]
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise UserError(f"{path}:{number} is not a JSON object with an \"inputs\" field "
                    f"({error}).") from None
  if not isinstance(inputs, str):
    raise UserError(f"{path}:{number}: \"inputs\" must be a string, got {inputs!r}.")
  return inputs


def _task_examples(name: str, split: str, lengths: Mapping[str, int], module: str | None,
                   num_examples: int | None) -> list[tuple[str, Any]]:
  """(task name, examples) for a task, or for each task of a mixture."""
  provider = datasets.get_mixture_or_task(name, module)
  tasks = seqio.get_subtasks(provider)
  out = []
  for task in tasks:
    if split not in task.splits:
      raise UserError(f"Task '{task.name}' has no split '{split}'; it has {list(task.splits)}.")
    ds = task.get_dataset(sequence_length=dict(lengths), split=split, shuffle=False,
                          num_epochs=1)
    out.append((task.name, ds.take(num_examples) if num_examples else ds))
  return out


def _text(example: Mapping[str, Any], key: str, vocabulary: seqio.Vocabulary) -> str:
  if f"{key}_pretokenized" in example:
    value = example[f"{key}_pretokenized"]
    return value.decode() if isinstance(value, bytes) else str(value)
  return vocabulary.decode([int(t) for t in example[key]])


def _predict_examples(model: BaseModel, runner: inference.BatchRunner, params: Any, examples: Any,
                      lengths: Mapping[str, int]) -> list[tuple[str, float]]:
  """Decoded predictions and their scores for unbatched token examples."""
  converter = model.INFERENCE_FEATURE_CONVERTER_CLS(pack=False)
  token_examples = examples.map(lambda ex: {k: ex[k] for k in ("inputs", "targets")})
  features = converter(token_examples, dict(lengths)).enumerate()

  def fn(p, batch):
    tokens, aux = model.predict_batch_with_aux(p, batch)
    return tokens, aux["scores"]
  rows = runner.run("predict", fn, params, features)
  vocabulary = model.output_vocabulary
  return [(vocabulary.decode(inference.token_list(t)), float(s)) for _, (t, s) in rows]


def infer(*, model: BaseModel, partitioner: Partitioner,
          restore_checkpoint_cfg: ckpt_lib.RestoreCheckpointConfig, output_dir: str,
          task_feature_lengths: Mapping[str, int], batch_size: int,
          mixture_or_task_name: str | None = None, split: str = "validation",
          input_file: str | None = None, module: str | None = None,
          num_examples: int | None = None) -> list[str]:
  """Writes predictions of a checkpoint to JSONL.

  Args:
    model: the model the checkpoint was trained with (its decode_fn decides
      greedy, sampling or beam search).
    partitioner: mesh and rules.
    restore_checkpoint_cfg: the checkpoint ('specific' step directory or
      'latest' in a directory).
    output_dir: gets `<task>-<step>.jsonl` (inputs, targets, prediction,
      score per line) or, for an input file, `<file name>-<step>.jsonl`.
    task_feature_lengths: inputs and targets lengths; longer inputs are cut
      (EOS kept, as in training), with one log line counting them.
      An encoder-decoder decodes at most the targets length, a decoder-only
      model inputs + targets (unless the model's max_decode_length says).
    batch_size: global decode batch.
    mixture_or_task_name: predict every example of this task's `split`.
    split: the task split.
    input_file: instead of a task: a UTF-8 text file with one input per
      line, or JSONL with an "inputs" field per line; every line, an empty
      one included, gets one output line, in order.
    module: module to import first (registers user tasks).
    num_examples: at most this many examples per task.

  Returns:
    The paths written.

  Raises:
    ValueError: neither or both of a task and an input file, an unknown task
      or split, or a missing checkpoint, before anything is written.
  """
  if (mixture_or_task_name is None) == (input_file is None):
    raise UserError("Give exactly one of MIXTURE_OR_TASK_NAME (a task to predict) and "
                    f"INPUT_FILE (a file of inputs); got {mixture_or_task_name!r} and "
                    f"{input_file!r}.")
  paths.check_scheme("INPUT_FILE", input_file)
  paths.check_scheme("INFER_OUTPUT_DIR", output_dir)
  partitioner.validate()
  partitioner.get_data_layout(batch_size)
  if input_file is not None:
    sources = [(os.path.splitext(paths.name(input_file))[0],
                inference.examples_from_texts(_input_texts(input_file), model.input_vocabulary,
                                              task_feature_lengths.get("inputs")))]
  else:
    sources = _task_examples(mixture_or_task_name, split, task_feature_lengths, module,
                             num_examples)
  opened = ckpt_lib.open_checkpoint(restore_checkpoint_cfg.path, restore_checkpoint_cfg.mode)
  step = opened.step
  params_shardings, restore = params_restorer(model, partitioner, task_feature_lengths, opened)
  params = restore(step)
  runner = inference.BatchRunner(partitioner, batch_size, params_shardings)
  written = []
  for name, examples in sources:
    predictions = _predict_examples(model, runner, params, examples, task_feature_lengths)
    path = paths.join(output_dir, f"{name}-{step}.jsonl")
    if jax.process_index() == 0:
      _write_predictions(path, examples, predictions, model)
    written.append(path)
    metrics_lib.log_line(f"Wrote {len(predictions)} predictions to {path}")
  return written


def _write_predictions(path: str, examples: Any, predictions: list[tuple[str, float]],
                       model: BaseModel) -> None:
  paths.makedirs(paths.parent(paths.absolute(path)))
  rows = []
  for example, (prediction, score) in zip(examples.as_numpy_iterator(), predictions):
    row = {"inputs": _text(example, "inputs", model.input_vocabulary)}
    if len(np.atleast_1d(example.get("targets", []))) > 1 or "targets_pretokenized" in example:
      row["targets"] = _text(example, "targets", model.output_vocabulary)
    row.update(prediction=prediction, score=score)
    rows.append(json.dumps(row) + "\n")
  paths.write_whole(path, "".join(rows))


def export_huggingface(*, model: BaseModel, partitioner: Partitioner,
                       restore_checkpoint_cfg: ckpt_lib.RestoreCheckpointConfig,
                       output_dir: str, overwrite: bool = False) -> list[str]:
  """Writes a checkpoint's model as a Hugging Face folder (`t5lite-export`).

  Args:
    model: the model the checkpoint holds: an encoder-decoder with a Hugging
      Face counterpart (T5 v1.0 / v1.1 / ByT5-style dense, or Switch).
    partitioner: mesh and rules to restore on.
    restore_checkpoint_cfg: the checkpoint: a step directory, a model_dir or
      checkpoints directory (its newest step), or a foreign checkpoint.
    output_dir: the folder to write `config.json`, `model.safetensors`, for
      a SentencePiece vocabulary `spiece.model`, and `t5lite-export.json`
      (the checkpoint it holds) into: a new or empty folder, or a previous
      export of the same checkpoint (of any step of the same run).
    overwrite: replace `output_dir` whatever it holds (`--overwrite`).

  Returns:
    The files written (by process 0).

  Raises:
    ValueError: the model has no Hugging Face counterpart, there is no
      checkpoint, or `output_dir` holds something else than an export of
      this checkpoint; checked before anything is written.
  """
  fields = interop.export_fields(model)  # refuses models with no counterpart first
  paths.check_scheme("EXPORT_DIR", output_dir)
  opened = ckpt_lib.open_checkpoint(restore_checkpoint_cfg.path or "", "auto")
  directory, step = opened.directory, opened.step
  source = paths.absolute(directory)
  interop.check_export_target(output_dir, source, overwrite)
  partitioner.validate()
  _, restore = params_restorer(model, partitioner, {"inputs": 8, "targets": 8}, opened)
  params = restore(step)
  # Every process joins the gather of the parameters; process 0 writes.
  written = interop.export_huggingface(params, fields, output_dir, model.input_vocabulary,
                                       write=jax.process_index() == 0, source=source,
                                       step=step, overwrite=overwrite)
  metrics_lib.log_line(f"Wrote a Hugging Face folder of {directory} (step {step}) to "
                       f"{output_dir}: {', '.join(os.path.basename(w) for w in written)}")
  return written
