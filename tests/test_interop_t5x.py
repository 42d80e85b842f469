"""T5X checkpoints imported into t5lite reproduce T5X's own outputs.

The checkpoints and `reference.npz` under tests/data/t5x/ were written by
T5X itself (see its README); nothing there was computed by t5lite.
"""

import dataclasses
import functools
import json
import shutil

import interop_helpers as h
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from t5lite import checkpoints as ckpt_lib
from t5lite import evaluate, interop
from t5lite.interop import lazy, t5x
from t5lite.models import transformer
from t5lite.partitioning import Partitioner


CASES = sorted(h.T5X_CHECKPOINTS)


def _programs(network, **overrides):
  # Overrides that restate a default name the same model.
  defaults = {f.name: f.default for f in dataclasses.fields(transformer.TransformerConfig)}
  return _cached_programs(network, **{k: v for k, v in overrides.items() if v != defaults[k]})


@functools.cache
def _cached_programs(network, **overrides):
  """The model of `network` with `overrides`, and its jitted forward pass and
  greedy decode: one function object per model, so every test and
  parametrization that runs the same model on the same batch shapes (both
  checkpoint formats, stacked and per-layer layouts) compiles it once.
  The forward pass gives the logits, `score_batch` and T5X's
  `loss_fn_loss` (summed weighted cross-entropy plus z-loss)."""
  model = h.t5x_model(network, **overrides)

  def forward(params, batch):
    _, sums = model.loss_fn(params, batch, dropout_rng=None)
    return (model.predict_logits(params, batch), model.score_batch(params, batch),
            sums["cross_ent_sum"] + sums["z_loss_sum"])

  return model, jax.jit(forward), jax.jit(model.predict_batch_with_aux)


def _import(network, fmt, path=None, **overrides):
  model, forward, decode = _programs(network, **overrides)
  batch = h.t5x_batch(network)
  params = interop.load_params(path or h.T5X_CHECKPOINTS[network, fmt],
                               h.abstract_params(model, batch))
  return model, batch, params, forward, decode


@pytest.mark.parametrize("network,fmt", CASES)
def test_logits_scores_and_loss_match_t5x(network, fmt):
  _, batch, params, forward, _ = _import(network, fmt)
  ref = h.t5x_reference(network)
  logits, scores, loss = forward(params, batch)
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=0, atol=1e-4)
  np.testing.assert_allclose(np.asarray(scores), ref["score_batch"], rtol=1e-4)
  # T5X's loss_fn_loss is the summed weighted cross-entropy plus z-loss.
  np.testing.assert_allclose(float(loss), float(ref["loss_fn_loss"]), rtol=1e-4)


@pytest.mark.parametrize("network,fmt", CASES)
def test_greedy_decodes_match_t5x(network, fmt):
  _, batch, params, _, decode = _import(network, fmt)
  ref = h.t5x_reference(network)
  tokens, aux = decode(params, batch)
  tokens = np.asarray(tokens)
  if network == "a":
    np.testing.assert_array_equal(tokens, ref["greedy_decodes"])
    np.testing.assert_allclose(np.asarray(aux["scores"]), ref["greedy_scores"], rtol=1e-4)
    return
  # T5X decodes a decoder-only model until prompt + continuation fill the
  # 64 positions; t5lite decodes 64 new tokens. The first 64 - prompt
  # tokens are the same decode and must agree exactly.
  prompts = batch["decoder_causal_attention"].sum(axis=1) - 1
  for row, prompt in enumerate(prompts):
    n = 64 - int(prompt)
    np.testing.assert_array_equal(tokens[row, :n], ref["greedy_decodes"][row, :n])
    assert not ref["greedy_decodes"][row, n:].any()


@pytest.mark.parametrize("network,fmt", CASES)
def test_every_parameter_sum_matches_t5x_state_sums(network, fmt):
  ref = h.t5x_reference(network)
  sums = dict(zip(ref["state_names"], ref["state_sums"]))
  checkpoint = t5x.T5xCheckpoint(h.T5X_CHECKPOINTS[network, fmt])
  assert checkpoint.format == fmt and checkpoint.step == 20
  for name, array in checkpoint.arrays.items():
    np.testing.assert_allclose(array.read().astype(np.float64).sum(), sums[name], rtol=1e-6)
  # Every parameter T5X restored is one of them; no optimizer slot was opened.
  assert set(checkpoint.arrays) == {n for n in sums if n.startswith("target/")}


@pytest.mark.parametrize("network", ["a", "c"])
def test_scanned_model_imports_per_layer_checkpoint(network):
  ref = h.t5x_reference(network)
  _, batch, params, forward, _ = _import(network, "orbax", scan_layers=True)
  assert "layers" in params["decoder"] and "layers_0" not in params["decoder"]
  np.testing.assert_allclose(np.asarray(forward(params, batch)[0]), ref["logits"],
                             rtol=0, atol=1e-4)


