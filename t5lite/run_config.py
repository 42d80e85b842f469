"""The settings of one training run, checked once and then read-only.

`train()` keeps its keyword arguments exactly as gin files and T5X users
bind them; its first act is to turn them into a `RunConfig`, which every
later phase (validation, the data, the state, the loop) and the dry run
take instead of long parameter lists. The decisions that follow from the
settings alone (`validate`, `RunConfig.end_step`, `RunConfig.evaluations`)
live here, so training and its dry run ask the same functions.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from t5lite import actions as actions_lib
from t5lite import checkpoints as ckpt_lib
from t5lite import metrics as metrics_lib
from t5lite import paths
from t5lite.checkpoints import CheckpointConfig
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.divergence import DivergenceLimits
from t5lite.errors import UserError
from t5lite.partitioning import Partitioner
from t5lite.periods import Periods, compute_periods


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel
  from t5lite.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """`train()`'s arguments (see there), with three of them resolved:

  `seed` is `random_seed`, drawn when that was None; `divergence` holds
  `max_update_ratio`, `loss_spike_factor` and `loss_spike_window`; and
  `actions` is checked, by mode.
  """

  model: BaseModel
  train_dataset_cfg: DatasetConfig
  train_eval_dataset_cfg: DatasetConfig | None
  infer_eval_dataset_cfg: DatasetConfig | None
  checkpoint_cfg: CheckpointConfig
  partitioner: Partitioner
  trainer_cls: Callable[..., Trainer]
  model_dir: str
  total_steps: int
  eval_steps: int
  eval_period: int
  relative_steps: int | None
  stats_period: int | None
  seed: int
  actions: Mapping[actions_lib.ActionMode, list]
  run_eval_before_training: bool
  gc_period: int
  prefetch_batches: int
  peak_flops_per_device: float | None
  divergence: DivergenceLimits
  summarize_config_fn: Callable[[str], None] | None
  resume_step: int | None

  @classmethod
  def from_train_arguments(cls, arguments: Mapping[str, Any], seed: int) -> RunConfig:
    """The settings of a `train(**arguments)` call, with `seed` for its random_seed.

    Raises:
      ValueError: a setting no run could use (a divergence limit, the peak
        FLOP/s or an action), named with its fix.
    """
    args = dict(arguments)
    peak = args["peak_flops_per_device"]
    if peak is not None and not peak > 0:
      raise UserError(f"train.peak_flops_per_device must be a positive FLOP/s figure or None, "
                      f"got {peak!r}.")
    divergence = DivergenceLimits(max_update_ratio=args.pop("max_update_ratio"),
                                  loss_spike_factor=args.pop("loss_spike_factor"),
                                  loss_spike_window=args.pop("loss_spike_window"))
    del args["random_seed"]
    args["actions"] = actions_lib.validate_actions(args["actions"])
    return cls(seed=seed, divergence=divergence, **args)

  @property
  def datasets(self) -> tuple[DatasetConfig, ...]:
    """The training, train-eval and infer-eval data that are set, in that order."""
    return tuple(cfg for cfg in (self.train_dataset_cfg, self.train_eval_dataset_cfg,
                                 self.infer_eval_dataset_cfg) if cfg is not None)

  def end_step(self, start: int) -> int:
    """The step a run starting at `start` trains up to: `relative_steps`
    past it when set, else `total_steps`."""
    return start + self.relative_steps if self.relative_steps is not None else self.total_steps

  def evaluations(self, periods: Periods) -> dict[str, DatasetConfig]:
    """The evaluators the run builds, by name ('train-eval', 'infer-eval'),
    with their data: those configured, when `periods` evaluates at all."""
    if not periods.eval:
      return {}
    return {name: cfg for name, cfg in (("train-eval", self.train_eval_dataset_cfg),
                                        ("infer-eval", self.infer_eval_dataset_cfg))
            if cfg is not None}


def resolve_seed(random_seed: int | None) -> int:
  """`random_seed`, or one drawn from the clock (the same on every process) when None."""
  if random_seed is not None:
    return int(random_seed)
  seed = int(time.time() * 1000) % (2**31)
  if jax.process_count() > 1:
    # Clocks differ between hosts; every process must init and drop out alike.
    from jax.experimental import multihost_utils
    seed = int(multihost_utils.broadcast_one_to_all(np.asarray(seed, np.int32)))
  metrics_lib.log_line(f"random_seed not set; using {seed}")
  return seed


def _check_writable(model_dir: str) -> None:
  """MODEL_DIR (or the directory it will be created in) must be writable; a
  bucket says so at the first write (the run lock)."""
  paths.check_scheme("MODEL_DIR", model_dir)
  if paths.is_url(model_dir):
    return
  path = os.path.abspath(model_dir)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
    raise UserError(f"MODEL_DIR '{model_dir}' is not writable ('{path}' is not a writable "
                    "directory); choose another MODEL_DIR or fix its permissions.")


def validate(run: RunConfig, trainer: Trainer) -> Periods:
  """Every check of `run` that needs no compilation and writes nothing.

  Raises:
    ValueError: the first problem found, as one readable message.
  """
  ckpt_lib.validate_config(run.checkpoint_cfg)
  _check_writable(run.model_dir)
  save = run.checkpoint_cfg.save
  periods = compute_periods(total_steps=run.total_steps, eval_period=run.eval_period,
                            checkpoint_period=save.period if save else 0,
                            gc_period=run.gc_period, stats_period=run.stats_period,
                            checkpoint_steps=tuple(save.checkpoint_steps) if save else ())
  partitioner = run.partitioner
  partitioner.validate()
  run.model.validate_mesh(partitioner.mesh.shape)
  trainer.validate(run.train_dataset_cfg.batch_size)
  for cfg in run.datasets:
    layout = partitioner.get_data_layout(cfg.batch_size)
    datasets.validate_dataset_config(cfg, num_shards=layout.num_shards)
    run.model.validate_vocabulary(cfg.mixture_or_task_name, datasets.get_vocabulary(cfg)[1])
  infer_cfg = run.infer_eval_dataset_cfg
  if infer_cfg is not None and infer_cfg.pack:
    raise UserError(f"infer_eval/DatasetConfig.pack must be False (each example is decoded "
                    f"on its own) for '{infer_cfg.mixture_or_task_name}'.")
  return periods
