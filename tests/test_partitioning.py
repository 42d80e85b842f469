"""Partitioner basics on one device and, in a subprocess, on 8 fake devices."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from t5lite import partitioning, testing


def test_standard_rules_t5x_semantics():
  ordered = partitioning.standard_logical_axis_rules()
  assert [m for name, m in ordered if name == "batch"] == [("data", "fsdp", "expert"),
                                                           ("data", "fsdp")]
  assert ordered.index(("expert", "expert")) < ordered.index(("batch", ("data", "fsdp", "expert")))
  rules = dict(ordered)
  assert rules["mlp"] == "model" and rules["heads"] == "model" and rules["vocab"] == "model"
  assert rules["embed"] is None and rules["kv"] is None
  two = partitioning.standard_logical_axis_rules(2, 2)
  assert ("embed", "model") in two and ("embed", "data") in two


def test_additional_rules_are_appended_as_in_t5x_and_override_rules_win():
  # A T5X gin file's additional_rules go after the standard ones: a rule for
  # an axis the standard rules cover never replaces theirs, one for a new
  # axis takes effect.
  extra = [("vocab", None), ("unmodeled", "model")]
  presets = ((partitioning.standard_logical_axis_rules, None),
             (partitioning.fsdp_logical_axis_rules, "fsdp"))
  for make, embed in presets:
    rules = make(additional_rules=extra)
    assert rules[-2:] == extra and rules[:-2] == make()
    p = partitioning.Partitioner(logical_axis_rules=rules)
    assert p.logical_to_mesh_spec(("vocab", "embed")) == P("model", embed)
    assert p.logical_to_mesh_spec(("unmodeled",)) == P("model")
    # override_rules go first and win.
    overridden = partitioning.Partitioner(logical_axis_rules=make(override_rules=extra))
    assert overridden.logical_to_mesh_spec(("vocab", "mlp")) == P(None, "model")


def test_bad_partitioning_dims():
  with pytest.raises(ValueError, match="activation_partitioning_dims=3"):
    partitioning.standard_logical_axis_rules(3)


def test_single_device_layout():
  p = partitioning.Partitioner()
  layout = p.get_data_layout(4)
  assert layout == partitioning.DataLayout(0, 1, True)
  assert dict(p.mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "expert": 1, "seq": 1,
                                "model": 1}


def test_impossible_mesh_names_shape_and_devices():
  p = partitioning.Partitioner(mesh_shape={"data": 3, "model": 2})
  with pytest.raises(ValueError, match=r"has 6 devices, but there are 1"):
    p.validate()
  with pytest.raises(ValueError, match=r"Unknown mesh axes \['tensor'\]"):
    partitioning.Partitioner(mesh_shape={"tensor": 1}).validate()


_EIGHT = textwrap.dedent("""
    import jax, jax.numpy as jnp, flax.linen as nn
    from jax.sharding import PartitionSpec as P
    from t5lite import partitioning
    p = partitioning.Partitioner(num_partitions=2)
    assert dict(p.mesh.shape)["data"] == 4 and dict(p.mesh.shape)["model"] == 2
    layout = p.get_data_layout(16)
    assert (layout.shard_id, layout.num_shards) == (0, 1), layout
    try:
      p.get_data_layout(6)
      raise SystemExit("expected an error")
    except ValueError as e:
      assert "multiple of the data-parallel size 4" in str(e), e
    sh = p.logical_to_sharding({"w": P("embed", "mlp")})["w"]
    assert sh.spec == P(None, "model"), sh.spec
    # A logical constraint inside a partitioned function changes the layout.
    def f(x):
      return nn.with_logical_constraint(x * 2, ("batch", "mlp"))
    fn = p.partition(f, in_shardings=p.batch_sharding(2), out_shardings=None)
    y = fn(jnp.ones((8, 4)))
    # Size-1 mesh axes drop out of the spec; 'model' appears only because of
    # the constraint.
    assert y.sharding.spec == P("data", "model"), y.sharding.spec
    plain = p.partition(lambda x: x * 2, in_shardings=p.batch_sharding(2), out_shardings=None)
    assert "model" not in str(plain(jnp.ones((8, 4))).sharding.spec)
    print("ok")
