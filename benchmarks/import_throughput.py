"""Checkpoint import throughput: t5lite's importer against a plain safetensors load.

Generates, at bench time, a Hugging Face T5 v1.1-style folder (config.json +
model.safetensors) with random float32 weights, by default 6 + 6 layers of
T5.1.1-base width with a 32128-token tied embedding (124M parameters,
about 0.5 GB), written by `t5lite.interop.huggingface.export`. Then reads it,
rounds alternating between the methods:

  plain + device_put  `safetensors.numpy.load_file` into host numpy arrays,
                      then `jax.device_put` of each, until ready
  plain, host only    `safetensors.numpy.load_file` alone
  t5lite              `interop.load_params(folder, abstract_params)` into the
                      model's unscanned parameter tree, until ready
  t5lite, scanned     the same into a `scan_layers=True` tree (layers stacked)

Every method reads the file once before the timed rounds, so all of them
read from the page cache the same way: this measures the importer, not the
disk. The plain load keeps Hugging Face's layout, while t5lite also turns
every torch `[out, in]` weight into its own layout (transposes, split head
axes and, scanned, stacked layers): that work is part of what is compared.
Throughput is the file's size over the seconds of one read (median
over the rounds, with the fastest and slowest). The peak host memory of a
read is the resident-set high-water mark above the resident set before it
(Linux; the kernel's mark is reset before each read). The JSON lands in
benchmarks/results/import-throughput-<time>.json.

  .venv/bin/python benchmarks/import_throughput.py [--repeats=7] [--layers=6]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from safetensors import numpy as safetensors_numpy

import gin
from t5lite import interop, tree_paths
from t5lite.data import vocabularies
from t5lite.interop import huggingface
from t5lite.models import models, transformer


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import run as bench  # noqa: E402


_INIT_SHAPES = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8),
                "decoder_target_tokens": (1, 8)}
METHODS = ("plain + device_put", "plain, host only", "t5lite", "t5lite, scanned")


# The generated model without --gin_file: T5 v1.1 widths (T5.1.1-base), 6 + 6
# layers, tied embedding; 124M parameters. Each size flag overrides its field.
DEFAULT_FIELDS = {"vocab_size": 32128, "emb_dim": 768, "num_heads": 12, "head_dim": 64,
                  "mlp_dim": 2048, "num_encoder_layers": 6, "num_decoder_layers": 6,
                  "mlp_activations": ("gelu", "linear"), "logits_via_embedding": True,
                  "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
_SIZE_FLAGS = {"d_model": ("emb_dim",), "heads": ("num_heads",), "head_dim": ("head_dim",),
               "d_ff": ("mlp_dim",), "vocab": ("vocab_size",),
               "layers": ("num_encoder_layers", "num_decoder_layers")}


def gin_model_fields(gin_files: list[str]) -> dict[str, Any]:
  """TransformerConfig fields of the MODEL a model or benchmark gin file builds.

  Raises:
    ValueError: the model has no Hugging Face counterpart.
  """
  gin.clear_config(clear_constants=True)
  gin.add_config_file_search_path(ROOT)
  # Only MODEL is built, so a run file's required macros (MODEL_DIR, ...) may
  # stay unset: the config is not finalized.
  gin.parse_config_files_and_bindings(gin_files, [], finalize_config=False)
  model = gin.query_parameter("MODEL/macro.value").scoped_configurable_fn()
  return interop.export_fields(model)


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
  """TransformerConfig fields of the model to generate (unscanned, no dropout)."""
  fields = gin_model_fields(args.gin_file) if args.gin_file else dict(DEFAULT_FIELDS)
  for flag, names in _SIZE_FLAGS.items():
    if getattr(args, flag) is not None:
      fields.update({name: getattr(args, flag) for name in names})
  return {**fields, "dropout_rate": 0.0, "scan_layers": False}


def abstract_params(fields: dict[str, Any]) -> Any:
  """The parameter tree (ShapeDtypeStructs, no memory) of an encoder-decoder."""
  vocab = vocabularies.byte_vocabulary()
  model = models.EncoderDecoderModel(
      transformer.EncoderDecoder(transformer.TransformerConfig(**fields)), vocab, vocab,
      optax.sgd(1.0))
  boxed = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), _INIT_SHAPES))
  return nn.unbox(boxed["params"])


def generate(folder: str, fields: dict[str, Any], seed: int) -> int:
  """Writes a Hugging Face folder of random weights; returns the parameter count."""
  rng = np.random.default_rng(seed)
  params = {name: rng.standard_normal(leaf.shape, np.float32)
            for name, leaf in tree_paths.leaves_by_name(abstract_params(fields)).items()}
  # The benchmark's own folder: a rerun in the same --workdir replaces it.
  huggingface.export(params, fields, folder, source=f"random weights, seed {seed}",
                     overwrite=True)
  return sum(p.size for p in params.values())


def _status_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
  except (OSError, StopIteration):
    return None


def _reset_peak_rss() -> bool:
  """Resets the kernel's resident-set high-water mark (VmHWM); False if it cannot."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


