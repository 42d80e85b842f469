"""Training parity with T5X: t5lite's train step reproduces T5X's own runs.

`tests/data/t5x_train/` holds runs written by T5X itself (its README): an
encoder-decoder (`encdec_a`, 30 steps, float32 and bfloat16) and a
decoder-only one (`deconly_b`, 20 steps), each with its step-0 state, the
exact batches, every logged metric and later states. A model imported from
a T5X checkpoint with the gin file `t5lite-import` writes (T5X's recipe
included) is trained by the train step `t5lite-train` compiles, on the same
batches, and compared step by step.

Each step's loss is held to 1e-5 relative up to step 10 and 1e-4 after,
checkpoint_10 to 1e-5 and later checkpoints to 1e-4 of each tensor's largest
value, except where T5X is not that close to itself: encdec_a is chaotic
past step 22. T5X, started from its checkpoint_0 with every parameter
changed by one part in 10^7 (about one float32 rounding; `t5x_chaos.npz`,
written by `t5x_chaos.py`, eight seeds), departs from its own logged run by
up to 2e-4 at step 23 and 1.1e-2 at step 30, and by 12-100 % of a tensor's
largest value at checkpoint_30 (1-6 % of the norm of all parameters), while an
unchanged rerun is bitwise equal. No
implementation that is not T5X's compiled program bit for bit can be held
closer than that spread, so there the bound is T5X's own spread. Nor is
T5X bitwise itself on another CPU: replayed on a machine with AVX-512 BF16
and 2 cores (`t5x_chaos_more.npz`, written by `t5x_chaos_more.py`), it
lands 7.3e-5 from deconly_b's checkpoint_20, and up to 1.5e-4 from a
perturbed start, so deconly_b's checkpoint_20 is held to that spread too.
Replayed on the CPU class that wrote the runs (an Intel Xeon with AVX-512,
without BF16; `t5x_chaos_more_xeon.npz`, the same script), T5X is bitwise
its own runs unchanged, and its perturbed starts spread as on the other CPU;
where T5X's spread is a bound, it is the larger of the two CPUs'. The
bfloat16 run, whose kernels differ most between the two, is compared with
T5X's replay on the CPU class the test runs on, where there is one
(`cpu_class.py`).
"""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest


DATA = os.path.join(os.path.dirname(__file__), "data", "t5x_train")
WORKER = os.path.join(os.path.dirname(__file__), "t5x_parity_worker.py")


def _load(name):
  with np.load(os.path.join(DATA, name), allow_pickle=False) as f:
    return dict(f)


METRICS = _load("encdec_a/metrics.npz")
DECODER_ONLY_METRICS = _load("deconly_b/metrics.npz")
BFLOAT16_METRICS = _load("encdec_a_bf16_metrics.npz")
CHAOS = _load("t5x_chaos.npz")
MORE = _load("t5x_chaos_more.npz")  # an AMD EPYC with AVX-512 BF16
XEON = _load("t5x_chaos_more_xeon.npz")  # the CPU class that wrote the runs
OTHER_REPLAYS = (MORE, XEON)


