"""Tests of t5lite.decoding and of the models' prediction API.

The decoders are checked on small synthetic step functions whose every
sequence can be enumerated in numpy, then on tiny real networks, where a
cached decode must give what recomputing the full forward pass gives.
"""

import functools
import itertools
import os
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio
import tensorflow as tf

import gin
from t5lite import decoding, partitioning, testing
from t5lite.models import layers, models, transformer


EOS = 1

# ---------------------------------------------------------------------------
# Synthetic step functions.
# ---------------------------------------------------------------------------

# A second-order chain over 5 tokens: the logits depend on the last two
# tokens, the older one kept in the cache, so a beam search that reorders
# the cache wrongly scores sequences wrongly.
CHAIN_VOCAB = 5
CHAIN_TABLE = np.random.default_rng(0).normal(0.0, 1.5, (CHAIN_VOCAB,) * 3).astype(np.float32)


def _chain_step(tokens, cache):
  logits = jnp.asarray(CHAIN_TABLE)[cache["previous"], tokens]  # [n, vocab]
  return logits, {"previous": tokens}


def _chain_start(batch):
  """Initial cache and first tokens: example b starts from token b % vocab."""
  first = jnp.arange(batch, dtype=jnp.int32) % CHAIN_VOCAB
  return {"previous": jnp.zeros((batch,), jnp.int32)}, first


def _chain_log_prob(first, sequence):
  """Log-probability of `sequence` (up to its EOS) after `first`, in numpy."""
  previous, last, total = 0, int(first), 0.0
  for token in sequence:
    logits = CHAIN_TABLE[previous, last].astype(np.float64)
    total += logits[token] - np.log(np.sum(np.exp(logits)))
    if token == EOS:
      break
    previous, last = last, int(token)
  return total


def _all_chain_decodes(length):
  """Every possible decode of `length` tokens: EOS at some step then 0s, or no EOS."""
  others = [t for t in range(CHAIN_VOCAB) if t != EOS]
  for n in range(length):
    for prefix in itertools.product(others, repeat=n):
      yield list(prefix) + [EOS] + [0] * (length - n - 1)
  yield from (list(p) for p in itertools.product(others, repeat=length))


def _chain_decode(rng, *, decode_fn, batch, length, knobs):
  cache, first = _chain_start(batch)
  return decode_fn(_chain_step, cache, first, rng, max_decode_length=length, eos_id=EOS,
                   **dict(knobs))


_run_chain = jax.jit(_chain_decode, static_argnames=("decode_fn", "batch", "length", "knobs"))


def _setting(decode_fn, batch=3, length=4, seed=0, **knobs):
  return decode_fn, batch, length, seed, tuple(sorted(knobs.items()))


def _first_step_probs():
  logits = CHAIN_TABLE[0, 0].astype(np.float64)
  return np.exp(logits) / np.sum(np.exp(logits))


def _shared_settings():
  """The chain decodes the tests below read from one compiled program."""
  greedy, beam, sample = decoding.greedy, decoding.beam_search, decoding.temperature_sample
  order = list(np.argsort(-_first_step_probs()))
  topp = float(_first_step_probs()[order[0]] + 0.5 * _first_step_probs()[order[1]])
  with np.load(T5X_BEAM, allow_pickle=False) as ref:
    configs = ref["configs"].tolist()
  return [
      _setting(greedy), _setting(greedy, batch=5, length=5),
      *(_setting(sample, batch=5, length=5, seed=3, num_decodes=3, **knobs)
        for knobs in DEGENERATE_SAMPLING),
      *(_setting(sample, batch=1, length=1, seed=5, num_decodes=200, temperature=1.0, **knobs)
        for knobs in ({}, dict(topk=2), dict(topp=topp))),
      *(_setting(beam, batch=3, length=3, num_beams=80, alpha=alpha, num_decodes=num_decodes)
        for alpha in (0.0, 0.6) for num_decodes in (5, 30)),
      # T5X's configurations (test_beam_search_is_t5x_s) include those of the
      # one-beam and more-beams tests: 1, 3 and 8 beams at length 5.
      *(_setting(beam, batch=5, length=length, num_beams=beams, alpha=alpha10 / 10)
        for beams, alpha10, length in configs),
      _setting(beam, num_beams=4, alpha=0.0), _setting(beam, num_beams=4, alpha=0.0, num_decodes=2),
      _setting(sample, num_decodes=6),
  ]


