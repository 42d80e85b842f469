"""The dry run's memory estimate against what the compiled step allocates.

For each `--gin_file` (by default the two pretraining configs) and each
variant (as configured, `scan_layers`, `remat_policy='full'`, both), the
per-device total that `t5lite-train --dry_run` prints (parameters,
gradients, optimizer state, activations kept for the backward pass) is set
beside the memory of the compiled training step on one device, as XLA's
`memory_analysis()` of the executable reports it: arguments (parameters,
optimizer state, batch) plus temporaries (activations, gradients, XLA's own
scratch) plus outputs not aliased to an argument. The report gives the
estimate over the compiled figure, which the dry run aims to keep within
`--tolerance` (25 %). The JSON lands in benchmarks/results/memory-<time>.json.

  .venv/bin/python benchmarks/memory.py [--gin_file=gin/pretrain_dense.gin]...
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
from typing import Any

import jax

import gin
from t5lite import cli, dry_run, state_init
from t5lite import train as train_lib


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = ("gin/pretrain_dense.gin", "gin/pretrain_moe.gin")
VARIANTS = {
    "as configured": [],
    "scan_layers": ["transformer.TransformerConfig.scan_layers = True"],
    "remat full": ["transformer.TransformerConfig.remat_policy = 'full'"],
    "scan_layers + remat full": ["transformer.TransformerConfig.scan_layers = True",
                                 "transformer.TransformerConfig.remat_policy = 'full'"],
}


def measure(gin_file: str, bindings: list[str]) -> dict[str, Any]:
  """The dry run's per-device estimate and the compiled step's allocation."""
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin([gin_file], ["MODEL_DIR = '/nonexistent/t5lite-memory-benchmark'", *bindings],
                cli.gin_search_paths([]))
  kwargs = gin.get_bindings(train_lib.train)
  report = dry_run.run(io.StringIO(), **kwargs)
  model, partitioner = kwargs["model"], kwargs["partitioner"]
  cfg = kwargs["train_dataset_cfg"]
  shapes, types = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
  specs, _ = state_init.state_specs(model, partitioner, shapes, types)
  # The global batch of one step (the executable's figures are per device;
  # with microbatches it keeps one microbatch's activations at a time).
  batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, *s[1:]), types[k])
           for k, s in shapes.items()}
  trainer = kwargs["trainer_cls"](model=model, partitioner=partitioner)
  step = trainer.compile_train_step(specs.shardings, partitioner.batch_shardings(shapes))
  analysis = step.lower(specs.abstract, batch).compile().memory_analysis()
  compiled = {"arguments": analysis.argument_size_in_bytes,
              "temporaries": analysis.temp_size_in_bytes,
              "outputs": analysis.output_size_in_bytes,
              "aliased": analysis.alias_size_in_bytes}
  compiled["total"] = (compiled["arguments"] + compiled["temporaries"] + compiled["outputs"]
                       - compiled["aliased"])
  m = report.memory
  estimate = {"parameters": m.params, "gradients": m.gradients, "optimizer": m.optimizer,
              "activations": m.activations, "total": m.total}
  return {"examples_per_device": m.examples_per_device, "estimate": estimate, "compiled": compiled,
          "ratio": estimate["total"] / compiled["total"]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help=f"default: {', '.join(CONFIGS)}")
  parser.add_argument("--variant", action="append", default=None, choices=list(VARIANTS),
                      help="default: all")
  parser.add_argument("--tolerance", type=float, default=0.25)
  parser.add_argument("--output", default=None)
  args = parser.parse_args()
  os.chdir(ROOT)
  started = datetime.datetime.now(datetime.timezone.utc)
  results: dict[str, dict[str, Any]] = {}
  print(f"{'config':28s} {'variant':26s} {'estimate':>10s} {'compiled':>10s}  ratio")
  for gin_file in args.gin_file or CONFIGS:
    results[gin_file] = {}
    for variant in args.variant or VARIANTS:
      r = measure(gin_file, VARIANTS[variant])
      r["within_tolerance"] = abs(r["ratio"] - 1) <= args.tolerance
      results[gin_file][variant] = r
      print(f"{gin_file:28s} {variant:26s} {dry_run.format_bytes(r['estimate']['total']):>10s} "
            f"{dry_run.format_bytes(r['compiled']['total']):>10s}  {r['ratio']:.3f}"
            + ("" if r["within_tolerance"] else f"  (off by more than {args.tolerance:.0%})"),
            flush=True)
  info = {"when": started.isoformat(), "backend": jax.default_backend(),
          "devices": len(jax.devices()), "tolerance": args.tolerance, "results": results}
  output = args.output or os.path.join(HERE, "results", f"memory-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(info, f, indent=2)
  print(f"results: {output}")


if __name__ == "__main__":
  main()
