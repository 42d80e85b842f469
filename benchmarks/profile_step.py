"""Where the time of one training step goes, by XLA operation.

Compiles the train step of a gin config (as `benchmarks/run.py` does), runs
a few steps under `jax.profiler.trace`, and sums the device (on the CPU:
XLA worker thread) time of every compiled operation. Operations are grouped
into matmuls (fusions containing a dot), copies/transposes and everything
else (elementwise work, reductions, gathers), and the slowest are listed
with the model operation they come from (`op_name` metadata).

  .venv/bin/python benchmarks/profile_step.py [--gin_file=gin/benchmarks/dense.gin] [--top=25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

import jax


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run as bench  # noqa: E402  (the benchmark's own model and step builder)


# Profiler lines that wrap whole executions rather than single operations.
_WRAPPERS = ("ThunkExecutor", "Await", "wait for completion")


def op_times(trace_dir: str) -> collections.Counter:
  """Milliseconds per XLA operation name, summed over the trace's XLA lines."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  space = xplane_pb2.XSpace()
  with open(path, "rb") as f:
    space.ParseFromString(f.read())
  times = collections.Counter()
  for plane in space.planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      if "XLA" not in line.name and "Stream" not in line.name:
        continue
      for event in line.events:
        name = names.get(event.metadata_id, "")
        if name and not any(w in name for w in _WRAPPERS):
          times[name] += event.duration_ps / 1e9
  return times


def describe_ops(hlo_text: str) -> dict[str, tuple[str, str, str]]:
  """Operation name -> (kind, result shape, model op) from compiled HLO text."""
  bodies, current = {}, None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      current = line.split()[0].lstrip("%")
      bodies[current] = []
    elif current:
      bodies[current].append(line)
  described = {}
  pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (\w+)\(")
  for line in hlo_text.splitlines():
    match = pattern.match(line)
    if not match or match.group(1) in described:
      continue
    name, shape, opcode = match.groups()
    called = re.search(r"calls=%?([\w.\-]+)", line)
    ops = set(re.findall(r"= \S+ (\w+)\(", "\n".join(bodies.get(called.group(1), []))
                         if called else ""))
    ops.add(opcode)
    if ops & {"dot", "convolution"}:
      kind = "matmul"
    elif ops <= {"copy", "transpose", "bitcast", "parameter", "reshape", "fusion"}:
      kind = "copy/transpose"
    else:
      kind = "other"
    op_name = re.search(r'op_name="([^"]+)"', line)
    described[name] = (kind, shape.split("{")[0], op_name.group(1) if op_name else "")
  return described


def phase(op_name: str) -> str:
  """Forward pass, backward pass, or the rest (optimizer, loss, metrics)."""
  if "transpose(jvp(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "optimizer/rest"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", default="gin/benchmarks/dense.gin")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--binding", action="append", default=[],
                      help="extra gin bindings, e.g. transformer.TransformerConfig.dtype='float32'")
  args = parser.parse_args()
  os.chdir(bench.ROOT)
  bench.configure(args.gin_file, tempfile.gettempdir(), 1, 1, args.binding)
  bare = bench.BareLoop()
  hlo = bare.step.lower(bare.state, bare.batch).compile().as_text()
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir):
      bare.run(args.steps)
    wall = (time.perf_counter() - start) / args.steps
    times = op_times(trace_dir)
  described = describe_ops(hlo)
  total = sum(times.values())
  by_kind, by_phase = collections.Counter(), collections.Counter()
  for name, ms in times.items():
    kind, _, op_name = described.get(name, ("other", "", ""))
    by_kind[kind] += ms
    by_phase[phase(op_name)] += ms
  print(f"{args.gin_file}: {wall:.3f} s per step (traced), {total / args.steps:.0f} ms of "
        f"operation time per step summed over threads; model {bare.flops_per_step / 1e9:.1f} "
        "GFLOP per step")
  for kind, ms in by_kind.most_common():
    print(f"  {kind:15s} {100 * ms / total:5.1f} %")
  for name, ms in by_phase.most_common():
    print(f"  {name:15s} {100 * ms / total:5.1f} %")
  print(f"slowest {args.top} operations (ms per step, share, result shape, model op):")
  for name, ms in times.most_common(args.top):
    kind, shape, op_name = described.get(name, ("?", "", ""))
    print(f"  {ms / args.steps:7.1f} {100 * ms / total:5.1f} %  {kind:14s} {shape:28s} "
          f"{op_name[-90:]}")


if __name__ == "__main__":
  main()