def _write_stacked_checkpoint(tmp_path, network, relpos_in_layers=False):
  """A T5X Orbax checkpoint whose layers are stacked on axis 1 (scalable_t5's
  `param_scan_axis`), made from the per-layer fixture; with
  `relpos_in_layers`, every layer holds a copy of its stack's table as
  scalable_t5's `relative_posemb` (and the stack none)."""
  source = t5x.T5xCheckpoint(h.T5X_CHECKPOINTS[network, "orbax"])
  per_layer = {name: array.read() for name, array in source.arrays.items()}
  if relpos_in_layers:
    for stack in ("encoder", "decoder"):
      table = per_layer.pop(f"target/{stack}/relpos_bias/rel_embedding", None)
      layers = {n.split("/")[2] for n in per_layer if n.startswith(f"target/{stack}/layers_")}
      for layer in layers:
        per_layer[f"target/{stack}/{layer}/relative_posemb/rel_embedding"] = table
  tree, stacked = {}, {}
  for name, value in per_layer.items():
    parts = name.split("/")
    if len(parts) > 2 and parts[2].startswith("layers_"):
      key = "/".join(parts[:2] + ["layers"] + parts[3:])
      stacked.setdefault(key, {})[int(parts[2][len("layers_"):])] = value
    else:
      stacked[name] = value
  for name, value in stacked.items():
    if isinstance(value, dict):
      value = np.stack([value[i] for i in sorted(value)], axis=1)
    node = tree
    *parents, leaf = name.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  step_dir = tmp_path / "stacked" / "checkpoint_7"
  ocp.PyTreeCheckpointer().save(step_dir / "state", tree)
  return str(step_dir)


