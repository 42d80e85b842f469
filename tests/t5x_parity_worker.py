"""Runs t5lite on T5X's recorded runs (tests/data/t5x_train/) and prints what it
measured, as JSON: the per-step losses and token accuracies and each
parameter's gap to T5X's
checkpoints. `test_t5x_training.py` starts it in a process of its own with
XLA's default settings, as `t5lite-train` compiles, and no other flags of
the test process; one process measures every case the tests ask for, each in
a directory of its own, one line per case:

  python tests/t5x_parity_worker.py WORKDIR CASE...
"""

import json
import os
import sys
import traceback

import jax
import numpy as np

import gin
from t5lite import checkpoints as ckpt_lib
from t5lite import cli, interop, optimizers, partitioning, state_init, tree_paths
from t5lite import trainer as trainer_lib
from t5lite.interop import t5x


DATA = os.path.join(os.path.dirname(__file__), "data", "t5x_train")


def _load(name):
  with np.load(os.path.join(DATA, name), allow_pickle=False) as f:
    return dict(f)


def _model(tmp_path, source, bindings=()):
  """The model of the gin file `t5lite-import` writes for `source` (the T5X
  run's recipe included), built as `t5lite-train` builds it."""
  path = str(tmp_path / "imported.gin")
  # Every training setting carried (decoding settings do not train).
  omitted = _import_gin_file(source, path)
  for name in omitted:
    assert "decod" in name or name.endswith("decode_fn"), omitted
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin([path], ["MODEL_DIR = 'unused'", "TRAIN_STEPS = 30", *bindings],
                cli.gin_search_paths([]))
  return gin.query_parameter("%MODEL").scoped_configurable_fn()


def _import_gin_file(source, output):
  """Writes the gin file `t5lite-import --source=SOURCE --output=OUTPUT`
  writes (`interop.model_gin`, which the command calls), in this process;
  returns the T5X settings the file leaves out."""
  imported = interop.model_gin(os.path.abspath(source))
  with open(output, "w") as f:
    f.write(imported.text)
  return [omitted.binding for omitted in imported.recipe.omitted]


class _Run:
  """T5X's batches through t5lite's own import, state shardings and train step."""

  def __init__(self, model, model_dir, fixture, restore_step, params_only=True):
    self.fixture = fixture
    self.batches = _load(f"{fixture}/batches.npz")
    restore_path = os.path.join(DATA, fixture, f"checkpoint_{restore_step}")
    self.partitioner = partitioning.Partitioner(mesh_shape={"data": 1},
                                                devices=jax.devices()[:1])
    shapes = {k: v.shape[1:] for k, v in self.batches.items()}
    types = {k: np.dtype(v.dtype) for k, v in self.batches.items()}
    self.specs, init_fn = state_init.state_specs(model, self.partitioner, shapes, types)
    self.batch_shardings = self.partitioner.batch_shardings(shapes)
    step_fn = trainer_lib.Trainer(model, self.partitioner).compile_train_step(
        self.specs.shardings, self.batch_shardings)
    self.step_fn = step_fn
    restore = ckpt_lib.RestoreCheckpointConfig(path=restore_path, mode="specific",
                                               params_only=params_only)
    checkpointer = ckpt_lib.Checkpointer(str(model_dir), None)
    self.state, self.start = state_init.init_or_restore(
        specs=self.specs, init_fn=init_fn, partitioner=self.partitioner,
        checkpointer=checkpointer, restore_cfg=restore, seed=0,
        start=state_init.find_start(str(model_dir), restore))
    checkpointer.close()

  def train(self, end):
    """Steps start+1..end on T5X's batches; the logged losses and token
    accuracies (percent)."""
    losses, accuracies = [], []
    with self.partitioner.activate():
      for index in range(self.start, end):
        batch = {k: jax.device_put(v[index], self.batch_shardings[k])
                 for k, v in self.batches.items()}
        self.state, metrics = self.step_fn(self.state, batch)
        losses.append(float(metrics["loss"]))
        accuracies.append(float(metrics["token_accuracy"]))
    self.start = end
    return losses, accuracies


