"""The settings of one training run, checked once and then read-only.

`train()` keeps its keyword arguments exactly as gin files and T5X users
bind them; its first act is to turn them into a `RunConfig`, which every
later phase (validation, the data, the state, the loop) and the dry run
take instead of long parameter lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from t5lite import actions as actions_lib
from t5lite.checkpoints import CheckpointConfig
from t5lite.data.datasets import DatasetConfig
from t5lite.divergence import DivergenceLimits
from t5lite.errors import UserError
from t5lite.partitioning import Partitioner


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """`train()`'s arguments (see there), with three of them resolved:

  `seed` is `random_seed`, drawn when that was None; `divergence` holds
  `max_update_ratio`, `loss_spike_factor` and `loss_spike_window`; and
  `actions` is checked, by mode.
  """

  model: Any
  train_dataset_cfg: DatasetConfig
  train_eval_dataset_cfg: DatasetConfig | None
  infer_eval_dataset_cfg: DatasetConfig | None
  checkpoint_cfg: CheckpointConfig
  partitioner: Partitioner
  trainer_cls: Callable[..., Any]
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
