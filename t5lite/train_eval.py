"""Evaluation during training: teacher-forced metrics on held-out batches,
and the evaluators a run builds (this one and `inference`'s) off the
training thread.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import seqio
from absl import logging

from t5lite import inference, paths
from t5lite import metrics as metrics_lib
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.feeder import global_batches
from t5lite.partitioning import Partitioner
from t5lite.periods import Periods
from t5lite.threads import Background


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel
  from t5lite.run_config import RunConfig
  from t5lite.trainer import Trainer


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

  def __init__(self, *, model: BaseModel, cfg: DatasetConfig, partitioner: Partitioner,
               trainer: Trainer, params_shardings: Any, eval_steps: int, model_dir: str):
    layout = partitioner.get_data_layout(cfg.batch_size)
    self._partitioner, self._batch = partitioner, cfg.batch_size
    self._steps = eval_steps
    self._datasets, self._writers = {}, {}
    for name in eval_task_names(cfg):
      self._datasets[name] = datasets.get_dataset(
          dataclasses.replace(cfg, mixture_or_task_name=name), layout.shard_id,
          layout.num_shards, model.FEATURE_CONVERTER_CLS, num_epochs=None)
      self._writers[name] = metrics_lib.SummaryWriter(
          paths.join(model_dir, "training_eval", name), jax.process_index() == 0)
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


class Evaluators:
  """The train-eval and inference evaluators, built on a background thread.

  Building them reads and preprocesses the eval splits (tf.data graphs, and
  SeqIO's evaluator caches the whole inference split), a second or more that
  would otherwise delay the first training step. `start` begins it once the
  first step is dispatched (started earlier, it would only take turns at
  Python's interpreter lock with tracing that step), so it overlaps the
  steps before the first evaluation. `get` starts it if needed and waits,
  so the first evaluation uses the evaluators as built, and raises what
  building raised.
  """

  def __init__(self, build_train_eval: Callable[[], TrainEvaluator] | None,
               build_infer_eval: Callable[[], inference.InferenceEvaluator] | None):
    self._builders = (build_train_eval, build_infer_eval)
    self._building: Background | None = None
    self._reported = False

  def start(self) -> None:
    """Starts building (once)."""
    if self._building is None and any(self._builders):
      self._building = Background(self._build, "t5lite-evaluators")

  def _build(self) -> tuple[TrainEvaluator | None, inference.InferenceEvaluator | None]:
    build_train_eval, build_infer_eval = self._builders
    evaluator = build_train_eval() if build_train_eval else None
    try:
      return evaluator, build_infer_eval() if build_infer_eval else None
    except BaseException:
      if evaluator is not None:
        evaluator.close()
      raise

  def get(self) -> tuple[TrainEvaluator | None, inference.InferenceEvaluator | None]:
    """(train-eval, inference) evaluators, None where not configured."""
    self.start()
    if self._building is None:
      return None, None
    self._reported = True  # a failed build is raised here, to the loop
    return self._building.result()

  def close(self) -> None:
    """Closes the writers of what was built; a failed build that no
    evaluation reported is logged."""
    if self._building is None:
      return
    try:
      built = self._building.result()
    except BaseException as e:  # noqa: BLE001 - the run is ending; say it, do not mask
      if not self._reported:
        logging.warning("The evaluators could not be built: %s", e)
      return
    for evaluator in built:
      if evaluator is not None:
        evaluator.close()


def build_evaluators(run: RunConfig, trainer: Trainer, periods: Periods, params_shardings: Any
                     ) -> Evaluators:
  """The evaluators `run.evaluations(periods)` names, to be built in the background.

  Args:
    run: the run's `RunConfig`.
    trainer: compiles the teacher-forced eval step.
    periods: the run's periods (no evaluation at all when `periods.eval` is 0).
    params_shardings: where the parameters live.
  """
  evaluations = run.evaluations(periods)
  build_eval = build_infer = None
  if "train-eval" in evaluations:
    build_eval = functools.partial(
        TrainEvaluator, model=run.model, cfg=evaluations["train-eval"],
        partitioner=run.partitioner, trainer=trainer, params_shardings=params_shardings,
        eval_steps=run.eval_steps, model_dir=run.model_dir)
  if "infer-eval" in evaluations:
    build_infer = functools.partial(
        inference.InferenceEvaluator, model=run.model, cfg=evaluations["infer-eval"],
        partitioner=run.partitioner, params_shardings=params_shardings,
        output_dir=run.model_dir)
  return Evaluators(build_eval, build_infer)
