"""`evaluate()` and `infer()`: the entry points of t5lite-eval and t5lite-infer."""

from __future__ import annotations

import os
from typing import Any

import jax

from t5lite import checkpoints as ckpt_lib
from t5lite import train as train_lib
from t5lite.data.datasets import DatasetConfig
from t5lite.partitioning import Partitioner


def evaluate(*, model: Any, dataset_cfg: DatasetConfig, partitioner: Partitioner,
             restore_checkpoint_cfg: ckpt_lib.RestoreCheckpointConfig, output_dir: str,
             trainer_cls: Any, eval_steps: int = 10) -> dict[str, float]:
  """Teacher-forced metrics of one checkpoint, written as TensorBoard events.

  Args:
    model: the model the checkpoint was trained with.
    dataset_cfg: evaluation data (usually the validation split).
    partitioner: mesh and rules to restore and run on.
    restore_checkpoint_cfg: which checkpoint ('latest' in a directory or a
      'specific' step directory).
    output_dir: events go to output_dir/training_eval/<task>/.
    trainer_cls: compiles the eval step.
    eval_steps: number of batches.

  Returns:
    The averaged metrics.

  Raises:
    ValueError: no checkpoint at the path, or an invalid dataset config.
  """
  partitioner.validate()
  layout = partitioner.get_data_layout(dataset_cfg.batch_size)
  from t5lite.data import datasets
  datasets.validate_dataset_config(dataset_cfg, num_shards=layout.num_shards)
  ckpt_lib.validate_config(ckpt_lib.CheckpointConfig(restore=restore_checkpoint_cfg))
  if not restore_checkpoint_cfg.path:
    raise ValueError("No checkpoint to evaluate; set RestoreCheckpointConfig.path "
                     "(e.g. --gin.CHECKPOINT_PATH=\"'<model_dir>/checkpoints'\").")
  trainer = trainer_cls(model=model, partitioner=partitioner)
  specs, _ = train_lib.state_specs(model, partitioner,
                                   *train_lib.model_input_shapes(model, dataset_cfg))
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.state_dict(),
                                              specs.shardings.state_dict())
  restored, step = ckpt_lib.restore_from_path(restore_checkpoint_cfg, abstract)
  os.makedirs(output_dir, exist_ok=True)
  evaluator = train_lib.TrainEvaluator(
      model=model, cfg=dataset_cfg, partitioner=partitioner, trainer=trainer,
      params_shardings=specs.shardings.params, eval_steps=eval_steps, model_dir=output_dir)
  try:
    return evaluator.evaluate(step, restored["params"])
  finally:
    evaluator.close()
    jax.effects_barrier()


def infer(**unused_kwargs: Any) -> None:
  """Prediction needs a decoder, which this version does not ship yet.

  Raises:
    ValueError: always, with the alternative to use meanwhile.
  """
  raise ValueError("t5lite-infer is not available in this version (no decoding yet); "
                   "use t5lite-eval for teacher-forced metrics of a checkpoint.")