@functools.lru_cache(maxsize=None)
def _shared_decodes():
  """{setting: (tokens, scores)} of every shared setting, from ONE jitted
  program: each setting's own program compiles in about a second, most of it
  the fixed cost of a compile; together they compile several times faster.
  Each decode in it is the same computation it is alone."""
  settings = _shared_settings()

  @jax.jit
  def run(rngs):
    return [_chain_decode(rng, decode_fn=decode_fn, batch=batch, length=length, knobs=knobs)
            for (decode_fn, batch, length, _, knobs), rng in zip(settings, rngs)]

  results = run([jax.random.key(seed) for _, _, _, seed, _ in settings])
  return {s: (np.asarray(t), np.asarray(c)) for s, (t, c) in zip(settings, results)}


def _decode(decode_fn, batch=3, length=4, seed=0, **knobs):
  """Decodes the chain from `batch` start tokens with `jax.random.key(seed)`:
  a shared setting from the one program of `_shared_decodes`, any other with
  a compile of its own."""
  setting = _setting(decode_fn, batch, length, seed, **knobs)
  shared = _shared_decodes()
  if setting in shared:
    return shared[setting]
  tokens, scores = _run_chain(jax.random.key(seed), decode_fn=decode_fn, batch=batch,
                              length=length, knobs=setting[-1])
  return np.asarray(tokens), np.asarray(scores)


DEGENERATE_SAMPLING = [dict(temperature=0.0), dict(temperature=1e-4),
                       dict(temperature=1.0, topk=1), dict(temperature=2.0, topp=1e-6)]


def _script_step():
  """Step function that emits `cache['script'][n, i]` at step i, counting its
  calls in `calls`; the script rides in the cache so beams copy it."""
  calls = []

  def step(tokens, cache):
    del tokens
    jax.debug.callback(lambda: calls.append(1))
    token = jnp.take_along_axis(cache["script"], cache["step"][:, None], axis=1)[:, 0]
    return 10.0 * jax.nn.one_hot(token, 8), {**cache, "step": cache["step"] + 1}

  return step, calls


def _script_cache(script):
  script = jnp.asarray(script, jnp.int32)
  return {"script": script, "step": jnp.zeros(script.shape[:1], jnp.int32)}


# ---------------------------------------------------------------------------
# Decoders on synthetic steps.
# ---------------------------------------------------------------------------


def test_greedy_follows_the_argmax_and_scores_it():
  tokens, scores = _decode(decoding.greedy, length=4)
  assert tokens.shape == (3, 1, 4) and scores.shape == (3, 1)
  for b in range(3):
    previous, last, expected = 0, b, []
    for _ in range(4):
      token = int(np.argmax(CHAIN_TABLE[previous, last]))
      expected.append(token)
      if token == EOS:
        break
      previous, last = last, token
    expected += [0] * (4 - len(expected))
    np.testing.assert_array_equal(tokens[b, 0], expected)
    np.testing.assert_allclose(scores[b, 0], _chain_log_prob(b, expected), rtol=1e-5)


def test_eos_pads_with_zeros_and_ends_the_loop_when_all_finished():
  # Row 0 ends at step 1, row 1 at step 2; afterwards the script says 7.
  step, calls = _script_step()
  cache = _script_cache([[5, EOS, 7, 7, 7, 7], [3, 4, EOS, 7, 7, 7]])
  # Beam search stops early only once it holds num_beams finished beams, so
  # with two beams it runs on; with one it stops when greedy does.
  for decode_fn, steps in ((decoding.greedy, 3),
                           (functools.partial(decoding.beam_search, num_beams=1), 3),
                           (functools.partial(decoding.beam_search, num_beams=2), 6)):
    calls.clear()
    tokens, _ = jax.jit(lambda c, f, fn=decode_fn: fn(step, c, f, max_decode_length=6,
                                                      eos_id=EOS))(cache, jnp.zeros(2, jnp.int32))
    jax.effects_barrier()
    np.testing.assert_array_equal(tokens[:, -1], [[5, EOS, 0, 0, 0, 0], [3, 4, EOS, 0, 0, 0]])
    assert len(calls) == steps, f"{decode_fn}: the loop ran {len(calls)} steps, not {steps}"


def test_without_eos_decodes_run_to_max_length():
  step, _ = _script_step()
  # Jitted: eager, the decoder's set-up compiles a program per op.
  tokens, _ = jax.jit(lambda cache, first: decoding.greedy(
      step, cache, first, max_decode_length=4, eos_id=None))(_script_cache([[5, EOS, 7, 7]]),
                                                              np.zeros(1, np.int32))
  np.testing.assert_array_equal(tokens[0, 0], [5, EOS, 7, 7])


@pytest.mark.parametrize("knobs", DEGENERATE_SAMPLING)
def test_sampling_degenerates_to_greedy(knobs):
  greedy, greedy_scores = _decode(decoding.greedy, batch=5, length=5)
  sampled, scores = _decode(decoding.temperature_sample, batch=5, length=5,
                            seed=3, num_decodes=3, **knobs)
  for k in range(3):
    np.testing.assert_array_equal(sampled[:, k], greedy[:, 0])
    np.testing.assert_allclose(scores[:, k], greedy_scores[:, 0], rtol=1e-6)


