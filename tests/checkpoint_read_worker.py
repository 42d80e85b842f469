"""Reads damaged checkpoints several times in one process, and ends as t5lite-train does.

Run by tests/test_checkpoint_faults.py as
`python checkpoint_read_worker.py DAMAGE READ MODEL_DIR REPEATS`. It saves
step 1 of a state of many small arrays (many TensorStore reads in flight at
once), copies it to steps 2 .. REPEATS + 1 and damages those (for READ=all,
step 1 too), then reads one of them REPEATS times: each read meets damage of
its own, not what an earlier one left in TensorStore's caches. DAMAGE:
garbage (array files of random bytes), truncated (array files cut in half),
manifest (`manifest.ocdbt` of random bytes). READ:

- fallback: `Checkpointer.restore_newest` of steps 1 and the damaged one
  restores step 1 and prints the warning on stdout; the process then exits
  normally.
- all: `Checkpointer.restore_newest` of every step, none of which restores;
  each failure is printed on stdout, the last one ends the process through
  `cli._stop` with exit 2.
- path: `restore_from_path` of the damaged step (t5lite-eval, t5lite-infer
  and a whole-state INITIAL_CHECKPOINT_PATH read this way), then as for all.
- params: `plan_params_restore` of the damaged step (a params-only
  INITIAL_CHECKPOINT_PATH), then as for all.
"""

import glob
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np

from t5lite import checkpoints, cli, console


_ARRAYS = 48


def _damage(step_dir: str, how: str) -> None:
  state = os.path.join(step_dir, "state")
  if how == "manifest":
    paths = glob.glob(os.path.join(state, "**", "manifest.ocdbt"), recursive=True)
  else:
    paths = glob.glob(os.path.join(state, "**", "d", "*"), recursive=True)
  for path in paths:
    size = os.path.getsize(path)
    if how == "truncated":
      os.truncate(path, size // 2)
    else:
      with open(path, "wb") as f:
        f.write(os.urandom(size))


def _read(how: str, model_dir: str, step: int, abstract: dict) -> str:
  directory = os.path.join(model_dir, checkpoints.CHECKPOINTS_SUBDIR)
  if how in ("fallback", "all"):
    checkpointer = checkpoints.Checkpointer(model_dir, None)
    try:
      steps = checkpointer.all_steps() if how == "all" else [1, step]
      return "\n".join(checkpointer.restore_newest(steps, abstract).warnings)
    finally:
      checkpointer.close()
  config = checkpoints.RestoreCheckpointConfig(path=os.path.join(directory, str(step)),
                                               mode="specific", params_only=how == "params")
  if how == "path":
    checkpoints.restore_from_path(config, abstract)
  else:
    checkpoints.plan_params_restore(config, abstract["params"])
  return "read"


def main(damage: str, how: str, model_dir: str, repeats: int) -> None:
  cli._quiet_libraries(["t5lite-train"])
  rng = np.random.default_rng(0)
  state = {"params": {f"w{i}": jnp.asarray(rng.random((8, 4 + i)), jnp.float32)
                      for i in range(_ARRAYS)}, "step": jnp.asarray(0)}
  writer = checkpoints.Checkpointer(model_dir, checkpoints.SaveCheckpointConfig(period=1))
  writer.save(1, state)
  writer.close()
  directory = os.path.join(model_dir, checkpoints.CHECKPOINTS_SUBDIR)
  damaged = range(2, repeats + 2)
  for step in damaged:
    shutil.copytree(os.path.join(directory, "1"), os.path.join(directory, str(step)))
  for step in (1, *damaged) if how == "all" else damaged:
    _damage(os.path.join(directory, str(step)), damage)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          state)
  for attempt, step in enumerate(damaged):
    try:
      print(_read(how, model_dir, step, abstract), flush=True)
    except checkpoints.CheckpointReadError as error:  # what cli._run maps to exit 2
      if attempt == repeats - 1:
        cli._stop(cli.USER_ERROR_EXIT, console.one_line(error))
      print(console.one_line(error), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
