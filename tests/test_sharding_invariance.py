"""Results do not depend on the mesh.

Golden partition specs of the tiny models under every partitioning preset,
the same parameters and loss after training on 1 device and under each
preset on 8 (the decoder-only model under fsdp and fsdp_tp: see
TRAIN_PRESETS), a run resumed on a different mesh, and parameters created
already split.

The device count is fixed before JAX starts, so the checks run in one
subprocess with 8 fake CPU devices that prints one JSON line; the tests
compare it with the literal expectations written here.
"""

import json
import textwrap

import pytest

from t5lite import testing


# End-to-end: real processes on 8 fake devices (part of `make test`).
pytestmark = pytest.mark.slow

PRESETS = ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")
TOLERANCE = 1e-5  # float reassociation only; never raise it to make a test pass

# Mesh axes larger than 1, as the gin presets build them on 8 devices.
MESHES = {"data_parallel": {"data": 8}, "fsdp": {"fsdp": 8},
          "tensor_parallel": {"data": 4, "model": 2}, "fsdp_tp": {"fsdp": 4, "model": 2}}

# (mesh spec, shard shape) under data_parallel, fsdp, tensor_parallel, fsdp_tp.
# Mesh axes of size 1 are left out of the spec. Tiny sizes: vocab 384,
# embed 8, heads 4, head_dim (kv) 3, mlp 16, relpos buckets 32.
EMBEDDING = [((None, None), (384, 8)), ((None, "fsdp"), (384, 1)),    # [vocab, embed]
             (("model", None), (192, 8)), (("model", "fsdp"), (192, 2))]
QKV = [((None, None, None), (8, 4, 3)), (("fsdp", None, None), (1, 4, 3)),  # [embed, heads, kv]
       ((None, "model", None), (8, 2, 3)), (("fsdp", "model", None), (2, 2, 3))]
OUT = [((None, None, None), (4, 3, 8)), ((None, None, "fsdp"), (4, 3, 1)),  # [heads, kv, embed]
       (("model", None, None), (2, 3, 8)), (("model", None, "fsdp"), (2, 3, 2))]
WI = [((None, None), (8, 16)), (("fsdp", None), (1, 16)),                # [embed, mlp]
      ((None, "model"), (8, 8)), (("fsdp", "model"), (2, 8))]
WO = [((None, None), (16, 8)), ((None, "fsdp"), (16, 1)),                # [mlp, embed]
      (("model", None), (8, 8)), (("model", "fsdp"), (8, 2))]
LOGITS = [((None, None), (8, 384)), (("fsdp", None), (1, 384)),          # [embed, vocab]
          ((None, "model"), (8, 192)), (("fsdp", "model"), (2, 192))]
RELPOS = [((None, None), (4, 32)), ((None, None), (4, 32)),              # [heads, buckets]
          (("model", None), (2, 32)), (("model", None), (2, 32))]
SCALE = [((None,), (8,)), (("fsdp",), (1,)), ((None,), (8,)), (("fsdp",), (2,))]  # [embed]
# Adafactor statistics keep every dimension of their kernel: the ones they
# reduce have size 1 and are not split, the others split like the kernel's.
ROWS_OF_WI = [((None, None), (8, 1)), (("fsdp", None), (1, 1)),          # [embed, 1]
              ((None, None), (8, 1)), (("fsdp", None), (2, 1))]
COLUMNS_OF_WI = [((None, None), (1, 16)), ((None, None), (1, 16)),       # [1, mlp]
                 ((None, "model"), (1, 8)), ((None, "model"), (1, 8))]
# The embedding [vocab, embed] is factored with embed (the smaller) as rows.
ROWS_OF_EMBEDDING = [((None, None), (1, 8)), ((None, "fsdp"), (1, 1)),   # [1, embed]
                     ((None, None), (1, 8)), ((None, "fsdp"), (1, 2))]
COLUMNS_OF_EMBEDDING = [((None, None), (384, 1)), ((None, None), (384, 1)),  # [vocab, 1]
                        (("model", None), (192, 1)), (("model", None), (192, 1))]