@dataclasses.dataclass(frozen=True)
class Read:
  """One timed read: wall seconds, process CPU seconds (all threads; other
  processes on the machine do not change it) and the host memory it took at
  its peak."""

  seconds: float
  cpu_seconds: float
  peak_rss_delta_mib: float | None


def timed_read(load: Callable[[], Any]) -> Read:
  """Runs `load` once; the result is dropped only after the memory is measured."""
  gc.collect()
  resettable = _reset_peak_rss()
  before = _status_kib("VmRSS")
  start, cpu_start = time.perf_counter(), time.process_time()
  result = load()
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  peak = _status_kib("VmHWM") if resettable else None
  del result
  delta = None if peak is None or before is None else (peak - before) / 1024
  return Read(seconds, cpu, delta)


def loaders(folder: str, unscanned: Any, scanned: Any) -> dict[str, Callable[[], Any]]:
  """The four ways of reading the folder, each returning arrays that are ready."""
  file = os.path.join(folder, huggingface.WEIGHTS)

  def plain_device():
    host = safetensors_numpy.load_file(file)
    return jax.block_until_ready({k: jax.device_put(v) for k, v in host.items()})

  return {
      "plain + device_put": plain_device,
      "plain, host only": lambda: safetensors_numpy.load_file(file),
      "t5lite": lambda: jax.block_until_ready(interop.load_params(folder, unscanned)),
      "t5lite, scanned": lambda: jax.block_until_ready(interop.load_params(folder, scanned)),
  }


def measure(reads: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Read]]:
  """One untimed warm-up read each, then `repeats` rounds alternating the methods."""
  for load in reads.values():
    timed_read(load)
  out: dict[str, list[Read]] = {name: [] for name in reads}
  for _ in range(repeats):
    for name, load in reads.items():
      out[name].append(timed_read(load))
  return out


def summarize(runs: list[Read], file_bytes: int) -> dict[str, Any]:
  seconds = [r.seconds for r in runs]
  peaks = [r.peak_rss_delta_mib for r in runs if r.peak_rss_delta_mib is not None]
  return {"seconds": seconds, "median_seconds": statistics.median(seconds),
          "median_cpu_seconds": statistics.median(r.cpu_seconds for r in runs),
          "gb_per_second_median": file_bytes / statistics.median(seconds) / 1e9,
          "gb_per_second_min": file_bytes / max(seconds) / 1e9,
          "gb_per_second_max": file_bytes / min(seconds) / 1e9,
          "peak_rss_delta_mib": max(peaks) if peaks else None}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help="model or benchmark gin file whose MODEL to generate (default: "
                           "T5 v1.1 widths, 6 + 6 layers, 124M parameters)")
  sizes = {"layers": "encoder and decoder depth (default 6)", "d_model": "default 768",
           "heads": "default 12", "head_dim": "default 64", "d_ff": "default 2048",
           "vocab": "default 32128"}
  for flag, text in sizes.items():
    parser.add_argument(f"--{flag}", type=int, default=None,
                        help=f"{text}; overrides the gin file's")
  parser.add_argument("--repeats", type=int, default=7, help="timed reads per method")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default=None,
                      help="where to write the folder (default: a temporary directory, "
                           "removed afterwards)")
  parser.add_argument("--output", default=None,
                      help="JSON path (default: benchmarks/results/import-throughput-<time>.json)")
  return parser


