"""Hugging Face T5 / mT5 / ByT5 / Switch Transformers folders, in and out.

A folder is `config.json` plus `model.safetensors` (or shards listed in
`model.safetensors.index.json`), and `spiece.model` for SentencePiece
models. An export also writes `generation_config.json` and the tokenizer
files (`hf_tokenizer`), every file readable as the umask allows. Weights
are read with safetensors' numpy API, region by region (see `lazy`); a
`pytorch_model.bin` is a pickle and is never loaded.

One table, `name_pairs`, says which Hugging Face arrays make each t5lite
parameter and how (`_KINDS`); import reads it one way and export the other,
so the two cannot drift apart. The facts it encodes: torch weights are
`[out, in]` (transposed here); q/k/v/o are `[heads*d_kv, d_model]`
heads-major; the relative-position table lives in block 0 of each stack as
`[buckets, heads]` (t5lite: `[heads, buckets]`); Switch experts are
separate modules `experts.expert_{e}` (t5lite stacks them on a leading
EXPERT axis) and the router is `router.classifier` `[experts, d_model]`.

An export writes only where `check_export_target` allows (a new or empty
folder, or its own earlier export of the same checkpoint, which `MARKER`
records), into a hidden sibling folder renamed into place when complete. A
bucket has no rename: the folder is written locally, then uploaded file by
file with `MARKER` last, so a folder in a bucket without it is unfinished.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from t5lite import paths, write_errors
from t5lite.errors import UserError
from t5lite.interop import hf_tokenizer, lazy


CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SPIECE = hf_tokenizer.SPIECE
# Written into every export last: which checkpoint it holds and what files
# (with their sizes) the export wrote, so a later export of the same
# checkpoint knows the folder is its own to replace.
MARKER = "t5lite-export.json"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin")
MODEL_TYPES = ("t5", "mt5", "switch_transformers")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64}
# Hugging Face feed_forward_proj -> t5lite mlp_activations. HF's non-gated
# 'gelu' is the exact (erf) GELU; 'gated-gelu' uses the tanh approximation.
_ACTIVATIONS = {"relu": ("relu",), "gelu": ("gelu_exact",), "gated-gelu": ("gelu", "linear"),
                "gated-relu": ("relu", "linear"), "gated-silu": ("silu", "linear"),
                "silu": ("silu",)}
_ACTIVATION_NAMES = {v: k for k, v in _ACTIVATIONS.items()}
# Tied copies of `shared.weight` some savers write; never read.
_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def is_huggingface(path: str) -> bool:
  """Whether `path` is a folder with a Hugging Face `config.json`."""
  return paths.Path(paths.join(path, CONFIG)).is_file()


def _read_json(file: str) -> dict[str, Any]:
  try:
    with paths.Path(file).open() as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{file} is not readable JSON ({e}).") from None


class HuggingFaceFolder:
  """A Hugging Face model folder, opened for reading.

  Attributes:
    path: the folder.
    config: the parsed config.json.
    model_type: 't5', 'mt5' or 'switch_transformers'.
    files: safetensors file of each array name.
  """

  def __init__(self, path: str):
    self.path = paths.absolute(path)
    self.config = _read_json(paths.join(self.path, CONFIG))
    self.model_type = self.config.get("model_type")
    if self.model_type not in MODEL_TYPES:
      raise UserError(f"{paths.join(self.path, CONFIG)} has model_type "
                      f"{self.model_type!r}; t5lite imports {', '.join(MODEL_TYPES)}.")
    self._handles: dict[str, Any] = {}
    self._local = paths.LocalCopies()
    self.files = self._weight_files()

  def _weight_files(self) -> dict[str, str]:
    index = paths.join(self.path, INDEX)
    if paths.Path(index).is_file():
      weight_map = _read_json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise UserError(f"{index} has no weight_map.")
      return {name: paths.join(self.path, file) for name, file in weight_map.items()}
    single = paths.join(self.path, WEIGHTS)
    if paths.Path(single).is_file():
      return {name: single for name in self._open(single).keys()}
    pickles = [p for p in _PICKLES if paths.Path(paths.join(self.path, p)).exists()]
    if pickles:
      raise UserError(
          f"{paths.join(self.path, pickles[0])} is a pickle, which t5lite never loads; "
          "convert it to safetensors first (in transformers: model.save_pretrained(folder, "
          "safe_serialization=True)).")
    raise UserError(f"{self.path} has no {WEIGHTS} or {INDEX}.")

  def _open(self, file: str) -> Any:
    if file not in self._handles:
      try:
        self._handles[file] = safe_open(self._local.file(file), framework="np")
      except Exception as e:  # safetensors raises its own error types.
        raise UserError(f"{file} is not a readable safetensors file ({e}).") from None
    return self._handles[file]

  def array(self, name: str) -> lazy.LazyArray:
    """The named array, read lazily.

    Raises:
      ValueError: the array is not in the folder, or has an unsupported dtype.
    """
    if name not in self.files:
      raise KeyError(name)
    file = self.files[name]
    handle = self._open(file)
    try:
      region = handle.get_slice(name)
    except Exception as e:  # a name the index promises but the file lacks.
      raise UserError(f"{file} does not hold {name} ({e}).") from None
    dtype = region.get_dtype()
    if dtype not in _DTYPES:
      raise UserError(f"{file}: {name} has dtype {dtype}; t5lite reads "
                      f"{', '.join(_DTYPES)}.")

    def reader(index: lazy.Index) -> np.ndarray:
      try:
        return np.asarray(region[index])
      except Exception as e:  # a truncated file fails here.
        raise UserError(f"{file}: {name} cannot be read ({e}).") from None

    return lazy.LazyArray(tuple(region.get_shape()), np.dtype(_DTYPES[dtype]), reader,
                          f"{file} array {name}")

  def vocabulary(self) -> tuple[str, str | None]:
    """('sentencepiece', path of spiece.model) or ('byte', None)."""
    spiece = paths.join(self.path, SPIECE)
    if paths.Path(spiece).is_file():
      return "sentencepiece", spiece
    return "byte", None


def _get(config: dict[str, Any], key: str, default: Any = None) -> Any:
  value = config.get(key, default)
  if value is None:
    raise UserError(f"config.json has no {key!r}.")
  return value


def model_config(folder: HuggingFaceFolder) -> dict[str, Any]:
  """t5lite `TransformerConfig` fields of the folder's model.

  Raises:
    ValueError: a feature t5lite does not have (an unknown activation, a
      norm epsilon other than 1e-6, Switch sparse layers placed other than
      in every layer or every other layer starting at layer 1).
  """
  c = folder.config
  proj = c.get("feed_forward_proj", "relu")
  if proj not in _ACTIVATIONS:
    raise UserError(f"config.json feed_forward_proj {proj!r} is not one of "
                    f"{sorted(_ACTIVATIONS)}.")
  if abs(float(c.get("layer_norm_epsilon", 1e-6)) - 1e-6) > 1e-12:
    raise UserError(f"config.json layer_norm_epsilon {c['layer_norm_epsilon']} differs from "
                    "t5lite's RMSNorm epsilon 1e-6.")
  num_layers = _get(c, "num_layers")
  fields = {
      "vocab_size": _get(c, "vocab_size"), "emb_dim": _get(c, "d_model"),
      "num_heads": _get(c, "num_heads"), "num_encoder_layers": num_layers,
      "num_decoder_layers": c.get("num_decoder_layers") or num_layers,
      "head_dim": _get(c, "d_kv"), "mlp_dim": _get(c, "d_ff"),
      "relative_attention_num_buckets": c.get("relative_attention_num_buckets", 32),
      "relative_attention_max_distance": c.get("relative_attention_max_distance", 128),
      "logits_via_embedding": "lm_head.weight" not in folder.files,
      "mlp_activations": _ACTIVATIONS[proj],
  }
  _check_output_scale(folder, fields["logits_via_embedding"])
  if folder.model_type == "switch_transformers":
    fields.update(_switch_fields(c, fields))
  return fields


def _check_output_scale(folder: HuggingFaceFolder, tied: bool) -> None:
  """Refuses the two logit layouts t5lite has no configuration for.

  A separate `lm_head.weight` means untied logits. Whether the decoder
  output is rescaled by d_model**-0.5 is `scale_decoder_outputs` in configs
  written by transformers 5.x (which always says `tie_word_embeddings:
  true`), `tie_word_embeddings` in older and published configs, and never
  for mT5. t5lite rescales exactly the tied logits.
  """
  c = folder.config
  if "scale_decoder_outputs" in c:
    rescaled = bool(c["scale_decoder_outputs"])
  elif folder.model_type == "mt5":
    rescaled = False
  else:
    rescaled = bool(c.get("tie_word_embeddings", True))
  if rescaled != tied:
    raise UserError(
        f"{os.path.join(folder.path, CONFIG)}: "
        f"{'tied' if tied else 'untied (lm_head.weight)'} logits "
        f"{'without' if tied else 'with'} the d_model**-0.5 rescale; t5lite rescales exactly "
        "the tied ones.")


def _sparse_step(num_layers: int, num_sparse: int) -> int:
  """Hugging Face's sparse step: block i is sparse when i % step == 1 (all if 1)."""
  return num_layers // num_sparse if num_sparse > 0 else 0


