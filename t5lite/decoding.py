"""Autoregressive decoding: greedy, temperature sampling and beam search.

Each decoder runs as one `lax.while_loop` that feeds one token per sequence
per iteration to a model step and stops at `max_decode_length` tokens or as
soon as every sequence has finished. The decoders know nothing about the
model; they call

  tokens_to_logits(tokens, cache) -> (logits, new_cache)

with `tokens` int32 `[n]` (one token per sequence, the last one fed or
produced) and `logits` `[n, vocab]` for the next position. `cache` is any
pytree whose every leaf has the `n` sequences on its leading axis (a
key/value cache, positions, encoder outputs): decoders repeat it to draw
several decodes per example and reorder it to follow beams, so a step
function must keep that layout. `t5lite.models.models` builds cached step
functions (and uncached ones that recompute the full forward pass, for
reference) from a network.

Every decoder has the same call signature,

  decode_fn(tokens_to_logits, initial_cache, first_tokens, rng, *,
            max_decode_length, eos_id, num_decodes) -> (tokens, scores)

with `first_tokens` int32 `[batch]` and `initial_cache` leaves `[batch,
...]`, and returns `tokens` int32 `[batch, num_decodes, max_decode_length]`
and `scores` float32 `[batch, num_decodes]`, sorted by score in increasing
order: the best decode is the LAST one, `tokens[:, -1]` (as in T5X). A
finished sequence's EOS is kept and followed by padding id 0.

Their tuning knobs (temperature, topk, topp, num_beams, alpha) are keyword
arguments with defaults, so gin binds them on the function itself:

  models.EncoderDecoderModel.decode_fn = @decoding.beam_search
  decoding.beam_search.num_beams = 4
  decoding.beam_search.alpha = 0.6
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from t5lite.errors import UserError


Array = jax.Array
Cache = Any
TokensToLogits = Callable[[Array, Cache], tuple[Array, Cache]]

# Log-probability of impossible beams: finite so that sums and divisions of
# it never produce NaNs, and far below any real sequence's log-probability.
NEG_INF = -1.0e9


def brevity_penalty(alpha: float, length: int | Array) -> Array:
  """T5X/GNMT length normalisation `((5 + length) / 6) ** alpha`.

  Args:
    alpha: strength; 0 disables length normalisation.
    length: decoded tokens, EOS included.

  Returns:
    float32 divisor of a sequence's log-probability.
  """
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def _check_common(first_tokens: Array, max_decode_length: int) -> None:
  if first_tokens.ndim != 1:
    raise ValueError(f"first_tokens must be int [batch], got shape {first_tokens.shape}.")
  if max_decode_length < 1:
    raise UserError(f"max_decode_length must be >= 1, got {max_decode_length}.")


def _is_eos(tokens: Array, eos_id: int | None) -> Array:
  """Boolean like `tokens`; all False when there is no EOS id."""
  if eos_id is None:
    return jnp.zeros(tokens.shape, jnp.bool_)
  return tokens == eos_id


def _default_rng(rng: Array | None) -> Array:
  return jax.random.key(0) if rng is None else rng


def _repeat(tree: Any, times: int) -> Any:
  """Repeats every leaf's leading (sequence) axis: [n, ...] -> [n * times, ...]."""
  return jax.tree.map(lambda x: jnp.repeat(x, times, axis=0), tree)


def _gather(x: Array, index: Array) -> Array:
  """Per example, picks rows along axis 1: `[batch, m, ...]`, int `[batch, k]`
  -> `[batch, k, ...]`."""
  return jax.vmap(lambda rows, i: rows[i])(x, index)


# ----------------------------------------------------------------------------
# Greedy and temperature sampling.
# ----------------------------------------------------------------------------


