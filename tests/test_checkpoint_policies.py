"""Save policies as a user sees them on disk: the keep rule by value, the
dry run's "kept at the end" against what Orbax and a real run leave, and
the console script end to end."""

import io
import os

import numpy as np
import pytest
from test_cli import SHALLOW, TINY, run_in_process
from test_dry_run import planned_schedule, train_arguments

import gin
from t5lite import checkpoints as ckpt_lib
from t5lite import dry_run, state_init


def _read(step_dir):
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))


def _on_disk(model_dir):
  return sorted(int(s) for s in os.listdir(os.path.join(model_dir, "checkpoints")) if s.isdigit())


# ---------------------------------------------------------------------------
# The rule, by value


def _save(keep=None, every=None):
  return ckpt_lib.SaveCheckpointConfig(keep=keep, keep_every_n_steps=every)


@pytest.mark.parametrize("existing, saves, save, set_aside, kept", [
    # Issue 35: 100-600 saved, keep 3, resume_step=200 up to step 400. The
    # steps after 200 leave checkpoints/ before the first save.
    (range(100, 700, 100), (300, 400), _save(keep=3), (300, 400, 500, 600), (200, 300, 400)),
    # Fresh: the newest 2; with keep_every_n_steps its multiples stay too.
    ((), (2, 4, 6, 8, 10), _save(keep=2), (), (8, 10)),
    ((), range(1, 8), _save(keep=2, every=3), (), (3, 6, 7)),
    # Steps from before the run count against keep, and go at the first save.
    ((1, 2, 3, 4, 5), (6,), _save(keep=2), (), (5, 6)),
    # A rule changed on resume applies to the older steps as well.
    ((3, 6, 7), (8, 9), _save(keep=2), (), (8, 9)),
    # Nothing to train, or only steps that exist: nothing is deleted.
    ((1, 2, 3, 4, 5), (), _save(keep=2), (), (1, 2, 3, 4, 5)),
    ((1, 2, 3, 4, 5), (5,), _save(keep=2), (), (1, 2, 3, 4, 5)),
    # Set aside and nothing to train: the rest stays as it is.
    ((1, 2, 3, 4, 5, 6), (), _save(keep=1), (5, 6), (1, 2, 3, 4)),
    # keep None keeps every step; so does no save config.
    ((1, 2), (3, 4), _save(), (), (1, 2, 3, 4)),
    ((1, 2), (3, 4), None, (), (1, 2, 3, 4)),
])
def test_kept_steps(existing, saves, save, set_aside, kept):
  assert ckpt_lib.kept_steps(existing, saves, save, set_aside) == kept


def test_retained_is_newest_keep_and_multiples_of_keep_every_n():
  assert ckpt_lib.retained([7, 3, 5, 6, 4], _save(keep=2)) == {6, 7}
  assert ckpt_lib.retained([7, 3, 5, 6, 4], _save(keep=1, every=2)) == {4, 6, 7}
  assert ckpt_lib.retained([7, 3], _save(keep=5)) == {3, 7}


# ---------------------------------------------------------------------------
# The dry run names what a run leaves


_STATE = {"step": np.zeros((), np.int32), "params": {"w": np.ones((3, 2), np.float32)}}