def _switch_fields(c: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
  steps = {c.get(f"{stack}_sparse_step") or _sparse_step(
      fields[f"num_{stack}_layers"], c.get(f"num_sparse_{stack}_layers", 0))
      for stack in ("encoder", "decoder")}
  if len(steps) != 1 or min(steps) not in (1, 2):
    raise UserError(
        f"config.json places Switch experts with sparse steps {sorted(steps)}; t5lite places "
        "them in every layer (step 1) or in layers 1, 3, 5, ... (step 2) of both stacks.")
  step = steps.pop()
  if c.get("router_bias", False):
    raise UserError("config.json has router_bias=true; t5lite's router has no bias.")
  return {"num_experts": _get(c, "num_experts"), "num_selected_experts": 1,
          "moe_layer_interval": step, "expert_capacity": _get(c, "expert_capacity"),
          "renormalize_router_weights": False, "group_size": None,
          "expert_mlp_dim": fields["mlp_dim"],
          "router_jitter_noise": float(c.get("router_jitter_noise", 0.0))}


def _is_moe_layer(fields: dict[str, Any], index: int) -> bool:
  interval = fields.get("moe_layer_interval", 0)
  return bool(fields.get("num_experts")) and (index + 1) % interval == 0


def _mlp_names(fields: dict[str, Any]) -> tuple[str, ...]:
  n = len(fields["mlp_activations"])
  return ("wi",) if n == 1 else tuple(f"wi_{i}" for i in range(n))


# How a t5lite parameter is made of Hugging Face arrays:
#   copy     same array (norm scales, the embedding)
#   T        transposed 2-D weight
#   qkv      [heads*d_kv, d_model] -> [d_model, heads, d_kv]
#   out      [d_model, heads*d_kv] -> [heads, d_kv, d_model]
#   experts  E arrays [out, in], each transposed, stacked -> [E, in, out]
_KINDS = ("copy", "T", "qkv", "out", "experts")


def _attention_pairs(hf: str, ours: str) -> list[tuple[str, list[str], str]]:
  pairs = [(f"{ours}/{o}/kernel", [f"{hf}.{h}.weight"], "qkv")
           for h, o in (("q", "query"), ("k", "key"), ("v", "value"))]
  return pairs + [(f"{ours}/out/kernel", [f"{hf}.o.weight"], "out")]


def _mlp_pairs(fields: dict[str, Any], hf: str, ours: str, index: int, switch: bool
               ) -> list[tuple[str, list[str], str]]:
  names = _mlp_names(fields) + ("wo",)
  if _is_moe_layer(fields, index):
    experts = range(fields["num_experts"])
    pairs = [(f"{ours}/moe/router/kernel", [f"{hf}.mlp.router.classifier.weight"], "T")]
    return pairs + [(f"{ours}/moe/{n}", [f"{hf}.mlp.experts.expert_{e}.{n}.weight"
                                          for e in experts], "experts") for n in names]
  module = "mlp" if switch else "DenseReluDense"
  return [(f"{ours}/mlp/{n}/kernel", [f"{hf}.{module}.{n}.weight"], "T") for n in names]


def name_pairs(fields: dict[str, Any], switch: bool) -> list[tuple[str, list[str], str]]:
  """(t5lite unscanned name, Hugging Face names, kind) for every parameter.

  Args:
    fields: `TransformerConfig` fields of an encoder-decoder (see
      `model_config`).
    switch: Switch Transformers naming (`mlp` instead of `DenseReluDense`).
  """
  pairs = [("token_embedder/embedding", ["shared.weight"], "copy")]
  for stack, depth in (("encoder", fields["num_encoder_layers"]),
                       ("decoder", fields["num_decoder_layers"])):
    pairs.append((f"{stack}/relpos_bias/rel_embedding",
                  [f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"], "T"))
    norm = "encoder_norm" if stack == "encoder" else "decoder_norm"
    pairs.append((f"{stack}/{norm}/scale", [f"{stack}.final_layer_norm.weight"], "copy"))
    for i in range(depth):
      hf, ours = f"{stack}.block.{i}.layer", f"{stack}/layers_{i}"
      if stack == "encoder":
        pairs += _attention_pairs(f"{hf}.0.SelfAttention", f"{ours}/attention")
        pairs.append((f"{ours}/pre_attention_layer_norm/scale", [f"{hf}.0.layer_norm.weight"],
                      "copy"))
        mlp = 1
      else:
        pairs += _attention_pairs(f"{hf}.0.SelfAttention", f"{ours}/self_attention")
        pairs.append((f"{ours}/pre_self_attention_layer_norm/scale",
                      [f"{hf}.0.layer_norm.weight"], "copy"))
        pairs += _attention_pairs(f"{hf}.1.EncDecAttention", f"{ours}/encoder_decoder_attention")
        pairs.append((f"{ours}/pre_cross_attention_layer_norm/scale",
                      [f"{hf}.1.layer_norm.weight"], "copy"))
        mlp = 2
      pairs += _mlp_pairs(fields, f"{hf}.{mlp}", ours, i, switch)
      pairs.append((f"{ours}/pre_mlp_layer_norm/scale", [f"{hf}.{mlp}.layer_norm.weight"],
                    "copy"))
  if not fields["logits_via_embedding"]:
    pairs.append(("decoder/logits_dense/kernel", ["lm_head.weight"], "T"))
  return pairs


def _import_one(arrays: list[lazy.LazyArray], kind: str, heads: int) -> lazy.LazyArray:
  if kind == "copy":
    return arrays[0]
  if kind == "T":
    return lazy.transpose(arrays[0])
  if kind == "qkv":
    x = lazy.transpose(arrays[0])
    return lazy.split_axis(x, 1, (heads, x.shape[1] // heads))
  if kind == "out":
    x = lazy.transpose(arrays[0])
    return lazy.split_axis(x, 0, (heads, x.shape[0] // heads))
  return lazy.stack([lazy.transpose(a) for a in arrays])


def to_t5lite(folder: HuggingFaceFolder) -> dict[str, lazy.LazyArray]:
  """The folder's weights under t5lite's unscanned names and shapes.

  Raises:
    ValueError: an array the config calls for is missing, or the folder
      holds arrays this architecture has no place for.
  """
  fields = model_config(folder)
  switch = folder.model_type == "switch_transformers"
  out, used, missing = {}, set(), []
  for ours, names, kind in name_pairs(fields, switch):
    absent = [n for n in names if n not in folder.files]
    if absent:
      missing.append(absent[0])
      continue
    used.update(names)
    out[ours] = _import_one([folder.array(n) for n in names], kind, fields["num_heads"])
  extra = sorted(set(folder.files) - used - set(_IGNORED)
                 - ({"lm_head.weight"} if fields["logits_via_embedding"] else set()))
  if missing or extra:
    problems = [f"{n} is missing" for n in missing[:3]] + [
        f"{n} has no place in a {folder.model_type} model of this config.json"
        for n in extra[:3]]
    raise UserError(f"{folder.path} does not match its config.json: " + "; ".join(problems)
                    + ".")
  return out


def _export_one(values: list[np.ndarray], kind: str) -> list[np.ndarray]:
  """t5lite parameter -> its Hugging Face arrays (inverse of `_import_one`)."""
  (value,) = values
  if kind == "copy":
    return [value]
  if kind == "T":
    return [value.T]
  if kind == "qkv":  # [d_model, heads, d_kv] -> [heads*d_kv, d_model]
    return [value.reshape(value.shape[0], -1).T]
  if kind == "out":  # [heads, d_kv, d_model] -> [d_model, heads*d_kv]
    return [value.reshape(-1, value.shape[-1]).T]
  return [expert.T for expert in value]


def hf_config(fields: dict[str, Any]) -> dict[str, Any]:
  """The config.json of a t5lite encoder-decoder's Hugging Face counterpart.

  Raises:
    ValueError: the model has no Hugging Face counterpart.
  """
  activations = tuple(fields["mlp_activations"])
  if fields.get("relpos_per_layer"):
    raise UserError("relpos_per_layer=True has no Hugging Face T5 counterpart, which shares "
                    "one relative-position table per stack.")
  if activations not in _ACTIVATION_NAMES:
    raise UserError(f"mlp_activations {activations} has no Hugging Face T5 counterpart; "
                    f"those are {sorted(_ACTIVATIONS.values())}.")
  config = {
      "model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
      "vocab_size": fields["vocab_size"], "d_model": fields["emb_dim"],
      "d_kv": fields["head_dim"], "d_ff": fields["mlp_dim"], "num_heads": fields["num_heads"],
      "num_layers": fields["num_encoder_layers"],
      "num_decoder_layers": fields["num_decoder_layers"],
      "relative_attention_num_buckets": fields["relative_attention_num_buckets"],
      "relative_attention_max_distance": fields["relative_attention_max_distance"],
      "feed_forward_proj": _ACTIVATION_NAMES[activations], "layer_norm_epsilon": 1e-6,
      "tie_word_embeddings": bool(fields["logits_via_embedding"]),
      "scale_decoder_outputs": bool(fields["logits_via_embedding"]),
      "dropout_rate": fields.get("dropout_rate", 0.0), "initializer_factor": 1.0,
      "is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1,
      "decoder_start_token_id": 0, "torch_dtype": "float32",
  }
  if fields.get("num_experts"):
    config.update(_switch_config(fields, activations))
  return config


def _switch_config(fields: dict[str, Any], activations: tuple[str, ...]) -> dict[str, Any]:
  problems = []
  if fields.get("num_selected_experts") != 1:
    problems.append(f"top-{fields.get('num_selected_experts')} routing (Switch is top-1)")
  if fields.get("renormalize_router_weights", True):
    problems.append("renormalize_router_weights=True (Switch scales by the probability)")
  if fields.get("moe_layer_interval") not in (1, 2):
    problems.append(f"moe_layer_interval={fields.get('moe_layer_interval')} (Switch: 1 or 2)")
  if not fields.get("expert_capacity"):
    problems.append("no fixed expert_capacity")
  if activations != ("relu",) or (fields.get("expert_mlp_dim") or fields["mlp_dim"]) != (
      fields["mlp_dim"]):
    problems.append("experts other than ReLU experts of width mlp_dim")
  if not fields["logits_via_embedding"]:
    problems.append("untied logits (Switch ties them)")
  if problems:
    raise UserError("This MoE model has no Hugging Face Switch Transformers counterpart: "
                    + "; ".join(problems) + ".")
  step = fields["moe_layer_interval"]
  return {
      "model_type": "switch_transformers",
      "architectures": ["SwitchTransformersForConditionalGeneration"],
      "num_experts": fields["num_experts"], "expert_capacity": fields["expert_capacity"],
      "num_sparse_encoder_layers": fields["num_encoder_layers"] // step,
      "num_sparse_decoder_layers": fields["num_decoder_layers"] // step,
      "encoder_sparse_step": step, "decoder_sparse_step": step,
      "router_bias": False, "router_jitter_noise": fields.get("router_jitter_noise", 0.0),
      "router_dtype": "float32", "router_ignore_padding_tokens": False,
      "router_z_loss_coef": 0.001, "router_aux_loss_coef": 0.001,
  }


def generation_config(ids: hf_tokenizer.SpecialIds) -> dict[str, Any]:
  """`generation_config.json`: the ids `generate()` starts, pads and stops with.

  Only what t5lite knows; everything else stays at transformers' defaults
  (greedy, `max_length` 20), as for a model saved without one.
  """
  return {"decoder_start_token_id": ids.decoder_start, "eos_token_id": ids.eos,
          "pad_token_id": ids.pad}


def _json(value: dict[str, Any]) -> bytes:
  return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def export(params: dict[str, np.ndarray], fields: dict[str, Any], output_dir: str,
           vocabulary: hf_tokenizer.Vocabulary | None = None, *, source: str,
           step: int = 0, overwrite: bool = False) -> list[str]:
  """Writes a Hugging Face folder of an unscanned t5lite encoder-decoder.

  The folder is written whole or not at all: into a new sibling folder,
  renamed into place when complete. A previous export there is moved aside
  first and back if the rename fails, and deleted once the new one is in
  place.

  Args:
    params: t5lite unscanned parameter path -> host array.
    fields: the model's `TransformerConfig` fields.
    output_dir: the folder to write (created); see `check_export_target`.
    vocabulary: the model's vocabulary (`hf_tokenizer.describe`), whose
      tokenizer files and special ids the folder gets; None: no tokenizer
      files, and T5's ids (pad and decoder start 0, eos 1).
    source: the checkpoint the parameters come from, recorded in `MARKER`.
    step: its training step, recorded in `MARKER`.
    overwrite: replace whatever folder `output_dir` is.

  Returns:
    The files written, in name order, `MARKER` last.

  Raises:
    UserError: the model has no Hugging Face counterpart, its SentencePiece
      model is unreadable, or `check_export_target` refuses the folder;
      nothing is written then.
    write_errors.WriteError: a write or rename failed; nothing is left but
      the earlier export, if there was one.
  """
  ids = hf_tokenizer.special_ids(vocabulary)
  generation = generation_config(ids)
  documents = {CONFIG: _json({**hf_config(fields), **generation}),
               GENERATION_CONFIG: _json(generation), **hf_tokenizer.files(vocabulary)}
  tensors = {}
  for ours, names, kind in name_pairs(fields, bool(fields.get("num_experts"))):
    for name, value in zip(names, _export_one([np.asarray(params[ours])], kind)):
      tensors[name] = np.ascontiguousarray(value, dtype=np.float32)
  check_export_target(output_dir, source, overwrite)
  if paths.is_url(output_dir):
    return _export_to_bucket(documents, tensors, output_dir, source, step)
  # A symlinked folder is replaced where it really is, so the renames stay
  # on its file system.
  target = os.path.realpath(output_dir)
  staging = _sibling(target, "export")
  try:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.mkdir(staging)
    files = _write_folder(staging, documents, tensors, target)
    _write_marker(staging, source, step, files)
    _put_in_place(staging, target)
  except write_errors.WriteError:
    raise
  except OSError as error:  # a full or read-only disk, a failed rename
    raise write_errors.WriteError(f"Could not write the export {target}: "
                                  f"{write_errors.reason(error)}.") from error
  finally:
    if os.path.lexists(staging):  # the export failed before its rename
      shutil.rmtree(staging)
  return [os.path.join(output_dir, name) for name in [*files, MARKER]]


def _export_to_bucket(documents: dict[str, bytes], tensors: dict[str, np.ndarray],
                      output_dir: str, source: str, step: int) -> list[str]:
  """`export` into a folder in a bucket, which has no rename.

  The files are written into a private local folder, then uploaded one by
  one: first the earlier export's `MARKER` is removed, so that a reader (or
  the next export) never takes a half-replaced folder for a finished one,
  then each file is uploaded (an object is replaced whole), objects the new
  export did not write are removed (what `--overwrite` replaces), and
  `MARKER` goes last. An upload that fails leaves a folder without `MARKER`,
  which an export refuses to replace without `--overwrite`.
  """
  folder = paths.Path(output_dir)
  with tempfile.TemporaryDirectory(prefix="t5lite-export-") as local:
    files = _write_folder(local, documents, tensors, output_dir)
    _write_marker(local, source, step, files)
    try:
      if (folder / MARKER).exists():
        (folder / MARKER).unlink()
      for name in files:
        paths.copy_tree(os.path.join(local, name), paths.join(output_dir, name))
      for old in (folder.iterdir() if folder.exists() else ()):
        if old.name in files:
          continue
        if old.is_dir():
          old.rmtree()
        else:
          old.unlink()
      paths.copy_tree(os.path.join(local, MARKER), paths.join(output_dir, MARKER))
    except OSError as error:
      raise write_errors.WriteError(f"Could not write the export {output_dir}: "
                                    f"{write_errors.reason(error)}.") from error
  return [paths.join(output_dir, name) for name in [*files, MARKER]]


def check_export_target(output_dir: str, source: str, overwrite: bool = False) -> None:
  """Refuses to export into a folder holding anything t5lite did not write.

  An export may go to a new or empty folder, or replace a previous export of
  the same checkpoint: a folder whose `MARKER` names `source` and that holds
  only the files that export wrote, each at the size it wrote. `overwrite`
  allows any folder (it is replaced with everything in it).

  Args:
    output_dir: the folder to write.
    source: the checkpoint to export, as the marker records it (t5lite-export
      gives the absolute path of a run's checkpoints directory, so every step
      of one run counts as the same checkpoint, or of a foreign checkpoint).
    overwrite: whether any folder may be replaced.

  Raises:
    ValueError: `output_dir` is not a folder, or it is a non-empty folder
      other than a previous export of `source` and `overwrite` is False.
  """
  folder = paths.Path(output_dir)
  if (folder.is_file() if paths.is_url(output_dir)
      else os.path.lexists(output_dir) and not os.path.isdir(output_dir)):
    raise UserError(f"Export folder {output_dir} exists and is not a folder; name a new "
                    "folder.")
  if overwrite or not folder.is_dir() or not any(folder.iterdir()):
    return
  reason = _not_an_export_of(output_dir, source)
  if reason is not None:
    raise UserError(f"Export folder {output_dir} is not empty and {reason}; an export only "
                    "replaces an earlier export of the same checkpoint. Name a new folder, "
                    "or pass --overwrite to replace this one and everything in it.")


def _not_an_export_of(folder: str, source: str) -> str | None:
  """Why `folder` is not an untouched export of `source`; None when it is one."""
  marker_file = paths.Path(folder) / MARKER
  if not marker_file.is_file():
    return f"was not written by t5lite (it has no {MARKER})"
  try:
    marker = json.loads(marker_file.read_text())
  except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
    return f"its {MARKER} is unreadable ({e})"
  if not (isinstance(marker, dict) and isinstance(marker.get("files"), dict)):
    return f"its {MARKER} is not one t5lite wrote"
  if marker.get("checkpoint") != source:
    return f"holds an export of {marker.get('checkpoint')}, not of {source}"
  sizes = marker["files"]
  for path in sorted(paths.Path(folder).iterdir()):
    if path.name == MARKER:
      continue
    if path.name not in sizes:
      return f"holds {path.name}, which its export did not write"
    if not path.is_file() or path.stat().length != sizes[path.name]:
      return f"its {path.name} changed after the export wrote it"
  return None


def _sibling(target: str, purpose: str) -> str:
  """A fresh hidden name next to `target`, on the same file system."""
  parent, name = os.path.split(target)
  return os.path.join(parent, f".{name}.t5lite-{purpose}-{secrets.token_hex(4)}")


def _write_folder(folder: str, documents: dict[str, bytes], tensors: dict[str, np.ndarray],
                  target: str) -> list[str]:
  """Writes the Hugging Face files into `folder`, the staging folder of
  `target`; returns their names, sorted. The small files go first."""
  for name, data in documents.items():
    with open(os.path.join(folder, name), "wb") as f:
      f.write(data)
  _save_tensors(tensors, os.path.join(folder, WEIGHTS), target)
  return sorted([*documents, WEIGHTS])


def _save_tensors(tensors: dict[str, np.ndarray], file: str, target: str) -> None:
  try:
    save_file(tensors, file, metadata={"format": "pt"})
  except SafetensorError as e:
    # The arrays are contiguous float32, so what fails here is the write (a
    # full disk, a file too large); safetensors names it with its own type.
    raise write_errors.WriteError(f"Writing the {WEIGHTS} of {target} failed: {e}") from e
  # safetensors writes a private temporary file (0600) and renames it; the
  # export's files are as readable as any other file the user creates.
  os.chmod(file, _new_file_mode(os.path.dirname(file)))


def _new_file_mode(folder: str) -> int:
  """The mode a new file gets in `folder`: 0o666 less the umask (and what a
  default ACL takes away).

  `os.umask` reads the umask only by setting it, which would race with any
  thread creating a file meanwhile; a file created here shows it instead.
  """
  probe = os.path.join(folder, f".t5lite-mode-{secrets.token_hex(4)}")
  fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    return stat.S_IMODE(os.fstat(fd).st_mode)
  finally:
    os.close(fd)
    os.unlink(probe)


def _write_marker(folder: str, source: str, step: int, files: list[str]) -> None:
  sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in files}
  with open(os.path.join(folder, MARKER), "w") as f:
    json.dump({"checkpoint": source, "step": step, "files": sizes}, f, indent=2)


def _put_in_place(staging: str, target: str) -> None:
  """Renames the finished `staging` folder to `target`.

  A non-empty folder at `target` is moved aside first, moved back if the
  rename fails, and deleted once the new folder is in place; only a kill
  between the two renames leaves it under its aside name.
  """
  if not os.path.isdir(target) or not os.listdir(target):
    os.replace(staging, target)  # onto nothing, or an empty folder
    return
  aside = _sibling(target, "replaced")
  os.rename(target, aside)
  placed = False
  try:
    os.rename(staging, target)
    placed = True
  finally:
    if not placed:
      os.rename(aside, target)
  shutil.rmtree(aside)