def _this_cpu():
  spec = importlib.util.spec_from_file_location("cpu_class", os.path.join(DATA, "cpu_class.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.cpu_description()


def _replay_on_this_cpu():
  """T5X's replays on a CPU described as the one the tests run on, or None."""
  return next((r for r in OTHER_REPLAYS if str(r["cpu"]) == _this_cpu()), None)


CASES = ("start", "start_scanned", "resume", "decoder_only", "decoder_only_scanned",
         "bfloat16")


@pytest.fixture(scope="module")
def measurements(tmp_path_factory):
  """Every case's measurements (or the traceback of its failure), from one
  worker process with XLA's default settings: its imports and start-up are
  paid once, not per case."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  workdir = tmp_path_factory.mktemp("t5x_parity")
  result = subprocess.run([sys.executable, WORKER, str(workdir), *CASES], env=env,
                          capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stderr[-3000:]
  measured = {}
  for line in result.stdout.splitlines():
    if line.startswith(("RESULT ", "FAILED ")):
      status, payload = line.split(" ", 1)
      case, found = json.loads(payload)
      measured[case] = (status == "RESULT", found)
  assert set(measured) == set(CASES), result.stderr[-3000:]
  return measured


def _measure(case, measurements):
  """The worker's measurements of `case`; fails with its traceback."""
  ok, found = measurements[case]
  assert ok, found
  return found


@dataclasses.dataclass(frozen=True)
class Spread:
  """How far T5X itself lands from one of its logged runs when the run is
  repeated with a one-ulp-scale change of its start (and, for the runs
  measured in `t5x_chaos_more.py`, on another CPU): per step, the largest
  relative loss difference; per checkpoint step, the largest
  max|dp| / max|p| of any tensor and ||dp|| / ||p|| of all parameters."""

  loss: np.ndarray
  checkpoint: dict
  l2: dict


# encdec_a: eight perturbed replays on the machine that wrote the run.
ENCDEC_SPREAD = Spread(
    loss=np.max(np.abs(CHAOS["loss_perturbed"] - CHAOS["loss_logged"]) / CHAOS["loss_logged"],
                axis=0),
    checkpoint={"30": float(np.max(CHAOS["ckpt_rel_diff_perturbed"][:, 1]))},
    l2={"30": float(np.max(CHAOS["param_rel_l2_perturbed"][:, 29]))})


def _replay_spread(run):
  """`run` ('deconly' or 'bf16') replayed by T5X on two CPUs
  (`t5x_chaos_more.py`: an AMD EPYC with AVX-512 BF16 and an Intel Xeon
  without BF16, 2 cores each), unchanged and from eight perturbed starts;
  per step, the largest distance of any of them from the logged run."""
  spreads = []
  for replays in OTHER_REPLAYS:
    logged = replays[f"{run}_loss_logged"]
    losses = np.concatenate([replays[f"{run}_loss_rerun"][None],
                             replays[f"{run}_loss_perturbed"]])
    spreads.append(np.max(np.abs(losses - logged) / logged, axis=0))
  return np.max(spreads, axis=0)


def _replay_checkpoint_spread(key, index):
  return float(max(max(r[f"deconly_ckpt_{key}_rerun"][index],
                       r[f"deconly_ckpt_{key}_perturbed"][:, index].max())
                   for r in OTHER_REPLAYS))


DECONLY_SPREAD = Spread(
    loss=_replay_spread("deconly"),
    checkpoint={str(step): _replay_checkpoint_spread("rel_diff", i)
                for i, step in enumerate([10, 20])},
    l2={str(step): _replay_checkpoint_spread("rel_l2", i) for i, step in enumerate([10, 20])})
L2 = "all parameters (L2)"  # t5x_parity_worker's key


def _loss_bound(step, spread):
  """1e-5 to step 10, 1e-4 after, unless T5X's own spread is larger there."""
  return max(1e-5 if step <= 10 else 1e-4, spread.loss[step - 1])


def _checkpoint_bound(step, spread, which):
  """checkpoint_10 within 1e-5 (T5X's own spread there is 1.3e-5 to 1.7e-5,
  t5lite is held to the issue's bound), later ones within 1e-4 unless T5X's
  own spread is larger."""
  return 1e-5 if step == "10" else max(1e-4, getattr(spread, which).get(step, 0))


def _check(measured, first_step, metrics=METRICS, spread=ENCDEC_SPREAD):
  losses = np.array(measured["losses"])
  want = metrics["loss"][first_step - 1:first_step - 1 + len(losses)]
  for step, gap in enumerate(np.abs(losses - want) / want, start=first_step):
    bound = _loss_bound(step, spread)
    assert gap <= bound, f"step {step}: loss off T5X's by {gap:.2e} (bound {bound:.1e})"
  _check_token_accuracy(measured, first_step, metrics)
  for step, gaps in measured["gaps"].items():
    bound = _checkpoint_bound(step, spread, "l2")
    assert gaps.pop(L2) <= bound, f"all parameters off T5X's checkpoint_{step} (bound {bound:.1e})"
    bound = _checkpoint_bound(step, spread, "checkpoint")
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= bound, (f"{worst} off T5X's checkpoint_{step} by {gaps[worst]:.2e} "
                                  f"(bound {bound:.2e})")
  assert measured["learning_rate"] == pytest.approx(0.1)


def _check_token_accuracy(measured, first_step, metrics):
  """The same tokens right as T5X at each step its loss is matched to 1e-5.

  T5X logs the token accuracy as a fraction (0-1), t5lite as a percentage.
  """
  got = np.array(measured["token_accuracies"])
  want = 100 * metrics["accuracy"][first_step - 1:first_step - 1 + len(got)]
  close = [i for i, step in enumerate(range(first_step, first_step + len(got)), start=0)
           if step <= 10]
  np.testing.assert_allclose(got[close], want[close], rtol=1e-6)


def test_the_fixture_is_t5x_s_own_deterministic_run():
  # On the machine that wrote it, T5X rerun from checkpoint_0 gave its logged
  # losses bitwise (t5x_chaos.py); the spread used past step 22 is T5X's, not
  # t5lite's.
  np.testing.assert_array_equal(CHAOS["loss_rerun"], METRICS["loss"])
  assert np.all(CHAOS["ckpt_rel_diff_rerun"] == 0)
  assert ENCDEC_SPREAD.loss[:10].max() < 1e-5 and ENCDEC_SPREAD.loss[:22].max() < 1e-4
  assert ENCDEC_SPREAD.loss[25:].min() > 1e-4


def test_t5x_on_another_cpu_is_not_bitwise_its_own_run():
  # t5x_chaos_more.py: T5X on a CPU with AVX-512 BF16 and 2 cores (XLA's CPU
  # kernels follow the instruction set and the thread count) reproduces none
  # of the runs bitwise. That is why the bounds past step 10 take T5X's own
  # spread where it is larger: deconly_b's checkpoint_20 is 7.3e-5 away
  # unchanged and up to 1.5e-4 from a perturbed start.
  assert not MORE["deconly_loss_bitwise"] and not MORE["f32_rerun_bitwise"]
  assert not MORE["bf16_loss_bitwise"]
  assert MORE["deconly_ckpt_rel_diff_rerun"][0] < 1e-5
  assert DECONLY_SPREAD.checkpoint["20"] > 1e-4
  assert DECONLY_SPREAD.loss[:10].max() < 1e-5 and DECONLY_SPREAD.loss.max() < 1e-4
  assert MORE["f32_ckpt_rel_diff_rerun"][0] < 1e-5


def test_t5x_on_the_cpu_class_that_wrote_the_runs_is_bitwise_its_own_runs():
  # t5x_chaos_more.py on an Intel Xeon with AVX-512 and without BF16, 2
  # cores: every logged scalar of all three runs, and both checkpoints of
  # encdec_a and deconly_b, bit for bit. Its perturbed starts still spread:
  # the bfloat16 run by up to 9.8e-3 at step 6 (1.3e-2 on the AMD CPU).
  assert "avx512_bf16=no" in str(XEON["cpu"]) and "avx512_bf16=yes" in str(MORE["cpu"])
  assert XEON["deconly_loss_bitwise"] and XEON["bf16_loss_bitwise"]
  assert XEON["f32_rerun_bitwise"] and not XEON["deconly_ckpt_unequal_leaves_rerun"].any()
  assert 5e-3 < XEON["bf16_loss_spread_vs_logged"][5] < MORE["bf16_loss_spread_vs_logged"][5]


@pytest.mark.parametrize("case", ["start", "start_scanned"])
def test_thirty_steps_from_t5x_s_start_match_t5x_s_run(measurements, case):
  measured = _measure(case, measurements)
  assert len(measured["losses"]) == 30 and set(measured["gaps"]) == {"10", "30"}
  _check(measured, 1)


def test_a_t5x_run_continues_from_its_step_10_state(measurements):
  measured = _measure("resume", measurements)
  assert len(measured["losses"]) == 20 and set(measured["gaps"]) == {"30"}
  _check(measured, 11)


@pytest.mark.parametrize("case", ["decoder_only", "decoder_only_scanned"])
def test_decoder_only_twenty_steps_match_t5x_s_run(measurements, case):
  # deconly_b: T5X's own decoder-only run. Its losses stay inside the
  # issue's bounds; at checkpoint_20 T5X's own spread (1.5e-4) is larger.
  measured = _measure(case, measurements)
  assert len(measured["losses"]) == 20 and set(measured["gaps"]) == {"10", "20"}
  _check(measured, 1, DECODER_ONLY_METRICS, DECONLY_SPREAD)


def test_bfloat16_activations_match_t5x_s_bfloat16_run(measurements):
  # bfloat16 keeps 8 significant bits (a rounding of up to 2e-3 per product);
  # two implementations, or two CPUs, that round different intermediate
  # products differ by that much per operation, which a sum over 100+ tokens
  # averages at the first step and training then amplifies. T5X's own
  # bfloat16 run is within 5.2e-5 of its float32 run at step 1 and 6.6e-3 by
  # step 10, then departs by up to 34 % (a loss spike in one run only). Its
  # bfloat16 kernels differ between CPUs (t5x_chaos_more.py): on the AMD CPU
  # its unchanged replay is 7.6e-3 off its logged run at step 6. So the
  # reference is T5X's run on the CPU class the test runs on: its replay
  # there, or its logged run on another class. Hence 1e-3 at step 1, 1e-2 to
  # step 10 or T5X's own spread where larger (its perturbed starts, on this
  # class about its replay, else on either class about its logged run), and
  # nothing per step after (docs/from_t5x.md). The output layer is a float32
  # product, as in T5X (test_models.py); in bfloat16 it was 1.35e-2 off at
  # step 6 on the Xeon, outside T5X's spread there.
  measured = _measure("bfloat16", measurements)
  losses = np.array(measured["losses"])
  replay = _replay_on_this_cpu()
  if replay is None:
    reference, spread = BFLOAT16_METRICS["loss"], _replay_spread("bf16")
  else:
    reference = replay["bf16_loss_rerun"]
    spread = np.max(np.abs(replay["bf16_loss_perturbed"] - reference) / reference, axis=0)
  gaps = np.abs(losses - reference) / reference
  bounds = np.maximum([1e-3] + [1e-2] * 9, spread[:10])
  against = "T5X's replay on this CPU" if replay is not None else "T5X's logged run"
  assert np.all(gaps[:10] <= bounds), (against, _this_cpu(), gaps[:10], bounds)
  # Still training the same way: the loss falls as T5X's does.
  assert losses[20:].mean() < 0.6 * losses[0]
  assert measured["learning_rate"] == pytest.approx(0.1)


@pytest.mark.slow
def test_the_console_continues_a_t5x_run_and_refuses_a_state_that_does_not_fit(tmp_path,
                                                                               monkeypatch):
  from test_cli import run_cli, user_error_line
  cwd = str(tmp_path)
  source = os.path.join(DATA, "encdec_a", "checkpoint_10")
  result = run_cli([f"--source={source}", "--output=run.gin"], cwd, script="t5lite-import")
  assert result.returncode == 0, result.stderr[-2000:]
  whole = "--gin.checkpoints.RestoreCheckpointConfig.params_only=False"
  result = run_cli(["--gin_file=run.gin", "--gin.MODEL_DIR='continued'", "--gin.TRAIN_STEPS=12",
                    "--gin.STATS_PERIOD=1", whole], cwd)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "continuing T5X's run at step 10" in result.stdout
  logged = {int(step): float(loss) for step, loss in
            re.findall(r"step (\d+)/12  loss ([\d.]+)", result.stdout)}
  assert sorted(logged) == [11, 12], result.stdout[-2000:]
  for step, loss in logged.items():  # T5X's losses at steps 11 and 12
    assert loss == pytest.approx(METRICS["loss"][step - 1], rel=1e-5), step
  # A state that does not fit: one line, exit 2, nothing written.
  for binding in ("--gin.optimizers.adafactor.beta1=0.9", "--gin.OPTIMIZER=@optimizers.adamw()"):
    line = user_error_line(["--gin_file=run.gin", "--gin.MODEL_DIR='refused'",
                            "--gin.TRAIN_STEPS=12", whole, binding,
                            "--gin.optimizers.adamw.learning_rate=0.001"], cwd, monkeypatch)
    assert "params_only = True" in line
    assert not os.path.exists(tmp_path / "refused")
