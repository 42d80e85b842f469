"""What each speed feature buys: step time and activation memory, on and off.

Starts from a benchmark config (gin/benchmarks/dense.gin by default) and
changes one gin switch at a time: the activation dtype, scan over layers,
each remat policy, the attention implementation. For each variant it
reports the bare-loop step time (fastest of a few blocks, as in
benchmarks/run.py, with the process CPU time per step, which other
processes on the machine do not change) and the compiled step's temporary
buffer size, which is where activations kept for the backward pass live.
Prefetching is a property of the `train()` loop, so its variant compares the
framework overhead of `train()` with `prefetch_batches` 0 and 2.

  .venv/bin/python benchmarks/features.py [--gin_file=gin/benchmarks/dense.gin]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run as bench  # noqa: E402


CONFIG = "transformer.TransformerConfig"
# name -> gin bindings applied on top of the config.
VARIANTS = {
    "as configured": [],
    "dtype float32": [f"{CONFIG}.dtype = 'float32'"],
    "dtype bfloat16": [f"{CONFIG}.dtype = 'bfloat16'"],
    "scan_layers": [f"{CONFIG}.scan_layers = True"],
    "remat full": [f"{CONFIG}.remat_policy = 'full'"],
    "remat dots_saveable": [f"{CONFIG}.remat_policy = 'dots_saveable'"],
    "scan_layers + remat full": [f"{CONFIG}.scan_layers = True",
                                 f"{CONFIG}.remat_policy = 'full'"],
    "scan_layers + remat dots_saveable": [f"{CONFIG}.scan_layers = True",
                                          f"{CONFIG}.remat_policy = 'dots_saveable'"],
    "attention xla": [f"{CONFIG}.attention_impl = 'xla'"],
    "attention dot_product_attention": [f"{CONFIG}.attention_impl = 'dot_product_attention'"],
}


def measure_step(gin_file: str, bindings: list[str], steps: int, blocks: int) -> dict:
  """Bare-loop step time, CPU time and compiled temporary memory of a variant."""
  bench.configure(gin_file, tempfile.gettempdir(), 1, 1, bindings)
  bare = bench.BareLoop()
  memory = bare.step.lower(bare.state, bare.batch).compile().memory_analysis()
  runs = [bare.run(steps) for _ in range(blocks)]
  rate = max(r[0] for r in runs)
  return {"step_seconds": 1 / rate, "cpu_seconds_per_step": min(r[1] for r in runs),
          "mfu_flops_per_second": bare.flops_per_step * rate,
          "temp_bytes": getattr(memory, "temp_size_in_bytes", None)}


def measure_prefetch(gin_file: str, depth: int, steps: int) -> dict:
  """train() loop against the bare loop with `prefetch_batches = depth`."""
  args = argparse.Namespace(steps=steps, stats=max(1, min(10, steps // 3)), bare_steps=10,
                            pipeline_batches=20,
                            compile_depths=[], memory_steps=0)
  binding = [f"train_lib.train.prefetch_batches = {depth}"]
  configure = bench.configure
  bench.configure = lambda g, m, s, st, extra=(): configure(g, m, s, st, [*extra, *binding])
  try:
    r = bench.bench_config(gin_file, args)
  finally:
    bench.configure = configure
  return {k: r[k] for k in ("framework_overhead", "framework_overhead_of_medians",
                            "cpu_overhead", "bare_steps_per_second",
                            "train_loop_steps_per_second")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", default="gin/benchmarks/dense.gin")
  parser.add_argument("--steps", type=int, default=4, help="steps per timed block")
  parser.add_argument("--blocks", type=int, default=3)
  parser.add_argument("--train_steps", type=int, default=60,
                      help="train() steps of each prefetch variant; 0 skips them")
  parser.add_argument("--variant", action="append", choices=list(VARIANTS), default=None,
                      help="measure only these variants (default: all)")
  parser.add_argument("--output", default=None)
  args = parser.parse_args()
  os.chdir(bench.ROOT)
  import tensorflow as tf
  tf.config.set_visible_devices([], "GPU")
  started = datetime.datetime.now(datetime.timezone.utc)
  result = {"when": started.isoformat(), "commit": bench.git_commit(),
            "machine": bench.machine(), "gin_file": args.gin_file,
            "load_average_start": os.getloadavg(), "variants": {}}
  print(f"{args.gin_file}, commit {result['commit']}, {started:%Y-%m-%d %H:%M} UTC, load "
        f"average {result['load_average_start'][0]:.1f}")
  print(f"{'variant':34s} {'step s':>8s} {'CPU s/step':>11s} {'GFLOP/s':>8s} {'temp MiB':>9s}")
  for name in args.variant or VARIANTS:
    bindings = VARIANTS[name]
    r = measure_step(args.gin_file, bindings, args.steps, args.blocks)
    result["variants"][name] = r
    temp = f"{r['temp_bytes'] / 2**20:9.0f}" if r["temp_bytes"] is not None else "        ?"
    print(f"{name:34s} {r['step_seconds']:8.3f} {r['cpu_seconds_per_step']:11.3f} "
          f"{r['mfu_flops_per_second'] / 1e9:8.1f} {temp}", flush=True)
  if args.train_steps:
    for depth in (0, 2):
      r = measure_prefetch(args.gin_file, depth, args.train_steps)
      result["variants"][f"prefetch_batches {depth}"] = r
      print(f"train() with prefetch_batches={depth}: framework overhead "
            f"{100 * r['framework_overhead']:.1f} % (of medians "
            f"{100 * r['framework_overhead_of_medians']:.1f} %, CPU time per step "
            f"{100 * r['cpu_overhead']:+.1f} %)", flush=True)
  result["load_average_end"] = os.getloadavg()
  output = args.output or os.path.join(HERE, "results",
                                       f"features-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(result, f, indent=2)
  print(f"load average {result['load_average_end'][0]:.1f} at the end; results: {output}")


if __name__ == "__main__":
  main()
