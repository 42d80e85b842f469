"""Training performance report: MFU, framework overhead, input pipeline,
compile time and host memory, for each benchmark config, in one run.

For every gin file (by default gin/benchmarks/dense.gin and moe.gin):

  (a) model FLOPs utilisation: the model's FLOPs per training step
      (`BaseModel.train_flops_per_step`, 3 x the forward matmuls; see
      docs/performance.md) over the step time of a bare loop, divided by the
      peak matmul FLOP/s of the dtype the model computes in, measured in the
      same run (best jitted square matmul of 1024, 2048 and 4096 run as the
      model runs it: float32, or bfloat16 inputs with float32 results on a
      CPU; measured before and after every config, the fastest kept);
  (b) framework overhead: 1 - steps/s of the real `train()` main loop (data
      pipeline, prefetching, metrics, summaries, console) over steps/s of
      a bare loop calling the same compiled step on one resident batch. The
      bare loop runs in blocks before and after `train()`; as with `timeit`,
      the fastest block and the fastest stats period of `train()` are
      compared, since other processes only ever slow either down (the ratio
      of medians and the change in process CPU time per step, which other
      processes do not change, are recorded too);
  (c) input pipeline: token positions per second the SeqIO pipeline builds
      (device transfer included, nothing else running) over those the
      `train()` loop consumes;
  (d) compile time of the train step against depth, with and without
      `scan_layers`, in a fresh process without the persistent cache;
  (e) peak host memory (resident set high-water mark) of a `t5lite-train`
      run of the config in a subprocess.

Other processes on the machine change every figure: the load average is
recorded at the start and end of each config. The JSON lands in
benchmarks/results/bench-<time>.json.

  .venv/bin/python benchmarks/run.py [--gin_file=...]... [--steps=60]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gin
from t5lite import cli, feeder, state_init
from t5lite import train as train_lib
from t5lite.models import layers
from t5lite.train_state import TrainState


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = ("gin/benchmarks/dense.gin", "gin/benchmarks/moe.gin")
# The dtypes models compute in, each with its own matmul peak.
COMPUTE_DTYPES = ("float32", "bfloat16")
# Targets on the 2-core CPU (docs/performance.md).
TARGETS = {"gin/benchmarks/dense.gin": 0.40, "gin/benchmarks/moe.gin": 0.25}
MAX_OVERHEAD, MIN_PIPELINE_RATIO = 0.03, 5.0


# ---------------------------------------------------------------------------
# Machine


def machine() -> dict[str, Any]:
  """CPU model, core count and platform, for the record."""
  model = platform.processor()
  try:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), model)
  except OSError:
    pass
  return {"cpu_model": model, "nproc": os.cpu_count(), "devices": str(jax.devices()),
          "jax": jax.__version__, "python": platform.python_version()}


def git_commit() -> str:
  out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True, check=False)
  return out.stdout.strip() or "unknown"


def _matmul_rate(n: int, dtype: str, repeats: int, result_dtype: str | None = None) -> float:
  """Best FLOP/s of a jitted `n` x `n` matmul (a few calls back to back on
  an accelerator, so that the launch latency does not count)."""
  calls = 1 if jax.default_backend() == "cpu" else 20
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=result_dtype))
  matmul(a, a).block_until_ready()  # compile
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = matmul(a, a)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - start) / calls)
  return 2 * n**3 / best


def matmul_peak(sizes: Sequence[int] = (1024, 2048, 4096), repeats: int = 5) -> dict[str, Any]:
  """The MFU denominators: best FLOP/s of jitted square `x @ y` over sizes,
  for each dtype a model computes in, run as the models run it: float32,
  and bfloat16 inputs with the result dtype `layers.einsum` asks for on this
  backend (float32 on a CPU, whose AVX512-BF16 kernels need it; bfloat16 on
  GPUs and TPUs).
  """
  rates = {f"{dtype} {n}": _matmul_rate(n, dtype, repeats,
                                        layers.accumulation_dtype(jnp.dtype(dtype)))
           for dtype in COMPUTE_DTYPES for n in sizes}
  return {"all": rates, **_by_dtype(rates)}


def _by_dtype(rates: Mapping[str, float]) -> dict[str, Any]:
  best = {dtype: max((k for k in rates if k.split()[0] == dtype), key=rates.get)
          for dtype in COMPUTE_DTYPES}
  return {"flops_per_second": {dtype: rates[k] for dtype, k in best.items()}, "best": best}


# ---------------------------------------------------------------------------
# One config


def configure(gin_file: str, model_dir: str, steps: int, stats: int,
              extra: Sequence[str] = ()) -> None:
  """Parses the config without evaluation or checkpoints: they would only
  run after the last timing window (benchmarks/checkpoint_blocking.py
  measures what a checkpoint costs the loop)."""
  gin.config.clear_config(clear_constants=True)
  bindings = [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}", f"STATS_PERIOD = {stats}",
              "EVAL_PERIOD = 0", "checkpoints.CheckpointConfig.save = None", *extra]
  cli.parse_gin([gin_file], bindings, cli.gin_search_paths([]))


def _objects() -> tuple[Any, Any, Any, Any]:
  """The gin-configured model, partitioner, training data config and trainer."""
  def get(name):
    return gin.query_parameter(f"train_lib.train.{name}").scoped_configurable_fn()
  model, partitioner, train_cfg = get("model"), get("partitioner"), get("train_dataset_cfg")
  trainer = gin.query_parameter("train_lib.train.trainer_cls").scoped_configurable_fn(
      model=model, partitioner=partitioner)
  return model, partitioner, train_cfg, trainer


def _tokens_per_batch(batch: Mapping[str, Any]) -> int:
  """Token positions of a batch: encoder inputs plus decoder targets."""
  keys = ("encoder_input_tokens", "decoder_target_tokens")
  return int(sum(np.prod(batch[k].shape) for k in keys if k in batch))


class BareLoop:
  """The compiled train step on one resident batch, nothing else."""

  def __init__(self):
    model, partitioner, train_cfg, trainer = _objects()
    specs, init_fn = state_init.state_specs(
        model, partitioner,
        *model.input_shapes_and_types(train_cfg.task_feature_lengths, train_cfg.pack))
    self.state: TrainState = partitioner.partition(init_fn, None, specs.shardings)(
        jax.random.key(0))
    self.batch = next(feeder.TrainData(model, train_cfg, partitioner, prefetch_batches=0))
    self.num_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.state.params)))
    shapes = {k: v.shape for k, v in self.batch.items()}
    self.flops_per_step = model.train_flops_per_step(shapes)
    self.compute_dtype = model.compute_dtype()
    self.tokens_per_batch = _tokens_per_batch(self.batch)
    self.step = trainer.compile_train_step(specs.shardings,
                                           {k: v.sharding for k, v in self.batch.items()})
    self.run(2)  # compile and warm up

  def run(self, steps: int) -> tuple[float, float]:
    """Steps/s and process CPU seconds per step of `steps` back-to-back
    steps (dispatch runs ahead, as in train())."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return steps / (time.perf_counter() - wall), (time.process_time() - cpu) / steps


