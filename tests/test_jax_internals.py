"""Every JAX internal t5lite uses (t5lite/jax_internals.py) is still where it
was: a JAX upgrade that moves one fails here, naming it, instead of in a
multi-host job."""

import ast
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


_WRITE_AS_PROCESS_1 = """
import os, sys
import jax, jax.numpy as jnp
from jax._src import distributed
from t5lite import jax_internals
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
distributed.global_state.process_id = 1  # as process 1 of a job sees itself
if sys.argv[2] == "every":
  jax_internals.write_compilation_cache_in_every_process()
  jax_internals.write_compilation_cache_in_every_process()  # twice wraps once
jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
assert distributed.global_state.process_id == 1
print(sorted(os.listdir(sys.argv[1])))
"""


def test_processes_other_than_0_write_the_compilation_cache_when_told(tmp_path):
  # JAX alone writes nothing from process 1; after the call it writes that
  # process's entry, and leaves the process index as it was.
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  written = {}
  for mode in ("jax", "every"):
    cache = tmp_path / mode
    out = subprocess.run([sys.executable, "-c", _WRITE_AS_PROCESS_1, str(cache), mode],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    written[mode] = [n for n in os.listdir(cache) if n.startswith("jit_")] if cache.exists() else []
  assert written["jax"] == []
  assert any(n.startswith("jit__lambda-") for n in written["every"]), written


_READ_A_DAMAGED_ENTRY = """
import sys, warnings
import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from t5lite import jax_internals
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: x * 3 + 1)(1.0)
(key,) = [n[:-len("-cache")] for n in __import__("os").listdir(sys.argv[1])]
entry, access_time = jax_internals.compilation_cache_entry_files(sys.argv[1], key)
with open(entry, "wb") as f:
  f.write(b"damaged")
seen = []
jax_internals.handle_compilation_cache_read_errors(
    (Exception,), lambda cache_key, error: seen.append(cache_key) or True)
jax_cache.reset_cache()
jax.clear_caches()
with warnings.catch_warnings():
  warnings.simplefilter("error")  # JAX's own warning would fail the read here
  assert jax.jit(lambda x: x * 3 + 1)(1.0) == 4.0
assert seen == [key], seen
print(entry == sys.argv[1] + "/" + key + "-cache", access_time.endswith(key + "-atime"))
"""


def test_failed_compilation_cache_reads_reach_the_handler_with_the_entrys_key(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  out = subprocess.run([sys.executable, "-c", _READ_A_DAMAGED_ENTRY, str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["True", "True"]
def test_platform_aliases_expand_as_jax_expands_them():
  assert jax_internals.expand_platforms("cpu") == ["cpu"]
  assert jax_internals.expand_platforms(" gpu ,cpu") == ["cuda", "rocm", "oneapi", "cpu"]


def test_cuda_is_passed_over_exactly_when_no_nvidia_gpu_is_visible():
  assert jax_internals.passed_over("cpu") is None
  visible = any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))
  assert (jax_internals.passed_over("cuda") is None) == visible


def test_platforms_present_after_a_failed_start_include_cpu():
  script = ("import jax\nfrom t5lite import jax_internals\n"
            "try:\n  jax.devices()\nexcept RuntimeError:\n  pass\n"
            "print(jax_internals.platforms_present())\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="tpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  platforms = ast.literal_eval(out.stdout)
  assert platforms[-1] == "cpu" and "tpu" not in platforms, out.stdout