# [embed, heads, kv] is factored as [embed, heads * kv]: rows keep embed,
# columns heads and kv.
ROWS_OF_QKV = [((None, None, None), (8, 1, 1)), (("fsdp", None, None), (1, 1, 1)),
               ((None, None, None), (8, 1, 1)), (("fsdp", None, None), (2, 1, 1))]
COLUMNS_OF_QKV = [((None, None, None), (1, 4, 3)), ((None, None, None), (1, 4, 3)),
                  ((None, "model", None), (1, 2, 3)), ((None, "model", None), (1, 2, 3))]
# Unfactored kernels keep a size-1 placeholder of their rank, replicated.
PLACEHOLDER = [((None, None), (1, 1))] * 4

# The encoder-decoder trains with adafactor factoring every dimension >= 4, so
# its kernels have row/column statistics; the decoder-only keeps the default
# (nothing in a tiny model reaches 128), so its kernels have full `v`.
ENC_DEC_GOLDEN = {
    "params/token_embedder/embedding": EMBEDDING,
    "params/encoder/layers_0/attention/query/kernel": QKV,
    "params/encoder/layers_0/attention/out/kernel": OUT,
    "params/encoder/layers_0/mlp/wi_0/kernel": WI,
    "params/encoder/layers_0/mlp/wo/kernel": WO,
    "params/encoder/relpos_bias/rel_embedding": RELPOS,
    "params/encoder/layers_0/pre_attention_layer_norm/scale": SCALE,
    "params/decoder/layers_0/encoder_decoder_attention/key/kernel": QKV,
    "params/decoder/logits_dense/kernel": LOGITS,
    "v_row:encoder/layers_0/mlp/wi_0/kernel": ROWS_OF_WI,
    "v_col:encoder/layers_0/mlp/wi_0/kernel": COLUMNS_OF_WI,
    "v_row:token_embedder/embedding": ROWS_OF_EMBEDDING,
    "v_col:token_embedder/embedding": COLUMNS_OF_EMBEDDING,
    "v_row:encoder/layers_0/attention/query/kernel": ROWS_OF_QKV,
    "v_col:encoder/layers_0/attention/query/kernel": COLUMNS_OF_QKV,
    "v:encoder/encoder_norm/scale": SCALE,
}
DEC_ONLY_GOLDEN = {
    "params/token_embedder/embedding": EMBEDDING,
    "params/decoder/layers_0/self_attention/query/kernel": QKV,
    "params/decoder/layers_0/self_attention/out/kernel": OUT,
    "params/decoder/layers_0/mlp/wi_0/kernel": WI,
    "params/decoder/layers_0/mlp/wo/kernel": WO,
    "params/decoder/relpos_bias/rel_embedding": RELPOS,
    "params/decoder/decoder_norm/scale": SCALE,
    "params/decoder/logits_dense/kernel": LOGITS,
    "v:decoder/layers_0/mlp/wi_0/kernel": WI,
    "v_row:decoder/layers_0/mlp/wi_0/kernel": PLACEHOLDER,
    "v_col:decoder/layers_0/mlp/wi_0/kernel": PLACEHOLDER,
}
GOLDEN = {"encdec": ENC_DEC_GOLDEN, "deconly": DEC_ONLY_GOLDEN}

# Training runs use one layer per stack (every layer is sharded alike; more
# only add compile time) and dropout, whose masks must not depend on the mesh
# either.
ENC_DEC_TRAIN = {"num_encoder_layers": 1, "num_decoder_layers": 1, "dropout_rate": 0.1}
DEC_ONLY_TRAIN = {"num_decoder_layers": 1, "dropout_rate": 0.1}
# The encoder-decoder trains under every preset. The decoder-only model's
# layers are the decoder's, placed by the same rules, so it trains under the
# presets that split everything the others split: fsdp (the batch and every
# embed dimension, with the oracle below) and fsdp_tp (the batch, embed, and
# heads and mlp over model). Its golden specs are checked under all four.
TRAIN_PRESETS = {"encdec": PRESETS, "deconly": ("fsdp", "fsdp_tp")}


def _per_preset(table):
  return {preset: {name: rows[i] for name, rows in table.items()}
          for i, preset in enumerate(PRESETS)}


def _tuples(x):
  """JSON lists back to the tuples the expectations use."""
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  return x