def train_loop(steps: int) -> tuple[list[float], list[float]]:
  """Steps/s and process CPU seconds per step of each stats period of a real
  train() run, the first (which compiles) left out.

  The clocks are read where train() reads its own (when it writes stats).
  """
  marks = []
  write_stats = train_lib._write_stats

  def timed_write_stats(loop, step, pending):
    stop = write_stats(loop, step, pending)
    marks.append((step, time.perf_counter(), time.process_time()))
    return stop

  train_lib._write_stats = timed_write_stats
  try:
    gin.get_configurable(train_lib.train)()
  finally:
    train_lib._write_stats = write_stats
  periods = list(zip(marks, marks[1:]))
  return ([(b[0] - a[0]) / (b[1] - a[1]) for a, b in periods],
          [(b[2] - a[2]) / (b[0] - a[0]) for a, b in periods])


def pipeline_rate(batches: int) -> float:
  """Batches/s the training input pipeline builds, device transfer included."""
  model, partitioner, train_cfg, _ = _objects()
  data = feeder.TrainData(model, train_cfg, partitioner, prefetch_batches=0)
  for _ in range(3):  # start tf.data's threads and buffers
    next(data)
  start = time.perf_counter()
  for _ in range(batches):
    next(data)
  return batches / (time.perf_counter() - start)


