"""Train-eval per task, inference evaluation, and the eval / infer CLIs."""

import os

import pytest

from test_cli import TINY, run_cli, scalars

MIX_MODULE = """
import seqio
from t5lite.data import tasks  # registers the embedded tasks

if "tiny_eval_mix" not in seqio.MixtureRegistry.names():
  seqio.MixtureRegistry.add(
      "tiny_eval_mix", [("t5lite_span_corruption", 1.0), ("t5lite_arithmetic", 1.0)])
"""


@pytest.mark.slow
def test_train_eval_writes_the_mixture_and_each_task(tmp_path):
  (tmp_path / "mix_tasks.py").write_text(MIX_MODULE)
  model_dir = str(tmp_path / "run")
  args = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIXTURE_OR_TASK_NAME='tiny_eval_mix'",
          "--gin.MIXTURE_OR_TASK_MODULE='mix_tasks'",
          "--gin.train_lib.train.run_eval_before_training=True"]
  result = run_cli(args, cwd=str(tmp_path))
  assert result.returncode == 0, result.stderr[-3000:]
  eval_dir = os.path.join(model_dir, "training_eval")
  assert sorted(os.listdir(eval_dir)) == ["t5lite_arithmetic", "t5lite_span_corruption",
                                          "tiny_eval_mix"]
  losses = {name: scalars(os.path.join(eval_dir, name), "loss") for name in os.listdir(eval_dir)}
  for name, by_step in losses.items():
    # Before training, at the eval period and at the final step.
    assert sorted(by_step) == [0, 2, 4], name
  # Different data, different numbers: each directory holds its own task.
  assert losses["t5lite_arithmetic"][4] != losses["t5lite_span_corruption"][4]
  assert not os.path.exists(os.path.join(model_dir, "inference_eval"))
