"""How long the train loop is blocked by each checkpoint save.

Orbax saves asynchronously, but `Checkpointer.save` still returns only after
its synchronous part (device-to-host copy, directory bookkeeping, dataset
iterator). This runs the gin-configured `train()` once, times every
`Checkpointer.save` call and the final `wait_until_finished`, and compares
the blocked time per save with the mean train step time of the same run,
read from train()'s own `timing/steps_per_second` summaries (first period,
which compiles, excluded). The JSON lands in benchmarks/results/.

  .venv/bin/python benchmarks/checkpoint_blocking.py [--gin_file=...] [--steps=40]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

import gin
from t5lite import checkpoints, cli, metrics
from t5lite import train as train_lib


HERE = os.path.dirname(os.path.abspath(__file__))


def _configure(gin_files: list[str], model_dir: str, steps: int, period: int,
               stats: int) -> None:
  gin.config.clear_config(clear_constants=True)
  # Evaluation only at the end, so no eval time lands inside a timing window.
  bindings = [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}", f"STATS_PERIOD = {stats}",
              f"EVAL_PERIOD = {steps}", f"CHECKPOINT_PERIOD = {period}", "EVAL_STEPS = 1"]
  cli.parse_gin(gin_files, bindings, cli.gin_search_paths([]))


class _SaveTimer:
  """Replaces Checkpointer.save / wait_until_finished with timed versions."""

  def __init__(self):
    self.saves: list[tuple[int, float]] = []  # (step, seconds inside save)
    self.waits: list[float] = []

  def __enter__(self) -> _SaveTimer:
    self._save = checkpoints.Checkpointer.save
    self._wait = checkpoints.Checkpointer.wait_until_finished
    timer = self

    @functools.wraps(self._save)
    def save(checkpointer, step, *args, **kwargs):
      start = time.perf_counter()
      try:
        return timer._save(checkpointer, step, *args, **kwargs)
      finally:
        timer.saves.append((int(step), time.perf_counter() - start))

    @functools.wraps(self._wait)
    def wait(checkpointer):
      start = time.perf_counter()
      try:
        return timer._wait(checkpointer)
      finally:
        timer.waits.append(time.perf_counter() - start)

    checkpoints.Checkpointer.save = save
    checkpoints.Checkpointer.wait_until_finished = wait
    return self

  def __exit__(self, *exc) -> None:
    checkpoints.Checkpointer.save = self._save
    checkpoints.Checkpointer.wait_until_finished = self._wait


def _steps_per_second(model_dir: str) -> dict[int, float]:
  return metrics.read_scalars(os.path.join(model_dir, "train"), "timing/steps_per_second")


def _step_times(rates: dict[int, float], stats: int,
                saves: list[tuple[int, float]]) -> tuple[float, float]:
  """Mean seconds per step over the timing windows after the first.

  A window (s - stats, s] is clocked from the stats write at s - stats, so a
  save made at that step is inside it. Returns (raw, with that save time
  taken out).
  """
  raw, net = [], []
  for step, rate in sorted(rates.items()):
    if step <= stats:  # the first window compiles
      continue
    seconds = stats / rate
    blocked = sum(t for s, t in saves if step - stats <= s < step)
    raw.append(seconds / stats)
    net.append((seconds - blocked) / stats)
  return float(np.mean(raw)), float(np.mean(net))


def run_arguments(doc: str, name: str) -> argparse.ArgumentParser:
  """The flags of a benchmark that trains with periodic checkpoints (this
  one and bucket_checkpoints.py): the run, its period and the JSON's path."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help="gin files (default: the dense headline)")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--checkpoint_period", type=int, default=10)
  parser.add_argument("--output", default=None,
                      help=f"JSON path (default: benchmarks/results/{name}-<time>.json)")
  return parser


def main() -> None:
  parser = run_arguments(__doc__, "checkpoint-blocking")
  parser.add_argument("--stats", type=int, default=10)
  args = parser.parse_args()
  gin_files = args.gin_file or ["gin/pretrain_dense.gin"]
  with tempfile.TemporaryDirectory() as model_dir:
    _configure(gin_files, model_dir, args.steps, args.checkpoint_period, args.stats)
    with _SaveTimer() as timer:
      gin.get_configurable(train_lib.train)()
    rates = _steps_per_second(model_dir)
  raw_step, net_step = _step_times(rates, args.stats, timer.saves)
  blocked = [t for _, t in timer.saves]
  mean_blocked = float(np.mean(blocked))
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "gin_files": gin_files, "steps": args.steps, "checkpoint_period": args.checkpoint_period,
      "stats_period": args.stats, "devices": str(jax.devices()),
      "save_seconds_by_step": {str(s): t for s, t in timer.saves},
      "mean_blocked_seconds_per_save": mean_blocked,
      "final_wait_until_finished_seconds": float(sum(timer.waits)),
      "mean_step_seconds_raw": raw_step,
      "mean_step_seconds_without_saves": net_step,
      "blocked_per_checkpoint_over_step_time": mean_blocked / net_step,
  }
  path = args.output or os.path.join(HERE, "results",
                                     f"checkpoint-blocking-{int(time.time())}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  for step, seconds in timer.saves:
    print(f"save at step {step:5d}           {1000 * seconds:9.1f} ms blocked")
  print(f"mean blocked per save        {1000 * mean_blocked:9.1f} ms")
  final_wait = result["final_wait_until_finished_seconds"]
  print(f"final wait_until_finished    {1000 * final_wait:9.1f} ms")
  print(f"mean step time               {1000 * net_step:9.1f} ms "
        f"({1000 * raw_step:.1f} ms with saves inside the timing windows)")
  print(f"blocked per checkpoint / mean step time  "
        f"{result['blocked_per_checkpoint_over_step_time']:6.2f}   ({path})")


if __name__ == "__main__":
  sys.exit(main())
