"""Params-only restore for fine-tuning: parameters from a checkpoint, fresh step
and optimizer state, assignment maps, shape mismatches, and a restarted
fine-tune resuming its own checkpoints.

Runs train the tiny encoder-decoder in-process: A pretrains 4 steps and B
fine-tunes 2 steps from A's step 4 (both shared by the module); checks of the
restored parameters alone use total_steps=0, which restores without compiling
a train step.
"""

import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest
from test_cli import launch_cache

import gin
from t5lite import checkpoints, cli, feeder, state_init, testing, tree_paths
from t5lite import train as train_lib
from t5lite.checkpoints import CheckpointConfig, RestoreCheckpointConfig, SaveCheckpointConfig
from t5lite.data.datasets import DatasetConfig
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer


CFG = DatasetConfig("t5lite_span_corruption", {"inputs": 32, "targets": 16}, "train", 4, False, 0,
                    pack=True)
SAVE = SaveCheckpointConfig(period=2)
WI = "encoder/layers_0/mlp/wi_0/kernel"


def _model(**overrides):
  """The tiny encoder-decoder with one encoder layer, which compiles faster:
  no check needs a deeper encoder (the assignment map reads decoder layers)."""
  return testing.tiny_encoder_decoder(num_encoder_layers=1, **overrides)


def _flat(tree):
  return {name: np.asarray(x)
          for name, x in tree_paths.leaves_by_name(jax.device_get(tree)).items()}


def _train(monkeypatch, model_dir, restore=None, model=None, total_steps=2):
  """Trains and returns (final step, start step, state at start, final params), flattened."""
  started = []
  original = state_init.init_or_restore

  def recording(**kwargs):
    state, start = original(**kwargs)
    # Read now: the train step donates the state's buffers.
    started.append((start, _flat(state.step), _flat(state.params), _flat(state.opt_state)))
    return state, start

  monkeypatch.setattr(state_init, "init_or_restore", recording)
  with launch_cache():
    step, state = train_lib.train(
        model=model or _model(), train_dataset_cfg=CFG,
        checkpoint_cfg=CheckpointConfig(save=SAVE, restore=restore), partitioner=Partitioner(),
        trainer_cls=Trainer, model_dir=str(model_dir), total_steps=total_steps, eval_period=0,
        random_seed=0)
  start, init_step, init_params, opt_state = started[-1]
  return dict(step=step, start=start, init_step=init_step[""], init_params=init_params,
              opt_state=opt_state, params=_flat(state.params))


def _assert_equal(got, want, names):
  assert names
  for name in names:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _steps(model_dir):
  path = os.path.join(model_dir, "checkpoints")
  return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def _record_prepares_and_batches(monkeypatch):
  """Records, in order, each program the loop prepares (with the names of
  its batch's features) and each batch it takes."""
  from t5lite import partitioning
  events = []
  prepare, take = partitioning.Partitioned.prepare, feeder.TrainData.__next__

  def recording_prepare(self, *args):
    events.append(("prepare", sorted(args[1])))
    return prepare(self, *args)

  def recording_next(self):
    events.append("batch")
    return take(self)

  monkeypatch.setattr(partitioning.Partitioned, "prepare", recording_prepare)
  monkeypatch.setattr(feeder.TrainData, "__next__", recording_next)
  return events


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """Run A: 4 steps from scratch, checkpointed at steps 2 and 4, with the
  programs its loop prepared and the batches it took (`events`)."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    model_dir = tmp_path_factory.mktemp("pretrain")
    events = _record_prepares_and_batches(monkeypatch)
    run = _train(monkeypatch, model_dir, total_steps=4)
  assert run["step"] == 4 and _steps(model_dir) == [2, 4]
  return dict(run, path=str(model_dir / "checkpoints" / "4"), events=events)


def _finetune_cfg(pretrained, **fields):
  return RestoreCheckpointConfig(path=pretrained["path"], mode="specific", params_only=True,
                                 **fields)


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
  """Run B: 2 steps fine-tuned from A's step 4, params only."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    model_dir = tmp_path_factory.mktemp("finetune")
    return dict(_train(monkeypatch, model_dir, _finetune_cfg(pretrained)), model_dir=model_dir)


