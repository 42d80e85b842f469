"""T5X's own beam search on the synthetic chain of tests/test_decoding.py.

Runs `t5x.decoding.beam_search` (google-research/t5x at cc342d41, unmodified)
on the second-order chain over 5 tokens that tests/test_decoding.py decodes:
the logits of the next token are `TABLE[previous, last]`, `TABLE` drawn as
there (numpy default_rng(0), normal(0, 1.5), shape [5, 5, 5]), EOS = 1,
example b starting from token b % 5. T5X feeds a dummy token at the first
step, so the chain keeps its start in the cache and ignores the token fed
then; every later step continues from the token T5X fed.

Writes beam.npz (load with allow_pickle=False):
  table                      float32 [5, 5, 5]
  configs                    int64 [C, 3]: num_beams, alpha * 10, length
  tokens_<i>                 int32 [5, num_beams, length], config i, T5X's
                             order (worst first, best last)
  scores_<i>                 float32 [5, num_beams]; -1e7 marks a slot T5X
                             filled with no finished beam

Rerun (T5X importable, e.g. PYTHONPATH=/path/to/t5x), from the repository
root; a few seconds on CPU:
  JAX_PLATFORMS=cpu python tests/data/t5x_decoding/make_beam.py
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from t5x import decoding as t5x_decoding


VOCAB, EOS, BATCH = 5, 1, 5
TABLE = np.random.default_rng(0).normal(0.0, 1.5, (VOCAB,) * 3).astype(np.float32)
CONFIGS = [(beams, alpha10, length)
           for beams, alpha10, length in itertools.product((1, 2, 3, 4, 8), (0, 6, 10), (3, 5, 8))]


def tokens_to_logits(state):
  cache = state.cache
  fed = state.cur_token[:, 0]
  previous = jnp.where(cache["started"], cache["last"], cache["previous"])
  last = jnp.where(cache["started"], fed, cache["last"])
  logits = jnp.asarray(TABLE)[previous, last]
  return logits, {"previous": previous, "last": last, "started": jnp.ones_like(cache["started"])}


def main():
  out = {"table": TABLE, "configs": np.array(CONFIGS, np.int64)}
  first = jnp.arange(BATCH, dtype=jnp.int32) % VOCAB
  cache = {"previous": jnp.zeros((BATCH,), jnp.int32), "last": first,
           "started": jnp.zeros((BATCH,), bool)}
  for i, (beams, alpha10, length) in enumerate(CONFIGS):
    run = jax.jit(lambda c, beams=beams, alpha10=alpha10, length=length: t5x_decoding.beam_search(
        jnp.zeros((BATCH, length), jnp.int32), c, tokens_to_logits, eos_id=EOS,
        num_decodes=beams, alpha=alpha10 / 10, max_decode_len=length))
    tokens, scores = run(cache)
    out[f"tokens_{i}"] = np.asarray(tokens, np.int32)
    out[f"scores_{i}"] = np.asarray(scores, np.float32)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "beam.npz")
  np.savez(path, **out)
  print(f"wrote {path}: {len(CONFIGS)} configurations")


if __name__ == "__main__":
  main()
