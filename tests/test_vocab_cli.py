"""`t5lite-vocab` through the real console script: a vocabulary that seqio
loads, one-line errors, and a training run (in this process) on it with the
printed flags."""

import gzip
import os
import re
import shlex
import shutil
import subprocess

import pytest
import seqio
from test_cli import BIN, SHALLOW, TINY, run_in_process, tool_error_line

from t5lite import vocab_cli
from t5lite.data import build_corpus


SENTENCE = "The quick brown fox jumps over the lazy dog, twice."


def run(script, args, cwd):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([os.path.join(BIN, script), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def write_text(directory, lines=3000):
  """Two plain text files cut from the embedded corpus."""
  with gzip.open(build_corpus.corpus_file("train"), "rt", encoding="utf-8") as f:
    text = [next(f) for _ in range(lines)]
  os.makedirs(directory, exist_ok=True)
  for i, part in enumerate((text[: lines // 2], text[lines // 2:])):
    with open(os.path.join(directory, f"part{i}.txt"), "w", encoding="utf-8") as f:
      f.writelines(part)


def printed_flags(stdout):
  return shlex.split(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained_vocab(tmp_path_factory):
  """One `t5lite-vocab` run, shared read-only: (its folder, with text/ and
  vocab/my.model, and its result)."""
  folder = tmp_path_factory.mktemp("vocab")
  write_text(folder / "text")
  result = run("t5lite-vocab", ["--input=text/part*.txt", "--model_prefix=vocab/my",
                                "--vocab_size=300", "--model_type=bpe", "--max_sentences=2000"],
               cwd=str(folder))
  assert result.returncode == 0, result.stderr[-3000:]
  return folder, result


@pytest.mark.slow  # a real process
def test_vocab_round_trips_and_prints_gin_flags(trained_vocab):
  folder, result = trained_vocab
  path = folder / "vocab" / "my.model"
  assert f"Wrote {path}: 300 bpe pieces from 2 file(s)." in result.stdout
  flags = printed_flags(result.stdout)
  assert flags == ["--gin.VOCABULARY=@vocabularies.sentencepiece_vocabulary()",
                   f"--gin.vocabularies.sentencepiece_vocabulary.model_path='{path}'",
                   "--gin.VOCAB_SIZE=512"]  # 300 pieces + 100 extra ids, padded to 128s
  vocab = seqio.SentencePieceVocabulary(str(path), extra_ids=100)
  assert vocab.vocab_size == 400
  ids = vocab.encode(SENTENCE)
  assert vocab.decode(ids) == SENTENCE and len(ids) < len(SENTENCE)
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)  # T5's layout


@pytest.mark.slow  # real processes
def test_vocab_bad_input_is_one_line(tmp_path, monkeypatch):
  # The console script once (exit 2, its last line), then in this process.
  missing = run("t5lite-vocab", ["--input=nope/*.txt", "--model_prefix=v", "--vocab_size=300"],
                cwd=str(tmp_path))
  assert missing.returncode == 2
  assert re.fullmatch(r"t5lite-vocab: ValueError: --input 'nope/\*\.txt' matches no file;.*",
                      missing.stderr.strip().splitlines()[-1])
  (tmp_path / "small.txt").write_text("a few words\nand a few more\n")
  line = tool_error_line(vocab_cli.train_vocabulary, "t5lite-vocab",
                         ["--input=small.txt", "--model_prefix=v", "--vocab_size=300"],
                         str(tmp_path), monkeypatch)
  assert line.startswith("t5lite-vocab: ValueError: "), line
  assert "Vocabulary size too high (300)" in line and "Use a smaller vocab_size" in line
  assert not (tmp_path / "v.model").exists()


TASK_MODULE = '''
import seqio
from t5lite.data import preprocessors, vocabularies

vocab = vocabularies.sentencepiece_vocabulary("vocab/my.model")
seqio.TaskRegistry.remove("my_text")
seqio.TaskRegistry.add(
    "my_text",
    source=seqio.TextLineDataSource({"train": "text/part0.txt", "validation": "text/part1.txt"}),
    preprocessors=[preprocessors.line_to_targets, seqio.preprocessors.tokenize,
                   preprocessors.span_corruption, seqio.preprocessors.append_eos_after_trim],
    output_features={"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)},
    metric_fns=[])
'''


@pytest.mark.slow  # the fixture's real t5lite-vocab process
def test_training_with_the_printed_flags(trained_vocab, tmp_path, monkeypatch):
  folder, result = trained_vocab
  shutil.copytree(folder, tmp_path, dirs_exist_ok=True)  # text/ and vocab/ for the task
  (tmp_path / "my_tasks.py").write_text(TASK_MODULE)
  args = [*TINY, *printed_flags(result.stdout), "--gin.MODEL_DIR='run'",
          "--gin.MIXTURE_OR_TASK_MODULE='my_tasks'", "--gin.MIXTURE_OR_TASK_NAME='my_text'",
          "--gin.TRAIN_STEPS=2",
          # Neither evaluation nor depth has to do with the vocabulary.
          "--gin.EVAL_PERIOD=0", *SHALLOW]
  # The training run in this process: what it writes is what matters here.
  # `run_in_process` takes the module it imports out again after.
  run_in_process(args, str(tmp_path), monkeypatch)
  assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
  info = (tmp_path / "run" / "model-info.txt").read_text()
  assert re.search(r"token_embedder/embedding .* shape \(512, 8\)", info)
  config = " ".join((tmp_path / "run" / "config.gin").read_text().replace("\\\n", "").split())
  assert "VOCAB_SIZE = 512" in config
  assert (f"vocabularies.sentencepiece_vocabulary.model_path = "
          f"'{folder / 'vocab' / 'my.model'}'") in config  # as printed
