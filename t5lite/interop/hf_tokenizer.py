"""The tokenizer files of a Hugging Face export, from t5lite's vocabulary.

`transformers` loads a folder's tokenizer from `tokenizer_config.json` (which
class, which special tokens) and, for a SentencePiece vocabulary, from
`tokenizer.json`: the serialised `tokenizers` pipeline of a T5 fast
tokenizer, so that no SentencePiece package and no conversion is needed to
load it. That pipeline, as `transformers` itself builds it from a
`spiece.model`:

  normalizer     the model's precompiled character map (NFKC and friends);
  pre-tokenizer  split on whitespace, then '▁' for a space and in front of
                 every word (`add_dummy_prefix`);
  model          Unigram over the model's pieces and scores, then the extra
                 ids `<extra_id_{E-1}>` .. `<extra_id_0>` (score 0);
  post-processor `</s>` after every sequence;
  decoder        '▁' back to spaces.

Ids are t5lite's (seqio's): pad 0, eos and unk where the SentencePiece model
puts them (1 and 2 for T5), and `<extra_id_i>` at `vocab_size - 1 - i`, the
top of the id range, counting down. A `ByT5Tokenizer` has no vocabulary
file: bytes are ids 3..258 by construction; its sentinels are placed at
t5lite's ids through `added_tokens_decoder` (on its own it would count up
from 259).

The files are built in memory (`files`) and written by the export, which
owns the folder and its failures.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from t5lite.errors import UserError


SPIECE = "spiece.model"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SENTENCEPIECE, BYTE = "sentencepiece", "byte"
# What transformers writes for "no length limit" (`VERY_LARGE_INTEGER`): T5's
# relative positions have none.
_NO_LENGTH_LIMIT = int(1e30)
_PAD, _EOS, _UNK = "<pad>", "</s>", "<unk>"
_SPACE = "\u2581"
# sentencepiece_model.proto: ModelProto.SentencePiece.Type.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_UNIGRAM = 1


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """The vocabulary an export's tokenizer files describe.

  Attributes:
    kind: `SENTENCEPIECE` or `BYTE`.
    extra_ids: sentinels at the top of the id range.
    spiece_model: the SentencePiece model file (SentencePiece only).
  """
  kind: str
  extra_ids: int
  spiece_model: str | None = None


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """The ids `generate()` needs; T5 starts decoding with the pad id."""
  pad: int
  eos: int

  @property
  def decoder_start(self) -> int:
    return self.pad


# T5's layout, and what an export without a vocabulary says.
T5_IDS = SpecialIds(pad=0, eos=1)


def describe(vocabulary: Any) -> Vocabulary | None:
  """The `Vocabulary` of a seqio vocabulary; None for one with no tokenizer files.

  Args:
    vocabulary: a model's `seqio.SentencePieceVocabulary` or
      `seqio.ByteVocabulary` (anything else has no Hugging Face tokenizer).
  """
  import seqio  # only for the type; callers have it loaded already
  extra_ids = int(getattr(vocabulary, "extra_ids", 0) or 0)
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return Vocabulary(SENTENCEPIECE, extra_ids, vocabulary.sentencepiece_model_file)
  if isinstance(vocabulary, seqio.ByteVocabulary):
    return Vocabulary(BYTE, extra_ids)
  return None


def _read_proto(path: str) -> tuple[bytes, Any]:
  """The SentencePiece model file's bytes and its parsed `ModelProto`."""
  from google.protobuf import message
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  try:
    with open(path, "rb") as f:
      data = f.read()
    proto.ParseFromString(data)
  except OSError as e:
    raise UserError(f"SentencePiece model {path} cannot be read ({e}).") from None
  except message.DecodeError as e:
    raise UserError(f"{path} is not a SentencePiece model ({e}).") from None
  if not proto.pieces:
    raise UserError(f"{path} is not a SentencePiece model (it has no pieces).")
  return data, proto