# Shared by every subprocess: presets as the gin files build them, the two
# tiny models with their data, and helpers that turn arrays and shardings into
# JSON-friendly (mesh spec, shard shape) pairs.
_COMMON = """
import json, os, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from t5lite import optimizers, partitioning as pt, testing, tree_paths
from t5lite import state_init
from t5lite import train as train_lib
from t5lite.data.datasets import DatasetConfig, get_dataset

PRESETS = {
    "single": lambda: pt.Partitioner(devices=jax.devices()[:1]),
    "data_parallel": lambda: pt.Partitioner(mesh_shape={"data": -1}),
    "fsdp": lambda: pt.Partitioner(mesh_shape={"fsdp": -1},
                                   logical_axis_rules=pt.fsdp_logical_axis_rules()),
    "tensor_parallel": lambda: pt.Partitioner(num_partitions=2,
                                              mesh_shape={"data": -1, "model": 2}),
    "fsdp_tp": lambda: pt.Partitioner(num_partitions=2, mesh_shape={"fsdp": -1, "model": 2},
                                      logical_axis_rules=pt.fsdp_logical_axis_rules()),
}

def make_model(kind, **overrides):
  if kind == "encdec":
    model = testing.tiny_encoder_decoder(optimizers.adafactor(0.01, min_dim_size_to_factor=4),
                                         **overrides)
    cfg = DatasetConfig("t5lite_span_corruption", {"inputs": 32, "targets": 16}, "train",
                        batch_size=8, shuffle=False, seed=0, pack=True)
  else:
    model = testing.tiny_decoder_only(**overrides)
    cfg = DatasetConfig("t5lite_lm", {"targets": 32}, "train", batch_size=8, shuffle=False,
                        seed=0, pack=True)
  return model, cfg

def named_leaves(tree):
  is_spec = lambda x: isinstance(x, P)
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)[0]
  return {tree_paths.path_name(path): x for path, x in flat}

def lookup(named, key):
  # 'params/...' is a parameter; 'v_row:<param>' the optimizer field of one.
  if ":" not in key:
    return named[key]
  field, param = key.split(":")
  hits = [v for k, v in named.items()
          if k.startswith("opt_state/") and k.endswith("/" + param) and ("/" + field + "/") in k]
  assert len(hits) == 1, (key, len(hits))
  return hits[0]

def mesh_spec(spec, mesh, ndim):
  # Mesh axes of size 1 split nothing, so they are left out.
  out = []
  for i in range(ndim):
    entry = spec[i] if i < len(spec) else None
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    names = [n for n in names if mesh.shape[n] > 1]
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return out

def placed(x):
  return [mesh_spec(x.sharding.spec, x.sharding.mesh, x.ndim),
          list(x.addressable_shards[0].data.shape)]

def big_axes(mesh):
  return {k: v for k, v in mesh.shape.items() if v > 1}
"""

_SPECS = """
out = {}
for kind in ("encdec", "deconly"):
  model, cfg = make_model(kind)
  shapes = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
  for preset in ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"):
    p = PRESETS[preset]()
    specs, _ = state_init.state_specs(model, p, *shapes)
    abstract, logical = named_leaves(specs.abstract), named_leaves(specs.logical)
    golden = {}
    for key in GOLDEN_KEYS[kind]:
      leaf, spec = lookup(abstract, key), p.logical_to_mesh_spec(lookup(logical, key))
      golden[key] = [mesh_spec(spec, p.mesh, leaf.ndim),
                     list(NamedSharding(p.mesh, spec).shard_shape(leaf.shape))]
    # Every leaf of the state must split evenly, or the preset cannot place it.
    uneven = []
    for name, sharding in named_leaves(specs.shardings).items():
      shape = abstract[name].shape
      for dim, entry in zip(shape, sharding.spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if dim % int(np.prod([p.mesh.shape[n] for n in names])):
          uneven.append(name)
    out[f"{kind}/{preset}"] = {"mesh": big_axes(p.mesh), "golden": golden, "uneven": uneven}
results["specs"] = out
"""

