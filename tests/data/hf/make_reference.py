"""Makes the Hugging Face reference data that t5lite's HF importer is tested against.

Run by hand, never by the tests, with a virtual environment of its own, so
that neither torch nor transformers becomes a dependency of t5lite:

  python3 -m venv /work/hfvenv
  /work/hfvenv/bin/pip install torch transformers safetensors sentencepiece numpy protobuf
  /work/hfvenv/bin/python tests/data/hf/make_reference.py

Last run with transformers 5.24.0 and torch 2.14.1+cu130 (on CPU, float32).
It rewrites every `tests/data/hf/<family>/` folder; the output is the same on
every run with the same versions (`torch.manual_seed` per family).

Families, each a small random-weight float32 model saved with
`save_pretrained` (d_model 32, num_heads 4, d_kv 12 so the attention inner
size 48 differs from d_model, d_ff 40, dropout 0, layer_norm_epsilon 1e-6):

  t5_v1_0  T5ForConditionalGeneration, ReLU, tied embeddings (decoder output
           times d_model**-0.5, then `shared.weight`), 2 encoder / 3 decoder
           layers, 32 buckets / max distance 128, vocab 2100: `spiece.model`
           (t5lite's stdlib_docs_unigram_2000) plus 100 extra ids.
  t5_v1_1  as t5_v1_0 but gated-gelu, untied (own `lm_head.weight`, no
           rescale), 16 buckets / max distance 20, saved in shards
           (`model-0000x-of-0000y.safetensors` + `model.safetensors.index.json`).
  mt5      MT5ForConditionalGeneration (model_type 'mt5'), gated-gelu, untied,
           3 encoder / 2 decoder layers, 16 buckets / max distance 20,
           vocab 2100 as above.
  byt5     T5ForConditionalGeneration, gated-gelu, untied, 4 encoder /
           2 decoder layers, 16 buckets / max distance 8 (so distances in the
           batch reach the clipped last bucket), vocab 384 (ByT5Tokenizer:
           0 pad, 1 eos, 2 unk, bytes at 3..258, `<extra_id_i>` from 259 up),
           no spiece.model. Its config.json is rewritten in the form of the
           published ByT5/Flan-T5 configs (`tie_word_embeddings: false`, no
           `scale_decoder_outputs`), see below.
  switch   SwitchTransformersForConditionalGeneration, ReLU experts, 4 experts,
           expert_capacity 3 (per sequence, so tokens overflow in the batch),
           6 encoder / 4 decoder layers with 3 / 2 sparse layers, so the sparse
           step is 2 in both stacks (blocks 1, 3, 5 and 1, 3 are sparse),
           router_jitter_noise 0, tied embeddings, vocab 384 (byte ids), 32
           buckets / max distance 128.

transformers 5.x config quirk an importer must know: `T5Config` always sets
`tie_word_embeddings: true` and turns a given `tie_word_embeddings=False`
into `scale_decoder_outputs: false`; `MT5Config` always says `true` and MT5
never rescales. So the folders written here say `tie_word_embeddings: true`
even for the untied t5_v1_1 and mt5; untied is told by `lm_head.weight`
being stored, and the rescale by `scale_decoder_outputs` (5.x) or
`tie_word_embeddings` (configs written by 4.x and the published checkpoints,
like byt5's here). Reference outputs are computed after reloading each folder
with `from_pretrained`, so they are what transformers makes of the files.

Weights. Every parameter is drawn again by hand (transformers' own init gives
near-constant greedy outputs at this size): embeddings N(0, 1), `lm_head`
N(0, 0.5), relative position biases N(0, 1), norm scales U(0.5, 1.5), q and k
N(0, 0.5 / sqrt(d_model)), attention `o` and MLP (and expert) `wo` N(0, 1),
other kernels (v, wi, wi_0, wi_1, router) N(0, 1 / sqrt(fan_in)). The o/wo
scale lets the sublayers outweigh the input embedding in the residual stream
(else a tied model keeps predicting its input token, 0 forever when greedy).
The q/k scale keeps attention scores about as large as the position biases,
so a wrong bucket or a missing bias changes the logits instead of vanishing
in a saturated softmax. Random models like these still tend to repeat a token
when greedy; each family's seed was picked by a search over seeds as one
whose greedy rows have many distinct tokens (at least 3 of 8 per row), for
switch as one where every expert of every sparse layer but one (expert 1 of
decoder block 1) gets tokens in the teacher-forced pass (a greedy row there
repeats one token).

Batch (the same layout in every family, ids drawn per family):
  input_ids       int32 [3, 11]  lengths 11, 8, 5: random ids in [3, vocab),
                                 then eos 1, then pad 0
  attention_mask  int32 [3, 11]  1 on real tokens, 0 on padding
  decoder_input_ids int32 [3, 7] 0 (decoder start), then random ids in
                                 [3, vocab); no decoder attention mask

reference.npz (plain arrays, `np.load(..., allow_pickle=False)` reads it):
  input_ids, attention_mask, decoder_input_ids  the batch above
  logits          float32 [3, 7, vocab]   teacher-forced, eager attention
  encoder_output  float32 [3, 11, 32]     encoder output after its final norm
  greedy          int32 [3, 9]            decoder start 0 then 8 greedy tokens
  greedy_method   int32 []                0: `model.generate(input_ids,
                  attention_mask=..., do_sample=False, num_beams=1,
                  max_new_tokens=8, eos_token_id=None)`, cached decoding, EOS
                  stopping off so all 8 steps run; 1: argmax decoding without a
                  cache, re-running the whole decoder each step, used where
                  `generate()` fails because the decoder has more layers than
                  the encoder (t5_v1_0, t5_v1_1). Without MoE both give the
                  same tokens (checked for byt5 and mt5). Switch uses 0, so its
                  decoder routes one token per step and never overflows there.
  switch only, per sparse layer of the teacher-forced pass:
  encoder_expert  int32 [3, 3, 11]  top-1 expert of each token
  encoder_dropped int32 [3, 3, 11]  1 where that expert was already full (the
                                    token's MLP output is zero)
  decoder_expert, decoder_dropped int32 [2, 3, 7]  the same for the decoder

Round trip (after t5lite's exporter wrote a folder):

  /work/hfvenv/bin/python tests/data/hf/make_reference.py \
      --roundtrip /tmp/export/t5_v1_0=tests/data/hf/t5_v1_0 [more ...]

Each argument is EXPORTED_DIR=REFERENCE_DIR, or just EXPORTED_DIR when its
basename is a family name (the reference is then tests/data/hf/<basename>).
The exported folder is loaded with AutoModelForSeq2SeqLM (eager attention),
run on the reference's batch, and `roundtrip.npz` is written into it with
`logits`, `encoder_output` and `greedy` (same method as the reference). The
differences from reference.npz are printed; judging them is the tests' job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (
  AutoModelForSeq2SeqLM,
  ByT5Tokenizer,
  MT5Config,
  MT5ForConditionalGeneration,
  PreTrainedModel,
  SwitchTransformersConfig,
  SwitchTransformersForConditionalGeneration,
  T5Config,
  T5ForConditionalGeneration,
  T5Tokenizer,
)


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SPIECE = os.path.join(REPO, "t5lite", "data", "vocab", "stdlib_docs_unigram_2000.model")

ENCODER_LENGTHS = (11, 8, 5)  # example lengths, eos included; padded to 11
DECODER_LENGTH = 7
NEW_TOKENS = 8
EXTRA_IDS = 100
GREEDY_GENERATE = 0
GREEDY_FULL_RERUN = 1

_COMMON = dict(d_model=32, num_heads=4, d_kv=12, d_ff=40, dropout_rate=0.0,
               layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0)


@dataclasses.dataclass(frozen=True)
class Family:
  """One reference model.

  Attributes:
    name: folder name under tests/data/hf.
    seed: torch seed for weights and batch.
    config: the model's config.
    model_class: the transformers class to build.
    untied: give `lm_head` its own weight.
    vocab: 'spiece' (spiece.model + T5Tokenizer) or 'byte' (ByT5Tokenizer).
    max_shard_size: save in shards of at most this size; None for one file.
    published_config: rewrite config.json the way 4.x / the hub wrote it.
  """
  name: str
  seed: int
  config: transformers.PretrainedConfig
  model_class: type[PreTrainedModel]
  untied: bool
  vocab: str
  max_shard_size: str | None = None
  published_config: bool = False


def families() -> list[Family]:
  """The families this script writes, in order."""
  spiece_vocab = 2000 + EXTRA_IDS
  return [
      Family("t5_v1_0", 15, T5Config(
          vocab_size=spiece_vocab, num_layers=2, num_decoder_layers=3,
          feed_forward_proj="relu", **_COMMON), T5ForConditionalGeneration,
             untied=False, vocab="spiece"),
      Family("t5_v1_1", 34, T5Config(
          vocab_size=spiece_vocab, num_layers=2, num_decoder_layers=3,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False,
          relative_attention_num_buckets=16, relative_attention_max_distance=20,
          **_COMMON), T5ForConditionalGeneration, untied=True, vocab="spiece",
             max_shard_size="200KB"),
      Family("mt5", 33, MT5Config(
          vocab_size=spiece_vocab, num_layers=3, num_decoder_layers=2,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False,
          relative_attention_num_buckets=16, relative_attention_max_distance=20,
          **_COMMON), MT5ForConditionalGeneration, untied=True, vocab="spiece"),
      Family("byt5", 28, T5Config(
          vocab_size=384, num_layers=4, num_decoder_layers=2,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False,
          relative_attention_num_buckets=16, relative_attention_max_distance=8,
          **_COMMON), T5ForConditionalGeneration, untied=True, vocab="byte",
             published_config=True),
      Family("switch", 2, SwitchTransformersConfig(
          vocab_size=384, num_layers=6, num_decoder_layers=4,
          num_sparse_encoder_layers=3, num_sparse_decoder_layers=2,
          num_experts=4, expert_capacity=3, router_jitter_noise=0.0,
          dense_act_fn="relu", tie_word_embeddings=True, **_COMMON),
             SwitchTransformersForConditionalGeneration, untied=False, vocab="byte"),
  ]


def _std(name: str, shape: tuple[int, ...], d_model: int) -> float | None:
  """Normal std for a parameter by name; None means a norm scale (uniform)."""
  if name.endswith("layer_norm.weight"):
    return None
  if "relative_attention_bias" in name or "embed_tokens" in name or name == "shared.weight":
    return 1.0
  if name == "lm_head.weight":
    return 0.5
  fan_in = shape[-1]  # torch Linear weights are [out, in]
  if name.endswith((".q.weight", ".k.weight")):
    return 0.5 / math.sqrt(d_model)
  if name.endswith((".o.weight", ".wo.weight")):
    # Sublayer outputs well above the embeddings in the residual stream, or a
    # tied model keeps predicting its input token (0 forever when greedy).
    return 1.0
  return 1.0 / math.sqrt(fan_in)


@torch.no_grad()
def randomize(model: PreTrainedModel, untied: bool) -> None:
  """Draws every parameter again from the current torch seed.

  Args:
    model: the freshly built model; changed in place.
    untied: replace the tied `lm_head.weight` by a separate parameter first
      (transformers 5.x ties it even when the config says untied).
  """
  if untied:
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
  d_model = model.config.d_model
  for name, param in sorted(model.named_parameters()):
    std = _std(name, tuple(param.shape), d_model)
    if std is None:
      param.uniform_(0.5, 1.5)
    else:
      param.normal_(0.0, std)


def make_batch(vocab_size: int) -> dict[str, np.ndarray]:
  """The fixed-layout batch, drawn from the current torch seed.

  Args:
    vocab_size: ids are drawn from [3, vocab_size).

  Returns:
    `input_ids` and `attention_mask` int32 [3, 11], `decoder_input_ids`
    int32 [3, 7].
  """
  batch, length = len(ENCODER_LENGTHS), max(ENCODER_LENGTHS)
  ids = torch.randint(3, vocab_size, (batch, length))
  mask = torch.zeros((batch, length), dtype=torch.int64)
  for row, n in enumerate(ENCODER_LENGTHS):
    ids[row, n - 1] = 1  # eos
    ids[row, n:] = 0  # pad
    mask[row, :n] = 1
  decoder = torch.randint(3, vocab_size, (batch, DECODER_LENGTH))
  decoder[:, 0] = 0  # decoder start
  return {"input_ids": ids.numpy().astype(np.int32),
          "attention_mask": mask.numpy().astype(np.int32),
          "decoder_input_ids": decoder.numpy().astype(np.int32)}


def greedy_method(config: transformers.PretrainedConfig) -> int:
  """`generate()` when it works; 5.x sizes its cache from the encoder."""
  if config.num_decoder_layers > config.num_layers:
    return GREEDY_FULL_RERUN
  return GREEDY_GENERATE


@torch.no_grad()
def greedy(model: PreTrainedModel, batch: dict[str, np.ndarray], method: int) -> np.ndarray:
  """Greedy decoding of NEW_TOKENS tokens with EOS stopping off.

  Args:
    model: the model, in eval mode.
    batch: from `make_batch`.
    method: GREEDY_GENERATE or GREEDY_FULL_RERUN.

  Returns:
    int32 [3, 1 + NEW_TOKENS], starting with the decoder start id 0.
  """
  ids = torch.from_numpy(batch["input_ids"]).long()
  mask = torch.from_numpy(batch["attention_mask"]).long()
  if method == GREEDY_GENERATE:
    out = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1,
                         max_new_tokens=NEW_TOKENS, eos_token_id=None)
  else:
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    out = torch.zeros((ids.shape[0], 1), dtype=torch.long)
    for _ in range(NEW_TOKENS):
      logits = model(encoder_outputs=encoder_outputs, attention_mask=mask,
                     decoder_input_ids=out, use_cache=False).logits
      out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
  if out.shape != (ids.shape[0], 1 + NEW_TOKENS):
    raise RuntimeError(f"greedy decoding returned shape {tuple(out.shape)}")
  return out.numpy().astype(np.int32)


class _RouterRecorder:
  """Records each Switch router call's top-1 experts and dropped tokens."""

  def __init__(self, model: PreTrainedModel):
    self.arrays = {}  # e.g. "encoder_expert": one [batch, length] per sparse layer
    self._handles = []
    for name, module in model.named_modules():
      if name.endswith("mlp.router"):
        stack = "decoder" if name.startswith("decoder.") else "encoder"
        self._handles.append(module.register_forward_hook(self._hook(stack)))

  def _hook(self, stack: str):
    def hook(_module, _inputs, outputs):
      expert_index, _, router_logits = outputs  # [batch, length, experts] each
      self.arrays.setdefault(f"{stack}_expert", []).append(
          router_logits.argmax(-1).numpy().astype(np.int32))
      # The one-hot dispatch is all zero where the expert was already full.
      self.arrays.setdefault(f"{stack}_dropped", []).append(
          (expert_index.sum(-1) == 0).numpy().astype(np.int32))
    return hook

  def remove(self) -> None:
    for handle in self._handles:
      handle.remove()


