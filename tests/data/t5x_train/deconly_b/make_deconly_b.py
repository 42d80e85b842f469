"""Makes deconly_b/: a 20-step decoder-only training run written by T5X itself.

1. Runs T5X's own trainer, `python -m t5x.train --gin_file=train.gin`, into a
   temporary model directory (T5X initialises from scratch with seed 0,
   trains 20 steps and saves Orbax checkpoints at steps 0, 10 and 20).
2. Copies T5X's checkpoint_0/10/20 (the temporary path in Orbax's
   commit_success.txt markers replaced by the checkpoint's name),
   model-info.txt and T5X's operative config.gin (MODEL_DIR blanked) here.
3. metrics.npz: every train scalar T5X wrote to TensorBoard (timing aside),
   `<tag>` float64 [20] and `<tag>__steps` int64 [20], `/` in tags written as
   `__`.
4. batches.npz: the training batches, regenerated with T5X's
   `utils.get_dataset` from the same `train/utils.DatasetConfig` and the
   model's feature converter, key -> [20, 8, 64]; batch s is the one step s+1
   consumed.
5. Checks, with T5X's own code in-process (`../t5x_replay.py`): replaying the
   run from checkpoint_0 on batches.npz reproduces every logged scalar bit
   for bit and the whole state (parameters and Adafactor slots) of
   checkpoint_10 and checkpoint_20 exactly. The script fails if not.

Rerun from the repository root (T5X importable, e.g. PYTHONPATH=/path/to/t5x,
t5lite installed so that `t5lite.data.tasks` registers `t5lite_lm`):
  JAX_PLATFORMS=cpu python tests/data/t5x_train/deconly_b/make_deconly_b.py
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import t5x_replay as replay  # noqa: E402


NUM_STEPS = 20
CHECKPOINT_STEPS = (0, 10, 20)


def run_t5x_train(model_dir):
  cmd = [
    sys.executable,
    "-m",
    "t5x.train",
    f"--gin_file={os.path.join(HERE, 'train.gin')}",
    f"--gin.MODEL_DIR='{model_dir}'",
  ]
  subprocess.run(cmd, check=True)


def copy_outputs(model_dir):
  for step in CHECKPOINT_STEPS:
    dst = os.path.join(HERE, f"checkpoint_{step}")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(model_dir, f"checkpoint_{step}"), dst)
    # Orbax's commit markers name the temporary directory; keep them neutral.
    for marker in glob.glob(os.path.join(dst, "**", "commit_success.txt"), recursive=True):
      with open(marker, "w") as f:
        f.write(f"Checkpoint commit was successful to checkpoint_{step}")
  shutil.copy(os.path.join(model_dir, "model-info.txt"), HERE)
  with open(os.path.join(model_dir, "config.gin")) as f:
    config = f.read()
  config = re.sub(r"^MODEL_DIR = .*$", "MODEL_DIR = '<model_dir>'", config, flags=re.M)
  with open(os.path.join(HERE, "config.gin"), "w") as f:
    f.write(config)


def read_train_scalars(model_dir):
  import tensorflow as tf
  from tensorflow.core.util import event_pb2

  values = {}
  for path in sorted(glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name != "scalars":
          continue
        if v.tag.startswith("timing/"):
          continue
        value = float(tf.make_ndarray(v.tensor)) if v.HasField("tensor") else v.simple_value
        values.setdefault(v.tag, {})[event.step] = value
  out = {}
  for tag, by_step in sorted(values.items()):
    steps = sorted(by_step)
    key = tag.replace("/", "__")
    out[key] = np.array([by_step[s] for s in steps], np.float64)
    out[key + "__steps"] = np.array(steps, np.int64)
  return out


def train_dataset_config():
  """The `train/utils.DatasetConfig` of train.gin."""
  from t5x import utils

  return utils.DatasetConfig(
    mixture_or_task_name="t5lite_lm",
    module="t5lite.data.tasks",
    task_feature_lengths={"targets": 64},
    split="train",
    batch_size=8,
    shuffle=False,
    seed=0,
    use_cached=False,
    pack=True,
  )


def regenerate_batches(model):
  from t5x import utils

  ds = utils.get_dataset(
    train_dataset_config(),
    shard_id=0,
    num_shards=1,
    feature_converter_cls=model.FEATURE_CONVERTER_CLS,
  )
  batches = [b for _, b in zip(range(NUM_STEPS), ds.as_numpy_iterator())]
  return {k: np.stack([b[k] for b in batches]) for k in sorted(batches[0])}


def check_replay(model, metrics):
  batches = replay.load_batches(os.path.join(HERE, "batches.npz"))
  setup = replay.make_setup(model, batches[0])

  def ckpt(step):
    return replay.restore(setup, os.path.join(HERE, f"checkpoint_{step}"), step)

  summaries, states = replay.train(setup, ckpt(0), batches, CHECKPOINT_STEPS[1:])
  losses = np.array([s["loss"] for s in summaries])
  if not np.array_equal(losses, metrics["loss"]):
    raise AssertionError(f"replayed losses {losses} != logged {metrics['loss']}")
  for tag in summaries[0]:
    replayed = [summary[tag] for summary in summaries]
    if not np.array_equal(replayed, metrics[tag.replace("/", "__")]):
      raise AssertionError(f"replayed {tag} differs from the logged one")
  for step in CHECKPOINT_STEPS[1:]:
    unequal = replay.unequal_leaves(states[step], replay.flat_state(ckpt(step)))
    if unequal:
      raise AssertionError(f"step {step}: state differs from checkpoint_{step}: {unequal}")
  print("replay check passed: logged scalars and checkpoints reproduced exactly")


def main():
  with tempfile.TemporaryDirectory() as model_dir:
    run_t5x_train(model_dir)
    copy_outputs(model_dir)
    metrics = read_train_scalars(model_dir)
  np.savez(os.path.join(HERE, "metrics.npz"), **metrics)
  model = replay.build_deconly_b_model()
  np.savez_compressed(os.path.join(HERE, "batches.npz"), **regenerate_batches(model))
  check_replay(model, metrics)


if __name__ == "__main__":
  main()