class _SampleState(NamedTuple):
  """Carry of the sampling loop (n sequences, D = max_decode_length)."""

  step: Array  # int32 scalar: tokens produced so far
  last_tokens: Array  # int32 [n]: fed at the next step
  tokens: Array  # int32 [n, D]
  scores: Array  # float32 [n]: summed log-probabilities
  finished: Array  # bool [n]: EOS produced
  cache: Cache


def _sample_loop(choose: Callable[[Array, Array], Array], tokens_to_logits: TokensToLogits,
                 cache: Cache, first_tokens: Array, rng: Array, max_decode_length: int,
                 eos_id: int | None) -> tuple[Array, Array]:
  """Runs `choose(logits [n, vocab], key) -> int32 [n]` until all sequences end.

  Returns:
    tokens int32 `[n, max_decode_length]` and their summed log-probability
    under the model's (untempered, unfiltered) distribution, float32 `[n]`.
  """
  n = first_tokens.shape[0]

  def cond(s: _SampleState) -> Array:
    return (s.step < max_decode_length) & ~jnp.all(s.finished)

  def body(s: _SampleState) -> _SampleState:
    logits, cache = tokens_to_logits(s.last_tokens, s.cache)
    logits = logits.astype(jnp.float32)  # [n, vocab]
    token = choose(logits, jax.random.fold_in(rng, s.step)).astype(jnp.int32)
    token = jnp.where(s.finished, 0, token)
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
    scores = s.scores + jnp.where(s.finished, 0.0, log_prob)
    tokens = lax.dynamic_update_slice_in_dim(s.tokens, token[:, None], s.step, axis=1)
    return _SampleState(s.step + 1, token, tokens, scores,
                        s.finished | _is_eos(token, eos_id), cache)

  init = _SampleState(
      step=jnp.zeros((), jnp.int32), last_tokens=first_tokens.astype(jnp.int32),
      tokens=jnp.zeros((n, max_decode_length), jnp.int32),
      scores=jnp.zeros((n,), jnp.float32), finished=jnp.zeros((n,), jnp.bool_), cache=cache)
  final = lax.while_loop(cond, body, init)
  return final.tokens, final.scores


def _sorted_decodes(tokens: Array, scores: Array, batch: int,
                    num_decodes: int) -> tuple[Array, Array]:
  """`[batch * k, D]`, `[batch * k]` -> `[batch, k, D]`, `[batch, k]`, best last."""
  tokens = tokens.reshape(batch, num_decodes, -1)  # [batch, k, D]
  scores = scores.reshape(batch, num_decodes)  # [batch, k]
  order = jnp.argsort(scores, axis=1)  # [batch, k], increasing
  return _gather(tokens, order), jnp.take_along_axis(scores, order, axis=1)