def test_sampling_with_temperature_is_random_and_reproducible():
  # Not shared settings: each call runs the program again, as reproducing needs.
  assert _setting(decoding.temperature_sample, batch=2, seed=1, num_decodes=16,
                  temperature=1.0) not in _shared_decodes()
  first, _ = _decode(decoding.temperature_sample, batch=2, seed=1, num_decodes=16,
                     temperature=1.0)
  again, _ = _decode(decoding.temperature_sample, batch=2, seed=1, num_decodes=16,
                     temperature=1.0)
  other, _ = _decode(decoding.temperature_sample, batch=2, seed=2, num_decodes=16,
                     temperature=1.0)
  np.testing.assert_array_equal(first, again)
  assert len({tuple(row) for row in first[0]}) > 3
  assert not np.array_equal(first, other)


def _first_step_samples(**knobs):
  """First tokens of 200 samples from example 0's first-step distribution."""
  tokens, _ = _decode(decoding.temperature_sample, batch=1, length=1, seed=5,
                      num_decodes=200, temperature=1.0, **knobs)
  return set(tokens[0, :, 0].tolist())


def test_topk_and_topp_restrict_samples_to_the_likeliest_tokens():
  probs = _first_step_probs()
  order = list(np.argsort(-probs))
  assert _first_step_samples() == set(range(CHAIN_VOCAB))  # unrestricted: all appear
  assert _first_step_samples(topk=2) == set(order[:2])
  # The nucleus: the likeliest tokens until their mass reaches topp.
  topp = float(probs[order[0]] + 0.5 * probs[order[1]])
  assert _first_step_samples(topp=topp) == set(order[:2])


