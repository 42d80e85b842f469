"""Partitioner basics on one device and, in a subprocess, on 8 fake devices."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from t5lite import partitioning


def test_standard_rules_t5x_semantics():
  rules = dict(partitioning.standard_logical_axis_rules())
  assert rules["batch"] == ("data", "fsdp", "expert")
  assert rules["mlp"] == "model" and rules["heads"] == "model" and rules["vocab"] == "model"
  assert rules["embed"] is None and rules["kv"] is None
  two = partitioning.standard_logical_axis_rules(2, 2)
  assert ("embed", "model") in two and ("embed", "data") in two


def test_bad_partitioning_dims():
  with pytest.raises(ValueError, match="activation_partitioning_dims=3"):
    partitioning.standard_logical_axis_rules(3)


def test_single_device_layout():
  p = partitioning.Partitioner()
  layout = p.get_data_layout(4)
  assert layout == partitioning.DataLayout(4, 0, 1, True)
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
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _EIGHT], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("ok")
