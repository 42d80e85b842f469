"""Checkpoints in a gs:// bucket against a local directory, on one machine.

The same gin-configured `train()` runs twice in this process: MODEL_DIR in
a local temporary directory, then in a bucket of a GCS server on localhost
(fake-gcs-server, started as the tests start it: tests/gcs_emulator.py). A
save every `--checkpoint_period` steps and a stats period of half that, so
the timing windows alternate between one that starts with a save (its
asynchronous write runs during the window's steps) and one without. For each
side it reports:

- blocked: the mean time `Checkpointer.save` holds the train loop;
- overlap: the mean step time of the windows with a save, their blocked
  time taken out, over that of the windows without one (1.0: the write in
  the background costs the steps nothing; t5lite's target is within 10 %);
- restore: reading the last checkpoint's whole state back (Orbax, as a
  resume reads it), best of three.

The bucket side over the local side, per figure, is the cost of the bucket
(here a server on the same machine: HTTP and its filesystem, no network).
The JSON lands in benchmarks/results/.

  .venv/bin/python benchmarks/bucket_checkpoints.py [--gin_file=...] [--steps=40]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import checkpoint_blocking as blocking  # noqa: E402
import gcs_emulator  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import gin  # noqa: E402
from t5lite import checkpoints, metrics, paths  # noqa: E402
from t5lite import train as train_lib  # noqa: E402


def _windows(rates: dict[int, float], stats: int, saves: list[tuple[int, float]]
             ) -> tuple[list[float], list[float]]:
  """Seconds per step of the timing windows after the first, net of the
  time blocked in saves: (windows that start with a save, the others)."""
  with_save, without = [], []
  for step, rate in sorted(rates.items()):
    if step <= stats:  # the first window compiles
      continue
    inside = [t for s, t in saves if step - stats <= s < step]
    (with_save if inside else without).append((stats / rate - sum(inside)) / stats)
  return with_save, without


def _restore_seconds(model_dir: str) -> float:
  """Best of three reads of the newest checkpoint's whole state."""
  step_dir = paths.join(model_dir, checkpoints.CHECKPOINTS_SUBDIR,
                        str(checkpoints.list_steps(model_dir)[1][-1]))
  item = paths.join(step_dir, "state")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  reader = ocp.StandardCheckpointer()
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        reader.metadata(item).item_metadata)
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(reader.restore(item, target))
    best = min(best, time.perf_counter() - start)
  reader.close()
  return best


def _measure(gin_files: list[str], model_dir: str, args: argparse.Namespace) -> dict[str, float]:
  stats = args.checkpoint_period // 2
  blocking._configure(gin_files, model_dir, args.steps, args.checkpoint_period, stats)
  with blocking._SaveTimer() as timer:
    gin.get_configurable(train_lib.train)()
  with tempfile.TemporaryDirectory() as events:
    rates = metrics.read_scalars(gcs_emulator.download(paths.join(model_dir, "train"), events),
                                 "timing/steps_per_second")
  with_save, without = _windows(rates, stats, timer.saves)
  return {
      "blocked_seconds_per_save": float(np.mean([t for _, t in timer.saves])),
      "step_seconds_windows_with_a_save": float(np.mean(with_save)),
      "step_seconds_windows_without": float(np.mean(without)),
      "overlap_ratio": float(np.mean(with_save) / np.mean(without)),
      "restore_seconds": _restore_seconds(model_dir),
  }


def main() -> None:
  parser = blocking.run_arguments(__doc__, "bucket-checkpoints")
  args = parser.parse_args()
  if args.checkpoint_period % 2 or args.steps % args.checkpoint_period:
    parser.error("--checkpoint_period must be even and divide --steps")
  gin_files = args.gin_file or ["gin/pretrain_dense.gin"]
  sides = {}
  with tempfile.TemporaryDirectory() as work:
    server = gcs_emulator.Emulator(os.path.join(work, "gcs"))
    os.environ.update(server.env)
    try:
      sides["local"] = _measure(gin_files, os.path.join(work, "run"), args)
      sides["bucket"] = _measure(gin_files, f"gs://{gcs_emulator.BUCKET}/run", args)
    finally:
      server.close()
  result = {
      "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "gin_files": gin_files, "steps": args.steps, "checkpoint_period": args.checkpoint_period,
      "devices": str(jax.devices()), **sides,
      "bucket_over_local": {k: sides["bucket"][k] / sides["local"][k] for k in sides["local"]},
  }
  path = args.output or os.path.join(HERE, "results",
                                     f"bucket-checkpoints-{int(time.time())}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"{'':34s}{'local':>10s}{'bucket':>10s}{'ratio':>8s}")
  for key in sides["local"]:
    print(f"{key:34s}{sides['local'][key]:10.4f}{sides['bucket'][key]:10.4f}"
          f"{result['bucket_over_local'][key]:8.2f}")
  print(path)


if __name__ == "__main__":
  sys.exit(main())
