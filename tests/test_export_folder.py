"""Where t5lite-export may write, and that it writes a folder whole or not at all.

An export goes to a new or empty folder, or replaces an earlier export of the
same checkpoint (the `t5lite-export.json` it wrote names the checkpoint and
the files); anything else is refused unless `--overwrite` says so. The
folder is written next to its target and renamed into place, so a failure
leaves no half folder, and an earlier export it was replacing survives.
"""

import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess

import interop_helpers as h
import pytest
from test_cli import BIN, cli_env, run_cli

from t5lite.interop import hf_tokenizer, huggingface


BYT5 = os.path.join(h.HF, "byt5")
SOURCE = "/runs/a/checkpoints"
# An export without a vocabulary; the CLI's byte vocabulary adds ByT5's
# tokenizer files.
HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "t5lite-export.json"]
BYTE_FILES = sorted(HF_FILES + ["special_tokens_map.json", "tokenizer_config.json"])


@pytest.fixture(scope="module")
def byt5():
  """(params, fields) of the small ByT5 folder, as numpy arrays."""
  folder = huggingface.HuggingFaceFolder(BYT5)
  params = {name: array.read() for name, array in huggingface.to_t5lite(folder).items()}
  return params, huggingface.model_config(folder)


def _snapshot(root):
  """Every entry under `root`: relative path -> (mode, bytes of a file)."""
  entries = {}
  for directory, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(directory, name)
      data = open(path, "rb").read() if name in files else None
      entries[os.path.relpath(path, root)] = (os.stat(path).st_mode, data)
  return entries


def _export(byt5, target, source=SOURCE, **kwargs):
  params, fields = byt5
  return huggingface.export(params, fields, str(target), source=source, **kwargs)


def _users_folder(target):
  target.mkdir()
  (target / "config.json").write_text('{"my": "own config"}\n')


def _earlier_export_of_another_checkpoint(target, byt5):
  _export(byt5, target, source="/runs/b/checkpoints")


def _earlier_export_and_a_users_file(target, byt5):
  _export(byt5, target)
  (target / "README.md").write_text("my notes\n")


def _earlier_export_with_an_edited_config(target, byt5):
  _export(byt5, target)
  with open(target / "config.json", "a") as f:
    f.write("\n")


@pytest.mark.parametrize("make,message", [
    (lambda target, byt5: _users_folder(target),
     r"is not empty and was not written by t5lite \(it has no t5lite-export.json\); .* "
     r"pass --overwrite"),
    (_earlier_export_of_another_checkpoint,
     r"holds an export of /runs/b/checkpoints, not of /runs/a/checkpoints"),
    (_earlier_export_and_a_users_file, r"holds README.md, which its export did not write"),
    (_earlier_export_with_an_edited_config,
     r"its config.json changed after the export wrote it"),
    (lambda target, byt5: target.write_text("a file\n"),
     r"Export folder .*/out exists and is not a folder"),
], ids=["users_config", "other_checkpoint", "added_file", "edited_file", "a_file"])
def test_export_refuses_what_it_did_not_write_and_changes_nothing(tmp_path, byt5, make,
                                                                  message):
  make(tmp_path / "out", byt5)
  before = _snapshot(tmp_path)
  with pytest.raises(ValueError, match=message):
    _export(byt5, tmp_path / "out", step=7)
  assert _snapshot(tmp_path) == before


def test_export_replaces_an_earlier_export_of_the_same_checkpoint(tmp_path, byt5):
  _export(byt5, tmp_path / "out", step=2)
  written = _export(byt5, tmp_path / "out", step=4)
  assert written == [str(tmp_path / "out" / name) for name in HF_FILES]
  assert sorted(os.listdir(tmp_path)) == ["out"]
  assert sorted(os.listdir(tmp_path / "out")) == HF_FILES
  marker = json.loads((tmp_path / "out" / "t5lite-export.json").read_text())
  sizes = {name: os.path.getsize(tmp_path / "out" / name) for name in HF_FILES[:-1]}
  assert marker == {"checkpoint": SOURCE, "step": 4, "files": sizes}


def _broken_save_file(tensors, filename, metadata=None):
  with open(filename, "wb") as f:
    f.write(b"half a safetensors file")
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def test_a_failed_export_leaves_no_folder_behind(tmp_path, byt5, monkeypatch):
  monkeypatch.setattr(huggingface, "save_file", _broken_save_file)
  with pytest.raises(OSError, match="No space left on device"):
    _export(byt5, tmp_path / "out")
  assert os.listdir(tmp_path) == []  # neither the folder nor its temporary sibling


@pytest.mark.parametrize("breaks", ["writer", "rename"])
def test_a_failed_overwrite_keeps_the_earlier_export(tmp_path, byt5, monkeypatch, breaks):
  _export(byt5, tmp_path / "out", step=2)
  before = _snapshot(tmp_path)
  if breaks == "writer":
    monkeypatch.setattr(huggingface, "save_file", _broken_save_file)
  else:
    rename = os.rename

    def rename_fails_into_place(src, dst):
      if ".t5lite-export-" in os.path.basename(src):
        raise OSError(errno.EIO, os.strerror(errno.EIO), src)
      rename(src, dst)
    monkeypatch.setattr(os, "rename", rename_fails_into_place)
  with pytest.raises(OSError):
    _export(byt5, tmp_path / "out", step=4, overwrite=True)
  assert _snapshot(tmp_path) == before


