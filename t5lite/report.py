"""What a training run prints: the banner, the progress line, the summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from t5lite import checkpoints as ckpt_lib
from t5lite import compilation_cache, inference, paths, state_init
from t5lite import metrics as metrics_lib
from t5lite.feeder import TrainData


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


def progress(model: BaseModel, data: TrainData, start: int, end: int,
             peak_flops_per_device: float | None = None) -> metrics_lib.Progress:
  """Throughput tracking, with model FLOP/s (and MFU where the devices'
  peak in the model's compute dtype is known) when the model can count its
  FLOPs."""
  flops = model.train_flops_per_step(data.global_shapes())
  peak = metrics_lib.peak_flops_per_second(per_device=peak_flops_per_device,
                                           compute_dtype=model.compute_dtype())
  return metrics_lib.Progress(end, start, flops_per_step=flops, peak_flops_per_second=peak)


def value_count(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def devices() -> str:
  """The devices a run uses, as the banner and the dry run both say it:
  '8 x cpu in 1 process(es)'."""
  every = jax.devices()
  return f"{len(every)} x {every[0].device_kind} in {jax.process_count()} process(es)"


def banner(*, model, specs, partitioner, train_cfg, periods, start, end, checkpointer) -> str:
  """What is about to run: devices, mesh, model size, data, schedule."""
  mesh = " x ".join(f"{k} {v}" for k, v in partitioner.mesh.shape.items() if v > 1) or "1 device"
  params = state_init.param_count(specs)
  layout = partitioner.get_data_layout(train_cfg.batch_size)
  lengths = ", ".join(f"{k} {v}" for k, v in train_cfg.task_feature_lengths.items())
  save = (f"checkpoints every {periods.checkpoint} steps and at the end"
          if periods.checkpoint else "no checkpoints")
  evals = f"evaluation every {periods.eval} steps" if periods.eval else "no evaluation"
  return "\n".join([
      f"t5lite: training {type(model.module).__name__} ({params / 1e6:.2f}M parameters, "
      f"{value_count(specs.abstract.opt_state) / 1e6:.2f}M optimizer values)",
      f"  devices: {devices()}; mesh: {mesh}",
      f"  data: {train_cfg.mixture_or_task_name} ({train_cfg.split}), global batch "
      f"{train_cfg.batch_size} ({train_cfg.batch_size // layout.num_shards} per host), "
      f"lengths {lengths}",
      f"  steps {start} -> {end}; {save} into {checkpointer.directory}; {evals}"])


def summary(*, model_dir, checkpointer, start, end, seconds) -> str:
  """Where everything went, once the run is over."""
  ran = end - start
  rate = f", {ran / seconds:.2f} steps/s" if ran and seconds > 0 else ""
  written = [d for d in ("train", "training_eval", inference.INFERENCE_EVAL_DIR)
             if paths.Path(paths.join(model_dir, d)).is_dir()]
  steps = ckpt_lib.list_steps(checkpointer.directory)[1]
  return "\n".join([
      f"Finished at step {end}: {ran} steps in {metrics_lib.format_duration(seconds)}{rate}.",
      f"  checkpoints: {checkpointer.directory} (steps {steps})",
      f"  summaries:   {', '.join(paths.join(model_dir, d) for d in written)}",
      f"  view with:   tensorboard --logdir {model_dir}",
      f"  {compilation_cache.use().describe()}"])