# Records the placement of the state as init_or_restore returns it (before
# any step). The persistent compilation cache lets the resume (_TRAIN_MODEL)
# reuse the executables that the invariance runs compiled for the same meshes.
_TRAIN_SETUP = """
from t5lite.checkpoints import CheckpointConfig, SaveCheckpointConfig
from t5lite.trainer import Trainer
jax.config.update("jax_compilation_cache_dir", os.path.join(ROOT, "compilation_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

started = []  # (start step, state summary) per init_or_restore call
_init_or_restore = state_init.init_or_restore

def recording_init_or_restore(**kwargs):
  state, start = _init_or_restore(**kwargs)
  named = named_leaves(state.state_dict())
  mesh = kwargs["partitioner"].mesh
  logical = named_leaves(kwargs["specs"].logical.state_dict())
  # Independent oracle for fsdp: every 'embed' dimension splits over fsdp.
  oracle = []
  if big_axes(mesh) == {"fsdp": 8}:
    for name, x in named.items():
      if not name.startswith("params/"):
        continue
      want = NamedSharding(mesh, P(*("fsdp" if a == "embed" else None for a in logical[name])))
      shard = tuple(x.addressable_shards[0].data.shape)
      if not x.sharding.is_equivalent_to(want, x.ndim) or shard != want.shard_shape(x.shape):
        oracle.append(f"{name}: {x.sharding.spec} shard {shard}, want {want.spec} "
                      f"shard {want.shard_shape(x.shape)}")
  started.append((start, {
      "mesh": big_axes(mesh),
      "golden": {k: placed(lookup(named, k)) for k in GOLDEN_KEYS[MODEL]},
      "params": sum(n.startswith("params/") for n in named),
      "split_params": sum(n.startswith("params/") and x.addressable_shards[0].data.shape != x.shape
                          for n, x in named.items()),
      "oracle_mismatches": oracle,
      "init_params": jax.device_get(state.params) if start == 0 else None}))
  return state, start

state_init.init_or_restore = recording_init_or_restore

def run(preset, model_dir, total_steps, save=None):
  step, state = train_lib.train(
      model=model, train_dataset_cfg=cfg, checkpoint_cfg=CheckpointConfig(save=save),
      partitioner=PRESETS[preset](), trainer_cls=Trainer, model_dir=model_dir,
      total_steps=total_steps, eval_period=0, random_seed=0)
  return step, jax.device_get(state.params)

def max_abs_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
"""

# Trains MODEL 5 steps on one device and under TRAIN_PRESETS[MODEL] and, for
# the encoder-decoder, resumes a 3-step data_parallel run under fsdp_tp.
_TRAIN_MODEL = """
model, cfg = make_model(MODEL, **TRAIN_OVERRIDES)
batch = next(get_dataset(cfg, 0, 1, model.FEATURE_CONVERTER_CLS, num_epochs=1).as_numpy_iterator())
_loss = jax.jit(lambda params, batch: model.loss_fn(params, batch, None)[0])
host_loss = lambda params: _loss(params, batch)

out = {"steps": {}, "losses": {}, "param_diffs": {}, "init": {}}
for preset in ("single",) + TRAIN_PRESETS[MODEL]:
  out["steps"][preset], params = run(preset, os.path.join(ROOT, MODEL, preset), 5)
  start, summary = started[-1]
  init_params = summary.pop("init_params")
  if preset == "single":
    baseline = params
    out["loss_at_init"] = float(host_loss(init_params))
  out["losses"][preset] = float(host_loss(params))
  out["param_diffs"][preset] = max_abs_diff(params, baseline)
  out["init"][preset] = summary

if MODEL == "encdec":
  resume_dir = os.path.join(ROOT, MODEL, "resume")
  step3, params3 = run("data_parallel", resume_dir, 3, SaveCheckpointConfig(period=3))
  step5, params5 = run("fsdp_tp", resume_dir, 5)
  start, summary = started[-1]
  summary.pop("init_params")
  out["resume"] = {
      "steps": [step3, step5], "restored_from": start, "restored": summary,
      "loss_at_3": float(host_loss(params3)), "loss": float(host_loss(params5)),
      "param_diff": max_abs_diff(params5, baseline),
      "checkpoints": sorted(int(d) for d in os.listdir(os.path.join(resume_dir, "checkpoints"))
                            if d.isdigit())}
results[MODEL] = out
"""