def run(args: argparse.Namespace, fields: dict[str, Any], workdir: str) -> dict[str, Any]:
  """Generates the model of `fields` in `workdir`, measures every method; the JSON result."""
  folder = os.path.join(workdir, "t5_random")
  started = time.perf_counter()
  num_params = generate(folder, fields, args.seed)
  generate_seconds = time.perf_counter() - started
  file_bytes = os.path.getsize(os.path.join(folder, huggingface.WEIGHTS))
  # The folder's own config decides the model, as it would for a user.
  read_fields = {**huggingface.model_config(huggingface.HuggingFaceFolder(folder)),
                 "dropout_rate": 0.0}
  unscanned = abstract_params(read_fields)
  scanned = abstract_params({**read_fields, "scan_layers": True})
  load_before = os.getloadavg()
  runs = measure(loaders(folder, unscanned, scanned), args.repeats)
  results = {name: summarize(r, file_bytes) for name, r in runs.items()}
  plain = results["plain + device_put"]["median_seconds"]
  for name in ("t5lite", "t5lite, scanned"):
    results[name]["throughput_over_plain_device_put"] = plain / results[name]["median_seconds"]
  return {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "commit": bench.git_commit(), "machine": bench.machine(), "args": vars(args),
      "model": args.gin_file or "T5 v1.1-style model", "fields": fields,
      "num_params": int(num_params), "file_bytes": file_bytes,
      "generate_seconds": generate_seconds, "load_average_start": load_before,
      "load_average_end": os.getloadavg(), "warm_page_cache": True, "methods": results,
  }


def print_table(result: dict[str, Any], path: str) -> None:
  f = result["fields"]
  print(f"{result['model']}: {f['num_encoder_layers']} + {f['num_decoder_layers']} layers, "
        f"d_model {f['emb_dim']}, {f['num_heads']} heads of {f['head_dim']}, d_ff "
        f"{f['mlp_dim']}, vocabulary {f['vocab_size']}")
  print(f"{result['num_params']:,} float32 parameters, model.safetensors "
        f"{result['file_bytes'] / 1e6:.1f} MB (generated in {result['generate_seconds']:.1f} s), "
        f"{result['machine']['devices']}, load average "
        f"{result['load_average_start'][0]:.1f} -> {result['load_average_end'][0]:.1f}")
  print(f"each method read the file once before {result['args']['repeats']} timed rounds, "
        "so every read is from the page cache; peak RSS counts the arrays read")
  print(f"{'method':20s} {'GB/s median':>11s} {'(min - max)':>15s} {'s median':>9s} "
        f"{'CPU s':>6s} {'peak RSS +MiB':>13s} {'vs plain':>8s}")
  for name in METHODS:
    r = result["methods"][name]
    ratio = r.get("throughput_over_plain_device_put")
    peak = r["peak_rss_delta_mib"]
    print(f"{name:20s} {r['gb_per_second_median']:11.2f} "
          f"{r['gb_per_second_min']:7.2f} - {r['gb_per_second_max']:5.2f} "
          f"{r['median_seconds']:9.3f} {r['median_cpu_seconds']:6.3f} "
          f"{'' if peak is None else f'{peak:.0f}':>13s} "
          f"{'' if ratio is None else f'{ratio:.2f}x':>8s}")
  print(f"({path})")


def main() -> None:
  args = _parser().parse_args()
  for flag in (*_SIZE_FLAGS, "repeats"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      sys.exit(f"--{flag} must be >= 1, got {getattr(args, flag)}.")
  try:
    fields = model_fields(args)
  except ValueError as e:  # a model without a Hugging Face counterpart
    sys.exit(str(e))
  if args.workdir:
    os.makedirs(args.workdir, exist_ok=True)
    result = run(args, fields, args.workdir)
  else:
    with tempfile.TemporaryDirectory() as workdir:
      result = run(args, fields, workdir)
  path = args.output or os.path.join(HERE, "results",
                                     f"import-throughput-{int(time.time())}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print_table(result, path)


if __name__ == "__main__":
  main()