def filter_logits(logits: Array, topk: int = 0, topp: float = 0.0) -> Array:
  """Keeps the top-k, then the top-p (nucleus), logits; the rest become -inf.

  Args:
    logits: float `[n, vocab]`.
    topk: keep the `topk` largest logits per row; 0 keeps all. Ties with
      the k-th value are kept too.
    topp: keep the smallest set of largest logits whose probability reaches
      `topp` (at least one, plus ties with the last); 0 keeps all.

  Returns:
    `[n, vocab]` with the dropped entries at -inf.
  """
  if 0 < topk < logits.shape[-1]:
    kth = lax.top_k(logits, topk)[0][:, -1:]  # [n, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if 0.0 < topp < 1.0:
    ordered = -jnp.sort(-logits, axis=-1)  # [n, vocab], decreasing
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(mass_before < topp, axis=-1, keepdims=True)  # [n, 1], >= 1
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)  # [n, 1]
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def temperature_sample(tokens_to_logits: TokensToLogits, initial_cache: Cache,
                       first_tokens: Array, rng: Array | None = None, *,
                       max_decode_length: int, eos_id: int | None = None,
                       num_decodes: int | None = None, temperature: float = 1.0,
                       topk: int = 0, topp: float = 0.0) -> tuple[Array, Array]:
  """Samples continuations, optionally restricted to the top-k / top-p tokens.

  The logits are divided by `temperature` first, then filtered with
  `filter_logits(topk, topp)`, then sampled. Scores are summed
  log-probabilities under the model's own distribution (no temperature, no
  filtering), so they compare across decoders.

  Args:
    tokens_to_logits: model step (see the module docstring).
    initial_cache: step state, leaves `[batch, ...]`.
    first_tokens: int32 `[batch]`, fed at the first step.
    rng: PRNG key; None uses a fixed key.
    max_decode_length: most tokens produced per sequence.
    eos_id: a sequence ends after producing it; None: no early end.
    num_decodes: independent samples per example; None means 1.
    temperature: >= 0; 0 is greedy (argmax, no randomness).
    topk: keep only the k most likely tokens; 0 disables.
    topp: nucleus sampling mass in [0, 1]; 0 (or 1) disables.

  Returns:
    tokens int32 `[batch, num_decodes, max_decode_length]` and scores float32
    `[batch, num_decodes]`, best last.

  Raises:
    ValueError: a negative temperature or topk, a topp outside [0, 1], or
      num_decodes < 1.
  """
  _check_common(first_tokens, max_decode_length)
  if temperature < 0:
    raise UserError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
  if topk < 0:
    raise UserError(f"topk must be >= 0 (0 disables top-k), got {topk}.")
  if not 0.0 <= topp <= 1.0:
    raise UserError(f"topp must be in [0, 1] (0 disables top-p), got {topp}.")
  num_decodes = 1 if num_decodes is None else num_decodes
  if num_decodes < 1:
    raise UserError(f"num_decodes must be >= 1, got {num_decodes}.")

  def choose(logits: Array, key: Array) -> Array:
    if temperature == 0:
      return jnp.argmax(logits, axis=-1)
    return jax.random.categorical(key, filter_logits(logits / temperature, topk, topp))

  batch = first_tokens.shape[0]
  tokens, scores = _sample_loop(choose, tokens_to_logits, _repeat(initial_cache, num_decodes),
                                jnp.repeat(first_tokens, num_decodes), _default_rng(rng),
                                max_decode_length, eos_id)
  return _sorted_decodes(tokens, scores, batch, num_decodes)


def greedy(tokens_to_logits: TokensToLogits, initial_cache: Cache, first_tokens: Array,
           rng: Array | None = None, *, max_decode_length: int, eos_id: int | None = None,
           num_decodes: int | None = None) -> tuple[Array, Array]:
  """Most likely token at every step (`temperature_sample` at temperature 0).

  Args:
    tokens_to_logits: model step (see the module docstring).
    initial_cache: step state, leaves `[batch, ...]`.
    first_tokens: int32 `[batch]`, fed at the first step.
    rng: unused; accepted for the common signature.
    max_decode_length: most tokens produced per sequence.
    eos_id: a sequence ends after producing it; None: no early end.
    num_decodes: must be None or 1: greedy has one decode per example.

  Returns:
    tokens int32 `[batch, 1, max_decode_length]`, summed log-probabilities
    float32 `[batch, 1]`.

  Raises:
    ValueError: num_decodes other than None or 1.
  """
  if num_decodes not in (None, 1):
    raise UserError(f"greedy decoding has one decode per example, got num_decodes="
                    f"{num_decodes}; use decoding.temperature_sample or "
                    "decoding.beam_search for several.")
  return temperature_sample(tokens_to_logits, initial_cache, first_tokens, rng,
                            max_decode_length=max_decode_length, eos_id=eos_id,
                            num_decodes=1, temperature=0.0)


# ----------------------------------------------------------------------------
# Beam search.
# ----------------------------------------------------------------------------


