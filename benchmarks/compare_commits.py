"""Steady training speed of two versions of t5lite, run alternately.

Each version (a commit, or this working tree) is unpacked into a temporary
directory and trained with its own `t5lite-train` for `--steps` steps of
each `--gin_file`, base and head taking turns `--runs` times, so a change in
the machine's load touches both sides alike. A run's speed is the median of
`timing/steps_per_second` over its stats periods, the first one (which holds
the compilation) left out; the report gives, per config and side, the median
over runs with the spread (min - max), the ratio head / base of the medians,
the median and spread of the ratios of each head run to the base run just
before it (which cancels a drift of the machine's speed), and the largest
relative difference between the two sides' training losses, step by step
(the same data and initialisation: equal to float32 rounding unless the
change means to alter the numbers), and each side's peak host memory (the
resident-set high-water mark of its `t5lite-train` processes: median and
spread, and head / base).

  .venv/bin/python benchmarks/compare_commits.py --base=39b9101 \
      --gin_file=gin/pretrain_dense.gin --runs=3

`--head` defaults to the working tree as it is, uncommitted changes
included. Each run ends with one evaluation and one checkpoint (the periods
equal `--steps`), after the measured periods. The JSON lands in
benchmarks/results/compare-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from typing import Any

from t5lite import metrics


HERE = os.path.dirname(os.path.realpath(__file__))
# TensorFlow (the event reader here, the data pipeline in the runs) keeps its
# C++ start-up logs to itself, as t5lite's commands make it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(HERE)
WORKING_TREE = "worktree"


def git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                        text=True).stdout.strip()


def unpack(version: str, into: str) -> tuple[str, str]:
  """A source tree of `version` under `into`, and the commit it is."""
  if version == WORKING_TREE:
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return ROOT, git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")
  commit = git("rev-parse", "--short", version)
  tree = os.path.join(into, commit)
  os.makedirs(tree)
  archive = os.path.join(into, f"{commit}.tar")
  subprocess.run(["git", "archive", "--format=tar", f"--output={archive}", commit], cwd=ROOT,
                 check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(tree, filter="data")
  return tree, commit


def environment(tree: str) -> dict[str, str]:
  """The environment that makes this interpreter import t5lite from `tree`."""
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
  found = subprocess.run([sys.executable, "-c", "import t5lite; print(t5lite.__file__)"],
                         env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
  if not os.path.realpath(found.strip()).startswith(os.path.realpath(tree) + os.sep):
    raise SystemExit(f"t5lite is imported from {found.strip()}, not from {tree}")
  return env


def train_once(tree: str, env: dict[str, str], gin_file: str, args: argparse.Namespace,
               model_dir: str) -> dict[str, Any]:
  """One `t5lite-train` run from `tree`; its steady steps/s and losses."""
  command = [sys.executable, "-c", "from t5lite import cli; cli.train_main()",
             f"--gin_file={gin_file}", f"--gin.MODEL_DIR='{model_dir}'",
             f"--gin.TRAIN_STEPS={args.steps}", f"--gin.STATS_PERIOD={args.stats}",
             f"--gin.EVAL_PERIOD={args.steps}", "--gin.EVAL_STEPS=1",
             f"--gin.CHECKPOINT_PERIOD={args.steps}"]
  log = os.path.join(model_dir + ".log")
  with open(log, "w") as out:
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    # The child's own resource usage: its resident-set high-water mark.
    _, status, usage = os.wait4(proc.pid, 0)
  code = os.waitstatus_to_exitcode(status)
  if code:
    with open(log) as f:
      raise SystemExit(f"t5lite-train from {tree} exited {code}:\n{f.read()[-3000:]}")
  logdir = os.path.join(model_dir, "train")
  rates = metrics.read_scalars(logdir, "timing/steps_per_second")
  steady = [rate for step, rate in sorted(rates.items())][1:]
  if not steady:
    raise SystemExit(f"{gin_file}: no stats period after the first; raise --steps")
  return {"steps_per_second": statistics.median(steady), "periods": steady,
          "peak_host_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
          "loss": {str(k): v for k, v in sorted(metrics.read_scalars(logdir, "loss").items())}}


def largest_relative_difference(a: dict[str, float], b: dict[str, float]) -> float:
  steps = sorted(set(a) & set(b), key=int)
  if not steps:
    return float("nan")
  return max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-30) for s in steps)


def _gib(stats: dict[str, float]) -> str:
  return (f"{stats['median'] / 2**30:.2f} ({stats['min'] / 2**30:.2f} - "
          f"{stats['max'] / 2**30:.2f})")


def summary(rates: Sequence[float]) -> dict[str, float]:
  return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, help="the commit measured against")
  parser.add_argument("--head", default=WORKING_TREE,
                      help=f"a commit, or '{WORKING_TREE}' (default): these files as they are")
  parser.add_argument("--gin_file", action="append", required=True)
  parser.add_argument("--runs", type=int, default=3, help="runs of each side per config")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--stats", type=int, default=10, help="stats period")
  parser.add_argument("--output", default=None)
  args = parser.parse_args()
  if args.runs < 1 or args.steps < 2 * args.stats or args.steps % args.stats:
    raise SystemExit("--runs must be >= 1 and --steps a multiple of --stats, at least twice it")
  started = datetime.datetime.now(datetime.timezone.utc)
  with tempfile.TemporaryDirectory(prefix="t5lite-compare-") as scratch:
    sides = {}
    for side, version in (("base", args.base), ("head", args.head)):
      tree, commit = unpack(version, scratch)
      sides[side] = {"tree": tree, "commit": commit, "env": environment(tree)}
    results: dict[str, Any] = {}
    for c, gin_file in enumerate(args.gin_file):
      runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
      for i in range(args.runs):
        for side in ("base", "head"):
          model_dir = os.path.join(scratch, f"run-{c}-{side}-{i}")
          run = train_once(sides[side]["tree"], sides[side]["env"], gin_file, args, model_dir)
          runs[side].append(run)
          print(f"{gin_file} {side} run {i + 1}: {run['steps_per_second']:.3f} steps/s",
                flush=True)
      stats = {side: summary([r["steps_per_second"] for r in runs[side]]) for side in runs}
      memory = {side: summary([r["peak_host_bytes"] for r in runs[side]]) for side in runs}
      # Each head run over the base run just before it: a drift in the
      # machine's speed over the invocation cancels within a pair.
      pairs = [h["steps_per_second"] / b["steps_per_second"]
               for b, h in zip(runs["base"], runs["head"])]
      results[gin_file] = {
          **stats, "runs": runs,
          "ratio": stats["head"]["median"] / stats["base"]["median"],
          "pair_ratios": {**summary(pairs), "all": pairs},
          "peak_host_bytes": memory,
          "peak_host_ratio": memory["head"]["median"] / memory["base"]["median"],
          "loss_largest_relative_difference": largest_relative_difference(
              runs["base"][0]["loss"], runs["head"][0]["loss"])}
  info = {"when": started.isoformat(), "base": sides["base"]["commit"],
          "head": sides["head"]["commit"], "args": vars(args), "results": results,
          "load_average_end": os.getloadavg()}
  output = args.output or os.path.join(HERE, "results", f"compare-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(info, f, indent=2)
  print(f"base {info['base']}, head {info['head']}, {args.runs} runs each, alternating; "
        f"{args.steps} steps, stats every {args.stats}, first period left out")
  for gin_file, r in results.items():
    b, h = r["base"], r["head"]
    print(f"{gin_file}: base {b['median']:.3f} steps/s ({b['min']:.3f} - {b['max']:.3f}), "
          f"head {h['median']:.3f} ({h['min']:.3f} - {h['max']:.3f}): "
          f"x{r['ratio']:.3f} (pair by pair x{r['pair_ratios']['median']:.3f}, "
          f"{r['pair_ratios']['min']:.3f} - {r['pair_ratios']['max']:.3f}); "
          "losses differ by at most "
          f"{r['loss_largest_relative_difference']:.2e} (relative); peak host memory "
          f"{_gib(r['peak_host_bytes']['base'])} -> {_gib(r['peak_host_bytes']['head'])} GiB "
          f"(x{r['peak_host_ratio']:.3f})")
  print(f"results: {output}")


if __name__ == "__main__":
  main()