def special_ids(vocab: Vocabulary | None) -> SpecialIds:
  """pad, eos (and decoder start) ids of the vocabulary, as seqio numbers them.

  Raises:
    UserError: the SentencePiece model cannot be read, or has no
      end-of-sequence piece.
  """
  if vocab is None or vocab.kind == BYTE:
    return T5_IDS
  _, proto = _read_proto(vocab.spiece_model)
  return SpecialIds(pad=0, eos=_eos_id(proto, vocab.spiece_model))


def _eos_id(proto: Any, path: str) -> int:
  eos = proto.trainer_spec.eos_id
  if not 0 <= eos < len(proto.pieces):
    raise UserError(f"SentencePiece model {path} has no end-of-sequence piece (eos_id "
                    f"{eos}); a T5 model needs one to end its outputs.")
  return eos


def files(vocab: Vocabulary | None) -> dict[str, bytes]:
  """The tokenizer files of an export: name -> contents.

  SentencePiece: `spiece.model` (a copy), `tokenizer.json` (only for a
  Unigram model whose text handling `tokenizer.json` can state, see
  `_fast_tokenizer_fits`), `tokenizer_config.json`, `special_tokens_map.json`.
  Bytes: `tokenizer_config.json`, `special_tokens_map.json`.

  Raises:
    UserError: the SentencePiece model cannot be read, or has no
      end-of-sequence piece.
  """
  if vocab is None:
    return {}
  if vocab.kind == BYTE:
    return _json_files(_byte_config(vocab.extra_ids), _special_tokens_map(vocab.extra_ids))
  model, proto = _read_proto(vocab.spiece_model)
  _eos_id(proto, vocab.spiece_model)
  out = {SPIECE: model}
  if _fast_tokenizer_fits(proto):
    out[TOKENIZER] = _dumps(tokenizer_json(proto, vocab.extra_ids))
  out.update(_json_files(_t5_config(proto, vocab.extra_ids), _special_tokens_map(
      vocab.extra_ids, _piece_names(proto))))
  return out


def _dumps(value: dict[str, Any]) -> bytes:
  return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _json_files(config: dict[str, Any], special: dict[str, Any]) -> dict[str, bytes]:
  return {TOKENIZER_CONFIG: _dumps(config), SPECIAL_TOKENS_MAP: _dumps(special)}


def _sentinels(extra_ids: int) -> list[str]:
  return [f"<extra_id_{i}>" for i in range(extra_ids)]


def _piece_names(proto: Any) -> dict[str, str]:
  """pad, eos and unk pieces; seqio pads with id 0 whatever piece it is."""
  spec = proto.trainer_spec
  names = {"pad_token": proto.pieces[0].piece}
  for key, index in (("eos_token", spec.eos_id), ("unk_token", spec.unk_id)):
    if 0 <= index < len(proto.pieces):
      names[key] = proto.pieces[index].piece
  return names


def _special_tokens_map(extra_ids: int, names: dict[str, str] | None = None
                        ) -> dict[str, Any]:
  names = names or {"pad_token": _PAD, "eos_token": _EOS, "unk_token": _UNK}
  return {"additional_special_tokens": _sentinels(extra_ids), **dict(sorted(names.items()))}


def _t5_config(proto: Any, extra_ids: int) -> dict[str, Any]:
  # `additional_special_tokens` is the name transformers 4 reads; 5 reads it
  # as `extra_special_tokens`.
  return {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids,
          **_special_tokens_map(extra_ids, _piece_names(proto)),
          "model_max_length": _NO_LENGTH_LIMIT}


def _byte_config(extra_ids: int) -> dict[str, Any]:
  """ByT5Tokenizer's settings, with its sentinels at t5lite's ids.

  Without `added_tokens_decoder` a ByT5Tokenizer numbers `<extra_id_i>` 259
  + i; t5lite's byte vocabulary (seqio's) has it at 258 + extra_ids - i.
  """
  top = 3 + 256 + extra_ids - 1
  decoder = {str(top - i): _added_token(name)
             for i, name in reversed(list(enumerate(_sentinels(extra_ids))))}
  return {"tokenizer_class": "ByT5Tokenizer", "extra_ids": extra_ids,
          **_special_tokens_map(extra_ids), "added_tokens_decoder": decoder,
          "model_max_length": _NO_LENGTH_LIMIT}


