"""Framework overhead of the train() main loop against a bare jitted loop.

Both loops run the same compiled train step of the same model in this
process: the bare loop feeds one resident batch, `train()` runs its real data
pipeline, metrics, summaries and checkpoints. The figure reported is the ratio
of their steps per second; the JSON lands in benchmarks/results/.

  .venv/bin/python benchmarks/run.py [--gin_file=...] [--steps=N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import gin
import jax
import numpy as np

from t5lite import cli
from t5lite import train as train_lib
from t5lite.train_state import TrainState

HERE = os.path.dirname(os.path.abspath(__file__))


def _configure(gin_files: list[str], model_dir: str, steps: int, stats: int) -> None:
  gin.config.clear_config(clear_constants=True)
  bindings = [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}", f"STATS_PERIOD = {stats}",
              f"EVAL_PERIOD = {steps}", f"CHECKPOINT_PERIOD = {steps}", "EVAL_STEPS = 1"]
  cli.parse_gin(gin_files, bindings, cli.gin_search_paths([]))


def bare_loop(steps: int) -> float:
  """Steps/s of the compiled step on one resident batch, nothing else."""
  kwargs = {k: gin.query_parameter(f"train_lib.train.{k}").scoped_configurable_fn()
            for k in ("model", "partitioner")}
  model, partitioner = kwargs["model"], kwargs["partitioner"]
  train_cfg = gin.query_parameter("train_lib.train.train_dataset_cfg").scoped_configurable_fn()
  trainer = gin.query_parameter("train_lib.train.trainer_cls").scoped_configurable_fn(
      model=model, partitioner=partitioner)
  specs, init_fn = train_lib.state_specs(model, partitioner,
                                         *train_lib.model_input_shapes(model, train_cfg))
  state: TrainState = partitioner.partition(init_fn, None, specs.shardings)(jax.random.key(0))
  batch = next(train_lib.TrainData(model, train_cfg, partitioner))
  step = trainer.compile_train_step(specs.shardings, {k: v.sharding for k, v in batch.items()})
  state, metrics = step(state, batch)  # compile
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  return steps / (time.perf_counter() - start)


def train_loop(steps: int, stats: int, model_dir: str) -> float:
  """Steps/s of train() measured by its own timing summaries, compile excluded."""
  gin.get_configurable(train_lib.train)()
  from tensorboard.backend.event_processing import event_accumulator
  from tensorflow.python.framework import tensor_util
  acc = event_accumulator.EventAccumulator(os.path.join(model_dir, "train"),
                                           size_guidance={"tensors": 0})
  acc.Reload()
  rates = {e.step: float(tensor_util.MakeNdarray(e.tensor_proto))
           for e in acc.Tensors("timing/steps_per_second")}
  later = [r for s, r in sorted(rates.items()) if s > stats]  # the first period compiles
  return float(np.median(later))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append",
                      default=None, help="gin files (default: the dense headline)")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--stats", type=int, default=10)
  args = parser.parse_args()
  gin_files = args.gin_file or ["gin/pretrain_dense.gin"]
  with tempfile.TemporaryDirectory() as model_dir:
    _configure(gin_files, model_dir, args.steps, args.stats)
    bare = bare_loop(args.steps)
    _configure(gin_files, model_dir, args.steps, args.stats)
    full = train_loop(args.steps, args.stats, model_dir)
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "gin_files": gin_files, "steps": args.steps, "devices": str(jax.devices()),
      "bare_steps_per_second": bare, "train_loop_steps_per_second": full,
      "framework_overhead": 1.0 - full / bare,
  }
  os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
  path = os.path.join(HERE, "results", f"overhead-{int(time.time())}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"bare jitted loop      {bare:8.2f} steps/s")
  print(f"train() main loop     {full:8.2f} steps/s")
  print(f"framework overhead    {100 * result['framework_overhead']:7.1f} %   ({path})")


if __name__ == "__main__":
  sys.exit(main())
