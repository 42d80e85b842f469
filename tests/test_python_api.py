"""The Python API (`t5lite.api`), through its public names only.

Parity is shown against outputs the other implementations produced: the
transformers logits and greedy decodes of tests/data/hf/ and the T5X
scores, greedy and beam decodes of tests/data/t5x/.
"""

import functools
import json
import os

import jax
import numpy as np
import pytest

from t5lite import api, state_init, trainer
from t5lite.errors import UserError


DATA = os.path.join(os.path.dirname(__file__), "data")
HF_T5 = os.path.join(DATA, "hf", "t5_v1_1")
T5X_A = os.path.join(DATA, "t5x", "t5x_encdec_a", "checkpoint_20")
# t5_tiny at the test sizes: a different size on every axis.
TINY = "gin/models/t5_tiny.gin"
TINY_BINDINGS = ("transformer.TransformerConfig.emb_dim = 8",
                 "transformer.TransformerConfig.num_heads = 4",
                 "transformer.TransformerConfig.head_dim = 3",
                 "transformer.TransformerConfig.mlp_dim = 16",
                 "transformer.TransformerConfig.num_encoder_layers = 2",
                 "transformer.TransformerConfig.num_decoder_layers = 2")


def _unpadded(rows, mask=None):
  mask = rows > 0 if mask is None else mask > 0
  return [[int(t) for t in row[m]] for row, m in zip(rows, mask)]


@pytest.fixture(scope="module")
def hf():
  with np.load(os.path.join(HF_T5, "reference.npz")) as ref:
    ref = dict(ref)
  inputs = _unpadded(ref["input_ids"], ref["attention_mask"])
  # Logits at a position do not depend on later targets: any last target will do.
  targets = [[int(t) for t in row[1:]] + [1] for row in ref["decoder_input_ids"]]
  return api.load(HF_T5, batch_size=2), ref, inputs, targets


# The examples the eight-device test scores (padded, like the score test's,
# to 16 input and 16 target tokens: one compiled score for both).
SHARDED_INPUTS, SHARDED_TARGETS = ["one two three", "three"], ["two", "four five"]


@pytest.fixture(scope="module")
def tiny_and_fresh_scores():
  """The tiny model as loaded (fresh from seed 3), and its scores of the
  eight-device test's examples, taken now: the train test trains this model
  (one initialisation compiled for the module, not two); the other tests
  check what holds for any parameters."""
  model = api.load(TINY, gin_bindings=TINY_BINDINGS, batch_size=4, seed=3)
  return model, model.score(SHARDED_INPUTS, SHARDED_TARGETS)


@pytest.fixture(scope="module")
def tiny(tiny_and_fresh_scores):
  return tiny_and_fresh_scores[0]


def test_a_hugging_face_folder_gives_transformers_logits_and_greedy_decodes(hf):
  model, ref, inputs, targets = hf
  assert model.step == 0
  logits = model.logits(inputs, targets)
  assert [x.shape for x in logits] == [(7, 2100)] * 3
  np.testing.assert_allclose(np.stack(logits), ref["logits"], rtol=0, atol=1e-4)
  greedy = model.generate(inputs, max_length=8)
  assert [g.tokens for g in greedy] == [tuple(row) for row in ref["greedy"][:, 1:].tolist()]


def test_score_is_the_summed_log_softmax_of_the_logits_at_the_targets(tiny):
  inputs = ["a short input", [5, 6, 7, 1], ""]
  targets = ["its target", [9, 1], "x"]
  scores = tiny.score(inputs, targets)
  encode = tiny.vocabulary.encode
  target_ids = [[*encode("its target"), 1], [9, 1], [*encode("x"), 1]]
  expected = [np.take_along_axis(jax.nn.log_softmax(logits), np.asarray(ids)[:, None], 1).sum()
              for logits, ids in zip(tiny.logits(inputs, targets), target_ids)]
  assert scores.shape == (3,)
  np.testing.assert_allclose(scores, expected, rtol=1e-5)


