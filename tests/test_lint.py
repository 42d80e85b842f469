"""The tree stays clean under the lint rules of ruff.toml (pyflakes,
pycodestyle, bugbear, import order), so `make test` and CI catch what they
find."""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
  ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
  out = subprocess.run([ruff, "check", "--no-cache", "t5lite", "tests", "benchmarks"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
