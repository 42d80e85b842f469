"""Save policies as a user sees them on disk."""

import os

import numpy as np
import pytest
from test_cli import TINY, run_cli


# End-to-end: real processes and training runs (part of `make test`).
pytestmark = pytest.mark.slow


def _read(step_dir):
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))


def test_keep_keep_every_n_dtype_and_resume(tmp_path):
  model_dir = tmp_path / "run"
  args = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=7",
          "--gin.CHECKPOINT_PERIOD=1", "--gin.EVAL_PERIOD=7", "--gin.STATS_PERIOD=1",
          "--gin.CHECKPOINTS_TO_KEEP=2",
          "--gin.checkpoints.SaveCheckpointConfig.keep_every_n_steps=3",
          "--gin.checkpoints.SaveCheckpointConfig.dtype='bfloat16'"]
  out = run_cli(args, cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  # Newest two (6, 7) plus every multiple of 3, kept forever (3, 6).
  assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [3, 6, 7]
  state = _read(model_dir / "checkpoints" / "7")
  kernel = state["params"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert kernel.dtype.name == "bfloat16"
  moments = [x for x in __import__("jax").tree.leaves(state["opt_state"])
             if np.ndim(x) > 0 and x.dtype.kind == "f"]
  assert moments and all(x.dtype == np.float32 for x in moments)  # optimizer state stays f32
  # A bfloat16 checkpoint resumes into the float32 run.
  more = run_cli([*args[:3], "--gin.TRAIN_STEPS=8", *args[4:]], cwd=str(tmp_path))
  assert more.returncode == 0, more.stderr[-3000:]
  assert "Restoring step 7" in more.stdout and "step 8/8" in more.stdout


def test_period_last_step_extra_steps_keep_and_keep_every_n(tmp_path):
  model_dir = tmp_path / "run"
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=9",
                 "--gin.CHECKPOINT_PERIOD=4", "--gin.EVAL_PERIOD=8", "--gin.STATS_PERIOD=1",
                 "--gin.CHECKPOINTS_TO_KEEP=2",
                 "--gin.checkpoints.SaveCheckpointConfig.checkpoint_steps=[3]",
                 "--gin.checkpoints.SaveCheckpointConfig.keep_every_n_steps=3"],
                cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  # Saved: 3 (checkpoint_steps), 4 and 8 (period), 9 (the last step, off the
  # period). Kept: the newest two (8, 9) and multiples of 3 (3, 9); 4 is pruned.
  assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [3, 8, 9]
  assert int(_read(model_dir / "checkpoints" / "9")["step"]) == 9


def test_dry_run_names_the_steps_a_resume_step_run_keeps(tmp_path):
  """Steps 1-6 saved, then keep 3 and resume_step=2 up to step 4: the newer
  steps are set aside first, so 2, 3 and 4 stay; the dry run says the same."""
  model_dir = tmp_path / "run"
  first = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.CHECKPOINT_PERIOD=1",
           "--gin.EVAL_PERIOD=6", "--gin.STATS_PERIOD=1"]
  out = run_cli([*first, "--gin.TRAIN_STEPS=6", "--gin.CHECKPOINTS_TO_KEEP=None"],
                cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  again = [*first, "--gin.TRAIN_STEPS=4", "--gin.CHECKPOINTS_TO_KEEP=3",
           "--gin.train.resume_step=2"]
  planned = run_cli([*again, "--dry_run"], cwd=str(tmp_path))
  assert planned.returncode == 0, planned.stderr[-3000:]
  assert "kept at the end: 2, 3, 4" in planned.stdout, planned.stdout
  out = run_cli(again, cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [2, 3, 4]