def test_filter_logits_keeps_ties_and_at_least_one_token():
  logits = jnp.array([[3.0, 1.0, 3.0, 0.0], [0.0, 5.0, 1.0, 2.0]])
  kept = np.isfinite(decoding.filter_logits(logits, topk=1))
  np.testing.assert_array_equal(kept, [[1, 0, 1, 0], [0, 1, 0, 0]])
  kept = np.isfinite(decoding.filter_logits(logits, topp=1e-9))
  np.testing.assert_array_equal(kept, [[1, 0, 1, 0], [0, 1, 0, 0]])
  assert np.isfinite(decoding.filter_logits(logits, topk=0, topp=1.0)).all()


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_one_beam_is_greedy_on_this_chain(alpha):
  # One beam continues with the best extension, as greedy does; it could
  # also end earlier, on an EOS ranked second (as T5X's beam search does),
  # but on this chain no such ending wins, and alpha only rescales the
  # single finished score.
  greedy, greedy_scores = _decode(decoding.greedy, batch=5, length=5)
  beam, beam_scores = _decode(decoding.beam_search, batch=5, length=5, num_beams=1, alpha=alpha)
  np.testing.assert_array_equal(beam, greedy)
  lengths = np.array([int(np.argmax(row == EOS)) + 1 if EOS in row else 5
                      for row in greedy[:, 0]])
  np.testing.assert_allclose(beam_scores[:, 0],
                             greedy_scores[:, 0] / ((5 + lengths) / 6) ** alpha, rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("num_decodes", [5, 30])
def test_exhaustive_beam_search_finds_the_best_sequences(alpha, num_decodes):
  # 80 beams keep every one of the 4**3 unfinished prefixes of length 3, so
  # the search is exhaustive and must return the brute-force optimum: the
  # finished sequences (21 of them) by length-normalised score, then, where
  # fewer finished than asked for, the unfinished ones by log-probability.
  length = 3
  tokens, scores = _decode(decoding.beam_search, batch=3, length=length, num_beams=80,
                           alpha=alpha, num_decodes=num_decodes)
  for b in range(3):
    candidates = []
    for seq in _all_chain_decodes(length):
      finished = EOS in seq
      penalty = ((5 + seq.index(EOS) + 1) / 6) ** alpha if finished else 1.0
      candidates.append((finished, _chain_log_prob(b, seq) / penalty, seq))
    candidates.sort()
    best = candidates[-num_decodes:]  # increasing, best last, like the decoder
    np.testing.assert_array_equal(tokens[b], [seq for _, _, seq in best])
    np.testing.assert_allclose(scores[b], [s for _, s, _ in best], rtol=1e-5)


T5X_BEAM = os.path.join(os.path.dirname(__file__), "data", "t5x_decoding", "beam.npz")


def test_beam_search_is_t5x_s():
  # T5X's own beam_search on this chain (tests/data/t5x_decoding/make_beam.py)
  # for 1-8 beams, alpha 0 / 0.6 / 1 and lengths 3 / 5 / 8. T5X fills places
  # no finished beam takes with empty sequences scored -1e7; t5lite with the
  # beams still alive (checked above), so only T5X's finished beams compare.
  with np.load(T5X_BEAM, allow_pickle=False) as ref:
    ref = dict(ref)
  np.testing.assert_array_equal(ref["table"], CHAIN_TABLE)
  for i, (beams, alpha10, length) in enumerate(ref["configs"]):
    tokens, scores = _decode(decoding.beam_search, batch=5, length=int(length),
                             num_beams=int(beams), alpha=alpha10 / 10)
    want_tokens, want_scores = ref[f"tokens_{i}"], ref[f"scores_{i}"]
    finished = want_scores > -1e6
    assert finished.sum() > 0
    for b in range(5):
      np.testing.assert_array_equal(tokens[b][finished[b]], want_tokens[b][finished[b]])
      np.testing.assert_allclose(scores[b][finished[b]], want_scores[b][finished[b]],
                                 rtol=1e-5)


def test_more_beams_never_score_below_greedy_here():
  _, greedy_scores = _decode(decoding.greedy, batch=5, length=5)
  for beams in (3, 8):
    _, beam_scores = _decode(decoding.beam_search, batch=5, length=5, num_beams=beams,
                             alpha=0.0)
    assert np.all(beam_scores[:, -1] >= greedy_scores[:, 0] - 1e-5), beams


def test_all_decodes_are_sorted_best_last_and_scored_truly():
  tokens, scores = _decode(decoding.beam_search, batch=3, length=4, num_beams=4, alpha=0.0)
  assert tokens.shape == (3, 4, 4) and scores.shape == (3, 4)
  assert np.all(np.diff(scores, axis=1) >= 0)
  for b, k in itertools.product(range(3), range(4)):
    np.testing.assert_allclose(scores[b, k], _chain_log_prob(b, tokens[b, k]), rtol=1e-5)
  assert len({tuple(t) for t in tokens[0]}) == 4
  two, two_scores = _decode(decoding.beam_search, batch=3, length=4, num_beams=4, alpha=0.0,
                            num_decodes=2)
  np.testing.assert_array_equal(two, tokens[:, 2:])
  np.testing.assert_allclose(two_scores, scores[:, 2:], rtol=1e-6)
  sampled, sample_scores = _decode(decoding.temperature_sample, batch=3, num_decodes=6)
  assert sampled.shape == (3, 6, 4)
  assert np.all(np.diff(sample_scores, axis=1) >= 0)


def test_brevity_penalty_is_t5x():
  np.testing.assert_allclose(decoding.brevity_penalty(0.6, 7), (12 / 6) ** 0.6, rtol=1e-6)
  assert float(decoding.brevity_penalty(0.0, 30)) == 1.0


@pytest.mark.parametrize("decode_fn, kwargs, match", [
    (decoding.temperature_sample, dict(temperature=-1.0), "temperature must be >= 0"),
    (decoding.temperature_sample, dict(topk=-2), "topk must be >= 0"),
    (decoding.temperature_sample, dict(topp=1.5), r"topp must be in \[0, 1\]"),
    (decoding.greedy, dict(num_decodes=2), "use decoding.temperature_sample"),
    (decoding.beam_search, dict(num_beams=0), "num_beams must be >= 1"),
    (decoding.beam_search, dict(alpha=-0.1), "alpha must be >= 0"),
    (decoding.beam_search, dict(num_beams=2, num_decodes=3), "at most num_beams=2"),
    (decoding.greedy, dict(max_decode_length=0), "max_decode_length must be >= 1"),
])
def test_bad_knobs_are_named(decode_fn, kwargs, match):
  cache, first = _chain_start(2)
  kwargs = {"max_decode_length": 3, **kwargs}
  with pytest.raises(ValueError, match=match):
    decode_fn(_chain_step, cache, first, eos_id=EOS, **kwargs)


# ---------------------------------------------------------------------------
# Relative position biases and attention of a cached step.
# ---------------------------------------------------------------------------


def test_relative_position_bias_of_a_step_equals_the_row_of_the_full_square():
  module = layers.RelativePositionBiases(num_buckets=10, max_distance=20, num_heads=4)
  # A [heads, buckets] table drawn by NumPy: a real init compiles a random
  # program, and both sides below read the same table.
  table = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)
  assert jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), 9, 9))) == {
      "params": {"rel_embedding": jax.ShapeDtypeStruct(table.shape, table.dtype)}}
  variables = {"params": {"rel_embedding": table}}
  apply = jax.jit(module.apply, static_argnums=(1, 2, 3))
  full = apply(variables, 9, 9, False)  # [1, heads, 9, 9]
  positions = jnp.array([0, 4, 8])
  step = apply(variables, 1, 9, False, positions)
  assert step.shape == (3, 4, 1, 9)
  for b, i in enumerate(positions.tolist()):
    np.testing.assert_array_equal(step[b, :, 0], full[0, :, i])
  scalar = apply(variables, 2, 9, False, 3)
  np.testing.assert_array_equal(scalar[0], full[0, :, 3:5])


