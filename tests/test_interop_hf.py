"""Hugging Face folders imported into t5lite reproduce transformers' outputs.

tests/data/hf/<family>/ holds small random-weight models saved by
transformers and the logits and greedy `generate()` output transformers
computed on a fixed batch (tests/data/hf/make_reference.py, run by hand).
"""

import functools
import os

import interop_helpers as h
import jax
import numpy as np
import optax
import pytest

from t5lite import interop
from t5lite.data import vocabularies
from t5lite.interop import huggingface
from t5lite.models import models, transformer


FAMILIES = ["t5_v1_0", "t5_v1_1", "mt5", "byt5", "switch"]


def _model(folder, decode_length=8, **overrides):
  fields = huggingface.model_config(folder)
  kind, spiece = folder.vocabulary()
  vocab = (vocabularies.sentencepiece_vocabulary(spiece) if kind == "sentencepiece"
           else vocabularies.byte_vocabulary())
  cfg = transformer.TransformerConfig(**{**fields, "dropout_rate": 0.0, **overrides})
  return models.EncoderDecoderModel(transformer.EncoderDecoder(cfg), vocab, vocab,
                                    optax.sgd(1.0), max_decode_length=decode_length)


def _reference(family):
  with np.load(os.path.join(h.HF, family, "reference.npz"), allow_pickle=False) as ref:
    return dict(ref)


def _batch(ref):
  # transformers ran without a decoder mask: no decoder position is padding.
  ones = np.ones_like(ref["decoder_input_ids"])
  return {"encoder_input_tokens": ref["input_ids"],
          "decoder_input_tokens": ref["decoder_input_ids"],
          "decoder_target_tokens": ones, "decoder_loss_weights": ones}


@functools.cache
def _import(family, **overrides):
  """The model of `family` with `overrides`, the reference, its batch and the
  imported parameters (loaded once; immutable, so tests can share them)."""
  folder = huggingface.HuggingFaceFolder(os.path.join(h.HF, family))
  model = _model(folder, **overrides)
  ref = _reference(family)
  batch = _batch(ref)
  params = interop.load_params(folder.path, h.abstract_params(model, batch))
  return model, ref, batch, params


@functools.cache
def _t5x_a():
  """The T5X fixture's model and parameters, run on the byte batch of byt5
  (byte ids fit the T5X model's vocabulary); loaded once, as `_import`."""
  model = h.t5x_model("a")
  batch = _batch(_reference("byt5"))
  params = interop.load_params(h.T5X_CHECKPOINTS["a", "orbax"], h.abstract_params(model, batch))
  return model, params, batch


SCANNED = ["t5_v1_1", "switch"]


@functools.cache
def _outputs():
  """Every forward pass and greedy decode the tests check, on the imported
  parameters: ("logits", family), ("greedy", family), ("scanned", family)
  and ("logits", "t5x_a"). One jitted program computes them all (each model
  on its own parameters and batch), as one compiled program costs a fraction
  of the CPU time of a program per model and pass."""
  passes = {}
  for family in FAMILIES:
    model, ref, batch, params = _import(family)
    passes["logits", family] = (model.predict_logits, params, batch)
    length = ref["greedy"].shape[1] - 1  # generate() starts with the decoder start id
    zeros = np.zeros((len(ref["input_ids"]), length), np.int32)
    passes["greedy", family] = (model.predict_batch, params, {
        "encoder_input_tokens": ref["input_ids"], "decoder_input_tokens": zeros,
        "decoder_target_tokens": zeros})
  for family in SCANNED:
    model, _, batch, params = _import(family, scan_layers=True)
    passes["scanned", family] = (model.predict_logits, params, batch)
  model, params, batch = _t5x_a()
  passes["logits", "t5x_a"] = (model.predict_logits, params, batch)
  run = jax.jit(lambda args: {k: passes[k][0](*a) for k, a in args.items()})
  out = run({k: (params, batch) for k, (_, params, batch) in passes.items()})
  return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_decodes_match_transformers(family):
  ref = _reference(family)
  # The batch pads the inputs with id 0, as transformers' attention_mask says.
  np.testing.assert_array_equal(ref["input_ids"] > 0, ref["attention_mask"] > 0)
  np.testing.assert_allclose(_outputs()["logits", family], ref["logits"], rtol=0, atol=1e-4)
  np.testing.assert_array_equal(_outputs()["greedy", family], ref["greedy"][:, 1:])


def test_switch_batch_overflows_expert_capacity():
  """The Switch reference exercises dropped tokens, so capacity is really tested."""
  ref = _reference("switch")
  assert ref["encoder_dropped"].any() and ref["decoder_dropped"].any()


