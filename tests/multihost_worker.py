"""One process of a multi-process test job (started by tests/multihost.py).

Joins the job through `t5lite.distributed` exactly as the CLI does, then:

  data   prints, as one JSON line, this process's data layout, the rows of
         the first global batch its devices hold and the whole global batch
         that `TrainData` assembled from every process's rows;
  hold   runs cross-process collectives until it is stopped, printing
         "collectives running" once they work.
"""

import argparse
import json
import time

import jax
import numpy as np

from t5lite import distributed


# The data pipeline (TensorFlow, seqio) loads only in `data` mode, so `hold`
# processes start in a moment.
DATA_CONFIG = dict(mixture_or_task_name="t5lite_span_corruption",
                   task_feature_lengths={"inputs": 32, "targets": 16}, split="train",
                   batch_size=8, shuffle=True, seed=0, pack=True)


def data_config():
  """Shuffled, span-corrupted and packed, like the shipped pretraining runs."""
  from t5lite.data import datasets
  return datasets.DatasetConfig(**DATA_CONFIG)


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=("data", "hold"))
  parser.add_argument("--multiprocess_gpu", action="store_true")
  parser.add_argument("--coordinator_address")
  parser.add_argument("--process_count", type=int)
  parser.add_argument("--process_index", type=int)
  parser.add_argument("--initialization_timeout", type=int, default=300)
  parser.add_argument("--heartbeat_timeout", type=int, default=100)
  return parser.parse_args()


def _data() -> dict:
  from jax.experimental import multihost_utils

  from t5lite import feeder, partitioning, testing
  from t5lite.data import datasets
  cfg = data_config()
  partitioner = partitioning.Partitioner(mesh_shape={"data": -1})
  model = testing.tiny_encoder_decoder()
  layout = partitioner.get_data_layout(cfg.batch_size)
  # The global pipeline every process builds: one shard at the global batch size.
  whole = next(datasets.get_dataset(cfg, 0, 1, model.FEATURE_CONVERTER_CLS)
               .as_numpy_iterator())["encoder_input_tokens"]
  batch = next(feeder.TrainData(model, cfg, partitioner))
  inputs = batch["encoder_input_tokens"]
  # Every device of this process holds its rows of that global batch.
  placed = all(np.array_equal(np.asarray(s.data), whole[s.index[0]])
               for s in inputs.addressable_shards)
  rows_per_process = cfg.batch_size // layout.num_shards
  offset = layout.shard_id * rows_per_process
  return {
      "process_index": jax.process_index(), "process_count": jax.process_count(),
      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
      "shard_id": layout.shard_id, "num_shards": layout.num_shards,
      "local_rows": np.asarray(whole[offset:offset + rows_per_process]).tolist(),
      "placed_from_local_rows": placed,
      "global_rows": np.asarray(
          multihost_utils.process_allgather(inputs, tiled=True)).tolist(),
  }


def _hold() -> None:
  from jax.experimental import multihost_utils
  announced = False
  while True:
    multihost_utils.process_allgather(np.arange(4) + jax.process_index())
    if not announced:
      print("collectives running", flush=True)
      announced = True
    time.sleep(0.2)


def main() -> None:
  args = _parse()
  distributed.initialize(distributed.DistributedConfig(
      multiprocess_gpu=args.multiprocess_gpu, coordinator_address=args.coordinator_address,
      process_count=args.process_count, process_index=args.process_index,
      initialization_timeout=args.initialization_timeout,
      heartbeat_timeout=args.heartbeat_timeout))
  if args.mode == "data":
    print(json.dumps(_data()), flush=True)
  else:
    _hold()
  distributed.finish()


if __name__ == "__main__":
  main()