def test_params_only_takes_params_and_starts_fresh(pretrained, finetuned):
  run = finetuned
  assert run["start"] == 0 and run["init_step"] == 0 and run["step"] == 2
  _assert_equal(run["init_params"], pretrained["params"], list(pretrained["params"]))
  # Fresh optimizer state: what A started from (adafactor count 0, zero statistics),
  # not A's state after 4 steps.
  _assert_equal(run["opt_state"], pretrained["opt_state"], list(pretrained["opt_state"]))
  counts = [v for k, v in run["opt_state"].items() if k.endswith("count")]
  assert counts and all(int(c) == 0 for c in counts)
  assert _steps(run["model_dir"]) == [2]
  assert not np.array_equal(run["params"][WI], pretrained["params"][WI])  # it trained


def test_restarted_finetune_resumes_its_own_checkpoint(pretrained, finetuned, monkeypatch):
  # Same config again: B's own step 2 wins over A's, full state, so there is
  # nothing left to train.
  again = _train(monkeypatch, finetuned["model_dir"], _finetune_cfg(pretrained))
  assert again["start"] == 2 and again["init_step"] == 2 and again["step"] == 2
  _assert_equal(again["init_params"], finetuned["params"], list(finetuned["params"]))
  assert not np.array_equal(again["init_params"][WI], pretrained["params"][WI])
  counts = [v for k, v in again["opt_state"].items() if k.endswith("count")]
  assert counts and all(int(c) == 2 for c in counts)  # B's optimizer state, not a fresh one
  assert _steps(finetuned["model_dir"]) == [2]


# The runs below restore into the model of run A, so they are module fixtures:
# they read the programs A compiled from the module's compilation cache.


@pytest.fixture(scope="module")
def assignment_map_run(pretrained, tmp_path_factory):
  # First full match wins: decoder layer 1 reads A's decoder layer 0, the rest
  # of the decoder keeps its fresh init, everything else reads itself.
  cfg = _finetune_cfg(pretrained, assignment_map=(
      (r"decoder/layers_1/(.*)", r"decoder/layers_0/\1"), (r"decoder/.*", None)))
  with pytest.MonkeyPatch.context() as monkeypatch:  # restore only
    return _train(monkeypatch, tmp_path_factory.mktemp("b"), cfg, total_steps=0)


def test_assignment_map(pretrained, assignment_map_run):
  run = assignment_map_run
  names = list(pretrained["params"])
  layer_1 = [n for n in names if n.startswith("decoder/layers_1/")]
  fresh = [n for n in names if n.startswith("decoder/") and n not in layer_1]
  rest = [n for n in names if not n.startswith("decoder/")]
  assert layer_1 and fresh and any(n.startswith("encoder/") for n in rest)
  _assert_equal(run["init_params"], pretrained["params"], rest)
  _assert_equal(run["init_params"], pretrained["init_params"], fresh)  # seed 0 init
  for name in layer_1:
    np.testing.assert_array_equal(run["init_params"][name],
                                  pretrained["params"][name.replace("layers_1", "layers_0")])
  assert not np.array_equal(pretrained["init_params"][WI], pretrained["params"][WI])


def test_shape_mismatch_strict_fails_before_writing(pretrained, tmp_path, monkeypatch):
  model_dir = tmp_path / "b"
  with pytest.raises(ValueError, match=r"mlp/wi_0/kernel is \(8, 16\) in the checkpoint but "
                                       r"\(8, 24\) in the model"):
    _train(monkeypatch, model_dir, _finetune_cfg(pretrained),
           model=_model(mlp_dim=24))
  assert _steps(model_dir) == []
  assert not any(os.path.exists(model_dir / f) for f in ("config.gin", "model-info.txt", "train"))


