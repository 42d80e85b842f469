"""Launch to first training step, with the compilation cache cold and warm.

For each `--gin_file`, `--runs` times: `t5lite-train` with an empty
compilation cache directory (cold), then again with the directory that run
filled (warm, as a restart after preemption is). Each run trains 2 steps
with stats at every step; its first step ends when the step-1 summary is
written, so launch-to-first-step is that event's wall time minus the time
the process was started. The report gives the median of each (all runs in
brackets), warm over cold, and the programs each run loaded from the cache
and compiled (the summary line `t5lite-train` prints). The JSON lands in
benchmarks/results/startup-<time>.json.

  .venv/bin/python benchmarks/startup.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from t5lite import metrics

HERE = os.path.dirname(os.path.realpath(__file__))
# TensorFlow (the event reader here, the data pipeline in the runs) keeps its
# C++ start-up logs to itself, as t5lite's commands make it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
CONFIGS = ("gin/pretrain_dense.gin", "gin/pretrain_moe.gin", "gin/finetune_dense.gin")
_CACHE_USE = re.compile(r"compilation cache \S+: (\d+) program\(s\) loaded, (\d+) compiled")


def first_step_wall_time(model_dir: str) -> float:
  events = metrics.read_scalar_events(os.path.join(model_dir, "train"), "loss")
  return min(wall_time for step, wall_time, _ in events if step == 1)


def launch(gin_file: str, model_dir: str, cache: str, extra: list[str]) -> dict[str, Any]:
  """One 2-step `t5lite-train` run; its launch-to-first-step and cache use."""
  command = [os.path.join(BIN, "t5lite-train"), f"--gin_file={gin_file}", *extra,
             f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=2", "--gin.STATS_PERIOD=1",
             "--gin.EVAL_PERIOD=2", "--gin.EVAL_STEPS=1", "--gin.CHECKPOINT_PERIOD=2",
             f"--compilation_cache_dir={cache}"]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  started = time.time()
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  ended = time.time()
  if done.returncode:
    raise SystemExit(f"t5lite-train exited {done.returncode}:\n{done.stderr[-3000:]}")
  use = _CACHE_USE.search(done.stdout)
  if use is None:
    raise SystemExit(f"no compilation cache line in the output:\n{done.stdout[-2000:]}")
  return {"first_step_seconds": first_step_wall_time(model_dir) - started,
          "total_seconds": ended - started, "loaded": int(use.group(1)),
          "compiled": int(use.group(2))}


def spread(values: list[float]) -> dict[str, Any]:
  return {"median": statistics.median(values), "all": values}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help=f"configs (default: {', '.join(CONFIGS)})")
  parser.add_argument("--extra_gin_file", action="append", default=[],
                      help="gin files added to every config (e.g. a smaller model)")
  parser.add_argument("--runs", type=int, default=2)
  parser.add_argument("--output", default=None)
  args = parser.parse_args()
  started = datetime.datetime.now(datetime.timezone.utc)
  extra = [f"--gin_file={f}" for f in args.extra_gin_file]
  results = {}
  with tempfile.TemporaryDirectory(prefix="t5lite-startup-") as scratch:
    for gin_file in args.gin_file or CONFIGS:
      runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
      for i in range(args.runs):
        cache = os.path.join(scratch, f"cache-{len(results)}-{i}")
        for kind in ("cold", "warm"):
          model_dir = os.path.join(scratch, f"run-{len(results)}-{i}-{kind}")
          runs[kind].append(launch(gin_file, model_dir, cache, extra))
          print(f"{gin_file} {kind}: first step after "
                f"{runs[kind][-1]['first_step_seconds']:.1f} s", flush=True)
      first = {kind: spread([r["first_step_seconds"] for r in runs[kind]]) for kind in runs}
      results[gin_file] = {
          "runs": runs, "first_step_seconds": first,
          "warm_over_cold": first["warm"]["median"] / first["cold"]["median"]}
  info = {"when": started.isoformat(), "args": vars(args), "results": results}
  output = args.output or os.path.join(HERE, "results", f"startup-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(info, f, indent=2)
  print(f"launch to first training step, {args.runs} run(s) each, median (all):")
  for gin_file, r in results.items():
    cold, warm = r["first_step_seconds"]["cold"], r["first_step_seconds"]["warm"]
    text = lambda s: f"{s['median']:.1f} s (" + ", ".join(f"{x:.1f}" for x in s["all"]) + ")"  # noqa: E731
    programs = lambda kind: "/".join(  # noqa: E731
        f"{x['loaded']}+{x['compiled']}" for x in r["runs"][kind])
    print(f"  {gin_file}: cold {text(cold)}, warm {text(warm)}: x{r['warm_over_cold']:.2f}; "
          f"programs loaded+compiled cold {programs('cold')}, warm {programs('warm')}")
  print(f"results: {output}")


if __name__ == "__main__":
  main()