def test_attention_step_without_prefill_or_keys_is_an_error():
  # Traced by jax.eval_shape, where the checks run: run eagerly, the init
  # and the projections before the checks compile a program per op.
  module = layers.MultiHeadDotProductAttention(num_heads=4, head_dim=3)
  x = jax.ShapeDtypeStruct((2, 1, 8), jnp.float32)
  variables = jax.eval_shape(module.init, jax.random.key(0), x, x)
  step = layers.DecodeCache(length=5, position=np.zeros(2, np.int32))
  with pytest.raises(ValueError, match="run a prefill first"):
    jax.eval_shape(lambda v, x: module.apply(v, x, x, cache=step, mutable=["cache"]),
                   variables, x)
  with pytest.raises(ValueError, match="only in a cached step"):
    jax.eval_shape(lambda v, x: module.apply(v, x, None), variables, x)
  with pytest.raises(ValueError, match="cannot hold the 3 prefilled"):
    three = jax.ShapeDtypeStruct((2, 3, 8), jnp.float32)
    jax.eval_shape(lambda v, x: module.apply(v, x, x, cache=layers.DecodeCache(length=2),
                                             mutable=["cache"]), variables, three)


# ---------------------------------------------------------------------------
# Real tiny networks.
# ---------------------------------------------------------------------------

VOCAB_SIZE = 32
VOCAB = seqio.PassThroughVocabulary(VOCAB_SIZE, eos_id=EOS)
MOE = dict(num_experts=4, num_selected_experts=2, moe_layer_interval=2,
           eval_capacity_factor=0.0)  # dropless, so routing is per token
SAMPLE = functools.partial(decoding.temperature_sample, temperature=1.0)

# Lengths differ from each other and from every model size.
TEXTS = [([5, 6, 7, 8], [9, 10]), ([11], [12, 13, 14]), ([15, 16, 17, 18, 19, 20], [21])]
ENCDEC_LENGTHS = {"inputs": 7, "targets": 6}
PREFIX_LENGTHS = {"inputs": 7, "targets": 4}


def _features(converter_cls, lengths):
  ds = tf.data.Dataset.from_generator(
      lambda: ({"inputs": i + [EOS], "targets": t + [EOS]} for i, t in TEXTS),
      output_signature={k: tf.TensorSpec([None], tf.int32) for k in ("inputs", "targets")})
  examples = list(converter_cls(pack=False)(ds, lengths).as_numpy_iterator())
  return {k: jnp.asarray(np.stack([e[k] for e in examples])) for k in examples[0]}


@functools.lru_cache(maxsize=None)
def _batch(kind):
  if kind == "encdec":
    return _features(seqio.EncDecFeatureConverter, ENCDEC_LENGTHS)
  return _features(seqio.PrefixLMFeatureConverter, PREFIX_LENGTHS)


@functools.lru_cache(maxsize=None)
def _params(config: transformer.TransformerConfig, decoder_only: bool):
  """Params of the model's shapes drawn with numpy: a real init compiles for
  seconds, and any weights with O(1) activations will do."""
  module = (transformer.DecoderOnly if decoder_only else transformer.EncoderDecoder)(config)
  model = (models.DecoderOnlyModel if decoder_only else models.EncoderDecoderModel)(
      module, VOCAB, VOCAB, optax.sgd(0.1))
  abstract = nn.unbox(_abstract_variables(model, _batch("prefix" if decoder_only else "encdec")))
  rng = np.random.default_rng(0)

  def draw(x):
    std = 1.0 if x.ndim < 2 else x.shape[0] ** -0.5  # roughly fan-in scaled
    return jnp.asarray(rng.normal(0.0, std, x.shape), x.dtype)

  return jax.tree.map(draw, abstract["params"])


def _abstract_variables(model, batch):
  """Boxed variables as ShapeDtypeStructs, with their logical axes."""
  shapes = {k: batch[k].shape for k in ("encoder_input_tokens", "decoder_input_tokens")
            if k in batch}
  return jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))


