"""A newcomer's path: clone, README's two commands, then the quickstart in order.

The clone is of the committed HEAD. Installing takes minutes, so the clone
borrows the checkout's virtualenv (a `.venv` link) and puts its own code
first on the Python path; `make -n` shows that the Makefile still does what
the README promises. Commands run in their CI-sized form (tests/test_docs.py).
"""

import glob
import json
import os
import subprocess

import pytest
from test_cli import scalars
from test_docs import REPO, Sandbox, ci_line, free_port, run_document


def make_dry(clone, target):
  result = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=clone,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout


def jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.docs
@pytest.mark.longest
def test_clone_readme_and_quickstart(tmp_path):
  clone = str(tmp_path / "t5lite")
  subprocess.run(["git", "clone", "--quiet", REPO, clone], check=True, timeout=300)
  os.symlink(os.path.join(REPO, ".venv"), os.path.join(clone, ".venv"))
  env = {"PYTHONPATH": clone}
  where = subprocess.run([os.path.join(clone, ".venv", "bin", "python"), "-c",
                          "import t5lite; print(t5lite.__file__)"], env={**os.environ, **env},
                         cwd=str(tmp_path), capture_output=True, text=True, check=True, timeout=300)
  assert where.stdout.strip().startswith(clone)  # the clone's code, not the checkout's

  # README: `make train` makes the virtualenv, installs and trains the headline
  # config into runs/pretrain; `make test` installs the same way and runs pytest.
  train = make_dry(clone, "train")
  assert "-m venv .venv" in train and "pip install --quiet -e '.[test]'" in train
  assert train.strip().splitlines()[-1] == (
      ".venv/bin/t5lite-train --gin_file=gin/pretrain_moe.gin --gin.MODEL_DIR=\"'runs/pretrain'\"")
  tests = make_dry(clone, "test")
  assert "pip install" in tests and tests.strip().splitlines()[-1].startswith(
      ".venv/bin/python -m pytest") and " tests" in tests

  box = Sandbox(clone, port=free_port(), link_to=None)
  readme_train = ci_line("make train", box, "README.md")
  result = subprocess.run(["bash", "-c", readme_train], cwd=clone, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", **env,
                                          "PATH": f"{clone}/.venv/bin:{os.environ['PATH']}"},
                          timeout=1200)
  assert result.returncode == 0, result.stderr[-3000:]
  pretrain = os.path.join(clone, "runs", "pretrain")
  assert sorted(os.listdir(os.path.join(pretrain, "checkpoints"))) == ["2", "4"]

  print("\n".join(run_document("docs/quickstart.md", box, **env)))  # seconds, with -s

  # What the quickstart says each step writes.
  assert {"config.gin", "model-info.txt", "checkpoints", "train", "training_eval"} <= set(
      os.listdir(pretrain))
  assert sorted(os.listdir(os.path.join(pretrain, "checkpoints"))) == ["2", "4", "6"]  # resumed
  losses = scalars(os.path.join(pretrain, "train"), "loss")
  assert sorted(losses) == [2, 4, 6]
  assert scalars(os.path.join(pretrain, "training_eval", "t5lite_span_corruption"), "loss")
  for run in ("finetune", "finetune_from_dense"):
    decoded = glob.glob(os.path.join(clone, "runs", run, "inference_eval",
                                     "t5lite_sort-*[0-9].jsonl"))
    assert decoded, run
    rows = jsonl(sorted(decoded)[-1])
    assert rows and {"input", "target", "prediction"} <= set(rows[0])
    metrics = jsonl(os.path.join(clone, "runs", run, "inference_eval",
                                 "t5lite_sort-metrics.jsonl"))
    assert metrics and "exact_match" in metrics[-1]
  # Training decoded the whole validation split (t5lite-eval then rewrote
  # runs/finetune's files with its CI-sized example count).
  assert len(jsonl(os.path.join(clone, "runs", "finetune_from_dense", "inference_eval",
                                "t5lite_sort-000004.jsonl"))) == 1000
  predictions = glob.glob(os.path.join(clone, "runs", "predictions", "inputs-*.jsonl"))
  assert len(predictions) == 1
  assert [r["inputs"] for r in jsonl(predictions[0])] == ["sort: 5 3 9", "sort: 1 1 0 7"]
  # The clone is still clean apart from what the commands were meant to write.
  status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True,
                          text=True, check=True, timeout=120).stdout.split("\n")
  written = sorted(line[3:].rstrip("/") for line in status if line)
  assert written == ["inputs.txt"], written  # runs/ and the .venv link are ignored