def test_shape_mismatch_not_strict_keeps_fresh_init(pretrained, tmp_path, monkeypatch):
  model = _model(mlp_dim=24)
  cfg = _finetune_cfg(pretrained, strict=False, fallback_to_scratch=True)
  run = _train(monkeypatch, tmp_path / "b", cfg, model=model)
  fresh = _train(monkeypatch, tmp_path / "scratch", None, model=model, total_steps=0)
  names = list(pretrained["params"])
  mlp = [n for n in names if "/mlp/" in n]
  rest = [n for n in names if "/mlp/" not in n]
  assert run["step"] == 2 and _steps(tmp_path / "b") == [2] and mlp and rest
  _assert_equal(run["init_params"], fresh["init_params"], mlp)
  _assert_equal(run["init_params"], pretrained["params"], rest)


_OLD_ENCODER = ((r"encoder/(.*)", r"old_encoder/\1"),)


@pytest.fixture(scope="module")
def fallback_run(pretrained, tmp_path_factory):
  cfg = _finetune_cfg(pretrained, assignment_map=_OLD_ENCODER, fallback_to_scratch=True)
  with pytest.MonkeyPatch.context() as monkeypatch:
    return _train(monkeypatch, tmp_path_factory.mktemp("c"), cfg, total_steps=0)


def test_missing_params_fail_unless_fallback(pretrained, fallback_run, tmp_path, monkeypatch):
  cfg = _finetune_cfg(pretrained, assignment_map=_OLD_ENCODER)
  with pytest.raises(ValueError, match=r"encoder/\S+ \(read from old_encoder/\S+\) is missing "
                                       r"from the checkpoint.*\(and \d+ more\)"):
    _train(monkeypatch, tmp_path / "b", cfg, total_steps=0)
  assert _steps(tmp_path / "b") == []
  run = fallback_run  # the same map with fallback_to_scratch=True
  encoder = [n for n in pretrained["params"] if n.startswith("encoder/")]
  decoder = [n for n in pretrained["params"] if n.startswith("decoder/")]
  _assert_equal(run["init_params"], pretrained["init_params"], encoder)
  _assert_equal(run["init_params"], pretrained["params"], decoder)


def test_checkpoint_param_path_first_full_match_wins():
  amap = ((r"decoder/(.*)", None), (r"enc(oder)?/(.*)", r"old/\2"), (r".*", r"never/\g<0>"))
  assert checkpoints.checkpoint_param_path("decoder/x/kernel", amap) is None
  assert checkpoints.checkpoint_param_path("encoder/x/kernel", amap) == "old/x/kernel"
  # fullmatch: 'xdecoder/...' is not caught by the first pair.
  assert checkpoints.checkpoint_param_path("xdecoder/k", amap) == "never/xdecoder/k"
  assert checkpoints.checkpoint_param_path("a/b", ()) == "a/b"


@pytest.mark.parametrize("fields, message", [
    (dict(assignment_map=(("a", None),)), "only apply to a params-only restore"),
    (dict(strict=False), "strict=False only apply"),
    (dict(params_only=True, assignment_map=(("(", None),)), "regex '\\(' does not compile"),
    (dict(params_only=True, assignment_map=(("a",),)), "must be a \\(regex, replacement"),
])
def test_bad_restore_options(fields, message):
  cfg = CheckpointConfig(restore=RestoreCheckpointConfig(path="/x", **fields))
  with pytest.raises(ValueError, match=message):
    checkpoints.validate_config(cfg)


@pytest.mark.parametrize("path", [None, "/tmp/pre/checkpoints/1000"])
def test_finetune_gin_binds_a_params_only_restore(path):
  gin.config.clear_config(clear_constants=True)
  try:
    cli.parse_gin(["gin/models/t5_tiny.gin", "gin/runs/finetune.gin"],
                  ["MODEL_DIR = '/tmp/x'", "MIXTURE_OR_TASK_NAME = 't5lite_span_corruption'",
                   "BATCH_SIZE = 2", "TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 8}",
                   "TRAIN_STEPS = 1", f"INITIAL_CHECKPOINT_PATH = {path!r}"],
                  cli.gin_search_paths([]))
    cfg = gin.get_configurable(CheckpointConfig)()
  finally:
    gin.config.clear_config(clear_constants=True)
  assert cfg.restore == RestoreCheckpointConfig(path=path, mode="specific", params_only=True)


