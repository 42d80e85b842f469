"""A job that is preempted or diverges keeps the user's work."""

import os
import signal
import subprocess

from test_cli import BIN, TINY, run_cli


def test_sigterm_checkpoints_the_current_step_and_resume_loses_nothing(tmp_path):
  model_dir = tmp_path / "run"
  args = [*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=100000",
          "--gin.CHECKPOINT_PERIOD=50000", "--gin.EVAL_PERIOD=50000", "--gin.STATS_PERIOD=1"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([os.path.join(BIN, "t5lite-train"), *args], cwd=str(tmp_path), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:  # wait until training is really under way
    if line.startswith("step 3/"):
      break
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-3000:]
  assert "Preempted at step" in err.strip().splitlines()[-1]
  saved = [int(s) for s in os.listdir(model_dir / "checkpoints")]
  assert len(saved) == 1 and saved[0] >= 3 and saved[0] % 50000
  # The same command continues from exactly that step.
  target = saved[0] + 2
  again = run_cli([*args[:-4], f"--gin.TRAIN_STEPS={target}", "--gin.CHECKPOINT_PERIOD=50000",
                   "--gin.EVAL_PERIOD=50000"], cwd=str(tmp_path))
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"Restoring step {saved[0]}" in again.stdout
  assert f"Training steps {saved[0]} -> {target}" in again.stdout


def test_nan_loss_stops_without_overwriting_good_checkpoints(tmp_path):
  model_dir = tmp_path / "run"
  base = [*TINY, f"--gin.MODEL_DIR='{model_dir}'"]
  good = run_cli([*base, "--gin.TRAIN_STEPS=2"], cwd=str(tmp_path))
  assert good.returncode == 0, good.stderr[-3000:]
  before = sorted(os.listdir(model_dir / "checkpoints"))
  # An absurd learning rate blows the weights up within a couple of steps.
  bad = run_cli([*base, "--gin.TRAIN_STEPS=8",
                 "--gin.optimizers.rsqrt_with_warmup.base_learning_rate=1e37"],
                cwd=str(tmp_path))
  assert bad.returncode == 3, bad.stderr[-3000:]
  last = bad.stderr.strip().splitlines()[-1]
  assert "NonFiniteLossError: Loss became" in last and "at step" in last
  assert sorted(os.listdir(model_dir / "checkpoints")) == before == ["2"]
