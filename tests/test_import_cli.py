"""Foreign checkpoints through the console scripts, as docs/checkpoints.md shows.

A Hugging Face folder goes to a fine-tuned, evaluated and exported model in
three commands (t5lite-import, t5lite-train, t5lite-export); a restarted
fine-tune resumes its own checkpoint; the file imported from a T5X run trains
as that run did with only MODEL_DIR and TRAIN_STEPS given; t5lite-infer and
t5lite-eval read T5X and Hugging Face checkpoints directly; bad input is one
line, exit 2, and nothing written.

t5lite-import runs as a process of its own (its flags are not t5lite-train's);
the other commands run in the test process (`run_in_process`), except where
a test is about exit status and console.
"""

import json
import os
import shutil

import interop_helpers as h
import numpy as np
import pytest
from test_cli import run_cli, run_in_process, user_error_line

from t5lite import interop, metrics
from t5lite.interop import huggingface


BYT5 = os.path.join(h.HF, "byt5")
SORT = ["--gin.MIXTURE_OR_TASK_NAME='t5lite_sort'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 24}", "--gin.BATCH_SIZE=32",
        "--gin.CHECKPOINT_PERIOD=2", "--gin.STATS_PERIOD=2", "--gin.EVAL_STEPS=1"]


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _one_line_exit_2(result):  # a t5lite-import process
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("t5lite")]
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


@pytest.mark.slow
def test_hugging_face_folder_to_finetuned_evaluated_exported_in_three_commands(
    tmp_path, monkeypatch):
  cwd = str(tmp_path)
  # 1. The model's gin file.
  _ok(run_cli([f"--source={BYT5}", "--output=byt5.gin"], cwd, script="t5lite-import"))
  text = (tmp_path / "byt5.gin").read_text()
  assert "num_encoder_layers = 4" in text and "VOCABULARY = @vocabularies.byte_vocabulary()" in text
  # 2. Fine-tune from the folder, with train-time inference evaluation.
  train = ["--gin_file=byt5.gin", "--gin_file=gin/runs/finetune.gin",
           f"--gin.INITIAL_CHECKPOINT_PATH='{BYT5}'", "--gin.MODEL_DIR='ft'", *SORT]
  stdout = run_in_process([*train, "--gin.TRAIN_STEPS=2", "--gin.EVAL_PERIOD=2"], cwd, monkeypatch)
  assert f"Imported 70 parameters from {BYT5}" in stdout
  predictions = tmp_path / "ft" / "inference_eval" / "t5lite_sort-000002.jsonl"
  assert len(predictions.read_text().splitlines()) == 1000
  # A restart resumes its own checkpoint, not the import.
  stdout = run_in_process([*train, "--gin.TRAIN_STEPS=4", "--gin.INFER_EVAL_DATASET_CFG=None"],
                          cwd, monkeypatch)
  assert "Restoring step 2 from" in stdout and "Imported" not in stdout
  # 3. Export the fine-tuned checkpoint.
  run_in_process(["--gin_file=byt5.gin", "--gin_file=gin/runs/export.gin",
                  "--gin.CHECKPOINT_PATH='ft'", "--gin.EXPORT_DIR='hf_out'"], cwd, monkeypatch,
                 script="t5lite-export")
  assert sorted(os.listdir(tmp_path / "hf_out")) == [
      "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
      "t5lite-export.json", "tokenizer_config.json"]  # a byte vocabulary: no tokenizer.json
  exported = huggingface.HuggingFaceFolder(str(tmp_path / "hf_out"))
  original = huggingface.HuggingFaceFolder(BYT5)
  assert huggingface.model_config(exported) == huggingface.model_config(original)
  assert set(exported.files) == set(original.files)
  # The export holds the fine-tuned step 4, not the import.
  changed = [n for n in original.files
             if not np.array_equal(exported.array(n).read(), original.array(n).read())]
  assert len(changed) > 40


@pytest.mark.slow
def test_file_imported_from_a_t5x_run_trains_as_that_run_did(tmp_path, monkeypatch):
  """Two steps from T5X's checkpoint_0 with the written file alone give the
  losses T5X's own run logged at those steps (encdec_a/metrics.npz)."""
  cwd = str(tmp_path)
  run = os.path.join(h.DATA, "t5x_train", "encdec_a")
  _ok(run_cli([f"--source={os.path.join(run, 'checkpoint_0')}", "--output=t5x.gin"], cwd,
              script="t5lite-import"))
  assert "\ninclude 'gin/runs/finetune.gin'\n" in (tmp_path / "t5x.gin").read_text()
  run_in_process(["--gin_file=t5x.gin", "--gin.MODEL_DIR='run'", "--gin.TRAIN_STEPS=2"], cwd,
                 monkeypatch)
  losses = metrics.read_scalars(str(tmp_path / "run" / "train"), "loss")
  t5x = np.load(os.path.join(run, "metrics.npz"))
  want = dict(zip(t5x["loss__steps"].tolist(), t5x["loss"].tolist()))
  assert sorted(losses) == [1, 2]
  # Summed over the batch (T5X's loss_normalizing_factor None), in float32.
  np.testing.assert_allclose([losses[1], losses[2]], [want[1], want[2]], rtol=1e-5)