@pytest.fixture(scope="module")
def restarted(pretrained, tmp_path_factory):
  """A copy of run A's model_dir resumed to step 5, with the datasets it
  built (and on which thread) and the batches its pipeline skipped."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    return _restart(pretrained, tmp_path_factory.mktemp("restart") / "resumed", monkeypatch)


def _restart(pretrained, model_dir, monkeypatch):
  from t5lite.data import datasets
  shutil.copytree(os.path.dirname(os.path.dirname(pretrained["path"])), model_dir)
  built = []
  original = datasets.get_dataset

  def recording(cfg, *args, **kwargs):
    built.append((cfg.mixture_or_task_name, threading.current_thread().name))
    return original(cfg, *args, **kwargs)

  skipped = []
  original_build_at = feeder.TrainData._build_at

  def recording_build_at(self, num_batches):
    skipped.append(num_batches)
    return original_build_at(self, num_batches)

  monkeypatch.setattr(datasets, "get_dataset", recording)
  monkeypatch.setattr(feeder.TrainData, "_build_at", recording_build_at)
  return dict(_train(monkeypatch, model_dir, total_steps=5), built=built, skipped=skipped)


def test_a_restart_builds_its_training_pipeline_once_while_the_state_restores(restarted):
  # A's checkpoint holds no data iterator, so the resumed run fast-forwards the
  # pipeline to step 4; it must not also build one at step 0 first. It is
  # built on its own thread, at the batch the restored step continues from.
  run, built, skipped = restarted, restarted["built"], restarted["skipped"]
  assert run["start"] == 4 and run["step"] == 5
  assert built == [(CFG.mixture_or_task_name, "t5lite-data-build")] and skipped == [4]


def test_a_failed_background_build_is_raised_where_the_data_is_needed(monkeypatch):
  data = feeder.TrainData(testing.tiny_encoder_decoder(), CFG, Partitioner(), prefetch_batches=0)

  def failing(num_batches):
    raise ValueError(f"cannot build at {num_batches}")

  monkeypatch.setattr(data, "_build_at", failing)
  data.build_in_background(3)
  assert data.shardings  # declared by the model: no pipeline needed
  with pytest.raises(ValueError, match="cannot build at 3"):
    _ = data.iterator
  # And again: nothing falls back to a pipeline at another position.
  with pytest.raises(ValueError, match="cannot build at 3"):
    next(data)


def test_a_skip_to_where_the_background_build_goes_does_not_wait_for_it(monkeypatch):
  data = feeder.TrainData(testing.tiny_encoder_decoder(), CFG, Partitioner(), prefetch_batches=0)
  release, built = threading.Event(), []
  build_at = data._build_at

  def slow(num_batches):
    assert release.wait(60)
    built.append(num_batches)
    build_at(num_batches)

  monkeypatch.setattr(data, "_build_at", slow)
  data.build_in_background(3)
  data.skip(3)  # returns while the build is still running
  assert built == []
  release.set()
  first = next(data)
  assert built == [3]
  # Once a batch is taken, a skip there again builds anew.
  data.skip(3)
  assert built == [3, 3]
  again = next(data)
  assert all((again[k] == first[k]).all() for k in first)


def test_close_waits_for_a_background_build_still_running(monkeypatch):
  """A run that ends without using its data (already at its target step)
  must not exit while TensorFlow builds on the daemon thread."""
  data = feeder.TrainData(testing.tiny_encoder_decoder(), CFG, Partitioner(), prefetch_batches=0)
  built = []
  build_at = data._build_at

  def slow(num_batches):
    time.sleep(0.5)
    build_at(num_batches)
    built.append(num_batches)

  monkeypatch.setattr(data, "_build_at", slow)
  data.build_in_background(2)
  data.skip(2)
  data.close()
  assert built == [2]


def test_the_loop_prepares_its_step_once_before_it_takes_the_first_batch(pretrained):
  """The train step's program is compiled (on a warm launch, read from
  JAX's cache) while the prefetch thread builds the first batches, not
  after the first one arrives; nothing else prepares a program (run A, from
  scratch, past a checkpoint at step 2)."""
  events = pretrained["events"]
  assert events[0][0] == "prepare" and "encoder_input_tokens" in events[0][1]
  assert events[1:] == ["batch"] * 4