@pytest.mark.parametrize("existing, total, period, keep, every, resume_step", [
    ((), 7, 1, 2, 3, None),             # fresh: 3, 6, 7
    ((), 10, 4, 2, None, None),         # the last step, off the period: 8, 10
    ((1, 2, 3, 4, 5), 7, 1, 3, None, None),  # older steps count: 5, 6, 7
    ((2, 4, 6), 7, 1, 1, 2, None),      # a keep period over older steps: 2, 4, 6, 7
    ((1, 2, 3, 4, 5), 5, 1, 2, None, None),  # nothing to train: all stay
    ((1, 2, 3, 4, 5, 6), 4, 1, 3, None, 2),  # the issue's case: 2, 3, 4
    ((1, 2, 3, 4, 5, 6), 2, 1, 1, None, 2),  # resume_step, nothing to train: 1, 2
])
def test_dry_run_kept_is_what_the_checkpointer_leaves(tmp_path, existing, total, period, keep,
                                                      every, resume_step):
  """The dry run's schedule, carried out by a Checkpointer as the run does:
  steps set aside once the start step restored, then a save at each
  checkpoint step (a tiny state: only what Orbax keeps matters here)."""
  before = ckpt_lib.Checkpointer(str(tmp_path), _save())
  for step in existing:
    before.save(step, _STATE)
  before.close()
  schedule = planned_schedule(tmp_path, total=total, ckpt=period, eval_=period, keep=keep,
                              every=every, resume_step=resume_step)
  plan = state_init.find_start(str(tmp_path), None, resume_step).plan
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), _save(keep, every))
  if plan.aside_subdir:
    checkpointer.set_aside(plan.set_aside, plan.aside_subdir)
  for step in schedule.checkpoints:
    checkpointer.save(step, _STATE)
  checkpointer.close()
  assert _on_disk(tmp_path) == list(schedule.kept)


def test_dry_run_of_the_issue_example_keeps_200_300_400(tmp_path):
  # Only directory listings are read: empty step directories will do.
  for step in range(100, 700, 100):
    os.makedirs(tmp_path / "checkpoints" / str(step))
  schedule = planned_schedule(tmp_path, total=400, ckpt=100, eval_=100, keep=3, resume_step=200)
  assert schedule.checkpoints == (300, 400)
  assert schedule.kept == (200, 300, 400)


def _printed_kept(report):
  line = next(line for line in report.splitlines() if line.startswith("  checkpoints "))
  return line.split("kept at the end: ")[1] if "kept at the end: " in line else None


# The runs of the two slow tests below are module fixtures, in-process as a
# launch: they train the same tiny model, so they share the module's
# compilation cache (tests/conftest.py) and compile its programs once. What
# is saved and kept depends neither on depth nor on evaluation: 1+1 layers,
# no evaluation.
_SMALL = [*TINY, *SHALLOW, "--gin.EVAL_PERIOD=0"]


_DRY_RUNS = [  # (bindings, the dry run's "kept at the end", the steps on disk after)
    # Fresh, everything kept (the dry run names no kept list).
    (["--gin.TRAIN_STEPS=4", "--gin.CHECKPOINTS_TO_KEEP=None"], None, [1, 2, 3, 4]),
    # Already at step 4: nothing to train, nothing deleted, keep 1 or not.
    (["--gin.TRAIN_STEPS=4", "--gin.CHECKPOINTS_TO_KEEP=1"], "1, 2, 3, 4", [1, 2, 3, 4]),
    # Back to step 2: 3 and 4 move aside before the save at 3, so 1 goes.
    (["--gin.TRAIN_STEPS=3", "--gin.CHECKPOINTS_TO_KEEP=2",
      "--gin.train_lib.train.resume_step=2"], "2, 3", [2, 3]),
    # On to 5 with a keep period: the newest one and the multiples of 2.
    (["--gin.TRAIN_STEPS=5", "--gin.CHECKPOINTS_TO_KEEP=1",
      "--gin.checkpoints.SaveCheckpointConfig.keep_every_n_steps=2"], "2, 4, 5", [2, 4, 5]),
]


@pytest.fixture(scope="module")
def dry_run_then_train(tmp_path_factory):
  """One model_dir through four real runs, in-process, each planned by the
  dry run first: for each, (bindings, the dry run's report, the steps on
  disk after the run)."""
  model_dir = tmp_path_factory.mktemp("dry_run_then_train")
  base = [*_SMALL, f"--gin.MODEL_DIR='{model_dir}'", "--gin.CHECKPOINT_PERIOD=1",
          "--gin.STATS_PERIOD=1"]
  done = []
  with pytest.MonkeyPatch.context() as monkeypatch:
    for extra, _, _ in _DRY_RUNS:
      gin.clear_config(clear_constants=True)
      try:
        kwargs = train_arguments(base + extra)
        out = io.StringIO()
        dry_run.run(out=out, **kwargs)
      finally:
        gin.clear_config(clear_constants=True)
      run_in_process(base + extra, str(model_dir), monkeypatch)
      done.append((extra, out.getvalue(), _on_disk(model_dir)))
  return done