@functools.lru_cache(maxsize=None)
def _model(kind="encdec", decode_fn=None, max_decode_length=None, **overrides):
  """(model, params, batch); kind is 'encdec', 'prefix' (bidirectional prefix)
  or 'causal' (decoder-only whose prompt attends causally). Cached, so tests
  asking for the same model share its compiled functions (see `_jit`)."""
  decoder_only = kind != "encdec"
  config = testing.tiny_config(vocab_size=VOCAB_SIZE,
                               **({"num_encoder_layers": 0} if decoder_only else {}),
                               **overrides)
  kwargs = dict(decode_fn=decode_fn, max_decode_length=max_decode_length)
  if decoder_only:
    model = models.DecoderOnlyModel(transformer.DecoderOnly(config), VOCAB, VOCAB,
                                    optax.sgd(0.1),
                                    inputs_bidirectional_attention=kind == "prefix", **kwargs)
  else:
    model = models.EncoderDecoderModel(transformer.EncoderDecoder(config), VOCAB, VOCAB,
                                       optax.sgd(0.1), **kwargs)
  return model, _params(config, decoder_only), _batch("encdec" if kind == "encdec" else "prefix")


@functools.lru_cache(maxsize=None)
def _jit(model, method, **kwargs):
  """`jax.jit` of a model method with keyword arguments bound, compiled once."""
  return jax.jit(functools.partial(getattr(model, method), **kwargs))


BEAM3 = functools.partial(decoding.beam_search, num_beams=3, alpha=0.0)
BEAM1 = functools.partial(decoding.beam_search, num_beams=1, alpha=0.0)


@functools.lru_cache(maxsize=None)
def _cached_and_full_decoder(model, num_decodes):
  """Jitted decode with and without the cache in ONE program: a compile of
  the two together costs less than two compiles; each decode in it is the
  same computation it is alone."""
  return jax.jit(lambda params, batch, rng: [
      model.decode_batch(params, batch, rng, num_decodes=num_decodes, use_cache=use_cache)
      for use_cache in (True, False)])


def _cached_and_full_decodes(model, params, batch, num_decodes=None):
  """((tokens, scores) with the cache, (tokens, scores) without), same key."""
  both = _cached_and_full_decoder(model, num_decodes)(params, batch, jax.random.key(7))
  return [(np.asarray(tokens), np.asarray(scores)) for tokens, scores in both]


@pytest.mark.parametrize("kind, overrides", [
    ("encdec", {}),
    ("encdec", dict(scan_layers=True)),
    pytest.param("encdec", MOE, marks=pytest.mark.slow),
    ("prefix", {}),
    ("causal", {}),
    ("prefix", dict(scan_layers=True, **MOE)),
], ids=["encdec", "encdec-scanned", "encdec-moe", "prefix", "causal", "prefix-scanned-moe"])
def test_cached_sampling_equals_recomputing_the_full_forward_pass(kind, overrides):
  # Sampling visits many different tokens, so every cache position matters;
  # the same key makes both paths draw the same tokens iff logits agree.
  model, params, batch = _model(kind, SAMPLE, max_decode_length=5, **overrides)
  (cached, cached_scores), (full, full_scores) = _cached_and_full_decodes(model, params, batch,
                                                                         num_decodes=2)
  assert cached.shape == (3, 2, 5)
  assert len(np.unique(cached)) > 6  # not a degenerate repetition
  np.testing.assert_array_equal(cached, full)
  np.testing.assert_allclose(cached_scores, full_scores, rtol=1e-5, atol=1e-5)


def test_cached_beam_search_of_scanned_layers_equals_full_forward_pass():
  # Beams reorder the cache, whose scanned leaves are [batch, layers, ...].
  beam = functools.partial(decoding.beam_search, num_beams=3, alpha=0.6)
  model, params, batch = _model("encdec", beam, scan_layers=True)
  (cached, cached_scores), (full, full_scores) = _cached_and_full_decodes(model, params, batch)
  assert cached.shape == (3, 3, 6)
  np.testing.assert_array_equal(cached, full)
  np.testing.assert_allclose(cached_scores, full_scores, rtol=1e-5, atol=1e-5)


def _manual_greedy(model, params, batch, length, prompt_lengths):
  """Decoder-only greedy decoding by hand: append the argmax and rerun the
  teacher-forced forward pass on the grown PrefixLM example, one at a time."""
  logits_fn = _jit(model, "predict_logits")
  out = np.zeros((len(prompt_lengths), length), np.int32)
  total = batch["decoder_input_tokens"].shape[1] + length
  for b, prompt_length in enumerate(prompt_lengths):
    tokens = np.zeros((1, total), np.int32)
    tokens[0, :prompt_length] = batch["decoder_input_tokens"][b, :prompt_length]
    for i in range(length):
      last = prompt_length - 1 + i
      example = {"decoder_input_tokens": tokens,
                 "decoder_target_tokens": (np.arange(total) <= last)[None].astype(np.int32),
                 "decoder_causal_attention": (np.arange(total) < prompt_length)[None]}
      token = int(np.argmax(np.asarray(logits_fn(params, example))[0, last]))
      out[b, i] = token
      if token == EOS:
        break
      tokens[0, last + 1] = token
  return out


