"""Inference evaluation: predictions for every example, scored by seqio metrics.

`InferenceEvaluator` wraps `seqio.Evaluator`: seqio caches each eval task's
examples (in input order, enumerated), we decode or score them in whole
global batches (the last one padded, the padding dropped after) with the
work split across processes by the data layout, and seqio applies each
task's postprocessor and metric functions. Metrics go to TensorBoard under
`<output_dir>/inference_eval/<task>/` and, with the predictions next to
their inputs and targets, to JSONL files in `<output_dir>/inference_eval/`.

`BatchRunner` is the batching core, shared with `t5lite-eval` and `t5lite-infer`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import seqio
import tensorflow as tf

from t5lite import metrics as metrics_lib
from t5lite import paths, write_errors
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.partitioning import Partitioner


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


INFERENCE_EVAL_DIR = "inference_eval"


def _padded_batches(ds: tf.data.Dataset, batch_size: int
                    ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray], int]]:
  """Yields (indices, features, num_real) for whole batches of an enumerated
  dataset; the last batch is padded with copies of zeros."""
  for indices, features in ds.batch(batch_size).as_numpy_iterator():
    real = len(indices)
    if real < batch_size:
      pad = batch_size - real
      features = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
                  for k, v in features.items()}
    yield indices, features, real


def _gather(x: jax.Array) -> np.ndarray:
  """The whole global array on this host (an all-gather across processes)."""
  if jax.process_count() == 1 or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@dataclasses.dataclass
class BatchRunner:
  """Runs a jitted function of (params, batch) over whole global batches.

  Each process feeds only the rows of the batch its devices hold (from the
  partitioner's data layout); results are gathered back on every process.

  Attributes:
    partitioner: mesh, rules and the batch sharding.
    batch_size: global batch size.
    params_shardings: shardings of the parameters passed to the function.
  """

  partitioner: Partitioner
  batch_size: int
  params_shardings: Any
  _compiled: dict = dataclasses.field(default_factory=dict)

  def _jit(self, name: str, fn: Callable, features: Mapping[str, np.ndarray]) -> Callable:
    if name not in self._compiled:
      shardings = self.partitioner.batch_shardings({k: v.shape for k, v in features.items()})
      self._compiled[name] = (self.partitioner.partition(
          fn, in_shardings=(self.params_shardings, shardings), out_shardings=None), shardings)
    return self._compiled[name]

  def to_global(self, features: Mapping[str, np.ndarray], shardings: Mapping[str, Any]
                 ) -> dict[str, jax.Array]:
    """Every process holds the whole batch; it passes on its layout's rows."""
    layout = self.partitioner.get_data_layout(self.batch_size)
    rows = self.batch_size // layout.num_shards
    lo = layout.shard_id * rows
    return self.partitioner.to_global({k: v[lo:lo + rows] for k, v in features.items()},
                                      shardings, self.batch_size)

  def run(self, name: str, fn: Callable, params: Any, ds: tf.data.Dataset
          ) -> list[tuple[int, Any]]:
    """`[(index, output row), ...]` for an enumerated dataset of features.

    Args:
      name: cache key of the compiled function.
      fn: `fn(params, batch) -> array or tuple of arrays`, batch-major.
      params: parameters, already placed with `params_shardings`.
      ds: enumerated dataset of unbatched model features.

    Returns:
      One entry per example, in the dataset's order; an output row is a
      numpy array, or a tuple of them when `fn` returns a tuple.
    """
    out: list[tuple[int, Any]] = []
    for indices, features, real in _padded_batches(ds, self.batch_size):
      jitted, shardings = self._jit(name, fn, features)
      result = jitted(params, self.to_global(features, shardings))
      parts = [_gather(r) for r in (result if isinstance(result, tuple) else (result,))]
      for row in range(real):
        values = tuple(p[row] for p in parts)
        out.append((int(indices[row]), values if isinstance(result, tuple) else values[0]))
    return out


def token_list(tokens: np.ndarray) -> list[int]:
  """Tokens up to (not including) the first padding 0."""
  tokens = np.asarray(tokens)
  stop = np.flatnonzero(tokens == 0)
  return tokens[: stop[0] if stop.size else len(tokens)].tolist()


def _scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
  """The numeric metrics, as floats (text or image metrics are left to JSONL)."""
  out = {}
  for name, value in metrics.items():
    value = getattr(value, "value", value)
    if isinstance(value, (int, float, np.number)) or (
        isinstance(value, np.ndarray) and value.size == 1):
      out[name] = float(value)
  return out


class _JSONLogger(seqio.JSONLogger):
  """seqio's JSONL logger, whose failed writes (TensorFlow's file system
  reports them as `OpError`s) are `WriteError`s naming the file's directory
  and the step."""

  def __call__(self, task_name: str, step: int | None, *args: Any, **kwargs: Any) -> None:
    try:
      super().__call__(task_name, step, *args, **kwargs)
    except (tf.errors.OpError, OSError) as error:
      raise write_errors.write_failed(f"the inference results of {task_name}",
                                      self.output_dir, step, error) from error


class InferenceEvaluator:
  """Decodes and scores every example of the eval split of each task.

  Args:
    model: the model (its `predict_batch_with_aux`, `score_batch` and
      `INFERENCE_FEATURE_CONVERTER_CLS` are used).
    cfg: the eval data: task or mixture, split, feature lengths and the
      global batch size.
    partitioner: mesh and rules.
    params_shardings: shardings of the parameters passed to `evaluate`.
    output_dir: TensorBoard and JSONL go under `output_dir/inference_eval/`.
    num_examples: evaluate only the first this many examples of each task.

  Raises:
    ValueError: an invalid dataset config (unknown task, split, ...).
  """

  def __init__(self, *, model: BaseModel, cfg: DatasetConfig, partitioner: Partitioner,
               params_shardings: Any, output_dir: str, num_examples: int | None = None):
    datasets.validate_dataset_config(cfg, num_shards=partitioner.get_data_layout(
        cfg.batch_size).num_shards)
    self._model = model
    self._primary = jax.process_index() == 0
    self._dir = paths.join(output_dir, INFERENCE_EVAL_DIR)
    # seqio writes its JSONL through TensorFlow: local files, uploaded to a
    # bucket after each evaluation. Process 0 alone writes them.
    self._jsonl = paths.Mirror(self._dir) if self._primary else None
    if self._jsonl is not None:
      with write_errors.writing("the inference results", self._dir):
        os.makedirs(self._jsonl.local, exist_ok=True)
    converter = model.INFERENCE_FEATURE_CONVERTER_CLS(pack=False)
    with datasets.TRACING:  # it traces (and caches) the eval split's pipeline
      self._evaluator = seqio.Evaluator(
          mixture_or_task_name=cfg.mixture_or_task_name, feature_converter=converter,
          eval_split=cfg.split, use_cached=cfg.use_cached, seed=cfg.seed,
          sequence_length=dict(cfg.task_feature_lengths), num_examples=num_examples,
          shuffle=False, logger_cls=(_JSONLogger,) if self._primary else (),
          log_dir=None if self._jsonl is None else self._jsonl.local,
          async_compute_metrics=False)
    self._runner = BatchRunner(partitioner, cfg.batch_size, params_shardings)
    self._writers: dict[str, metrics_lib.SummaryWriter] = {}

  @property
  def task_names(self) -> list[str]:
    """The tasks that have metric functions for the split (others are skipped)."""
    return [t.name for t in self._evaluator.eval_tasks]

  def _predict_with_aux(self, params: Any) -> Callable:
    model = self._model

    def fn(p, batch):
      tokens, aux = model.predict_batch_with_aux(p, batch)
      return tokens, aux["scores"]

    def predict(ds: tf.data.Dataset, unused_shapes: Any = None):
      rows = self._runner.run("predict", fn, params, ds)
      # Whole rows (padding included): seqio stacks them into one array.
      tokens = [(i, np.asarray(t).tolist()) for i, (t, _) in rows]
      return tokens, {"scores": [float(s) for _, (_, s) in rows]}
    return predict

  def _predict(self, params: Any) -> Callable:
    with_aux = self._predict_with_aux(params)
    return lambda ds, unused_shapes=None: with_aux(ds)[0]

  def _score(self, params: Any) -> Callable:
    model = self._model

    def score(ds: tf.data.Dataset, unused_shapes: Any = None):
      return [(i, float(s)) for i, s in self._runner.run("score", model.score_batch, params, ds)]
    return score

  def evaluate(self, step: int, params: Any) -> dict[str, dict[str, float]]:
    """Predicts, scores and computes each task's metrics at `step`.

    Returns:
      task name -> numeric metrics (also written to TensorBoard and JSONL).

    Raises:
      write_errors.WriteError: the JSONL or TensorBoard files could not be written.
    """
    if not self.task_names:
      return {}
    try:
      future, _ = self._evaluator.evaluate(
          compute_metrics=True, step=step, predict_fn=self._predict(params),
          score_fn=self._score(params), predict_with_aux_fn=self._predict_with_aux(params))
      computed = future.result()
    except ValueError as error:
      # seqio turns any failure of a task's metrics or logging into a
      # ValueError; a failed write is not bad input (exit 5, not 2).
      if isinstance(error.__cause__, write_errors.WriteError):
        raise error.__cause__ from None
      raise
    if self._jsonl is not None:
      with write_errors.writing("the inference results", self._dir, step):
        self._jsonl.sync()
    results = {task: _scalar_metrics(m) for task, m in computed.items()}
    for task, scalars in results.items():
      self._writer(task).write_scalars(step, scalars)
      self._writer(task).flush()
    metrics_lib.log_line(metrics_lib.format_table(f"inference eval at step {step}", results))
    return results

  def _writer(self, task: str) -> metrics_lib.SummaryWriter:
    if task not in self._writers:
      self._writers[task] = metrics_lib.SummaryWriter(paths.join(self._dir, task),
                                                      self._primary)
    return self._writers[task]

  def close(self) -> None:
    self._evaluator.close()
    for writer in self._writers.values():
      writer.close()
    if self._jsonl is not None:
      with write_errors.writing("the inference results", self._dir):
        self._jsonl.close()


def examples_from_texts(texts: Sequence[str], vocabulary: seqio.Vocabulary,
                        inputs_length: int | None = None) -> tf.data.Dataset:
  """Unbatched {"inputs", "targets"} token examples for raw input strings.

  One example per text, in order, an empty text included (its inputs are
  EOS alone). The targets are empty (EOS only), so the feature converter
  sees the same structure as a task's examples.

  Args:
    texts: the inputs.
    vocabulary: encodes them.
    inputs_length: inputs longer than this many tokens (EOS included) are
      cut to it with EOS kept last, as `seqio.preprocessors.
      append_eos_after_trim` cuts the training tasks' inputs; one log line
      says how many were cut. None cuts nothing.
  """
  eos = vocabulary.eos_id
  inputs = [list(vocabulary.encode(t)) for t in texts]
  if inputs_length is not None:
    cut = sum(len(x) + 1 > inputs_length for x in inputs)
    if cut:
      metrics_lib.log_line(
          f"Truncated {cut} of {len(inputs)} inputs to the inputs length of {inputs_length} "
          "tokens, as in training; raise TASK_FEATURE_LENGTHS['inputs'] to keep them whole.")
    inputs = [x[:inputs_length - 1] for x in inputs]
  inputs = [x + [eos] for x in inputs]
  return tf.data.Dataset.from_generator(
      lambda: ({"inputs": np.asarray(x, np.int32), "targets": np.asarray([eos], np.int32)}
               for x in inputs),
      output_signature={"inputs": tf.TensorSpec([None], tf.int32),
                        "targets": tf.TensorSpec([None], tf.int32)})
