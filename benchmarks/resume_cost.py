"""What exact resume costs: saving the data iterator per checkpoint
(`save_dataset=True`) against fast-forwarding the pipeline per restart (the
default), for the training pipeline of a headline gin file.

For each gin file this builds the training `TrainData` on one CPU device,
takes `--warmup` batches, then times (1) writing the tf.data iterator state
as a checkpoint does, with its size on disk, (2) restoring it, and (3)
building the pipeline anew and taking the first batch after `--skip` batches
(what a restart without a saved iterator does), per fast-forwarded batch.

  .venv/bin/python benchmarks/resume_cost.py --gin_file=gin/pretrain_dense.gin \\
      [--gin_file=gin/testing/local_tiny.gin] [--skip=1000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import tensorflow as tf

import gin
from t5lite import cli, feeder, partitioning


def _train_data() -> feeder.TrainData:
  """The training data the gin files configure, as `train()` would build it."""
  def get(name):
    return gin.query_parameter(f"train_lib.train.{name}").scoped_configurable_fn()
  return feeder.TrainData(get("model"), get("train_dataset_cfg"),
                             partitioning.Partitioner(), prefetch_batches=0)


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(warmup: int, skip: int) -> dict[str, float]:
  data = _train_data()
  for _ in range(warmup):
    next(data)
  with tempfile.TemporaryDirectory() as tmp:
    began = time.perf_counter()
    tf.train.Checkpoint(iterator=data.iterator).write(os.path.join(tmp, "iterator"))
    saved = time.perf_counter() - began
    size = _dir_bytes(tmp)
    fresh = _train_data()
    began = time.perf_counter()
    tf.train.Checkpoint(iterator=fresh.iterator).read(os.path.join(tmp, "iterator"))
    next(fresh)
    restored = time.perf_counter() - began
  began = time.perf_counter()
  first = _train_data()
  next(first)
  build = time.perf_counter() - began
  began = time.perf_counter()
  resumed = _train_data()
  resumed.skip(skip)
  next(resumed)
  forward = time.perf_counter() - began - build
  return dict(save_s=saved, size_mb=size / 2**20, restore_s=restored, build_s=build,
              fast_forward_s=forward, per_batch_ms=1e3 * forward / skip)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin_file", action="append", required=True)
  parser.add_argument("--gin", action="append", default=[], help="extra gin bindings")
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--skip", type=int, default=1000)
  args = parser.parse_args()
  cli.parse_gin(args.gin_file, ["MODEL_DIR = '/tmp/unused'", *args.gin],
                cli.gin_search_paths([]))
  r = measure(args.warmup, args.skip)
  print(f"{' + '.join(args.gin_file)}: iterator checkpoint {r['size_mb']:.1f} MB written in "
        f"{r['save_s']:.2f} s, restored in {r['restore_s']:.2f} s; fast-forward of "
        f"{args.skip} batches {r['fast_forward_s']:.1f} s ({r['per_batch_ms']:.1f} ms/batch; "
        f"pipeline build {r['build_s']:.1f} s)")


if __name__ == "__main__":
  main()