def test_a_text_and_its_token_ids_give_the_same_logits(tiny):
  # Padded to 16 input and 16 target tokens, as the score test's: its compiled logits serve.
  ids = [*tiny.vocabulary.encode("hello there"), tiny.vocabulary.eos_id]
  by_text = tiny.logits(["hello there"] * 5, ["the world"] * 5)
  by_ids = tiny.logits([ids] * 5, ["the world"] * 5)
  assert len(by_text) == 5  # two batches of 4, the second padded
  for a, b in zip(by_text, by_ids):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def t5x():
  with np.load(os.path.join(os.path.dirname(T5X_A), "reference.npz")) as ref:
    ref = dict(ref)
  # The checkpoint does not name its vocabulary; the fixture was trained on bytes.
  model = api.load(T5X_A, gin_bindings=["VOCABULARY = @vocabularies.byte_vocabulary()"],
                   batch_size=4)
  return model, ref, _unpadded(ref["encoder_input_tokens"]), _unpadded(
      ref["decoder_target_tokens"])


def test_a_t5x_checkpoint_gives_t5x_scores_greedy_and_beam_decodes(t5x):
  model, ref, inputs, targets = t5x
  assert model.step == 20
  np.testing.assert_allclose(model.score(inputs, targets), ref["score_batch"], rtol=0,
                             atol=1e-3)
  greedy = model.generate(inputs, max_length=32)
  np.testing.assert_array_equal([_padded(g.tokens, 32) for g in greedy], ref["greedy_decodes"])
  np.testing.assert_allclose([g.score for g in greedy], ref["greedy_scores"], atol=1e-3)


def test_a_t5x_checkpoint_gives_t5x_beam_decodes(t5x):
  model, ref, inputs, _ = t5x
  beams = model.generate(inputs, method="beam", num_beams=4, num_decodes=4, max_length=32)
  eos = model.vocabulary.eos_id
  # T5X sorts the beams worst first and fills the places no finished beam
  # takes with empty sequences scored -1e7 (here three of four: only EOS
  # alone, ranked 7th of 8 at the first step, finishes); the API gives the
  # best first and fills those places with beams unfinished at max_length.
  for row, want_tokens, want_scores in zip(beams, ref["beam4_decodes"], ref["beam4_scores"]):
    finished = [k for k in reversed(range(4)) if want_scores[k] > -1e6]
    assert finished
    assert [_padded(b.tokens, 32) for b in row[:len(finished)]] == [
        list(want_tokens[k]) for k in finished]
    np.testing.assert_allclose([b.score for b in row[:len(finished)]], want_scores[finished],
                               atol=1e-3)
    assert all(len(b.tokens) == 32 and eos not in b.tokens for b in row[len(finished):])


def _padded(tokens, length):
  return list(tokens) + [0] * (length - len(tokens))


def test_one_beam_is_greedy_and_more_beams_score_at_least_as_well(hf):
  model, _, inputs, _ = hf
  greedy = model.generate(inputs, max_length=8)
  one_beam = model.generate(inputs, method="beam", num_beams=1, alpha=0.0, max_length=8)
  assert [b.tokens for b in one_beam] == [g.tokens for g in greedy]
  np.testing.assert_allclose([b.score for b in one_beam], [g.score for g in greedy], rtol=1e-5)
  # Without length normalisation a beam's score is its log-probability.
  beams = model.generate(inputs, method="beam", num_beams=4, alpha=0.0, max_length=8,
                         num_decodes=4)
  assert all(len(row) == 4 for row in beams)
  for row, best in zip(beams, greedy):
    assert row[0].score >= best.score - 1e-5
    assert [b.score for b in row] == sorted((b.score for b in row), reverse=True)


def test_sampling_is_reproducible_by_seed(hf):
  model, _, inputs, _ = hf
  first = model.generate(inputs, method="sample", seed=1, max_length=8, num_decodes=2)
  assert model.generate(inputs, method="sample", seed=1, max_length=8, num_decodes=2) == first
  assert model.generate(inputs, method="sample", seed=2, max_length=8, num_decodes=2) != first
  assert model.generate(inputs, method="sample", temperature=0.0, max_length=8) == (
      model.generate(inputs, max_length=8))


