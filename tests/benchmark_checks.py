"""What the benchmark scripts write, checked for consistency.

`make docs-check` runs every command of docs/performance.md at smoke-test
size (tests/test_docs.py, BENCH_TINY_ARGS) and then these checks on the JSON
files those runs wrote. Their figures are measured by `make bench`; here
only their consistency is checked.
"""

import json
import os

import pytest


def _load(results_dir, name):
  with open(os.path.join(results_dir, f"{name}.json"), encoding="utf-8") as f:
    return json.load(f)


def check_run(results_dir, gin_file):
  """benchmarks/run.py on `gin_file`: MFU, framework overhead, pipeline, compile, memory."""
  info = _load(results_dir, "run")
  peak = info["matmul_peak"]
  # Measured before and after the config, for both dtypes.
  assert peak["measurements"] == 2
  assert set(peak["all"]) == {"float32 64", "bfloat16 64"}
  assert peak["flops_per_second"] == {"float32": peak["all"]["float32 64"],
                                      "bfloat16": peak["all"]["bfloat16 64"]}
  r = info["results"][gin_file]
  # MFU counts against the peak of the dtype the model computes in.
  assert r["compute_dtype"] == "bfloat16"  # the dense benchmark config, made tiny
  assert r["peak_flops_per_second"] == peak["flops_per_second"]["bfloat16"]
  assert r["mfu_against_float32_peak"] == pytest.approx(
      r["model_flops_per_second"] / peak["flops_per_second"]["float32"])
  # train() ran 6 steps in stats periods of 2; the first period compiles.
  assert len(r["train_loop_steps_per_second"]) == 2
  bare = max(r["bare_steps_per_second"])
  assert r["mfu"] == pytest.approx(r["flops_per_step"] * bare / r["peak_flops_per_second"])
  assert r["framework_overhead"] == pytest.approx(
      1 - max(r["train_loop_steps_per_second"]) / bare)
  assert r["pipeline_ratio"] == pytest.approx(
      r["pipeline_tokens_per_second"] / r["consumed_tokens_per_second"])
  assert r["tokens_per_batch"] == 4 * (32 + 16)  # local_tiny: batch 4, lengths 32 + 16
  # The compile sweep at depth 1, both layouts, both clocks; a fresh process
  # ran 2 steps for the peak host memory.
  for clock in ("wall", "cpu"):
    for layout in ("unscanned", "scanned"):
      assert list(r["compile_seconds"][clock][layout]) == ["1"]
      assert r["compile_seconds"][clock][layout]["1"] > 0
  assert r["peak_host_memory_bytes"] > 0


def check_checkpoint_blocking(results_dir):
  result = _load(results_dir, "checkpoint_blocking")
  assert sorted(int(s) for s in result["save_seconds_by_step"]) == [2, 4, 6]
  assert result["mean_step_seconds_without_saves"] > 0


def check_decode(results_dir):
  result = _load(results_dir, "decode")
  assert result["same_tokens"] is True
  assert result["cached"]["generated_tokens"] == result["uncached"]["generated_tokens"] > 0


def check_compare_commits(results_dir, gin_file):
  """benchmarks/compare_commits.py: one run of each side (4 steps, stats
  every 2, the first period left out), the same training either way."""
  info = _load(results_dir, "compare_commits")
  r = info["results"][gin_file]
  for side in ("base", "head"):
    [run] = r["runs"][side]
    assert len(run["periods"]) == 1
    assert r[side]["median"] == run["steps_per_second"] == run["periods"][0] > 0
    assert sorted(int(step) for step in run["loss"]) == [2, 4]
    # A process that imported JAX and TensorFlow and trained holds hundreds of MiB.
    assert 2**28 < run["peak_host_bytes"] == r["peak_host_bytes"][side]["median"] < 2**36
  assert r["peak_host_ratio"] == pytest.approx(
      r["peak_host_bytes"]["head"]["median"] / r["peak_host_bytes"]["base"]["median"])
  assert r["ratio"] == pytest.approx(r["head"]["median"] / r["base"]["median"])
  assert r["pair_ratios"]["all"] == [pytest.approx(r["ratio"])]
  # Base is the committed HEAD, head these files: the same numbers.
  assert r["loss_largest_relative_difference"] == 0.0


def check_startup(results_dir, gin_file):
  """benchmarks/startup.py: a cold launch compiles what the warm one loads,
  and the restart resumes from the cold launch's checkpoint with the cache."""
  r = _load(results_dir, "startup")["results"][gin_file]
  [cold], [warm], [restart] = r["runs"]["cold"], r["runs"]["warm"], r["runs"]["restart"]
  assert cold["compiled"] > 0
  assert warm["loaded"] == cold["loaded"] + cold["compiled"] and warm["compiled"] == 0
  # No fresh initialisation to run, the train step and evaluation from the cache.
  assert 0 < restart["loaded"] < warm["loaded"]
  for run in (cold, warm, restart):
    assert 0 < run["first_step_seconds"] < run["total_seconds"]
  for kind, run in (("warm", warm), ("restart", restart)):
    assert r[f"{kind}_over_cold"] == pytest.approx(
        run["first_step_seconds"] / cold["first_step_seconds"])


def check_memory(results_dir, gin_file):
  """benchmarks/memory.py: the estimate and the compiled step's figures add up."""
  info = _load(results_dir, "memory")
  variants = info["results"][gin_file]
  assert set(variants) == {"as configured", "scan_layers", "remat full",
                           "scan_layers + remat full"}
  for r in variants.values():
    e, c = r["estimate"], r["compiled"]
    assert e["total"] == e["parameters"] + e["gradients"] + e["optimizer"] + e["activations"]
    assert c["total"] == c["arguments"] + c["temporaries"] + c["outputs"] - c["aliased"] > 0
    assert r["ratio"] == pytest.approx(e["total"] / c["total"])
    assert r["within_tolerance"] == (abs(r["ratio"] - 1) <= info["tolerance"])
  # Remat in a scan keeps less for the backward pass, in the estimate and compiled.
  full, plain = variants["scan_layers + remat full"], variants["scan_layers"]
  assert full["estimate"]["activations"] < plain["estimate"]["activations"]
  assert full["compiled"]["temporaries"] < plain["compiled"]["temporaries"]


def check_all(results_dir, gin_file, memory_gin_file):
  """Every check, on the JSON files the scripts wrote to `results_dir`
  (memory.py's for its own gin file)."""
  check_run(results_dir, gin_file)
  check_compare_commits(results_dir, gin_file)
  check_startup(results_dir, gin_file)
  check_memory(results_dir, memory_gin_file)
  check_checkpoint_blocking(results_dir)
  check_decode(results_dir)