def compile_seconds(gin_file: str, layers: int, scan: bool) -> tuple[float, float]:
  """Wall and CPU seconds to trace, lower and compile the train step at a
  depth (nothing is initialised). CPU time is what other processes on the
  machine do not change."""
  configure(gin_file, tempfile.gettempdir(), 1, 1, [
      f"transformer.TransformerConfig.num_encoder_layers = {layers}",
      f"transformer.TransformerConfig.num_decoder_layers = {layers}",
      f"transformer.TransformerConfig.scan_layers = {scan}"])
  model, partitioner, train_cfg, trainer = _objects()
  shapes, types = model.input_shapes_and_types(train_cfg.task_feature_lengths, train_cfg.pack)
  specs, _ = state_init.state_specs(model, partitioner, shapes, types)
  shardings = partitioner.batch_shardings(shapes)
  batch = {k: jax.ShapeDtypeStruct((train_cfg.batch_size,) + s[1:], types[k],
                                   sharding=shardings[k]) for k, s in shapes.items()}
  step = trainer.compile_train_step(specs.shardings, {k: v.sharding for k, v in batch.items()})
  wall, cpu = time.perf_counter(), time.process_time()
  step.lower(specs.abstract, batch).compile()
  return time.perf_counter() - wall, time.process_time() - cpu


def compile_sweep(gin_file: str, depths: Sequence[int]) -> dict[str, dict[str, dict[int, float]]]:
  """Compile seconds by clock ('wall', 'cpu'), layout ('unscanned',
  'scanned') and depth."""
  out = {clock: {"unscanned": {}, "scanned": {}} for clock in ("wall", "cpu")}
  compile_seconds(gin_file, depths[0], False)  # the first compile also warms XLA up
  for depth in depths:
    for layout in ("unscanned", "scanned"):
      wall, cpu = compile_seconds(gin_file, depth, layout == "scanned")
      out["wall"][layout][depth], out["cpu"][layout][depth] = wall, cpu
  return out


