"""The tokenizer files and generation_config.json of a Hugging Face export.

transformers is not installed here: its files are read as plain JSON, and
the tokenizer they describe is run by a small Unigram Viterbi below, then
compared with SeqIO's own encoding of the same strings. The reference
tokenizer.json and generation_config.json in tests/data/hf/t5_v1_0/ are what
transformers itself wrote for the same spiece.model (make_reference.py).
"""

import json
import os

import interop_helpers as h
import pytest

from t5lite.data import vocabularies
from t5lite.interop import hf_tokenizer, huggingface


T5_V1_0 = os.path.join(h.HF, "t5_v1_0")
SPIECE = os.path.join(T5_V1_0, "spiece.model")
# The last two split differently if every piece scored the same.
TEXTS = ["translate English to German: That is good.", "Hello world",
         "In 2024, 3 of 17 runs (about 17.6%) failed; see PEP 8!",
         "The quick brown fox jumps over the lazy dog.",
         "unbelievably misunderstood interrelationships"]
SPACE = "\u2581"


def _params_and_fields(name):
  folder = huggingface.HuggingFaceFolder(os.path.join(h.HF, name))
  params = {n: array.read() for n, array in huggingface.to_t5lite(folder).items()}
  return params, huggingface.model_config(folder)


@pytest.fixture(scope="module")
def t5_export(tmp_path_factory):
  """(folder, seqio vocabulary) of an export of the T5 v1.0 folder's model."""
  vocab = vocabularies.sentencepiece_vocabulary(SPIECE)
  out = str(tmp_path_factory.mktemp("t5") / "out")
  params, fields = _params_and_fields("t5_v1_0")
  huggingface.export(params, fields, out, hf_tokenizer.describe(vocab), source="t5")
  return out, vocab


@pytest.fixture(scope="module")
def byt5_export(tmp_path_factory):
  vocab = vocabularies.byte_vocabulary()
  out = str(tmp_path_factory.mktemp("byt5") / "out")
  params, fields = _params_and_fields("byt5")
  huggingface.export(params, fields, out, hf_tokenizer.describe(vocab), source="byt5")
  return out, vocab


def _json(folder, name):
  with open(os.path.join(folder, name)) as f:
    return json.load(f)


def _viterbi(word, pieces):
  """Highest-scoring split of `word` into pieces: SentencePiece's Unigram encoding."""
  longest = max(len(p) for p in pieces)
  best = [(0.0, [])] + [None] * len(word)
  for end in range(1, len(word) + 1):
    for start in range(max(0, end - longest), end):
      piece = word[start:end]
      if best[start] is None or piece not in pieces:
        continue
      index, score = pieces[piece]
      candidate = (best[start][0] + score, best[start][1] + [index])
      if best[end] is None or candidate[0] > best[end][0]:
        best[end] = candidate
  assert best[-1] is not None, f"{word!r} has no split into the vocabulary's pieces"
  return best[-1][1]