def test_decoder_only_returns_the_continuation_left_aligned():
  model, params, batch = _model("prefix", max_decode_length=4)
  prompt_lengths = np.asarray(batch["decoder_causal_attention"]).sum(axis=1)
  assert prompt_lengths.tolist() == [6, 3, 8]  # BOS, inputs and their EOS
  tokens = np.asarray(_jit(model, "predict_batch_with_aux")(params, batch)[0])
  assert tokens.shape == (3, 4)
  np.testing.assert_array_equal(tokens, _manual_greedy(model, params, batch, 4, prompt_lengths))


@functools.lru_cache(maxsize=None)
def _scorer(kind):
  """Jitted `score_batch` of the plain model of `kind`, with the
  `token_loss_sums` of each example's teacher-forced logits: the scoring
  tests share its one compile (the decode knobs do not change scoring), and
  the per-example sums, made eagerly, would compile a program per op."""
  model = _model(kind)[0]

  def run(params, batch):
    logits = model.predict_logits(params, batch)
    sums = [models.token_loss_sums(logits[b:b + 1], batch["decoder_target_tokens"][b:b + 1],
                                   batch["decoder_loss_weights"][b:b + 1])
            for b in range(logits.shape[0])]
    return model.score_batch(params, batch), sums

  return jax.jit(run)


def test_score_batch_is_minus_the_summed_cross_entropy():
  for kind in ("encdec", "prefix"):
    _, params, batch = _model(kind)
    scores, sums = _scorer(kind)(params, batch)
    scores = np.asarray(scores)
    assert scores.shape == (3,)
    for b in range(3):
      np.testing.assert_allclose(scores[b], -sums[b]["cross_ent_sum"], rtol=1e-5)
    assert np.all(scores < 0)


def test_decode_scores_equal_score_batch_of_the_decodes():
  model, params, batch = _model("encdec")
  tokens, aux = _jit(model, "predict_batch_with_aux")(params, batch)
  tokens = np.asarray(tokens)
  rows = [b for b in range(3)
          if 0 not in tokens[b, :list(tokens[b]).index(EOS) + 1 if EOS in tokens[b] else None]]
  assert rows  # teacher forcing reads an early 0 as padding, so skip such rows
  # Of the batch's dtype, so that scoring it is the program scoring the batch.
  weights = np.zeros(tokens.shape, batch["decoder_loss_weights"].dtype)
  for b in range(3):
    weights[b, :list(tokens[b]).index(EOS) + 1 if EOS in tokens[b] else None] = 1.0
  decoded = {"encoder_input_tokens": batch["encoder_input_tokens"],
             "decoder_target_tokens": tokens,
             "decoder_input_tokens": np.pad(tokens[:, :-1], ((0, 0), (1, 0))),
             "decoder_loss_weights": weights}
  scores, _ = _scorer("encdec")(params, decoded)
  np.testing.assert_allclose(np.asarray(scores)[rows], np.asarray(aux["scores"])[rows],
                             rtol=1e-5)


def test_predict_api_shapes_ordering_and_beam_width():
  model, params, batch = _model("encdec", BEAM3)
  tokens, aux = _jit(model, "predict_batch_with_aux", return_all_decodes=True)(params, batch)
  assert tokens.shape == (3, 3, 6) and aux["scores"].shape == (3, 3)
  assert tokens.dtype == jnp.int32
  assert np.all(np.diff(np.asarray(aux["scores"]), axis=1) >= 0)
  greedy_model = _model("encdec")[0]
  greedy_tokens, greedy_aux = _jit(greedy_model, "predict_batch_with_aux")(params, batch)
  assert greedy_tokens.shape == (3, 6) and greedy_aux["scores"].shape == (3,)
  assert np.all(np.asarray(aux["scores"])[:, -1] >= np.asarray(greedy_aux["scores"]) - 1e-5)


def test_model_beam_of_one_follows_greedy():
  # One beam takes greedy's path; where an EOS ranked second on the way, the
  # beam may end there instead (it finished; greedy's sequence had not).
  model, params, batch = _model("prefix", max_decode_length=4)
  greedy, greedy_aux = _jit(model, "predict_batch_with_aux")(params, batch)
  beam_model = _model("prefix", BEAM1, max_decode_length=4)[0]
  beam, beam_aux = _jit(beam_model, "predict_batch_with_aux")(params, batch)
  ended_early = 0
  for row, (got, want) in enumerate(zip(np.asarray(beam), np.asarray(greedy))):
    if np.array_equal(got, want):
      np.testing.assert_allclose(np.asarray(beam_aux["scores"])[row],
                                 np.asarray(greedy_aux["scores"])[row], rtol=1e-5)
      continue
    end = int(np.argmax(got == EOS))
    assert got[end] == EOS and EOS not in want[:end + 1], (got, want)
    np.testing.assert_array_equal(got[:end], want[:end])
    ended_early += 1
  assert ended_early < len(greedy)