def compile_sweep_in_subprocess(gin_file: str, depths: Sequence[int]) -> dict[str, Any]:
  """`compile_sweep` in a fresh process without JAX's persistent cache,
  which would turn compiles into lookups (and cannot be turned off once
  used)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  command = [sys.executable, os.path.abspath(__file__), "--compile_sweep_only",
             f"--gin_file={gin_file}", f"--compile_depths={','.join(map(str, depths))}"]
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"compile sweep failed:\n{out.stderr[-2000:]}")
  result = json.loads(out.stdout.strip().splitlines()[-1])
  return {clock: {layout: {int(d): t for d, t in times.items()} for layout, times in v.items()}
          for clock, v in result.items()}


def peak_host_memory(gin_file: str, steps: int) -> float:
  """Resident-set high-water mark, in bytes, of a `t5lite-train` run."""
  with tempfile.TemporaryDirectory() as model_dir:
    command = [os.path.join(os.path.dirname(sys.executable), "t5lite-train"),
               f"--gin_file={gin_file}", f"--gin.MODEL_DIR='{model_dir}'",
               f"--gin.TRAIN_STEPS={steps}", f"--gin.EVAL_PERIOD={steps}",
               f"--gin.CHECKPOINT_PERIOD={steps}", f"--gin.STATS_PERIOD={steps}",
               "--gin.EVAL_STEPS=1"]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
      raise RuntimeError(f"t5lite-train failed:\n{stderr[-2000:]}")
  return usage.ru_maxrss * 1024.0  # Linux reports KiB


def best_peak(peaks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """The fastest rate of every matmul over several `matmul_peak` runs: other
  processes on the machine only ever slow a measurement down."""
  rates = {k: max(p["all"][k] for p in peaks) for k in peaks[0]["all"]}
  return {"all": rates, **_by_dtype(rates), "measurements": len(peaks)}


def add_mfu(result: dict[str, Any], peak: Mapping[str, Any]) -> None:
  """MFU of the bare loop and of train() against the run's matmul peak of
  the dtype the model computes in (and, for reference, against the float32
  peak)."""
  rate = peak["flops_per_second"][result["compute_dtype"]]
  result["peak_flops_per_second"] = rate
  result["mfu"] = result["model_flops_per_second"] / rate
  result["train_loop_mfu"] = (result["flops_per_step"]
                              * max(result["train_loop_steps_per_second"]) / rate)
  result["mfu_against_float32_peak"] = (result["model_flops_per_second"]
                                        / peak["flops_per_second"]["float32"])


def bench_config(gin_file: str, args: argparse.Namespace) -> dict[str, Any]:
  """Every figure of one config but MFU (see `add_mfu`); see the module
  docstring."""
  result: dict[str, Any] = {"gin_file": gin_file, "load_average_start": os.getloadavg()}
  with tempfile.TemporaryDirectory() as model_dir:
    configure(gin_file, model_dir, args.steps, args.stats)
    bare = BareLoop()
    blocks = [bare.run(args.bare_steps) for _ in range(2)]
    configure(gin_file, model_dir, args.steps, args.stats)
    periods, period_cpu = train_loop(args.steps)
    blocks += [bare.run(args.bare_steps) for _ in range(2)]
  flops, tokens, params = bare.flops_per_step, bare.tokens_per_batch, bare.num_params
  compute_dtype = bare.compute_dtype
  blocks, block_cpu = [b[0] for b in blocks], [b[1] for b in blocks]
  bare_rate, train_rate = max(blocks), max(periods)
  del bare
  configure(gin_file, tempfile.gettempdir(), args.steps, args.stats)
  pipeline = pipeline_rate(args.pipeline_batches)
  result.update(
      num_params=params, flops_per_step=flops, tokens_per_batch=tokens,
      compute_dtype=compute_dtype,
      bare_steps_per_second=blocks, train_loop_steps_per_second=periods,
      step_seconds=1 / bare_rate, model_flops_per_second=flops * bare_rate,
      framework_overhead=1 - train_rate / bare_rate,
      framework_overhead_of_medians=1 - statistics.median(periods) / statistics.median(blocks),
      bare_cpu_seconds_per_step=block_cpu, train_loop_cpu_seconds_per_step=period_cpu,
      cpu_overhead=min(period_cpu) / min(block_cpu) - 1,
      pipeline_tokens_per_second=pipeline * tokens,
      consumed_tokens_per_second=train_rate * tokens, pipeline_ratio=pipeline / train_rate)
  if args.compile_depths:
    result["compile_seconds"] = compile_sweep_in_subprocess(gin_file, args.compile_depths)
  if args.memory_steps:
    result["peak_host_memory_bytes"] = peak_host_memory(gin_file, args.memory_steps)
  result["load_average_end"] = os.getloadavg()
  return result


# ---------------------------------------------------------------------------
# Report


def _verdict(ok: bool) -> str:
  return "met" if ok else "MISSED"


def report(name: str, r: Mapping[str, Any], peak: Mapping[str, Any]) -> list[str]:
  """The printed lines of one config."""
  target = TARGETS.get(name)
  lines = [f"{name}: {r['num_params'] / 1e6:.1f}M parameters, "
           f"{r['flops_per_step'] / 1e9:.1f} GFLOP per step (3 x forward matmuls), "
           f"{r['tokens_per_batch']} token positions per batch; load average "
           f"{r['load_average_start'][0]:.1f} -> {r['load_average_end'][0]:.1f}"]
  dtype = r["compute_dtype"]
  mfu = (f"  (a) MFU              {100 * r['mfu']:5.1f} %  ({r['model_flops_per_second'] / 1e9:.1f}"
         f" of {r['peak_flops_per_second'] / 1e9:.1f} GFLOP/s, the {dtype} peak; step "
         f"{r['step_seconds']:.3f} s; {100 * r['train_loop_mfu']:.1f} % in train()"
         + ("" if dtype == "float32" else
            f"; {100 * r['mfu_against_float32_peak']:.1f} % against the float32 peak")
         + ")")
  if target is not None:
    mfu += f"   target >= {100 * target:.0f} %: {_verdict(r['mfu'] >= target)}"
  lines.append(mfu)
  lines.append(
      f"  (b) framework overhead {100 * r['framework_overhead']:5.1f} %  (train() best "
      f"{max(r['train_loop_steps_per_second']):.3f} steps/s vs bare best "
      f"{max(r['bare_steps_per_second']):.3f}; of medians "
      f"{100 * r['framework_overhead_of_medians']:.1f} %; CPU time per step "
      f"{100 * r['cpu_overhead']:+.1f} %)   target <= "
      f"{100 * MAX_OVERHEAD:.0f} %: {_verdict(r['framework_overhead'] <= MAX_OVERHEAD)}")
  lines.append(
      f"  (c) input pipeline   {r['pipeline_ratio']:7.1f} x  "
      f"({r['pipeline_tokens_per_second']:,.0f}"
      f" tokens/s built vs {r['consumed_tokens_per_second']:,.0f} consumed)   target >= "
      f"{MIN_PIPELINE_RATIO:.0f} x: {_verdict(r['pipeline_ratio'] >= MIN_PIPELINE_RATIO)}")
  if "compile_seconds" in r:
    wall, cpu = r["compile_seconds"]["wall"], r["compile_seconds"]["cpu"]
    for layout in ("unscanned", "scanned"):
      text = "  ".join(f"{d}+{d} layers {cpu[layout][d]:5.1f} s ({wall[layout][d]:.1f} wall)"
                       for d in cpu[layout])
      lines.append(f"  (d) compile {layout:9s} CPU {text}")
    # A scan of one block (the shallowest MoE stack) has no loop left after
    # XLA's simplification, so flatness is judged from the second depth on.
    depths = list(cpu["scanned"])
    first = depths[1] if len(depths) > 2 else depths[0]
    growth = {k: cpu[k][depths[-1]] / cpu[k][first] for k in cpu}
    lines.append(f"      compile CPU time from {first} to {depths[-1]} layers: unscanned x"
                 f"{growth['unscanned']:.2f}, scanned x{growth['scanned']:.2f}: "
                 f"{'flat' if growth['scanned'] <= 1.25 else 'NOT flat'} with scan")
  else:
    lines.append("  (d) compile            not measured (--compile_depths empty)")
  if "peak_host_memory_bytes" in r:
    lines.append(f"  (e) peak host memory {r['peak_host_memory_bytes'] / 2**30:5.2f} GiB "
                 "(t5lite-train run, resident-set high-water mark)")
  else:
    lines.append("  (e) peak host memory   not measured (--memory_steps 0)")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help=f"configs to measure (default: {', '.join(CONFIGS)})")
  parser.add_argument("--steps", type=int, default=100, help="train() steps")
  parser.add_argument("--stats", type=int, default=10, help="train() stats period")
  parser.add_argument("--bare_steps", type=int, default=10,
                      help="bare-loop steps before and after train()")
  parser.add_argument("--pipeline_batches", type=int, default=200)
  parser.add_argument("--compile_depths", type=lambda s: [int(x) for x in s.split(",") if x],
                      default=[2, 4, 8, 16],
                      help="comma-separated depths per stack; empty skips")
  parser.add_argument("--memory_steps", type=int, default=10,
                      help="steps of the t5lite-train run measured for memory; 0 skips")
  parser.add_argument("--matmul_sizes", type=lambda s: [int(x) for x in s.split(",")],
                      default=[1024, 2048, 4096], help="square sizes of the peak matmuls")
  parser.add_argument("--output", default=None)
  parser.add_argument("--compile_sweep_only", action="store_true",
                      help="print the compile sweep of one --gin_file as JSON and exit")
  args = parser.parse_args()
  os.chdir(ROOT)
  import tensorflow as tf
  tf.config.set_visible_devices([], "GPU")  # TensorFlow only feeds data
  if args.compile_sweep_only:
    print(json.dumps(compile_sweep(args.gin_file[0], args.compile_depths)))
    return
  # train() and the memory run then reuse the bare loop's compiled step
  # (the compile-time sweep turns the cache off).
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(tempfile.gettempdir(), "t5lite-bench-xla"))
  configs = args.gin_file or list(CONFIGS)
  started = datetime.datetime.now(datetime.timezone.utc)
  info = {"when": started.isoformat(), "commit": git_commit(), "machine": machine(),
          "load_average_start": os.getloadavg(), "args": vars(args)}
  # The peak is measured before and after every config and the best kept.
  peaks, results = [matmul_peak(args.matmul_sizes)], {}
  for name in configs:
    results[name] = bench_config(name, args)
    peaks.append(matmul_peak(args.matmul_sizes))
  peak = best_peak(peaks)
  for result in results.values():
    add_mfu(result, peak)
  info["matmul_peak"] = peak
  info.update(results=results, load_average_end=os.getloadavg(),
              benchmark_process_peak_rss_bytes=resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss * 1024.0)
  output = args.output or os.path.join(HERE, "results", f"bench-{int(started.timestamp())}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(info, f, indent=2)
  m = info["machine"]
  print(f"t5lite training benchmark, commit {info['commit']}, {started:%Y-%m-%d %H:%M} UTC")
  print(f"machine: {m['cpu_model']}, {m['nproc']} cores; load average "
        f"{info['load_average_start'][0]:.1f} -> {info['load_average_end'][0]:.1f}")
  print("matmul peaks (MFU counts against the one of the model's dtype): "
        + "; ".join(f"{dtype} {rate / 1e9:.1f} GFLOP/s ({peak['best'][dtype]})"
                    for dtype, rate in peak["flops_per_second"].items())
        + f"; best of {peak['measurements']} measurements of "
        + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peak["all"].items()))
  for name, r in results.items():
    print("\n".join(report(name, r, peak)))
  print(f"results: {output}")


if __name__ == "__main__":
  main()
