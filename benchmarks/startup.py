"""Launch to first training step: cold, warm, and a restart from a checkpoint.

For each `--gin_file`, `--runs` times, three launches of the same command
(4 training steps, 2 per launch, stats at every step, a checkpoint at step 2):

  cold     an empty compilation cache directory and a new MODEL_DIR: every
           program compiles and the state is initialised;
  warm     the cache that run filled and another new MODEL_DIR: the second
           launch of a configuration;
  restart  the cache and the cold run's MODEL_DIR: a restart after
           preemption, which resumes from the step-2 checkpoint (no saved
           data iterator, so the pipeline is fast-forwarded).

A launch's first step ends when that step's summary is written, so
launch-to-first-step is the event's wall time minus the time the process
was started. The report gives the median of each (all runs in brackets),
warm and restart over cold, and the programs each launch loaded from the
cache and compiled (the summary line `t5lite-train` prints; a "p" after
them where a version before 2026-12-05 loaded its training pipeline from
its store). The JSON lands
in benchmarks/results/startup-<time>.json.

  .venv/bin/python benchmarks/startup.py

With `--version` (repeatable: a git revision, or `worktree` for this tree
as it is, uncommitted changes included), warm launches of those versions
are measured instead, taking turns: each revision is checked out with
`git worktree add --detach` into a temporary directory and launched with
PYTHONPATH pointing at it (its own gin files, from its directory); each
version first fills its own cache with one cold launch, then each of the
`--runs` rounds makes one warm launch of every version, in the order
given, so a change in the machine's load touches all alike. The report
gives each version's median warm launch (all runs in brackets) and its
ratio to the first version's; the temporary checkouts are removed at the
end.

  .venv/bin/python benchmarks/startup.py --version=c71d552 --version=worktree \
      --gin_file=gin/pretrain_moe.gin --runs=5
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from t5lite import metrics


HERE = os.path.dirname(os.path.realpath(__file__))
# TensorFlow (the event reader here, the data pipeline in the runs) keeps its
# C++ start-up logs to itself, as t5lite's commands make it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
CONFIGS = ("gin/pretrain_dense.gin", "gin/pretrain_moe.gin", "gin/finetune_dense.gin")
WORKING_TREE = "worktree"
# Versions before 2026-12-05 also say how many training pipelines they loaded.
_CACHE_USE = re.compile(r"compilation cache \S+: (\d+) program\(s\) loaded, (\d+) compiled"
                        r"(?:, (\d+) data pipeline\(s\) loaded)?")


KINDS = ("cold", "warm", "restart")


def first_step_wall_time(model_dir: str, step: int) -> float:
  events = metrics.read_scalar_events(os.path.join(model_dir, "train"), "loss")
  return min(wall_time for s, wall_time, _ in events if s == step)


def launch(gin_file: str, model_dir: str, cache: str, extra: list[str],
           first_step: int = 1, tree: str = ROOT) -> dict[str, Any]:
  """One `t5lite-train` launch training 2 of 4 steps; its launch-to-first-step
  and cache use.

  Args:
    gin_file / extra: the config, and gin files added to it.
    model_dir / cache: MODEL_DIR and the compilation cache directory.
    first_step: the step whose summary marks the first step's end.
    tree: the source tree whose t5lite (and gin files) the launch uses.
  """
  command = [os.path.join(BIN, "t5lite-train"), f"--gin_file={gin_file}", *extra,
             f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=4",
             "--gin.train_lib.train.relative_steps=2", "--gin.STATS_PERIOD=1",
             "--gin.EVAL_PERIOD=2", "--gin.EVAL_STEPS=1", "--gin.CHECKPOINT_PERIOD=2",
             f"--compilation_cache_dir={cache}"]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  if tree != ROOT:
    env["PYTHONPATH"] = tree
  started = time.time()
  done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
  ended = time.time()
  if done.returncode:
    raise SystemExit(f"t5lite-train exited {done.returncode}:\n{done.stderr[-3000:]}")
  use = _CACHE_USE.search(done.stdout)
  if use is None:
    raise SystemExit(f"no compilation cache line in the output:\n{done.stdout[-2000:]}")
  return {"first_step_seconds": first_step_wall_time(model_dir, first_step) - started,
          "total_seconds": ended - started, "loaded": int(use.group(1)),
          "compiled": int(use.group(2)), "pipelines_loaded": int(use.group(3) or 0)}


def spread(values: list[float]) -> dict[str, Any]:
  return {"median": statistics.median(values), "all": values}


def write_results(args: argparse.Namespace, started: datetime.datetime,
                  results: dict[str, Any]) -> str:
  info = {"when": started.isoformat(), "args": vars(args), "results": results}
  output = args.output or os.path.join(HERE, "results", f"startup-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(info, f, indent=2)
  return output


def git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                        text=True).stdout.strip()


@contextlib.contextmanager
def checkouts(versions: list[str], scratch: str) -> Iterator[dict[str, tuple[str, str]]]:
  """Each version's source tree and commit: this tree for `worktree`, else
  a detached `git worktree` under `scratch`, removed on leaving."""
  trees, added = {}, []
  try:
    for version in versions:
      if version == WORKING_TREE:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        trees[version] = (ROOT, git("rev-parse", "--short", "HEAD")
                          + (" + uncommitted changes" if dirty else ""))
        continue
      commit = git("rev-parse", "--short", f"{version}^{{commit}}")
      tree = os.path.join(scratch, f"tree-{commit}")
      git("worktree", "add", "--detach", tree, commit)
      added.append(tree)
      trees[version] = (tree, commit)
    yield trees
  finally:
    for tree in added:
      subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT,
                     capture_output=True, check=False)


def compare_warm(gin_file: str, trees: dict[str, tuple[str, str]], extra: list[str],
                 runs: int, scratch: str, tag: int) -> dict[str, Any]:
  """Warm launches of `gin_file` by each version, taking turns (see the
  module's docstring); `tag` tells this config's directories in `scratch`
  from the others'."""
  result: dict[str, Any] = {v: {"commit": commit, "warm": []} for v, (_, commit) in trees.items()}
  for j, (version, (tree, _)) in enumerate(trees.items()):
    cache = os.path.join(scratch, f"cache-{tag}-{j}")
    result[version]["cache"] = cache
    result[version]["cold"] = launch(gin_file, os.path.join(scratch, f"run-{tag}-{j}-cold"),
                                     cache, extra, tree=tree)
  for i in range(runs):
    for j, (version, (tree, _)) in enumerate(trees.items()):
      run = launch(gin_file, os.path.join(scratch, f"run-{tag}-{j}-warm-{i}"),
                   result[version]["cache"], extra, tree=tree)
      result[version]["warm"].append(run)
      print(f"{gin_file} {version} warm: first step after {run['first_step_seconds']:.1f} s",
            flush=True)
  first = None
  for version in trees:
    r = result[version]
    r["warm_seconds"] = spread([x["first_step_seconds"] for x in r["warm"]])
    first = first or r["warm_seconds"]["median"]
    r["warm_over_first_version"] = r["warm_seconds"]["median"] / first
  return result


def print_comparison(results: dict[str, Any], runs: int) -> None:
  print(f"warm launch to first training step, {runs} run(s) each, taking turns; median (all):")
  for gin_file, by_version in results.items():
    print(f"  {gin_file}:")
    for version, r in by_version.items():
      seconds = r["warm_seconds"]
      programs = "/".join(f"{x['loaded']}+{x['compiled']}" + ("p" * x["pipelines_loaded"])
                          for x in r["warm"])
      print(f"    {version} ({r['commit']}): {seconds['median']:.2f} s ("
            + ", ".join(f"{x:.2f}" for x in seconds["all"])
            + f") x{r['warm_over_first_version']:.3f}; programs loaded+compiled {programs}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help=f"configs (default: {', '.join(CONFIGS)})")
  parser.add_argument("--extra_gin_file", action="append", default=[],
                      help="gin files added to every config (e.g. a smaller model)")
  parser.add_argument("--runs", type=int, default=2)
  parser.add_argument("--output", default=None)
  parser.add_argument("--version", action="append", default=[],
                      help="a git revision, or 'worktree' (this tree): warm launches of "
                           "each, taking turns (repeatable)")
  args = parser.parse_args()
  if len(set(args.version)) != len(args.version):
    parser.error(f"--version given twice: {args.version}")
  started = datetime.datetime.now(datetime.timezone.utc)
  extra = [f"--gin_file={f}" for f in args.extra_gin_file]
  results = {}
  if args.version:
    with tempfile.TemporaryDirectory(prefix="t5lite-startup-") as scratch:
      with checkouts(args.version, scratch) as trees:
        for gin_file in args.gin_file or CONFIGS:
          results[gin_file] = compare_warm(gin_file, trees, extra, args.runs, scratch,
                                           len(results))
    output = write_results(args, started, results)
    print_comparison(results, args.runs)
    print(f"results: {output}")
    return
  with tempfile.TemporaryDirectory(prefix="t5lite-startup-") as scratch:
    for gin_file in args.gin_file or CONFIGS:
      runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
      for i in range(args.runs):
        cache = os.path.join(scratch, f"cache-{len(results)}-{i}")
        cold_dir = os.path.join(scratch, f"run-{len(results)}-{i}-cold")
        dirs = {"cold": cold_dir, "warm": os.path.join(scratch, f"run-{len(results)}-{i}-warm"),
                "restart": cold_dir}
        for kind in KINDS:
          first = 3 if kind == "restart" else 1
          runs[kind].append(launch(gin_file, dirs[kind], cache, extra, first))
          print(f"{gin_file} {kind}: first step after "
                f"{runs[kind][-1]['first_step_seconds']:.1f} s", flush=True)
      first = {kind: spread([r["first_step_seconds"] for r in runs[kind]]) for kind in runs}
      results[gin_file] = {
          "runs": runs, "first_step_seconds": first,
          "warm_over_cold": first["warm"]["median"] / first["cold"]["median"],
          "restart_over_cold": first["restart"]["median"] / first["cold"]["median"]}
  output = write_results(args, started, results)
  print(f"launch to first training step, {args.runs} run(s) each, median (all):")
  for gin_file, r in results.items():
    text = lambda s: f"{s['median']:.1f} s (" + ", ".join(f"{x:.1f}" for x in s["all"]) + ")"  # noqa: E731
    programs = lambda kind, r=r: "/".join(  # noqa: E731
        f"{x['loaded']}+{x['compiled']}" + ("p" * x.get("pipelines_loaded", 0))
        for x in r["runs"][kind])
    seconds = r["first_step_seconds"]
    print(f"  {gin_file}: cold {text(seconds['cold'])}, warm {text(seconds['warm'])} "
          f"x{r['warm_over_cold']:.2f}, restart {text(seconds['restart'])} "
          f"x{r['restart_over_cold']:.2f}; programs loaded+compiled (p: the training "
          "pipeline loaded from a store) "
          + ", ".join(f"{kind} {programs(kind)}" for kind in KINDS))
  print(f"results: {output}")


if __name__ == "__main__":
  main()
