"""Saves checkpoints into a MODEL_DIR broken one way, and ends as t5lite-train does.

Run by tests/test_checkpoint_faults.py as
`python checkpoint_fault_worker.py CAUSE MODEL_DIR`. Causes:

- file: `checkpoints` is a file.
- readonly: the checkpoints directory is read-only (chmod; as root, which
  ignores permission bits, mkdir fails with EROFS as on a read-only mount).
- vanished: the checkpoints directory is removed while a save is in flight,
  just before Orbax renames the finished step into place.
- deleted: the checkpoints directory is removed between two saves.
- full: MODEL_DIR is a tiny tmpfs the test mounted; `full-injected` makes
  mkdir fail with ENOSPC where no tmpfs can be mounted.

Library logs are quieted as the CLI quiets them at its default verbosity.
"""

import errno
import os
import shutil
import sys

from absl import app

from t5lite import cli, console


# The C++ start-up lines of TensorFlow and XLA stay off stderr, as in the CLI.
with cli._native_start_up_logs_hidden():
  import jax
  import jax.numpy as jnp
  import numpy as np

  from t5lite import checkpoints

  jax.devices()


def _fail_mkdir(code: int, under: str) -> None:
  real = os.makedirs

  def makedirs(name, *args, **kwargs):
    if os.fspath(name).startswith(under):
      raise OSError(code, os.strerror(code), os.fspath(name))
    return real(name, *args, **kwargs)

  os.makedirs = makedirs


def _vanish_before_commit(directory: str) -> None:
  real = os.rename

  def rename(src, dst):
    if ".orbax-checkpoint-tmp" in os.fspath(src):
      shutil.rmtree(directory, ignore_errors=True)
    return real(src, dst)

  os.rename = rename


def main(cause: str, model_dir: str) -> None:
  cli._quiet_libraries(["t5lite-train"])
  directory = os.path.join(model_dir, checkpoints.CHECKPOINTS_SUBDIR)
  if cause == "file":
    os.makedirs(model_dir, exist_ok=True)
    with open(directory, "w") as f:
      f.write("not a directory")
  checkpointer = checkpoints.Checkpointer(model_dir, checkpoints.SaveCheckpointConfig(period=1))
  if cause == "readonly":
    if os.geteuid() != 0:
      os.chmod(directory, 0o555)
    else:
      _fail_mkdir(errno.EROFS, directory)
  elif cause == "full-injected":
    _fail_mkdir(errno.ENOSPC, directory)
  elif cause == "vanished":
    _vanish_before_commit(directory)
  # Random values do not compress: 400 kB per save, more than the tmpfs holds.
  state = {"params": {"w": jnp.asarray(np.random.default_rng(0).random((100, 1000)),
                                       jnp.float32)}, "step": jnp.asarray(0)}
  try:
    for step in (1, 2, 3):
      checkpointer.save(step, state)
      if cause == "deleted" and step == 1:
        checkpointer.wait_until_finished()
        shutil.rmtree(directory)
    checkpointer.wait_until_finished()
    checkpointer.close()
  except OSError as error:  # what cli._run maps to the I/O exit status
    cli._stop(cli.IO_ERROR_EXIT, console.one_line(error))
  print("all saves succeeded", file=sys.stderr)


if __name__ == "__main__":
  # Under absl's app, as the CLI runs: its log handler is the one quieted.
  app.run(lambda argv: main(argv[1], argv[2]))