@pytest.mark.slow
def test_dry_run_prints_what_training_leaves(dry_run_then_train):
  """One model_dir through four real runs, in-process, each planned by the
  dry run first."""
  assert len(dry_run_then_train) == len(_DRY_RUNS)
  for (extra, report, on_disk), (_, kept, after) in zip(dry_run_then_train, _DRY_RUNS):
    assert _printed_kept(report) == kept, (extra, report)
    assert on_disk == after, extra


# ---------------------------------------------------------------------------
# End to end through the console script's entry point, in-process (part of
# `make test`)


@pytest.fixture(scope="module")
def period_runs(tmp_path_factory):
  """A 7-step run that saves every step in bfloat16 (keep 2, every 3rd kept),
  resumed to step 8; and a 9-step run saving at a period of 4 and at step 3:
  (the first model_dir, the resume's stdout, the second model_dir)."""
  tmp_path = tmp_path_factory.mktemp("period_runs")
  model_dir = tmp_path / "run"
  args = [*_SMALL, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=7",
          "--gin.CHECKPOINT_PERIOD=1", "--gin.STATS_PERIOD=1",
          "--gin.CHECKPOINTS_TO_KEEP=2",
          "--gin.checkpoints.SaveCheckpointConfig.keep_every_n_steps=3",
          "--gin.checkpoints.SaveCheckpointConfig.dtype='bfloat16'"]
  with pytest.MonkeyPatch.context() as monkeypatch:
    run_in_process(args, str(tmp_path), monkeypatch)
    kept = sorted(int(s) for s in os.listdir(model_dir / "checkpoints"))
    state = _read(model_dir / "checkpoints" / "7")
    # A bfloat16 checkpoint resumes into the float32 run.
    more = run_in_process([*args, "--gin.TRAIN_STEPS=8"], str(tmp_path), monkeypatch)
    model_dir9 = tmp_path / "run9"
    run_in_process([*_SMALL, f"--gin.MODEL_DIR='{model_dir9}'", "--gin.TRAIN_STEPS=9",
                    "--gin.CHECKPOINT_PERIOD=4", "--gin.STATS_PERIOD=1",
                    "--gin.CHECKPOINTS_TO_KEEP=2",
                    "--gin.checkpoints.SaveCheckpointConfig.checkpoint_steps=[3]",
                    "--gin.checkpoints.SaveCheckpointConfig.keep_every_n_steps=3"],
                   str(tmp_path), monkeypatch)
  return dict(kept=kept, state=state, more=more, model_dir9=model_dir9)


@pytest.mark.slow
def test_period_last_step_extra_steps_keep_and_keep_every_n_then_dtype_and_resume(period_runs):
  # Newest two (6, 7) plus every multiple of 3, kept forever (3, 6).
  assert period_runs["kept"] == [3, 6, 7]
  state = period_runs["state"]
  kernel = state["params"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert kernel.dtype.name == "bfloat16"
  moments = [x for x in __import__("jax").tree.leaves(state["opt_state"])
             if np.ndim(x) > 0 and x.dtype.kind == "f"]
  assert moments and all(x.dtype == np.float32 for x in moments)  # optimizer state stays f32
  # A bfloat16 checkpoint resumes into the float32 run.
  more = period_runs["more"]
  assert "Restoring step 7" in more and "step 8/8" in more
  model_dir = period_runs["model_dir9"]
  # Saved: 3 (checkpoint_steps), 4 and 8 (period), 9 (the last step, off the
  # period). Kept: the newest two (8, 9) and multiples of 3 (3, 9); 4 is pruned.
  assert sorted(int(s) for s in os.listdir(model_dir / "checkpoints")) == [3, 8, 9]
  assert int(_read(model_dir / "checkpoints" / "9")["step"]) == 9
