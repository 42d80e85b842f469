"""Decode throughput with the key/value cache against recomputing everything.

Builds an encoder-decoder from a model gin file (t5_tiny by default, which a
2-core CPU decodes in seconds; pass --gin_file=gin/models/t5_small.gin on an
accelerator), initialises it, and decodes one random batch with the model's
`decode_batch` twice in the same process: over the cache, and uncached, where
every step reruns the full teacher-forced forward pass. Both are jitted
`lax.while_loop`s; compile time is reported apart from the timed calls. The
two must produce the same tokens. Throughput counts generated tokens (EOS
included, padding after it excluded). The JSON lands in
benchmarks/results/decode-<time>.json.

  .venv/bin/python benchmarks/decode.py [--gin_file=...] [--batch=8] [--length=64]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gin
from t5lite import decoding


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_model(gin_file: str, decode_fn_name: str):
  """The gin file's MODEL with the named decoder and dropout off."""
  gin.clear_config(clear_constants=True)
  gin.add_config_file_search_path(ROOT)
  gin.parse_config_files_and_bindings([gin_file], ["DROPOUT_RATE = 0.0"])
  model = gin.query_parameter("MODEL/macro.value").scoped_configurable_fn()
  model.decode_fn = {"greedy": decoding.greedy,
                     "beam4": functools.partial(decoding.beam_search, num_beams=4)}[decode_fn_name]
  return model


def make_batch(batch: int, length: int, vocab_size: int, seed: int = 0) -> dict[str, jax.Array]:
  """Random encoder inputs (ids >= 2, so no padding or EOS) and a decode length."""
  rng = np.random.default_rng(seed)
  return {"encoder_input_tokens": jnp.asarray(rng.integers(2, vocab_size, (batch, length)),
                                              jnp.int32),
          "decoder_input_tokens": jnp.zeros((batch, length), jnp.int32)}


def time_decode(model, params, batch, use_cache: bool, repeats: int) -> dict:
  """Compile once, then time `repeats` calls; returns the figures and tokens."""
  fn = jax.jit(functools.partial(model.decode_batch, use_cache=use_cache))
  start = time.perf_counter()
  tokens, _ = jax.block_until_ready(fn(params, batch))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, batch))
    times.append(time.perf_counter() - start)
  tokens = np.asarray(tokens)
  eos = model.output_vocabulary.eos_id
  generated = int(sum(list(row).index(eos) + 1 if eos in row else len(row)
                      for row in tokens.reshape(-1, tokens.shape[-1])))
  seconds = statistics.median(times)
  return {"compile_and_first_call_s": compile_s, "median_call_s": seconds,
          "call_s": times, "generated_tokens": generated,
          "tokens_per_second": generated / seconds, "tokens": tokens}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", default="gin/models/t5_tiny.gin")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=64,
                      help="encoder input length and decode length")
  parser.add_argument("--decoder", choices=("greedy", "beam4"), default="greedy")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--output", default=None,
                      help="JSON path (default: benchmarks/results/decode-<time>.json)")
  args = parser.parse_args()

  model = build_model(args.gin_file, args.decoder)
  batch = make_batch(args.batch, args.length, model.module.config.vocab_size)
  shapes = {k: v.shape for k, v in batch.items()}
  init = jax.jit(lambda rng: model.get_initial_variables(rng, shapes))
  params = nn.unbox(init(jax.random.key(0)))["params"]
  cached = time_decode(model, params, batch, True, args.repeats)
  uncached = time_decode(model, params, batch, False, args.repeats)
  same = bool(np.array_equal(cached.pop("tokens"), uncached.pop("tokens")))

  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "gin_file": args.gin_file, "decoder": args.decoder, "batch": args.batch,
      "encoder_length": args.length, "max_decode_length": args.length,
      "devices": str(jax.devices()), "cached": cached, "uncached": uncached,
      "speedup": cached["tokens_per_second"] / uncached["tokens_per_second"],
      "same_tokens": same,
  }
  args.output = args.output or os.path.join(HERE, "results", f"decode-{int(time.time())}.json")
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, "w") as f:
    json.dump(result, f, indent=2)
  print(f"{args.gin_file}, {args.decoder}, batch {args.batch}, decode length {args.length}, "
        f"{jax.devices()[0].platform}")
  for name, r in (("KV cache", cached), ("uncached", uncached)):
    print(f"{name:10s} {r['tokens_per_second']:10.1f} tokens/s   {r['median_call_s']:7.3f} "
          f"s/batch   (compile + first call {r['compile_and_first_call_s']:.1f} s)")
  print(f"speedup    {result['speedup']:10.1f} x   same tokens: {same}   ({args.output})")
  if not same:
    sys.exit("Cached and uncached decodes differ.")


if __name__ == "__main__":
  main()