@pytest.mark.parametrize("network", ["a", "c"])
@pytest.mark.parametrize("scan", [False, True])
def test_layers_stacked_on_one_axis_import(tmp_path, network, scan):
  path = _write_stacked_checkpoint(tmp_path, network)
  assert any("/layers/" in n for n in t5x.T5xCheckpoint(path).arrays)
  _, batch, params, forward, _ = _import(network, None, path, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(forward(params, batch)[0]),
                             h.t5x_reference(network)["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("network", ["a", "c"])
@pytest.mark.parametrize("scan", [False, True])
def test_scalable_t5_layout_with_a_table_in_every_layer_imports(tmp_path, network, scan):
  path = _write_stacked_checkpoint(tmp_path, network, relpos_in_layers=True)
  names = set(t5x.T5xCheckpoint(path).arrays)
  assert "target/decoder/layers/relative_posemb/rel_embedding" in names
  assert "target/decoder/relpos_bias/rel_embedding" not in names
  fields = interop.describe(path).fields
  assert fields["relpos_per_layer"] is True
  _, batch, params, forward, decode = _import(network, None, path, scan_layers=scan,
                                              relpos_per_layer=True)
  ref = h.t5x_reference(network)
  np.testing.assert_allclose(np.asarray(forward(params, batch)[0]), ref["logits"],
                             rtol=0, atol=1e-4)
  if network == "a":
    np.testing.assert_array_equal(np.asarray(decode(params, batch)[0]), ref["greedy_decodes"])


def test_model_dir_resolves_to_its_newest_step(tmp_path):
  for step in (5, 20):
    shutil.copytree(h.T5X_CHECKPOINTS["a", "orbax"], tmp_path / f"checkpoint_{step}")
  assert t5x.find_step_dir(str(tmp_path)).endswith("checkpoint_20")
  assert interop.checkpoint_format(str(tmp_path)) == interop.T5X
  assert interop.checkpoint_step(str(tmp_path)) == 20


def test_evaluate_infer_and_export_read_the_t5x_step(tmp_path):
  # One answer to "which step is this checkpoint?": every reader names the
  # files and records it the same way (an export once recorded step 0).
  shutil.copytree(h.T5X_CHECKPOINTS["a", "orbax"], tmp_path / "run" / "checkpoint_20")
  path = str(tmp_path / "run")
  opened = ckpt_lib.open_checkpoint(path)
  assert (opened.kind, opened.step, opened.foreign) == (interop.T5X, 20, True)
  for mode in ("specific", "latest", "all"):
    cfg = ckpt_lib.RestoreCheckpointConfig(path=path, mode=mode)
    assert evaluate._steps_to_evaluate(cfg)[1] == [20], mode
  cfg = ckpt_lib.RestoreCheckpointConfig(path=path)
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("hello\n")
  written = evaluate.infer(model=h.t5x_model("a"), partitioner=Partitioner(),
                           restore_checkpoint_cfg=cfg, output_dir=str(tmp_path / "out"),
                           task_feature_lengths={"inputs": 8, "targets": 4}, batch_size=1,
                           input_file=str(inputs))
  assert [p.rsplit("/", 1)[1] for p in written] == ["inputs-20.jsonl"]
  evaluate.export_huggingface(model=h.t5x_model("a"), partitioner=Partitioner(),
                              restore_checkpoint_cfg=cfg, output_dir=str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "t5lite-export.json") as f:
    assert json.load(f)["step"] == 20


def test_describe_finds_the_architecture_and_vocabulary():
  found = interop.describe(h.T5X_CHECKPOINTS["a", "legacy"])
  network, fields, vocab = found.network, found.fields, found.vocabulary
  assert network == "encoder_decoder" and vocab == ("byte", None)
  assert fields == {
      "vocab_size": 384, "emb_dim": 64, "num_heads": 2, "num_encoder_layers": 2,
      "num_decoder_layers": 2, "head_dim": 16, "mlp_dim": 128,
      "mlp_activations": ("gelu", "linear"), "logits_via_embedding": False,
      "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
  found = interop.describe(h.T5X_CHECKPOINTS["c", "orbax"])
  network, fields = found.network, found.fields
  assert network == "decoder_only" and fields["logits_via_embedding"]
  assert fields["num_encoder_layers"] == 0


def test_reads_only_the_regions_asked_for():
  """A region of a split attention kernel reads only the rows and columns it needs."""
  checkpoint = t5x.T5xCheckpoint(h.T5X_CHECKPOINTS["a", "legacy"])
  source = checkpoint.arrays["target/encoder/layers_0/attention/query/kernel"]  # [64, 32]
  reads = []
  spy = lazy.LazyArray(source.shape, source.dtype,
                       lambda index: reads.append(index) or source.reader(index), source.origin)
  split = lazy.split_axis(spy, 1, (2, 16))  # [64, 2, 16]
  region = split.read((slice(0, 32), slice(1, 2), slice(None)))
  np.testing.assert_array_equal(region, source.read()[:32, 16:32].reshape(32, 1, 16))
  assert reads == [(slice(0, 32), slice(16, 32))]


# --- bad input: one line naming the file and the mismatch ---------------------


def test_checkpoint_of_another_architecture_is_refused():
  encdec, deconly = h.t5x_model("a"), h.t5x_model("c")
  with pytest.raises(ValueError, match=r"t5x_deconly_c/checkpoint_20 .*does not match the "
                                       r"model: 31 model parameter\(s\) missing from it "
                                       r"\(first: decoder/layers_0/encoder_decoder_attention"):
    interop.load_params(h.T5X_CHECKPOINTS["c", "orbax"],
                        h.abstract_params(encdec, h.t5x_batch("a")))
  with pytest.raises(ValueError, match=r"does not match the model: .*array\(s\) have no "
                                       r"place in the model"):
    interop.load_params(h.T5X_CHECKPOINTS["a", "orbax"],
                        h.abstract_params(deconly, h.t5x_batch("c")))


def test_shape_that_differs_from_the_gin_file_is_refused():
  model = h.t5x_model("a", num_heads=4, head_dim=8)
  with pytest.raises(ValueError, match=r"attention.query.kernel.* is \(64, 2, 16\) as t5lite's "
                                       r".*, but the model \(gin file\) has \(64, 4, 8\)"):
    interop.load_params(h.T5X_CHECKPOINTS["a", "legacy"],
                        h.abstract_params(model, h.t5x_batch("a")))


def test_missing_array_is_named(tmp_path):
  copy = tmp_path / "checkpoint_20"
  shutil.copytree(h.T5X_CHECKPOINTS["a", "legacy"], copy)
  shutil.rmtree(copy / "target.decoder.layers_1.mlp.wo.kernel")
  with pytest.raises(ValueError, match=r"target.decoder.layers_1.mlp.wo.kernel cannot be read"):
    interop.read_foreign(str(copy))


def test_garbage_data_file_is_named(tmp_path):
  copy = tmp_path / "checkpoint_20"
  shutil.copytree(h.T5X_CHECKPOINTS["a", "legacy"], copy)
  (copy / "target.encoder.layers_0.mlp.wi_0.kernel" / "0.0").write_bytes(b"garbage")
  model = h.t5x_model("a")
  with pytest.raises(ValueError, match=r"target.encoder.layers_0.mlp.wi_0.kernel"):
    jax.block_until_ready(interop.load_params(str(copy),
                                              h.abstract_params(model, h.t5x_batch("a"))))


def test_not_a_checkpoint_is_refused(tmp_path):
  with pytest.raises(ValueError, match="neither a T5X checkpoint"):
    interop.read_foreign(str(tmp_path))
  (tmp_path / "checkpoint_3").mkdir()
  with pytest.raises(ValueError, match="neither T5X format"):
    interop.read_foreign(str(tmp_path))


@pytest.mark.parametrize("network", ["a", "c"])
def test_bfloat16_model_is_within_two_bfloat16_steps_of_t5x(network):
  """A bfloat16 import against T5X's float32 outputs (docs/checkpoints.md).

  bfloat16 keeps 8 significant bits, so a logit near 7.75 (the largest here)
  is rounded in steps of 2**-5; the tolerance is two such steps, 0.0625.
  Measured: 0.032 (encoder-decoder) and 0.044 (decoder-only), and scores
  within 0.13 % (tolerance 0.5 %).
  """
  _, batch, params, forward, _ = _import(network, "orbax", dtype="bfloat16")
  ref = h.t5x_reference(network)
  step = 2.0 ** (np.floor(np.log2(np.abs(ref["logits"]).max())) - 7)
  logits, scores, _ = forward(params, batch)
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=0, atol=2 * step)
  np.testing.assert_allclose(np.asarray(scores), ref["score_batch"], rtol=5e-3)
