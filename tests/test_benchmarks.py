"""The benchmark scripts run end to end at smoke-test size and report every
figure the performance page quotes. Their figures are measured by `make
bench`; here only their consistency is checked."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "gin/testing/bench_tiny.gin"


def run_script(args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
  assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
  return result.stdout


@pytest.mark.slow
def test_run_reports_mfu_overhead_and_pipeline(tmp_path):
  # The compile sweep and the memory run are further processes; `make
  # docs-check` runs them (docs/performance.md's commands).
  output = tmp_path / "bench.json"
  stdout = run_script(["benchmarks/run.py", f"--gin_file={TINY}", "--steps=6", "--stats=2",
                       "--bare_steps=2", "--pipeline_batches=4", "--compile_depths=",
                       "--memory_steps=0", "--matmul_sizes=64", f"--output={output}"])
  for figure in ("(a) MFU", "(b) framework overhead", "(c) input pipeline",
                 "(d) compile            not measured", "(e) peak host memory   not measured"):
    assert figure in stdout, stdout
  info = json.loads(output.read_text())
  peak = info["matmul_peak"]
  # Measured before and after the config, for both dtypes.
  assert peak["measurements"] == 2
  assert set(peak["all"]) == {"float32 64", "bfloat16 64"}
  assert peak["flops_per_second"] == max(peak["all"].values())
  r = info["results"][TINY]
  # train() ran 6 steps in stats periods of 2; the first period compiles.
  assert len(r["train_loop_steps_per_second"]) == 2
  bare = max(r["bare_steps_per_second"])
  assert r["mfu"] == pytest.approx(r["flops_per_step"] * bare / peak["flops_per_second"])
  assert r["framework_overhead"] == pytest.approx(
      1 - max(r["train_loop_steps_per_second"]) / bare)
  assert r["pipeline_ratio"] == pytest.approx(
      r["pipeline_tokens_per_second"] / r["consumed_tokens_per_second"])
  assert r["tokens_per_batch"] == 4 * (32 + 16)  # local_tiny: batch 4, lengths 32 + 16
  assert "compile_seconds" not in r and "peak_host_memory_bytes" not in r


@pytest.mark.slow
def test_checkpoint_blocking_times_every_save(tmp_path):
  output = tmp_path / "blocking.json"
  run_script(["benchmarks/checkpoint_blocking.py", "--gin_file=gin/pretrain_dense.gin",
              "--gin_file=gin/testing/local_tiny.gin", "--steps=6", "--checkpoint_period=2",
              "--stats=2", f"--output={output}"])
  result = json.loads(output.read_text())
  assert sorted(int(s) for s in result["save_seconds_by_step"]) == [2, 4, 6]
  assert result["mean_step_seconds_without_saves"] > 0


@pytest.mark.slow
def test_decode_benchmark_compares_cached_and_uncached(tmp_path):
  output = tmp_path / "decode.json"
  run_script(["benchmarks/decode.py", "--batch=2", "--length=8", "--repeats=1",
              f"--output={output}"])
  result = json.loads(output.read_text())
  assert result["same_tokens"] is True
  assert result["cached"]["generated_tokens"] == result["uncached"]["generated_tokens"] > 0