@torch.no_grad()
def forward(model: PreTrainedModel, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Teacher-forced logits and encoder output (and Switch drops).

  Args:
    model: the model, in eval mode.
    batch: from `make_batch`.

  Returns:
    `logits` float32 [3, 7, vocab], `encoder_output` float32 [3, 11, d_model],
    and for Switch `{encoder,decoder}_{expert,dropped}` int32
    [sparse layers, 3, length].
  """
  recorder = _RouterRecorder(model)
  try:
    out = model(input_ids=torch.from_numpy(batch["input_ids"]).long(),
                attention_mask=torch.from_numpy(batch["attention_mask"]).long(),
                decoder_input_ids=torch.from_numpy(batch["decoder_input_ids"]).long(),
                use_cache=False)
  finally:
    recorder.remove()
  result = {"logits": out.logits.numpy().astype(np.float32),
            "encoder_output": out.encoder_last_hidden_state.numpy().astype(np.float32)}
  result.update({key: np.stack(value) for key, value in recorder.arrays.items()})
  return result


def save_vocab(family: Family, folder: str) -> None:
  """Writes the tokenizer files (and spiece.model) into the model folder."""
  if family.vocab == "spiece":
    shutil.copyfile(SPIECE, os.path.join(folder, "spiece.model"))
    tokenizer = T5Tokenizer.from_pretrained(folder, extra_ids=EXTRA_IDS)
  else:
    tokenizer = ByT5Tokenizer()
  if len(tokenizer) > family.config.vocab_size:
    raise ValueError(f"{family.name}: tokenizer has {len(tokenizer)} ids, "
                     f"vocab_size is {family.config.vocab_size}")
  tokenizer.save_pretrained(folder)


def write_published_config(folder: str) -> None:
  """Rewrites config.json as 4.x wrote untied T5 configs (the hub's form)."""
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    config = json.load(f)
  if config.pop("scale_decoder_outputs", True):
    raise ValueError(f"{path}: expected scale_decoder_outputs false for an untied model")
  config["tie_word_embeddings"] = False
  with open(path, "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")


def check_untied(folder: str) -> None:
  """Fails unless lm_head.weight is stored on its own and differs from shared."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  tensors = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(folder, name), "np") as f:
        for key in ("lm_head.weight", "shared.weight"):
          if key in f.keys():
            tensors[key] = f.get_tensor(key)
  if len(tensors) != 2 or np.array_equal(tensors["lm_head.weight"], tensors["shared.weight"]):
    raise RuntimeError(f"{folder}: lm_head.weight is not stored apart from shared.weight")


def build(family: Family) -> None:
  """Builds, saves and records one family into tests/data/hf/<name>/."""
  folder = os.path.join(HERE, family.name)
  shutil.rmtree(folder, ignore_errors=True)
  os.makedirs(folder)
  torch.manual_seed(family.seed)
  model = family.model_class._from_config(family.config, attn_implementation="eager")
  randomize(model, family.untied)
  batch = make_batch(family.config.vocab_size)
  save_kwargs = {"max_shard_size": family.max_shard_size} if family.max_shard_size else {}
  model.save_pretrained(folder, **save_kwargs)
  save_vocab(family, folder)
  if family.published_config:
    write_published_config(folder)
  if family.untied:
    check_untied(folder)

  # The reference is what transformers makes of the saved files.
  loaded = family.model_class.from_pretrained(folder, attn_implementation="eager",
                                              dtype=torch.float32).eval()
  for name, param in model.state_dict().items():
    if not torch.equal(param, loaded.state_dict()[name]):
      raise RuntimeError(f"{family.name}: {name} changed on save and reload")
  method = greedy_method(loaded.config)
  reference = dict(batch, **forward(loaded, batch))
  reference["greedy"] = greedy(loaded, batch, method)
  reference["greedy_method"] = np.array(method, dtype=np.int32)
  np.savez_compressed(os.path.join(folder, "reference.npz"), **reference)
  report(family, loaded, reference)


def report(family: Family, model: PreTrainedModel, reference: dict[str, np.ndarray]) -> None:
  """Prints the checks that show the reference data is worth testing against."""
  logits = reference["logits"]
  distinct = [len(np.unique(row[1:])) for row in reference["greedy"]]
  method = "generate" if int(reference["greedy_method"]) == GREEDY_GENERATE else "full re-run"
  print(f"{family.name}: {type(model).__name__} max|logit| {np.abs(logits).max():.3f}, "
        f"logit std {logits.std():.3f}, greedy ({method}) {reference['greedy'].tolist()}, "
        f"distinct tokens per row {distinct}")
  if min(distinct) < 2:
    raise RuntimeError(f"{family.name}: a greedy row is one repeated token")
  if int(reference["greedy_method"]) == GREEDY_GENERATE:
    rerun = greedy(model, reference, GREEDY_FULL_RERUN)
    print(f"  generate equals full re-run argmax: {np.array_equal(rerun, reference['greedy'])}")
  if "encoder_dropped" in reference:
    enc, dec = reference["encoder_dropped"], reference["decoder_dropped"]
    print(f"  tokens over capacity: encoder {enc.sum(axis=(1, 2)).tolist()} per sparse layer, "
          f"decoder {dec.sum(axis=(1, 2)).tolist()}")
    for stack in ("encoder", "decoder"):
      kept = [np.bincount(e[d == 0], minlength=model.config.num_experts).tolist()
              for e, d in zip(reference[f"{stack}_expert"], reference[f"{stack}_dropped"])]
      print(f"  {stack} tokens kept per expert, per sparse layer: {kept}")
    if enc.sum() == 0 or dec.sum() == 0:
      raise RuntimeError(f"{family.name}: no token overflowed expert capacity")


def roundtrip(spec: str) -> None:
  """Runs an exported folder on its reference batch; writes roundtrip.npz.

  Args:
    spec: EXPORTED_DIR=REFERENCE_DIR, or EXPORTED_DIR whose basename is a
      family name.
  """
  exported, _, reference_dir = spec.partition("=")
  if not reference_dir:
    reference_dir = os.path.join(HERE, os.path.basename(os.path.normpath(exported)))
  reference_path = os.path.join(reference_dir, "reference.npz")
  if not os.path.isfile(reference_path):
    raise ValueError(f"no reference for {spec!r}: {reference_path} does not exist; "
                     "pass EXPORTED_DIR=tests/data/hf/<family>")
  with np.load(reference_path, allow_pickle=False) as f:
    reference = dict(f)
  model = AutoModelForSeq2SeqLM.from_pretrained(exported, attn_implementation="eager",
                                                dtype=torch.float32).eval()
  result = forward(model, reference)
  result = {key: result[key] for key in ("logits", "encoder_output")}
  result["greedy"] = greedy(model, reference, int(reference["greedy_method"]))
  np.savez_compressed(os.path.join(exported, "roundtrip.npz"), **result)
  diff = np.abs(result["logits"] - reference["logits"]).max()
  same = np.array_equal(result["greedy"], reference["greedy"])
  print(f"{exported}: {type(model).__name__}, max |logits - reference| {diff:.3g}, "
        f"greedy equal {same}")


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--roundtrip", nargs="+", metavar="EXPORTED[=REFERENCE]",
                      help="run exported folders instead of writing the references")
  args = parser.parse_args(argv)
  torch.use_deterministic_algorithms(True)
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  try:
    if args.roundtrip:
      for spec in args.roundtrip:
        roundtrip(spec)
    else:
      for family in families():
        build(family)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