@pytest.mark.slow
def test_infer_and_eval_read_foreign_checkpoints_directly(tmp_path, monkeypatch):
  cwd = str(tmp_path)
  _ok(run_cli([f"--source={h.T5X_CHECKPOINTS['a', 'legacy']}", "--output=a.gin"], cwd,
              script="t5lite-import"))
  (tmp_path / "inputs.txt").write_text("The cat sat on the mat.\nHello world\n")
  # The file carries the T5X run's recipe and its run file; infer.gin after it
  # sets what only training needs.
  run_in_process(["--gin_file=a.gin", "--gin_file=gin/runs/infer.gin",
                  f"--gin.CHECKPOINT_PATH='{h.T5X_CHECKPOINTS['a', 'legacy']}'",
                  "--gin.INFER_OUTPUT_DIR='out'", "--gin.INPUT_FILE='inputs.txt'",
                  "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 32}",
                  "--gin.BATCH_SIZE=2"], cwd, monkeypatch, script="t5lite-infer")
  rows = [json.loads(line) for line in (tmp_path / "out" / "inputs-20.jsonl").open()]
  assert [r["inputs"] for r in rows] == ["The cat sat on the mat.", "Hello world"]

  _ok(run_cli([f"--source={BYT5}", "--output=byt5.gin"], cwd, script="t5lite-import"))
  run_in_process(["--gin_file=byt5.gin", "--gin_file=gin/runs/eval.gin",
                  f"--gin.CHECKPOINT_PATH='{BYT5}'", "--gin.EVAL_OUTPUT_DIR='eval'",
                  "--gin.MIXTURE_OR_TASK_NAME='t5lite_sort'", "--gin.NUM_EVAL_EXAMPLES=16",
                  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 24}",
                  "--gin.BATCH_SIZE=8"], cwd, monkeypatch, script="t5lite-eval")
  rows = (tmp_path / "eval" / "inference_eval" / "t5lite_sort-000000.jsonl").read_text()
  assert len(rows.splitlines()) == 16


@pytest.mark.slow
def test_checkpoint_that_does_not_fit_the_gin_file_writes_nothing(tmp_path, monkeypatch):
  line = user_error_line(["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/runs/finetune.gin",
                          f"--gin.INITIAL_CHECKPOINT_PATH='{BYT5}'", "--gin.MODEL_DIR='ft'",
                          "--gin.TRAIN_STEPS=2", "--gin.EVAL_PERIOD=2", *SORT], str(tmp_path),
                         monkeypatch)
  assert f"Hugging Face t5 folder {BYT5} does not match the model" in line
  assert "but the model (gin file) has" in line
  assert not (tmp_path / "ft").exists()


def _folder_with(tmp_path, drop=(), add=None, config=None):
  folder = tmp_path / "model"
  shutil.copytree(BYT5, folder)
  for name in drop:
    os.remove(folder / name)
  if add:
    name, data = add
    (folder / name).write_bytes(data)
  if config:
    conf = json.loads((folder / "config.json").read_text())
    conf.update(config)
    (folder / "config.json").write_text(json.dumps(conf))
  return str(folder)


@pytest.mark.parametrize("case,pattern", [
    ("pickle", r"pytorch_model.bin is a pickle, which t5lite never loads; convert it to "
               r"safetensors"),
    ("model_type", r"config.json has model_type 'bert'; t5lite imports t5, mt5, "
                   r"switch_transformers"),
    ("truncated", r"model.safetensors is not a readable safetensors file"),
    ("activation", r"feed_forward_proj 'gated-swish' is not one of"),
])
def test_bad_folders_are_one_line_exit_2_and_write_nothing(tmp_path, case, pattern):
  if case == "pickle":
    source = _folder_with(tmp_path, drop=["model.safetensors"],
                          add=("pytorch_model.bin", b"\x80\x04not really"))
  elif case == "model_type":
    source = _folder_with(tmp_path, config={"model_type": "bert"})
  elif case == "truncated":
    data = open(os.path.join(BYT5, "model.safetensors"), "rb").read()
    source = _folder_with(tmp_path, drop=["model.safetensors"],
                          add=("model.safetensors", data[: len(data) // 2]))
  else:
    source = _folder_with(tmp_path, config={"feed_forward_proj": "gated-swish"})
  result = run_cli([f"--source={source}", "--output=x.gin"], str(tmp_path),
                   script="t5lite-import")
  line = _one_line_exit_2(result)
  assert line.startswith("t5lite-import: ValueError: ")
  import re
  assert re.search(pattern, line), line
  assert not (tmp_path / "x.gin").exists()


def test_missing_array_in_a_folder_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  source = _folder_with(tmp_path)
  tensors = load_file(os.path.join(source, "model.safetensors"))
  del tensors["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
  save_file(tensors, os.path.join(source, "model.safetensors"))
  with pytest.raises(ValueError, match=r"does not match its config.json: "
                                       r"decoder.block.1.layer.2.DenseReluDense.wo.weight is "
                                       r"missing"):
    interop.describe(source)