def _encode(tokenizer, text):
  """What the tokenizer.json pipeline gives for ASCII text (no added tokens in it)."""
  # ASCII text is left as it is by the precompiled (NFKC) map; what the
  # pre-tokenizer does is stated here and checked against the file.
  assert tokenizer["normalizer"]["type"] == "Precompiled"
  metaspace = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always",
               "split": True}
  assert tokenizer["pre_tokenizer"] == {
      "type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]}
  model = tokenizer["model"]
  assert model["type"] == "Unigram" and not model["byte_fallback"]
  pieces = {piece: (i, score) for i, (piece, score) in enumerate(model["vocab"])}
  ids = [i for word in text.split() for i in _viterbi(SPACE + word, pieces)]
  template = tokenizer["post_processor"]
  assert template["type"] == "TemplateProcessing"
  out = []
  for item in template["single"]:
    if "Sequence" in item:
      out += ids
    else:
      out += template["special_tokens"][item["SpecialToken"]["id"]]["ids"]
  return out


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_gives_seqios_ids(t5_export, text):
  folder, vocab = t5_export
  expected = list(vocab.encode(text)) + [vocab.eos_id]
  assert vocab.unk_id not in expected  # every character has a piece
  assert _encode(_json(folder, "tokenizer.json"), text) == expected


def test_tokenizer_json_is_what_transformers_writes(t5_export):
  folder, _ = t5_export
  assert _json(folder, "tokenizer.json") == _json(T5_V1_0, "tokenizer.json")


def test_sentinels_and_special_tokens_have_seqios_ids(t5_export):
  folder, vocab = t5_export
  added = {t["content"]: t for t in _json(folder, "tokenizer.json")["added_tokens"]}
  assert vocab.vocab_size == 2100
  for i in range(100):
    assert added[f"<extra_id_{i}>"]["id"] == vocab.vocab_size - 1 - i
  assert [added[name]["id"] for name in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
  assert all(t["special"] and not t["normalized"] for t in added.values())
  assert len(added) == 103
  config = _json(folder, "tokenizer_config.json")
  assert config["tokenizer_class"] == "T5Tokenizer" and config["extra_ids"] == 100
  assert config["additional_special_tokens"] == [f"<extra_id_{i}>" for i in range(100)]
  names = {k: config[k] for k in ("pad_token", "eos_token", "unk_token")}
  assert names == {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
  # The same special tokens transformers wrote for this spiece.model.
  reference = _json(T5_V1_0, "tokenizer_config.json")
  assert names == {k: reference[k] for k in names}
  assert set(config["additional_special_tokens"]) <= set(reference["extra_special_tokens"])
  special = _json(folder, "special_tokens_map.json")
  assert special == {**names, "additional_special_tokens": config["additional_special_tokens"]}
  with open(os.path.join(folder, "spiece.model"), "rb") as a, open(SPIECE, "rb") as b:
    assert a.read() == b.read()


def test_byt5_tokenizer_config_gives_seqios_ids(byt5_export):
  folder, vocab = byt5_export
  assert not os.path.exists(os.path.join(folder, "tokenizer.json"))
  assert not os.path.exists(os.path.join(folder, "spiece.model"))
  config = _json(folder, "tokenizer_config.json")
  assert config["tokenizer_class"] == "ByT5Tokenizer" and config["extra_ids"] == 100
  names = {k: config[k] for k in ("pad_token", "eos_token", "unk_token")}
  assert names == {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
  # ByT5Tokenizer puts <pad>, </s>, <unk> at 0, 1, 2 and byte b at b + 3,
  # then the sentinels where added_tokens_decoder says: t5lite's ids.
  assert [vocab.pad_id, vocab.eos_id, vocab.unk_id] == [0, 1, 2]
  sentinels = {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}
  assert sentinels == {vocab.vocab_size - 1 - i: f"<extra_id_{i}>" for i in range(100)}
  assert min(sentinels) == 3 + 256 and 3 + 256 + len(sentinels) == vocab.vocab_size
  for text in TEXTS + ["Grüße, 東京"]:
    byt5_ids = [b + 3 for b in text.encode("utf-8")] + [1]
    assert byt5_ids == list(vocab.encode(text)) + [vocab.eos_id]
  assert _json(folder, "special_tokens_map.json") == {
      **names, "additional_special_tokens": [f"<extra_id_{i}>" for i in range(100)]}


@pytest.mark.parametrize("export", ["t5_export", "byt5_export"])
def test_generation_config_has_the_vocabularys_ids(request, export):
  folder, vocab = request.getfixturevalue(export)
  generation = _json(folder, "generation_config.json")
  assert generation == {"decoder_start_token_id": 0, "eos_token_id": vocab.eos_id,
                        "pad_token_id": vocab.pad_id}
  # What transformers writes from T5's config, and what config.json says.
  reference = _json(T5_V1_0, "generation_config.json")
  assert generation == {k: reference[k] for k in generation}
  config = _json(folder, "config.json")
  assert generation == {k: config[k] for k in generation}


def test_the_marker_lists_the_tokenizer_files_and_a_second_export_replaces_them(
    t5_export, tmp_path):
  folder, vocab = t5_export
  names = sorted(os.listdir(folder))
  assert names == ["config.json", "generation_config.json", "model.safetensors",
                   "special_tokens_map.json", "spiece.model", "t5lite-export.json",
                   "tokenizer.json", "tokenizer_config.json"]
  marker = _json(folder, "t5lite-export.json")
  assert set(marker["files"]) == set(names) - {"t5lite-export.json"}
  target = str(tmp_path / "again")
  params, fields = _params_and_fields("t5_v1_0")
  for step in (1, 2):
    written = huggingface.export(params, fields, target, hf_tokenizer.describe(vocab),
                                 source="t5", step=step)
  assert [os.path.basename(w) for w in written] == [
      n for n in names if n != "t5lite-export.json"] + ["t5lite-export.json"]
  assert _json(target, "t5lite-export.json")["step"] == 2


def test_an_unreadable_spiece_model_is_refused_before_writing(tmp_path):
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"not a model")
  params, fields = _params_and_fields("t5_v1_0")
  vocab = hf_tokenizer.Vocabulary(hf_tokenizer.SENTENCEPIECE, 100, str(bad))
  with pytest.raises(ValueError, match=r"bad.model is not a SentencePiece model"):
    huggingface.export(params, fields, str(tmp_path / "out"), vocab, source="t5")
  assert sorted(os.listdir(tmp_path)) == ["bad.model"]