# The console script: the target is checked before the checkpoint is read,
# and the checkpoint it names is the one the marker records.


@pytest.fixture(scope="module")
def byt5_gin(tmp_path_factory):
  cwd = tmp_path_factory.mktemp("gin")
  result = run_cli([f"--source={BYT5}", "--output=byt5.gin"], str(cwd), script="t5lite-import")
  assert result.returncode == 0, result.stderr[-3000:]
  return str(cwd / "byt5.gin")


def _export_cli(cwd, gin_file, *flags):
  return run_cli([f"--gin_file={gin_file}", "--gin_file=gin/runs/export.gin",
                  f"--gin.CHECKPOINT_PATH='{BYT5}'", "--gin.EXPORT_DIR='out'", *flags],
                 str(cwd), script="t5lite-export")


def _one_line(result, exit_code):
  assert result.returncode == exit_code, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("t5lite")]
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


def test_cli_refuses_a_folder_holding_the_users_config(tmp_path, byt5_gin):
  _users_folder(tmp_path / "out")
  before = _snapshot(tmp_path)
  line = _one_line(_export_cli(tmp_path, byt5_gin), 2)
  assert line.startswith("t5lite: ValueError: Export folder out is not empty and was not "
                         "written by t5lite"), line
  assert "--overwrite" in line
  assert _snapshot(tmp_path) == before


def test_cli_overwrite_replaces_the_folder(tmp_path, byt5_gin):
  _users_folder(tmp_path / "out")
  (tmp_path / "out" / "notes.txt").write_text("mine\n")
  result = _export_cli(tmp_path, byt5_gin, "--overwrite")
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == ["out"]
  assert sorted(os.listdir(tmp_path / "out")) == BYTE_FILES
  exported = huggingface.HuggingFaceFolder(str(tmp_path / "out"))
  assert huggingface.model_config(exported) == huggingface.model_config(
      huggingface.HuggingFaceFolder(BYT5))


def test_cli_exports_again_over_its_own_export_of_the_same_checkpoint(tmp_path, byt5,
                                                                     byt5_gin):
  # An earlier export of the folder names it by its absolute path.
  _export(byt5, tmp_path / "out", source=os.path.abspath(BYT5), step=3)
  result = _export_cli(tmp_path, byt5_gin)
  assert result.returncode == 0, result.stderr[-3000:]
  marker = json.loads((tmp_path / "out" / "t5lite-export.json").read_text())
  assert marker["checkpoint"] == os.path.abspath(BYT5) and marker["step"] == 0
  # A copy of the checkpoint elsewhere is another checkpoint.
  shutil.copytree(BYT5, tmp_path / "copy")
  before = _snapshot(tmp_path)
  result = run_cli([f"--gin_file={byt5_gin}", "--gin_file=gin/runs/export.gin",
                    "--gin.CHECKPOINT_PATH='copy'", "--gin.EXPORT_DIR='out'"], str(tmp_path),
                   script="t5lite-export")
  assert f"holds an export of {os.path.abspath(BYT5)}, not of {tmp_path / 'copy'}" in \
      _one_line(result, 2)
  assert _snapshot(tmp_path) == before


def _files_up_to(limit):
  """A child's files may not grow past `limit` bytes: the write fails (EFBIG)."""
  def set_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  return set_limit


def test_cli_export_that_runs_out_of_room_leaves_nothing(tmp_path, byt5_gin):
  # model.safetensors is 397 kB; the config (under 1 kB) is written first.
  result = subprocess.run(
      [os.path.join(BIN, "t5lite-export"), f"--gin_file={byt5_gin}",
       "--gin_file=gin/runs/export.gin", f"--gin.CHECKPOINT_PATH='{BYT5}'",
       "--gin.EXPORT_DIR='out'"], cwd=str(tmp_path), env=cli_env(), capture_output=True,
      text=True, timeout=600, preexec_fn=_files_up_to(300_000))
  line = _one_line(result, 5)
  assert f"Writing the model.safetensors of {tmp_path / 'out'} failed" in line, line
  assert "File too large" in line, line
  assert os.listdir(tmp_path) == []


def test_overwrite_is_a_flag_of_export_only(tmp_path):
  line = _one_line(run_cli(["--gin_file=gin/pretrain_dense.gin", "--overwrite"],
                           str(tmp_path)), 2)
  assert "--overwrite is a t5lite-export flag" in line
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask,file_mode,folder_mode", [(0o022, 0o644, 0o755),
                                                         (0o027, 0o640, 0o750)])
def test_every_exported_file_is_as_readable_as_the_umask_allows(tmp_path, byt5, umask,
                                                                 file_mode, folder_mode):
  spiece = os.path.join(h.HF, "t5_v1_0", "spiece.model")
  vocabulary = hf_tokenizer.Vocabulary(hf_tokenizer.SENTENCEPIECE, 100, spiece)
  before = os.umask(umask)
  try:
    written = _export(byt5, tmp_path / "out", vocabulary=vocabulary)
  finally:
    os.umask(before)
  assert {os.path.basename(w) for w in written} >= {"model.safetensors", "tokenizer.json",
                                                    "spiece.model"}
  assert sorted(os.listdir(tmp_path / "out")) == sorted(os.path.basename(w) for w in written)
  modes = {os.path.basename(w): stat.S_IMODE(os.stat(w).st_mode) for w in written}
  assert modes == dict.fromkeys(modes, file_mode)
  assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == folder_mode