# LLVM's optimisation level only changes how fast the per-device code runs,
# not the partitioned HLO under test, and -O0 compiles the tiny models ~3x
# faster; the flag must be set before JAX starts.
_FAST_COMPILE = """
import os
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
"""


def _run(body, tmp_path, **constants):
  constants = {"GOLDEN_KEYS": {kind: sorted(table) for kind, table in GOLDEN.items()},
               "TRAIN_PRESETS": TRAIN_PRESETS, "ROOT": str(tmp_path), **constants}
  code = (_FAST_COMPILE + "\n".join(f"{k} = {v!r}" for k, v in constants.items())
          + _COMMON + body)
  out = testing.run_with_devices(textwrap.dedent(code), num_devices=8, timeout=1200,
                                 extra_env={"TF_CPP_MIN_LOG_LEVEL": "3"})
  assert out.returncode == 0, out.stderr[-4000:]
  return _tuples(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """What every test checks, from one process (its start-up paid once): the
  golden specs, then each model trained on every mesh."""
  trained = {"encdec": ENC_DEC_TRAIN, "deconly": DEC_ONLY_TRAIN}
  body = ("results = {}\n" + _SPECS + _TRAIN_SETUP
          + f"for MODEL, TRAIN_OVERRIDES in {trained!r}.items():\n"
          + textwrap.indent(_TRAIN_MODEL, "  ") + "print(json.dumps(results))\n")
  return _run(body, tmp_path_factory.mktemp("meshes"))


def test_golden_partition_specs_per_preset(results):
  for kind, table in GOLDEN.items():
    for preset, expected in _per_preset(table).items():
      result = results["specs"][f"{kind}/{preset}"]
      assert result["mesh"] == MESHES[preset], (kind, preset)
      assert result["golden"] == expected, (kind, preset)
      # The tiny model's sizes split evenly under every preset.
      assert result["uneven"] == (), (kind, preset)


def _check_invariance_and_placement(got, kind):
  # The 1e-5 comparisons mean something: training moves the loss far more.
  assert abs(got["loss_at_init"] - got["losses"]["single"]) > 1000 * TOLERANCE
  assert got["steps"] == dict.fromkeys(("single",) + TRAIN_PRESETS[kind], 5)
  baseline = got["losses"]["single"]
  assert got["losses"] == pytest.approx(dict.fromkeys(got["losses"], baseline), rel=TOLERANCE)
  assert max(got["param_diffs"].values()) <= TOLERANCE, got["param_diffs"]

  # Arrays are created already split: the state init_or_restore returns has
  # the golden shardings and its buffers are the shard shapes.
  golden = _per_preset(GOLDEN[kind])
  for preset in TRAIN_PRESETS[kind]:
    init = got["init"][preset]
    assert init["mesh"] == MESHES[preset], preset
    assert init["golden"] == golden[preset], preset
  fsdp = got["init"]["fsdp"]
  assert fsdp["oracle_mismatches"] == ()
  # Every parameter has an embed dimension except the relpos tables (1 per stack).
  stacks = 2 if kind == "encdec" else 1
  assert fsdp["split_params"] == fsdp["params"] - stacks


def test_encoder_decoder_is_mesh_invariant_and_resumes_on_another_mesh(results):
  got = results["encdec"]
  _check_invariance_and_placement(got, "encdec")

  resume = got["resume"]
  assert resume["steps"] == (3, 5)
  assert resume["restored_from"] == 3  # not a fresh init
  assert resume["checkpoints"] == (3,)
  # Restored straight into the fsdp_tp shardings.
  assert resume["restored"]["mesh"] == MESHES["fsdp_tp"]
  assert resume["restored"]["golden"] == _per_preset(ENC_DEC_GOLDEN)["fsdp_tp"]
  assert abs(resume["loss_at_3"] - resume["loss"]) > 1000 * TOLERANCE
  assert resume["loss"] == pytest.approx(got["losses"]["single"], rel=TOLERANCE)
  assert resume["param_diff"] <= TOLERANCE


def test_decoder_only_is_mesh_invariant(results):
  got = results["deconly"]
  _check_invariance_and_placement(got, "deconly")
