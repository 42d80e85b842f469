"""Every JAX internal t5lite uses (t5lite/jax_internals.py) is still where it
was: a JAX upgrade that moves one fails here, naming it, instead of in a
multi-host job."""

import os
import subprocess
import sys

from t5lite import jax_internals


def test_cluster_detection_reads_slurm_and_finds_nothing_outside_a_cluster(monkeypatch):
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "PMI")):
      monkeypatch.delenv(name)
  assert jax_internals.detect_cluster(None, None, 10)[:3] == (None, None, None)
  slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[003-004]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
  for name, value in slurm.items():
    monkeypatch.setenv(name, value)
  address, count, index, _ = jax_internals.detect_cluster(None, None, 10)
  assert address.startswith("node003:") and (count, index) == (2, 1)


def test_distributed_runtime_has_the_service_factory_initialize_calls():
  assert callable(jax_internals.distributed_runtime().get_distributed_runtime_service)


def test_coordination_client_is_none_until_a_job_is_joined():
  # A fresh process: the test processes never join a job themselves.
  out = subprocess.run([sys.executable, "-c", "from t5lite import jax_internals; "
                        "print(jax_internals.coordination_client())"],
                       capture_output=True, text=True, check=True, timeout=300)
  assert out.stdout.strip() == "None"


def test_registered_platforms_include_cpu():
  platforms = jax_internals.registered_platforms()
  assert "cpu" in platforms and all(isinstance(p, str) for p in platforms)


def test_no_other_module_reaches_into_jax_private_modules():
  root = os.path.join(os.path.dirname(jax_internals.__file__))
  offenders = []
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      if name.endswith(".py") and path != jax_internals.__file__:
        with open(path, encoding="utf-8") as f:
          if "jax._src" in f.read():
            offenders.append(os.path.relpath(path, root))
  assert not offenders, offenders