def _t5x_params(fixture, step):
  """T5X's parameters after `step` updates, in t5lite's names and shapes."""
  arrays = t5x.to_t5lite(t5x.T5xCheckpoint(os.path.join(DATA, fixture, f"checkpoint_{step}")))
  return {name: array.read() for name, array in arrays.items()}


def _param_gaps(params, fixture, step):
  """Per tensor: max |t5lite - T5X| / max |T5X|, keyed by name."""
  want = _t5x_params(fixture, step)
  # Scanned layers as T5X's per-layer names (the exporter's unstacking).
  got = interop._unscan({name: np.asarray(leaf)
                         for name, leaf in tree_paths.leaves_by_name(params).items()})
  assert set(got) == set(want)
  gaps = {name: float(np.max(np.abs(got[name] - want[name])) / np.max(np.abs(want[name])))
          for name in want}
  # And of all parameters together: ||t5lite - T5X|| / ||T5X||.
  squares = lambda tree: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in tree)  # noqa: E731
  gaps[L2] = (squares(got[n] - want[n] for n in want) / squares(want.values())) ** 0.5
  return gaps


L2 = "all parameters (L2)"



def _measure(run, checkpoints, end):
  """Trains to `end`, recording the gaps at each of `checkpoints` on the way."""
  losses, accuracies, gaps = [], [], {}
  for step in [*checkpoints, end]:
    if step > run.start:
      more_losses, more_accuracies = run.train(step)
      losses.extend(more_losses)
      accuracies.extend(more_accuracies)
    if step in checkpoints or step == end:
      gaps[step] = _param_gaps(run.state.params, run.fixture, step)
  return {"losses": losses, "token_accuracies": accuracies,
          "gaps": {str(k): v for k, v in gaps.items()},
          "learning_rate": float(optimizers.learning_rate_from_state(run.state.opt_state))}


def _case(fixture, restore_step, checkpoints, end, bindings=(), params_only=True):
  def run(workdir):
    source = os.path.join(DATA, fixture, f"checkpoint_{restore_step}")
    model = _model(workdir, source, bindings)
    trained = _Run(model, workdir / "run", fixture, restore_step, params_only)
    assert trained.start == (0 if params_only else restore_step), trained.start
    return _measure(trained, checkpoints, end)
  return run


SCANNED = ["transformer.TransformerConfig.scan_layers = True"]
BFLOAT16 = ["transformer.TransformerConfig.dtype = 'bfloat16'"]
CASES = {
    # Thirty steps from T5X's checkpoint_0.
    "start": _case("encdec_a", 0, [10], 30),
    "start_scanned": _case("encdec_a", 0, [10], 30, SCANNED),
    # T5X's run continued from checkpoint_10, its Adafactor state included.
    "resume": _case("encdec_a", 10, [], 30, params_only=False),
    "decoder_only": _case("deconly_b", 0, [10], 20),
    "decoder_only_scanned": _case("deconly_b", 0, [10], 20, SCANNED),
    "bfloat16": _case("encdec_a", 0, [], 30, BFLOAT16),
}


def main(workdir, cases):
  """Prints `RESULT CASE JSON` per case, or `FAILED CASE TRACEBACK` (one
  line) for a case that raised, so that one case's failure fails its own
  test only."""
  for case in cases:
    (workdir / case).mkdir()
    try:
      line = "RESULT " + json.dumps([case, CASES[case](workdir / case)])
    except Exception:  # noqa: BLE001 - reported to the case's test
      line = "FAILED " + json.dumps([case, traceback.format_exc()])
    print(line, flush=True)


if __name__ == "__main__":
  import pathlib
  main(pathlib.Path(sys.argv[1]), sys.argv[2:])