def test_train_lowers_the_loss_with_t5lites_own_train_step(tiny):
  model = tiny  # as loaded: the only test that trains it (see tiny_and_fresh_scores)
  assert model.step == 0
  inputs, targets = ["one two", "three four five"], ["two one", "five four three"]
  before = jax.device_get(model.params)
  losses = model.train(inputs, targets, steps=1)
  # The same step, by hand: the model's optimizer on the batch the API
  # trains on (the two examples in turn, to the batch size of 4).
  specs, _ = state_init.state_specs(
      model.model, model.partitioner,
      *model.model.input_shapes_and_types({"inputs": 16, "targets": 16}, pack=False))
  state = state_init.state_from_params(specs, model.partitioner, before)
  batch = _train_batch(model, inputs, targets, rows=[0, 1, 0, 1])
  step = jax.jit(functools.partial(trainer.train_step, model=model.model, dropout_seed=3,
                                   num_microbatches=None))
  _, metrics = step(state, batch)
  np.testing.assert_allclose(losses[0], float(metrics["loss"]), rtol=1e-5)
  later = model.train(inputs, targets, steps=10)
  assert model.step == 11
  assert later[-1] < losses[0] * 0.8, [*losses, *later]


def _train_batch(model, inputs, targets, rows):
  """Encoder-decoder training features, padded to 16 (the API pads to a multiple of 8)."""
  def padded(ids):
    return np.asarray(ids + [0] * (16 - len(ids)), np.int32)
  vocab = model.vocabulary
  enc = [padded([*vocab.encode(x), 1]) for x in inputs]
  dec = [[*vocab.encode(y), 1] for y in targets]
  target_tokens = [padded(d) for d in dec]
  input_tokens = [padded([0] + d[:-1]) for d in dec]
  batch = {"encoder_input_tokens": np.stack(enc), "decoder_target_tokens": np.stack(target_tokens),
           "decoder_input_tokens": np.stack(input_tokens),
           "decoder_loss_weights": (np.stack(target_tokens) > 0).astype(np.int32)}
  return {k: v[rows] for k, v in batch.items()}


@pytest.mark.parametrize("call,message", [
    (lambda m: m.generate(["x"], method="topk"),
     r"Unknown generation method 'topk'; use one of \['greedy', 'sample', 'beam'\]"),
    (lambda m: m.generate(["x"], num_decodes=2),
     r"Greedy search gives one decode per input, got num_decodes=2; use method='sample'"),
    (lambda m: m.score("x", ["y"]), r"inputs must be a list of examples .* wrap it in a list"),
    (lambda m: m.score(["x", "y"], ["z"]), r"targets must be a list as long as inputs \(2\)"),
    (lambda m: m.logits([[3, 400]], ["z"]),
     r"Token ids \[400\] in inputs are not in the vocabulary's 1 \.\. 358 \(0 is padding"),
    (lambda m: m.logits(["y"], [[5, 0, 0]]), r"Token ids \[0, 0\] in targets are not in the "),
    (lambda m: m.logits([3.5], ["z"]), r"Each of inputs must be a string or a list of token ids"),
    (lambda m: m.logits([3], ["z"]), r"Each of inputs must be a string or a list of token ids"),
    (lambda m: m.train(["x"], ["y"], steps=0), r"steps must be >= 1, got 0"),
])
def test_bad_calls_say_what_is_wrong(tiny, call, message):
  with pytest.raises(UserError, match=message):
    call(tiny)


@pytest.mark.parametrize("source,bindings,message", [
    ("no/such/folder", (), r"'no/such/folder' does not exist; give a gin file that defines "
                           r"MODEL, a t5lite model_dir, a T5X checkpoint or a Hugging Face"),
    ("no_such.gin", (), r"Gin file 'no_such.gin' not found in"),
    (DATA, (), r"is neither a gin file, a t5lite model_dir \(with config.gin\), a T5X"),
    ("gin/partitioning/fsdp.gin", (), r"gin/partitioning/fsdp.gin does not define MODEL"),
    (TINY, ("transformer.TransformerConfig.emb_dimm = 8",),
     r"Unknown parameter 'emb_dimm' of transformer.TransformerConfig; did you mean 'emb_dim'"),
])
def test_bad_sources_say_what_is_wrong(source, bindings, message):
  with pytest.raises(UserError, match=message):
    api.load(source, gin_bindings=bindings)


