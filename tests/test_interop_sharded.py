"""Imports read each parameter straight into its sharding, shard by shard.

Runs in a subprocess with 8 fake CPU devices under FSDP x tensor-parallel
rules: every imported array must carry the sharding training would give it,
every read must be one device's shard (never the whole array), and the
logits must still be T5X's.
"""

import json
import os
import textwrap

import interop_helpers as h
import pytest

from t5lite import testing


_BODY = """
import json, sys
import jax, numpy as np
sys.path.insert(0, TESTS)
import interop_helpers as h
from t5lite import interop, partitioning as pt
from t5lite import state_init
from t5lite import checkpoints as ckpt_lib
from t5lite.interop import lazy

materialize = lazy.materialize
reads = []
def spying(x, target):
  inner = x.reader
  shard = tuple(target.sharding.shard_shape(tuple(target.shape)))
  def reader(index):
    reads.append((tuple(s.stop - s.start for s in index), shard))
    return inner(index)
  return materialize(lazy.LazyArray(x.shape, x.dtype, reader, x.origin), target)
lazy.materialize = spying

def check(scan):
  del reads[:]
  partitioner = pt.Partitioner(num_partitions=2, mesh_shape={"fsdp": -1, "model": 2},
                               logical_axis_rules=pt.fsdp_logical_axis_rules())
  model = h.t5x_model("a", scan_layers=scan)
  batch = h.t5x_batch("a")
  shapes = {k: (1,) + v.shape[1:] for k, v in batch.items() if k != "decoder_loss_weights"}
  specs, _ = state_init.state_specs(model, partitioner, shapes, {k: np.int32 for k in shapes})
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.params, specs.shardings.params)
  with partitioner.activate():
    params = interop.load_params(PATH, abstract)
  wrong = [str(p) for p, a, t in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                     jax.tree.leaves(params), jax.tree.leaves(abstract))
           if a.sharding != t.sharding]
  sharded = sum(1 for a in jax.tree.leaves(params)
                if a.addressable_shards[0].data.shape != a.shape)
  not_a_shard = [r for r in reads if r[0] != r[1]]
  ref = h.t5x_reference("a")
  logits = np.asarray(model.predict_logits(jax.device_get(params), batch))
  return {"wrong": wrong, "sharded": sharded, "reads": len(reads),
          "not_a_shard": len(not_a_shard),
          "max_diff": float(np.abs(logits - ref["logits"]).max())}

print(json.dumps([check(False), check(True)]))
"""


def _run():
  """Both layer layouts, unscanned then scanned, in one process."""
  code = "\n".join([f"TESTS = {os.path.dirname(__file__)!r}",
                    f"PATH = {h.T5X_CHECKPOINTS['a', 'legacy']!r}",
                    textwrap.dedent(_BODY)])
  out = testing.run_with_devices(code, num_devices=8, timeout=600,
                                 extra_env={"TF_CPP_MIN_LOG_LEVEL": "3"})
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_reads_shards_into_the_training_shardings():
  for got in _run():  # unscanned, then scanned layers
    assert got["wrong"] == []
    assert got["sharded"] > 20  # most kernels are split over the 8 devices
    assert got["reads"] > 0 and got["not_a_shard"] == 0  # each read is one device's shard
    assert got["max_diff"] < 1e-4


@pytest.mark.slow
def test_two_processes_import_and_decode_like_one(tmp_path):
  """A T5X checkpoint read by a 2-process FSDP job (each process reading its
  own shards) decodes exactly what one process decodes (to the last bit of
  the scores: this holds for the code XLA compiles at its default level, not
  at level 0)."""
  from multihost import run_two_processes
  from test_cli import run_cli

  checkpoint = h.T5X_CHECKPOINTS["a", "orbax"]
  (tmp_path / "inputs.txt").write_text("The cat sat on the mat.\nHello world\nabc\nxyz\n")
  result = run_cli([f"--source={checkpoint}", "--output=a.gin"], str(tmp_path),
                   script="t5lite-import")
  assert result.returncode == 0, result.stderr[-2000:]

  def args(out):
    return ["--gin_file=a.gin", "--gin_file=gin/runs/infer.gin",
            "--gin_file=gin/partitioning/fsdp.gin", f"--gin.CHECKPOINT_PATH='{checkpoint}'",
            f"--gin.INFER_OUTPUT_DIR='{out}'", "--gin.INPUT_FILE='inputs.txt'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 32}", "--gin.BATCH_SIZE=8"]

  one = run_cli(args("one"), str(tmp_path), script="t5lite-infer")
  assert one.returncode == 0, one.stderr[-2000:]
  results = run_two_processes(lambda i: args("two"), cwd=str(tmp_path), script="t5lite-infer",
                              timeout=500)
  assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
  want = (tmp_path / "one" / "inputs-20.jsonl").read_text()
  assert len(want.splitlines()) == 4
  assert (tmp_path / "two" / "inputs-20.jsonl").read_text() == want