def test_inference_feature_converters_and_decode_defaults():
  encdec, _, batch = _model("encdec")
  assert encdec.INFERENCE_FEATURE_CONVERTER_CLS is seqio.EncDecFeatureConverter
  assert models.DecoderOnlyModel.INFERENCE_FEATURE_CONVERTER_CLS is seqio.PrefixLMFeatureConverter
  assert encdec.decode_fn is decoding.greedy and encdec.max_decode_length is None
  with pytest.raises(ValueError, match="max_decode_length must be >= 1"):
    _model("encdec", max_decode_length=0)
  with pytest.raises(ValueError, match="decode_fn must be a function"):
    _model("encdec", decode_fn="beam_search")
  causal, params, prefix_batch = _model("causal")
  without = {k: v for k, v in prefix_batch.items() if k != "decoder_causal_attention"}
  with pytest.raises(ValueError, match="PrefixLMFeatureConverter"):
    causal.predict_batch(params, without)
  with pytest.raises(ValueError, match="max_decode_length or a 'decoder_input_tokens'"):
    encdec.predict_batch(params, {"encoder_input_tokens": batch["encoder_input_tokens"]})


def test_gin_configures_the_decoder_of_a_model():
  gin.clear_config()
  try:
    gin.parse_config(textwrap.dedent("""
        from __gin__ import dynamic_registration
        from t5lite import decoding
        from t5lite.models import models

        models.EncoderDecoderModel.decode_fn = @decoding.beam_search
        models.EncoderDecoderModel.max_decode_length = 4
        decoding.beam_search.num_beams = 2
        decoding.beam_search.alpha = 0.0
    """))
    plain, params, batch = _model("encdec")
    model = gin.get_configurable(models.EncoderDecoderModel)(plain.module, VOCAB, VOCAB,
                                                             optax.sgd(0.1))
    # Shapes only: tracing runs the configured decoder (beams and length
    # show in them); compiling it would cost seconds and check no more.
    tokens, aux = jax.eval_shape(functools.partial(model.predict_batch_with_aux,
                                                   return_all_decodes=True), params, batch)
  finally:
    gin.clear_config()
  assert tokens.shape == (3, 2, 4) and aux["scores"].shape == (3, 2)


def test_predict_and_score_under_a_mesh_with_logical_rules():
  model, params, batch = _model("encdec", BEAM3)
  partitioner = partitioning.Partitioner(num_partitions=1)
  predict = partitioner.partition(model.predict_batch, None, None)
  every = _jit(model, "predict_batch_with_aux", return_all_decodes=True)(params, batch)[0]
  np.testing.assert_array_equal(predict(params, batch), np.asarray(every)[:, -1])
  scorer = _model("encdec")[0]  # scoring ignores the decoder
  score = partitioner.partition(scorer.score_batch, None, None)
  np.testing.assert_allclose(score(params, batch), _scorer("encdec")(params, batch)[0],
                             rtol=1e-5)


_SHARDED = """
import functools, sys
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {tests_dir!r})
import test_decoding as t
from t5lite import decoding, partitioning

cases = (("encdec", t.MOE, functools.partial(decoding.beam_search, num_beams=2),
          {{"data": 2, "expert": 2, "model": 2}}),
         ("prefix", dict(scan_layers=True), t.SAMPLE, {{"data": 4, "model": 2}}))
for kind, overrides, decode_fn, mesh_shape in cases:
  model, params, batch = t._model(kind, decode_fn, max_decode_length=5, **overrides)
  batch = {{k: jnp.tile(v, (3, 1))[:8] for k, v in batch.items()}}
  rng = jax.random.key(3)
  expected = jax.jit(model.predict_batch_with_aux)(params, batch, rng)
  partitioner = partitioning.Partitioner(mesh_shape=mesh_shape)
  specs = nn.get_partition_spec(t._abstract_variables(model, batch))["params"]
  params = jax.device_put(params, partitioner.logical_to_sharding(specs))
  batch = jax.device_put(batch, partitioner.batch_sharding())
  tokens, aux = partitioner.partition(model.predict_batch_with_aux, None, None)(
      params, batch, rng)
  assert len(tokens.sharding.device_set) == 8, tokens.sharding
  np.testing.assert_array_equal(tokens, expected[0])
  np.testing.assert_allclose(aux["scores"], expected[1]["scores"], rtol=1e-4, atol=1e-4)
print("OK")
"""


@pytest.mark.slow
def test_sharded_predict_on_eight_devices_equals_one_device():
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  result = testing.run_with_devices(_SHARDED.format(tests_dir=tests_dir), num_devices=8)
  assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
