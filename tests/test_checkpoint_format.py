"""Checkpoints are plain Orbax: readable with orbax alone, as docs/checkpoints.md shows."""

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