class _BeamState(NamedTuple):
  """Carry of the beam search loop (B examples, K beams, D = max length)."""

  step: Array  # int32 scalar
  last_tokens: Array  # int32 [B * K]
  alive_tokens: Array  # int32 [B, K, D]: unfinished beams
  alive_log_probs: Array  # float32 [B, K], decreasing
  finished_tokens: Array  # int32 [B, K, D]: beams that produced EOS
  finished_scores: Array  # float32 [B, K], length-normalised, decreasing
  cache: Cache  # leaves [B * K, ...]


def _reorder_cache(cache: Cache, parents: Array) -> Cache:
  """Makes beam k of each example continue from beam `parents[b, k]`."""
  batch, beams = parents.shape

  def reorder(x: Array) -> Array:
    x = x.reshape((batch, beams) + x.shape[1:])  # [B * K, ...] -> [B, K, ...]
    return _gather(x, parents).reshape((batch * beams,) + x.shape[2:])  # [B * K, ...]

  return jax.tree.map(reorder, cache)


def _beam_step(s: _BeamState, logits: Array, cache: Cache, eos_id: int | None,
               alpha: float) -> _BeamState:
  """Extends every alive beam by every token and keeps the best.

  Of the 2K best extensions, those ending in EOS join the finished pool
  (scored with the brevity penalty), which keeps its K best; the K best of
  the others stay alive. As in T5X, any of the 2K may finish, so a short
  ending ranked below the K best continuations is still found (and one beam
  can end earlier than greedy decoding does, with a better score).
  """
  batch, beams, _ = s.alive_tokens.shape
  vocab = logits.shape[-1]
  # [B * K, vocab] -> [B, K, vocab]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(batch, beams, vocab)
  # [B, K, vocab] -> [B, K * vocab]: extension (k, token) sits at k * vocab + token.
  candidates = (s.alive_log_probs[..., None] + log_probs).reshape(batch, beams * vocab)
  top_log_probs, top_index = lax.top_k(candidates, 2 * beams)  # [B, 2K], decreasing
  parent, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
  extended = _gather(s.alive_tokens, parent)  # [B, 2K, D]
  extended = lax.dynamic_update_slice_in_dim(extended, token[..., None], s.step, axis=2)
  is_eos = _is_eos(token, eos_id)

  alive_log_probs, keep = lax.top_k(jnp.where(is_eos, NEG_INF, top_log_probs), beams)
  new_parent = jnp.take_along_axis(parent, keep, axis=1)  # [B, K]
  last_tokens = jnp.take_along_axis(token, keep, axis=1).reshape(-1)

  new_scores = jnp.where(is_eos, top_log_probs / brevity_penalty(alpha, s.step + 1), NEG_INF)
  pool_scores = jnp.concatenate([s.finished_scores, new_scores], axis=1)  # [B, 3K]
  finished_scores, pick = lax.top_k(pool_scores, beams)
  pool_tokens = jnp.concatenate([s.finished_tokens, extended], axis=1)
  return _BeamState(
      step=s.step + 1, last_tokens=last_tokens, alive_tokens=_gather(extended, keep),
      alive_log_probs=alive_log_probs, finished_tokens=_gather(pool_tokens, pick),
      finished_scores=finished_scores, cache=_reorder_cache(cache, new_parent))