""")


def test_eight_fake_devices():
  env = dict(os.environ, XLA_FLAGS=testing.fake_device_flags(8),
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _EIGHT], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("ok")


def test_mesh_rules_first_match_wins_and_the_selector_overrides_the_device_kind():
  rules = [("H100", {"fsdp": -1, "model": 8}), ("cpu", {"data": -1}), (".*", {"fsdp": -1})]
  assert partitioning.select_mesh_shape(rules, "NVIDIA H100 80GB HBM3") == {"fsdp": -1, "model": 8}
  assert partitioning.select_mesh_shape(rules, "cpu") == {"data": -1}
  assert partitioning.select_mesh_shape(rules, "TPU v5") == {"fsdp": -1}
  with pytest.raises(ValueError, match=r"No mesh rule matches 'TPU v5'; patterns are \['H100'\]"):
    partitioning.select_mesh_shape(rules[:1], "TPU v5")
  # The device kind selects by default; the selector (--mesh_selector) overrides it.
  p = partitioning.Partitioner(mesh_rules=[("no-such-device", {"model": 4}), (".*", {"fsdp": -1})])
  assert dict(p.mesh.shape)["fsdp"] == len(jax.devices())
  p = partitioning.Partitioner(mesh_rules=[("no-such-device", {"model": 4}), (".*", {"fsdp": -1})],
                               mesh_selector="no-such-device")
  with pytest.raises(ValueError, match=r"has 4 devices, but there are 1"):
    p.validate()


def test_num_partitions_must_agree_with_mesh_shape():
  p = partitioning.Partitioner(num_partitions=2, mesh_shape={"data": -1})
  with pytest.raises(ValueError, match=r"num_partitions=2 contradicts the mesh shape"):
    p.validate()


def test_fsdp_rules_shard_params_not_activations():
  rules = partitioning.fsdp_logical_axis_rules()
  p = partitioning.Partitioner(logical_axis_rules=rules)
  from jax.sharding import PartitionSpec as P
  assert p.logical_to_mesh_spec(("embed", "mlp")) == P("fsdp", "model")
  assert p.logical_to_mesh_spec(("vocab", "embed")) == P("model", "fsdp")
  # The batch already uses fsdp, so activations keep embed whole.
  assert p.logical_to_mesh_spec(("batch", "length", "embed")) == P(("data", "fsdp", "expert"),
                                                                    None, None)


_TWO_HOSTS_MODEL_AXIS = textwrap.dedent("""
    import jax
    from t5lite import partitioning
    # Pretend 8 devices belong to 2 hosts: model=8 would cross hosts.
    class D:
      def __init__(self, i): self.id, self.process_index, self.device_kind = i, i // 4, 'cpu'
    devices = [D(i) for i in range(8)]
    try:
      partitioning.create_mesh({'data': 1, 'model': 8}, devices)
      raise SystemExit('expected an error')
    except ValueError as e:
      assert 'Model-parallel size 8 must divide the 4 devices of a host' in str(e), e
    print('ok')
""")


def test_model_axis_must_stay_inside_a_host():
  out = subprocess.run([sys.executable, "-c", _TWO_HOSTS_MODEL_AXIS], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]


_INDIVISIBLE = textwrap.dedent("""
    import jax
    from t5lite import partitioning, testing
    from t5lite.state_init import state_specs
    model = testing.tiny_decoder_only(num_heads=3)
    p = partitioning.Partitioner(num_partitions=2, mesh_shape={'data': -1, 'model': 2})
    shapes = {'decoder_input_tokens': (1, 8), 'decoder_target_tokens': (1, 8)}
    specs, _ = state_specs(model, p, shapes, None)
    try:
      p.check_divisible(specs.abstract, specs.logical)
      raise SystemExit('expected an error')
    except ValueError as e:
      msg = str(e)
    assert "has shape" in msg and "'heads'" in msg and "size 3" in msg, msg
    assert "mesh axes ('model',) of total size 2" in msg, msg
    print('ok')
""")


def test_indivisible_parameter_dimension_is_named():
  out = subprocess.run([sys.executable, "-c", _INDIVISIBLE], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                             XLA_FLAGS=testing.fake_device_flags(8)))
  assert out.returncode == 0, out.stderr[-3000:]


_TWO_HOST_LAYOUTS = textwrap.dedent("""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from t5lite import partitioning
    host = lambda d: d.id // 4  # 8 fake devices seen as 2 hosts x 4
    def layouts(shape):
      mesh = partitioning.create_mesh(shape)
      sharding = NamedSharding(mesh, P(partitioning.BATCH_MESH_AXES))
      slices = partitioning.host_batch_slices(sharding, 16, host)
      return [partitioning.layout_for_process(slices, p, 16) for p in (0, 1)]
    # Data parallel across hosts: different shards.
    a, b = layouts({'data': 2, 'model': 4})
    assert (a.shard_id, a.num_shards, b.shard_id, b.num_shards) == (0, 2, 1, 2), (a, b)
    assert a.is_first_host_in_replica_set and b.is_first_host_in_replica_set
    # Hosts that differ only along a non-batch axis (seq) hold the same rows:
    # the same shard, and only host 0 is first in the replica set.
    a, b = layouts({'seq': 2, 'model': 4})
    assert (a.shard_id, a.num_shards) == (b.shard_id, b.num_shards) == (0, 1), (a, b)
    assert a.is_first_host_in_replica_set and not b.is_first_host_in_replica_set
    print('ok')
""")


def test_hosts_holding_the_same_rows_read_the_same_shard():
  out = subprocess.run([sys.executable, "-c", _TWO_HOST_LAYOUTS], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                             XLA_FLAGS=testing.fake_device_flags(8)))
  assert out.returncode == 0, out.stderr[-3000:]


def test_batch_shardings_follow_each_features_rank_and_place_the_rows():
  p = partitioning.Partitioner()
  shardings = p.batch_shardings({"tokens": (4, 3), "weights": [4]})
  assert {k: len(s.spec) for k, s in shardings.items()} == {"tokens": 2, "weights": 1}
  assert shardings["tokens"] == p.batch_sharding(2)
  rows = {"tokens": np.arange(12, dtype=np.int32).reshape(4, 3),
          "weights": np.ones(4, np.float32)}
  placed = p.to_global(rows, shardings, global_batch=4)
  assert {k: v.sharding for k, v in placed.items()} == shardings
  np.testing.assert_array_equal(np.asarray(placed["tokens"]), rows["tokens"])