@pytest.mark.parametrize("family", SCANNED)
def test_scanned_model_imports_the_same_logits(family):
  _, ref, _, params = _import(family, scan_layers=True)
  assert "layers" in params["encoder"]
  np.testing.assert_allclose(_outputs()["scanned", family], ref["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family,expected", [
    ("t5_v1_0", dict(mlp_activations=("relu",), logits_via_embedding=True, num_encoder_layers=2,
                     num_decoder_layers=3, vocab_size=2100)),
    ("t5_v1_1", dict(mlp_activations=("gelu", "linear"), logits_via_embedding=False,
                     relative_attention_num_buckets=16, relative_attention_max_distance=20)),
    ("mt5", dict(mlp_activations=("gelu", "linear"), logits_via_embedding=False,
                 num_encoder_layers=3, num_decoder_layers=2)),
    ("byt5", dict(vocab_size=384, relative_attention_max_distance=8)),
    ("switch", dict(num_experts=4, num_selected_experts=1, expert_capacity=3,
                    moe_layer_interval=2, renormalize_router_weights=False,
                    mlp_activations=("relu",), logits_via_embedding=True, group_size=None)),
])
def test_config_json_gives_the_architecture(family, expected):
  fields = huggingface.model_config(huggingface.HuggingFaceFolder(os.path.join(h.HF, family)))
  assert {k: fields[k] for k in expected} == expected
  assert fields["emb_dim"] == 32 and fields["num_heads"] == 4 and fields["head_dim"] == 12


@pytest.mark.parametrize("family,kind", [("t5_v1_0", "sentencepiece"), ("mt5", "sentencepiece"),
                                         ("byt5", "byte"), ("switch", "byte")])
def test_vocabulary_comes_with_the_folder(family, kind):
  folder = huggingface.HuggingFaceFolder(os.path.join(h.HF, family))
  assert folder.vocabulary()[0] == kind
  vocab = _model(folder).input_vocabulary
  # 2000 SentencePiece pieces + 100 extra ids fill the 2100 rows; bytes use 359 of 384.
  assert vocab.vocab_size == (2100 if kind == "sentencepiece" else 359)


def test_sharded_folder_reads_through_its_index():
  folder = huggingface.HuggingFaceFolder(os.path.join(h.HF, "t5_v1_1"))
  assert len(set(folder.files.values())) > 1
  assert all(os.path.basename(f).startswith("model-000") for f in folder.files.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_back_the_same_arrays_and_config(tmp_path, family):
  source = os.path.join(h.HF, family)
  model, _, batch, params = _import(family)
  fields = interop.export_fields(model)
  interop.export_huggingface(params, fields, str(tmp_path), model.input_vocabulary,
                             source=source)
  original, exported = (huggingface.HuggingFaceFolder(p) for p in (source, str(tmp_path)))
  assert huggingface.model_config(exported) == huggingface.model_config(original)
  assert set(exported.files) == set(original.files) - set(huggingface._IGNORED)
  for name in exported.files:
    np.testing.assert_array_equal(exported.array(name).read(), original.array(name).read())
  assert os.path.exists(tmp_path / "spiece.model") == (original.vocabulary()[0] ==
                                                      "sentencepiece")


def test_export_refuses_models_without_a_counterpart(tmp_path):
  model = h.t5x_model("c")
  with pytest.raises(ValueError, match="Only encoder-decoder models have a Hugging Face "
                                       "counterpart; this model's network is DecoderOnly"):
    interop.export_fields(model)
  folder = huggingface.HuggingFaceFolder(os.path.join(h.HF, "switch"))
  topk = _model(folder, num_selected_experts=2)
  with pytest.raises(ValueError, match=r"no Hugging Face Switch Transformers counterpart: "
                                       r"top-2 routing"):
    interop.export_fields(topk)
  assert not os.listdir(tmp_path)


ROUNDTRIP = os.path.join(h.HF, "roundtrip")


def _roundtrip_source(name):
  """t5lite's model and params of the export transformers ran."""
  if name == "t5x_a":
    model, params, _ = _t5x_a()
    return model, params
  model, _, _, params = _import(name)
  return model, params


@pytest.mark.parametrize("name", ["t5_v1_0", "t5_v1_1", "switch", "t5x_a"])
def test_transformers_loads_the_export_and_gives_t5lite_logits(tmp_path, name):
  """tests/data/hf/roundtrip/<name>/ is what the exporter wrote and transformers
  loaded (export_roundtrip.py, then make_reference.py --roundtrip)."""
  model, params = _roundtrip_source(name)
  # The exporter still writes exactly the arrays transformers was given.
  interop.export_huggingface(params, interop.export_fields(model), str(tmp_path),
                             model.input_vocabulary, source=name)
  fresh = huggingface.HuggingFaceFolder(str(tmp_path))
  committed = huggingface.HuggingFaceFolder(os.path.join(ROUNDTRIP, name))
  assert set(fresh.files) == set(committed.files)
  for array in fresh.files:
    np.testing.assert_array_equal(fresh.array(array).read(), committed.array(array).read())
  with np.load(os.path.join(ROUNDTRIP, name, "roundtrip.npz"), allow_pickle=False) as got:
    transformers_logits = got["logits"]
  # t5lite's logits on the batch transformers ran the export on.
  np.testing.assert_allclose(transformers_logits, _outputs()["logits", name], rtol=0, atol=1e-4)