def beam_search(tokens_to_logits: TokensToLogits, initial_cache: Cache, first_tokens: Array,
                rng: Array | None = None, *, max_decode_length: int,
                eos_id: int | None = None, num_decodes: int | None = None,
                num_beams: int = 4, alpha: float = 0.6) -> tuple[Array, Array]:
  """Beam search with T5X length normalisation.

  T5X's algorithm: a finished beam of L tokens (EOS included) scores
  `log p / ((5 + L) / 6) ** alpha`. The search stops early once, for every
  example, the worst of the `num_beams` finished beams beats the best score
  any alive beam could still reach. Finished beams are returned before
  beams still alive at `max_decode_length`, whatever their scores, as T5X
  returns them; alive beams (scored by their log-probability, as T5X scores
  them) fill only the places of `num_decodes` that no finished beam takes,
  where T5X returns empty sequences scored -1e7.

  Args:
    tokens_to_logits: model step (see the module docstring).
    initial_cache: step state, leaves `[batch, ...]`.
    first_tokens: int32 `[batch]`, fed at the first step.
    rng: unused; accepted for the common signature.
    max_decode_length: most tokens per sequence.
    eos_id: a beam finishes after producing it; None: beams never finish
      early.
    num_decodes: how many of the best beams to return; None: all
      `num_beams`.
    num_beams: beam width.
    alpha: length normalisation strength, >= 0 (0: plain log-probability).

  Returns:
    tokens int32 `[batch, num_decodes, max_decode_length]` and their scores
    float32 `[batch, num_decodes]`, best last: the finished beams, best last,
    after any alive ones.

  Raises:
    ValueError: num_beams < 1, alpha < 0, or num_decodes outside
      [1, num_beams].
  """
  del rng
  _check_common(first_tokens, max_decode_length)
  if num_beams < 1:
    raise UserError(f"num_beams must be >= 1, got {num_beams}.")
  if alpha < 0:
    raise UserError(f"alpha must be >= 0 (0 disables length normalisation), got {alpha}.")
  num_decodes = num_beams if num_decodes is None else num_decodes
  if not 1 <= num_decodes <= num_beams:
    raise UserError(f"beam search returns at most num_beams={num_beams} decodes, got "
                    f"num_decodes={num_decodes}; raise decoding.beam_search.num_beams "
                    "or ask for fewer.")
  batch, beams, length = first_tokens.shape[0], num_beams, max_decode_length
  # Only beam 0 is live at first; the others are copies that must not be
  # extended too, or the first step would fill the beam with duplicates.
  initial_log_probs = jnp.where(jnp.arange(beams) == 0, 0.0, NEG_INF)
  init = _BeamState(
      step=jnp.zeros((), jnp.int32),
      last_tokens=jnp.repeat(first_tokens.astype(jnp.int32), beams),
      alive_tokens=jnp.zeros((batch, beams, length), jnp.int32),
      alive_log_probs=jnp.tile(initial_log_probs, (batch, 1)).astype(jnp.float32),
      finished_tokens=jnp.zeros((batch, beams, length), jnp.int32),
      finished_scores=jnp.full((batch, beams), NEG_INF, jnp.float32),
      cache=_repeat(initial_cache, beams))
  # Log-probabilities only fall and, for alpha >= 0, the penalty only grows
  # with length, so an alive beam can at best reach this.
  max_penalty = brevity_penalty(alpha, length)

  def cond(s: _BeamState) -> Array:
    best_alive = s.alive_log_probs[:, 0] / max_penalty
    done = jnp.all(s.finished_scores[:, -1] > best_alive)
    return (s.step < length) & ~done

  def body(s: _BeamState) -> _BeamState:
    logits, cache = tokens_to_logits(s.last_tokens, s.cache)
    return _beam_step(s, logits, cache, eos_id, alpha)

  final = lax.while_loop(cond, body, init)
  # Both pools are sorted, best first; the finished ones come first, then
  # alive ones in the places left: place j of an example with n finished
  # beams takes finished beam j if j < n, else alive beam j - n.
  num_finished = jnp.sum(final.finished_scores > NEG_INF / 2, axis=1, keepdims=True)  # [B, 1]
  place = jnp.arange(num_decodes)[None]  # [1, num_decodes]
  pick = jnp.where(place < num_finished, place, beams + place - num_finished)  # [B, num_decodes]
  scores = jnp.concatenate([final.finished_scores, final.alive_log_probs], axis=1)  # [B, 2K]
  tokens = jnp.concatenate([final.finished_tokens, final.alive_tokens], axis=1)
  picked_scores = jnp.take_along_axis(scores, pick, axis=1)
  return _gather(tokens, pick)[:, ::-1], picked_scores[:, ::-1]
