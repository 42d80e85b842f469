"""Evaluation during training: teacher-forced metrics on held-out batches.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import seqio

from t5lite import metrics as metrics_lib
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.feeder import global_batches
from t5lite.partitioning import Partitioner


def eval_task_names(cfg: DatasetConfig) -> list[str]:
  """The evaluated names: the task, or a mixture and each of its tasks that
  has the split."""
  provider = datasets.get_mixture_or_task(cfg.mixture_or_task_name, cfg.module)
  names = [cfg.mixture_or_task_name]
  if isinstance(provider, seqio.Mixture):
    names += [t.name for t in provider.tasks if cfg.split in t.splits]
  return names


class TrainEvaluator:
  """Teacher-forced metrics on `eval_steps` batches of a held-out split.

  A mixture is evaluated as a whole and task by task. Each evaluation reads
  the same first batches, so numbers are comparable across steps. Results
  go to MODEL_DIR/training_eval/<task>/.
  """

  def __init__(self, *, model: Any, cfg: DatasetConfig, partitioner: Partitioner,
               trainer: Any, params_shardings: Any, eval_steps: int, model_dir: str):
    layout = partitioner.get_data_layout(cfg.batch_size)
    self._partitioner, self._batch = partitioner, cfg.batch_size
    self._steps = eval_steps
    self._datasets, self._writers = {}, {}
    for name in eval_task_names(cfg):
      self._datasets[name] = datasets.get_dataset(
          dataclasses.replace(cfg, mixture_or_task_name=name), layout.shard_id,
          layout.num_shards, model.FEATURE_CONVERTER_CLS, num_epochs=None)
      self._writers[name] = metrics_lib.SummaryWriter(
          os.path.join(model_dir, "training_eval", name), jax.process_index() == 0)
    spec = next(iter(self._datasets.values())).element_spec
    shardings = partitioner.batch_shardings({k: s.shape for k, s in spec.items()})
    self._step_fn = trainer.compile_eval_step(params_shardings, shardings)

  def evaluate(self, step: int, params: Any) -> dict[str, dict[str, float]]:
    """Metrics of each evaluated name at `step`: {task: {metric: value}}."""
    out = {}
    for name, ds in self._datasets.items():
      batches = global_batches(ds.take(self._steps), self._partitioner, self._batch)
      # Merged clu metrics: each batch weighs by its tokens (or rows), not 1.
      results = metrics_lib.merge_and_compute([self._step_fn(params, b) for b in batches])
      self._writers[name].write_scalars(step, results)
      self._writers[name].flush()
      out[name] = results
    metrics_lib.log_line(metrics_lib.format_table(f"train-eval at step {step}", out))
    return out

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()
