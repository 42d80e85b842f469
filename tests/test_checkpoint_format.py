"""Checkpoints are plain Orbax: readable with orbax alone, as docs/checkpoints.md shows."""

import json
import os
import re
import subprocess
import sys

import pytest
from test_cli import REPO, SHALLOW, TINY, run_in_process


# End-to-end: a training run and a process of its own (part of `make test`).
pytestmark = pytest.mark.slow


def test_docs_snippet_reads_params_without_t5lite(tmp_path, monkeypatch):
  model_dir = tmp_path / "run"
  run_in_process([*TINY, f"--gin.MODEL_DIR='{model_dir}'", "--gin.EVAL_PERIOD=0",
                  *SHALLOW], str(tmp_path), monkeypatch)
  doc = open(os.path.join(REPO, "docs", "checkpoints.md")).read()
  snippet = re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1)
  snippet = snippet.replace("/path/to/model_dir", str(model_dir))
  # Refuse to run if anything could pull t5lite in.
  guard = "import sys\nsys.modules['t5lite'] = None\n"
  out = subprocess.run([sys.executable, "-c", guard + snippet], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["4", "(384,", "8)"]


# A replicated array saved from 4 devices, first with Orbax's defaults, then
# once t5lite is imported; prints [programs compiled by each save, the
# non-data files each wrote, whether t5lite's save reads back].
_SAVE_REPLICATED = """
import json, os, re, sys
import jax, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

root = sys.argv[1]
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kwargs: compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

def save(name, shape):
  x = jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
                     NamedSharding(mesh, P()))
  before = len(compiles)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(root, name), {"x": x})
  compiled = len(compiles) - before
  step = os.path.join(root, name)
  files = {re.sub(r"(^|/)d/[0-9a-f]+$", r"\\1d/<data>", os.path.relpath(os.path.join(d, f), step))
           for d, _, names in os.walk(step) for f in names}
  with ocp.StandardCheckpointer() as checkpointer:
    back = checkpointer.restore(step)["x"]
  return compiled, sorted(files), bool(np.array_equal(back, x))

default = save("default", (8, 16))
import t5lite.checkpoints
print(json.dumps([default, save("t5lite", (8, 24))]))
"""


def test_the_first_replica_writes_each_array_without_compiling_slices(tmp_path):
  # Orbax's default off GPUs splits a replicated shard across its replicas,
  # compiling a sliced copy per slice shape and device before a save returns;
  # t5lite has the first replica write it whole, into the same kinds of files.
  out = subprocess.run([sys.executable, "-c", _SAVE_REPLICATED, str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu",
                                XLA_FLAGS="--xla_force_host_platform_device_count=4"))
  assert out.returncode == 0, out.stderr[-3000:]
  default, t5lite = json.loads(out.stdout.strip().splitlines()[-1])
  assert default[0] >= 3 and t5lite[0] == 0, (default, t5lite)
  assert t5lite[1] == default[1] and "array_metadatas/process_0" in t5lite[1], (default, t5lite)
  assert default[2] and t5lite[2]
  # The override is meant: importing t5lite prints no warning about it.
  assert "overriding" not in out.stderr, out.stderr[-3000:]