def _added_token(content: str, special: bool = True) -> dict[str, Any]:
  """An added token as `tokenizers` and transformers serialise one."""
  return {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": special}


def _fast_tokenizer_fits(proto: Any) -> bool:
  """Whether `tokenizer_json` states exactly how this SentencePiece model splits text.

  That is T5's kind of model: Unigram, no byte fallback, pieces that never
  span a space, and the default text handling (extra whitespace removed,
  spaces written as '▁'). For any other model the export leaves
  `tokenizer.json` out and transformers converts `spiece.model` itself.
  """
  spec, norm = proto.trainer_spec, proto.normalizer_spec
  return (spec.model_type == _UNIGRAM and not spec.byte_fallback
          and spec.split_by_whitespace and norm.remove_extra_whitespaces
          and norm.escape_whitespaces)


def tokenizer_json(proto: Any, extra_ids: int) -> dict[str, Any]:
  """`tokenizer.json` of a T5 fast tokenizer for a SentencePiece Unigram model.

  Args:
    proto: the parsed `sentencepiece_model_pb2.ModelProto`.
    extra_ids: sentinels appended above the model's pieces.

  Returns:
    The JSON object, in the layout the `tokenizers` library serialises.
  """
  vocab = [[p.piece, p.score] for p in proto.pieces]
  vocab += [[f"<extra_id_{i}>", 0.0] for i in reversed(range(extra_ids))]
  charsmap = proto.normalizer_spec.precompiled_charsmap
  normalizer = ({"type": "Precompiled",
                 "precompiled_charsmap": base64.b64encode(charsmap).decode("ascii")}
                if charsmap else None)
  metaspace = {"type": "Metaspace", "replacement": _SPACE,
               "prepend_scheme": "always" if proto.normalizer_spec.add_dummy_prefix
               else "never", "split": True}
  eos = proto.pieces[proto.trainer_spec.eos_id].piece
  return {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": _added_tokens(proto, extra_ids),
      "normalizer": normalizer,
      "pre_tokenizer": {"type": "Sequence",
                        "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]},
      "post_processor": _append_eos(eos, proto.trainer_spec.eos_id),
      "decoder": dict(metaspace),
      "model": {"type": "Unigram", "unk_id": proto.trainer_spec.unk_id, "vocab": vocab,
                "byte_fallback": False},
  }


def _added_tokens(proto: Any, extra_ids: int) -> list[dict[str, Any]]:
  """Tokens matched whole before the model splits text, by id.

  Control and unknown pieces and the sentinels are special (dropped when
  decoding with `skip_special_tokens`); user-defined pieces are not, as in
  SentencePiece, which also never splits them.
  """
  tokens = [{"id": i, **_added_token(p.piece, special=p.type != _USER_DEFINED)}
            for i, p in enumerate(proto.pieces)
            if p.type in (_UNKNOWN, _CONTROL, _USER_DEFINED)]
  first = len(proto.pieces)
  tokens += [{"id": first + j, **_added_token(f"<extra_id_{extra_ids - 1 - j}>")}
             for j in range(extra_ids)]
  return tokens


def _append_eos(eos: str, eos_id: int) -> dict[str, Any]:
  """T5's post-processor: `</s>` after each sequence of a single or a pair."""
  def sequence(name: str) -> dict[str, Any]:
    return {"Sequence": {"id": name, "type_id": 0}}
  end = {"SpecialToken": {"id": eos, "type_id": 0}}
  return {"type": "TemplateProcessing", "single": [sequence("A"), end],
          "pair": [sequence("A"), end, sequence("B"), end],
          "special_tokens": {eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}}}
