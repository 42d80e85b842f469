"""One process of a multi-process test job (started by tests/multihost.py).

Joins the job through `t5lite.distributed` exactly as the CLI does, then:

  data   prints, as one JSON line, this process's data layout, the rows of
         its own first training batch and the whole global batch that
         `TrainData` assembled from every process's rows;
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
DATA_CONFIG = dict(mixture_or_task_name="t5lite_arithmetic",
                   task_feature_lengths={"inputs": 32, "targets": 16}, split="train",
                   batch_size=8, shuffle=False, seed=0, pack=False)


def data_config():
  """Unshuffled, unpacked and free of random preprocessing, so the rows do not
  depend on how many processes split them."""
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

  from t5lite import partitioning, testing
  from t5lite import train as train_lib
  from t5lite.data import datasets
  cfg = data_config()
  partitioner = partitioning.Partitioner(mesh_shape={"data": -1})
  model = testing.tiny_encoder_decoder()
  layout = partitioner.get_data_layout(cfg.batch_size)
  local = next(datasets.get_dataset(cfg, layout.shard_id, layout.num_shards,
                                    model.FEATURE_CONVERTER_CLS).as_numpy_iterator())
  batch = next(train_lib.TrainData(model, cfg, partitioner))
  inputs = batch["encoder_input_tokens"]
  # Every device of this process holds rows of this process's own batch.
  rows_per_process = cfg.batch_size // layout.num_shards
  offset = layout.shard_id * rows_per_process
  placed = all(
      np.array_equal(np.asarray(s.data),
                     local["encoder_input_tokens"][s.index[0].start - offset:
                                                   s.index[0].stop - offset])
      for s in inputs.addressable_shards)
  return {
      "process_index": jax.process_index(), "process_count": jax.process_count(),
      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
      "shard_id": layout.shard_id, "num_shards": layout.num_shards,
      "local_rows": local["encoder_input_tokens"].tolist(),
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