@pytest.mark.slow
def test_a_t5lite_run_generates_what_t5lite_infer_predicts(tmp_path, monkeypatch):
  # The commands run in this process: what they write is what is compared.
  from test_cli import SHALLOW, SHALLOW_BINDINGS, run_in_process
  model_dir = str(tmp_path / "run")
  tiny = ["--gin_file=gin/models/t5_tiny.gin", "--gin_file=gin/testing/local_tiny.gin"]
  # One layer a stack: what is compared does not depend on depth.
  run_in_process([tiny[0], "--gin_file=gin/runs/finetune.gin", tiny[1], *SHALLOW,
                  "--gin.INITIAL_CHECKPOINT_PATH=None", f"--gin.MODEL_DIR='{model_dir}'",
                  "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'",
                  "--gin.INFER_EVAL_DATASET_CFG=None",
                  # No evaluation while training: what is compared is the checkpoint.
                  "--gin.EVAL_PERIOD=0"], str(tmp_path), monkeypatch)
  questions = ["add: 1 + 2", "sub: 10 - 3", "add: 7 + 7"]
  (tmp_path / "questions.txt").write_text("\n".join(questions) + "\n")
  run_in_process([tiny[0], "--gin_file=gin/runs/infer.gin", tiny[1], *SHALLOW,
                  f"--gin.CHECKPOINT_PATH='{model_dir}'",
                  f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'out'}'",
                  f"--gin.INPUT_FILE='{tmp_path / 'questions.txt'}'"],
                 str(tmp_path), monkeypatch, script="t5lite-infer")
  rows = [json.loads(line) for line in (tmp_path / "out" / "questions-4.jsonl").open()]
  # The run's own config.gin and newest checkpoint, or the files it was trained with.
  for model in (api.load(model_dir, batch_size=2),
                api.load(["gin/models/t5_tiny.gin", "gin/testing/local_tiny.gin"],
                         os.path.join(model_dir, "checkpoints", "4"),
                         gin_bindings=SHALLOW_BINDINGS)):
    assert model.step == 4
    generated = model.generate(questions, max_length=16)  # local_tiny's targets length
    assert [g.text for g in generated] == [r["prediction"] for r in rows]
    np.testing.assert_allclose([g.score for g in generated], [r["score"] for r in rows],
                               rtol=1e-5)


def test_a_decoder_only_model_scores_its_continuations():
  model = api.load("gin/models/decoder_only_tiny.gin", batch_size=2,
                   gin_bindings=["transformer.TransformerConfig.emb_dim = 8",
                                 "transformer.TransformerConfig.num_decoder_layers = 2"])
  prompts, continuations = ["hello", [5, 6]], ["world", [7, 1]]
  logits = model.logits(prompts, continuations)
  ids = [[*model.vocabulary.encode("world"), 1], [7, 1]]
  assert [x.shape for x in logits] == [(6, 384), (2, 384)]  # the continuations' positions only
  expected = [np.take_along_axis(jax.nn.log_softmax(x), np.asarray(y)[:, None], 1).sum()
              for x, y in zip(logits, ids)]
  np.testing.assert_allclose(model.score(prompts, continuations), expected, rtol=1e-5)
  generated = model.generate(prompts, max_length=3)
  assert [len(g.tokens) for g in generated] == [3, 3]


# Loads the tiny model on 8 CPU devices as a 4 x 2 (data x model) mesh and
# prints its scores.
_SHARDED = """
import json, sys
from t5lite import api
inputs, targets = json.loads(sys.argv[1])
model = api.load("gin/models/t5_tiny.gin", gin_bindings=sys.argv[2:], batch_size=8, seed=3)
kernel = model.params["decoder"]["logits_dense"]["kernel"]
print(json.dumps({"mesh": dict(model.partitioner.mesh.shape),
                  "kernel_devices": len(kernel.sharding.device_set),
                  "kernel_shard": list(kernel.addressable_shards[0].data.shape),
                  "scores": model.score(inputs, targets).tolist()}))
"""


@pytest.mark.slow
def test_eight_devices_give_the_scores_of_one(tiny_and_fresh_scores):
  import subprocess
  import sys
  bindings = [*TINY_BINDINGS, "partitioning.Partitioner.num_partitions = 2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  examples = json.dumps([SHARDED_INPUTS, SHARDED_TARGETS])
  result = subprocess.run([sys.executable, "-c", _SHARDED, examples, *bindings], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(DATA))
  assert result.returncode == 0, result.stderr[-3000:]
  sharded = json.loads(result.stdout.strip().splitlines()[-1])
  assert sharded["mesh"]["data"] == 4 and sharded["mesh"]["model"] == 2
  assert sharded["kernel_devices"] == 8 and sharded["kernel_shard"] == [8, 192]
  np.testing.assert_allclose(sharded["scores"], tiny_and_fresh_scores[1], rtol=1e-5)
