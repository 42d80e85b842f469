"""Trainer: microbatching equals the full batch; the step's metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite import optimizers, partitioning, testing, trainer
from t5lite.train_state import TrainState


B, LI, LT = 8, 12, 7


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  targets = rng.integers(3, 300, size=(B, LT)).astype(np.int32)
  weights = (rng.random((B, LT)) > 0.2).astype(np.float32)
  targets = targets * (weights > 0)  # padding is token 0 with weight 0
  return {
      "encoder_input_tokens": rng.integers(1, 300, size=(B, LI)).astype(np.int32),
      "decoder_target_tokens": targets,
      "decoder_input_tokens": np.concatenate([np.zeros((B, 1), np.int32), targets[:, :-1]], 1),
      "decoder_loss_weights": weights,
  }


@pytest.fixture(scope="module")
def model_and_params():
  model = testing.tiny_encoder_decoder()
  shapes = {k: (1,) + v.shape[1:] for k, v in _batch().items()}
  import flax.linen as nn
  params = nn.unbox(model.get_initial_variables(jax.random.key(0), shapes)["params"])
  return model, params, testing.param_axes(model, shapes)


# One program for every gradient the tests take; num_microbatches is static.
_accumulate_gradients = jax.jit(trainer.accumulate_gradients, static_argnums=(0, 4))


@pytest.fixture(scope="module")
def full_batch_gradients(model_and_params):
  """The one-pass gradients, loss and sums that every microbatch count is
  compared with, computed once."""
  model, params, _ = model_and_params
  batch = jax.tree.map(jnp.asarray, _batch())
  return _accumulate_gradients(model, params, batch, jax.random.key(1), None)


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_microbatches_equal_full_batch(model_and_params, full_batch_gradients, num_microbatches):
  model, params, axes = model_and_params
  batch = jax.tree.map(jnp.asarray, _batch())
  rng = jax.random.key(1)
  full_g, full_loss, full_sums = full_batch_gradients
  mb_g, mb_loss, mb_sums = _accumulate_gradients(model, params, batch, rng, num_microbatches)
  np.testing.assert_allclose(mb_loss, full_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(mb_g), jax.tree.leaves(full_g)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  for k in full_sums:
    np.testing.assert_allclose(mb_sums[k], full_sums[k], rtol=1e-5)
  # The gradient is not trivially zero, so equality means something. (In
  # NumPy: eager jnp would compile a program per leaf shape.)
  assert max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(full_g)) > 1e-4


@pytest.fixture(scope="module")
def compiled_train_step(model_and_params):
  """The Trainer's train step (jitted with shardings, donating its state),
  compiled once for the tests of the step, with a new placed state for each
  call and the batch placement. Every state is a copy of one TrainState:
  `TrainState.create` makes a new optimizer object, which would compile the
  step again."""
  import flax.linen as nn

  from t5lite.train_state import state_logical_axes
  model, params, axes = model_and_params
  p = partitioning.Partitioner()
  t = trainer.Trainer(model=model, partitioner=p)
  state = TrainState.create(params, optimizers.adafactor(optimizers.constant(0.01)), axes)
  shapes = {k: (1,) + v.shape[1:] for k, v in _batch().items()}
  boxed = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))
  shardings = p.logical_to_sharding(
      state_logical_axes(state, nn.get_partition_spec(boxed)["params"]))
  batch_sh = {k: p.batch_sharding(2) for k in _batch()}
  step = t.compile_train_step(shardings, batch_sh)

  def new_state():
    # As in train(): the state comes out of a jitted init already placed. The
    # step donates it: copies keep the shared arrays alive. Copied through
    # NumPy: an eager jnp.copy compiles a program per leaf shape.
    return jax.device_put(jax.tree.map(np.array, state), shardings)

  return step, new_state, lambda batch: jax.device_put(batch, batch_sh)


def test_train_step_metrics_and_update(compiled_train_step):
  step, new_state, place = compiled_train_step
  state = new_state()
  old_params = jax.tree.map(np.asarray, state.params)  # the step donates `state`
  new_state, metrics = step(state, place(_batch()))
  assert int(new_state.step) == 1
  assert set(metrics) >= {"loss", "token_accuracy", "z_loss", "cross_ent_loss", "learning_rate",
                          "num_tokens", "grad_norm", "param_norm", "update_ratio"}
  assert 0 < float(metrics["update_ratio"]) < 0.1  # a normal step moves the parameters a little
  np.testing.assert_allclose(metrics["learning_rate"], 0.01, rtol=1e-6)
  np.testing.assert_allclose(metrics["num_tokens"], _batch()["decoder_loss_weights"].sum())
  np.testing.assert_allclose(metrics["loss"], metrics["cross_ent_loss"] + metrics["z_loss"],
                             rtol=1e-5)
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), new_state.params,
                         old_params)
  assert all(jax.tree.leaves(changed))


def test_norm_metrics_measure_gradients_parameters_and_the_update():
  old = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]], jnp.bfloat16)}
  new = {"a": jnp.array([3.0, 10.0]), "b": jnp.array([[4.0]], jnp.bfloat16)}
  grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[jnp.nan]], jnp.bfloat16)}
  m = trainer.norm_metrics(grads, old, new)
  assert np.isnan(m["grad_norm"])  # a NaN anywhere shows, whatever the dtype
  np.testing.assert_allclose(m["param_norm"], np.sqrt(9 + 100 + 16))
  np.testing.assert_allclose(m["update_ratio"], 10.0 / 5.0)  # |update| / |params before|
  assert all(v.dtype == jnp.float32 for v in m.values())


def test_microbatch_validation_message():
  t = trainer.Trainer(model=None, partitioner=partitioning.Partitioner(), num_microbatches=3)
  with pytest.raises(ValueError, match=r"num_microbatches=3 must be a positive divisor of the "
                                       r"batch size 8"):
    t.validate(8)


def test_train_step_compiles_once(compiled_train_step):
  step, new_state, place = compiled_train_step
  state = new_state()
  for seed in range(3):
    state, _ = step(state, place(_batch(seed)))
  assert int(state.step) == 3
  # One compilation for three steps (and for the other tests' calls).
  assert step.jitted._cache_size() == 1


@pytest.fixture(scope="module")
def eval_step_and_sums(model_and_params):
  """One jitted program for the eval tests: the eval step's metrics, and the
  model's own loss sums of the same batch to check them against."""
  model, _, _ = model_and_params
  return jax.jit(lambda p, b: (trainer.eval_step(p, b, model=model),
                               model.loss_fn(p, b, None)[1]))


def test_eval_metrics_weigh_batches_by_tokens_not_one_vote_each(model_and_params,
                                                               eval_step_and_sums):
  from t5lite import metrics as metrics_lib
  model, params, axes = model_and_params
  full = jax.tree.map(jnp.asarray, _batch(0))
  # The second batch weighs a single token: averaged per batch it would count
  # as much as the 40-odd tokens of the first.
  sparse = dict(jax.tree.map(jnp.asarray, _batch(1)))
  sparse["decoder_loss_weights"] = jnp.zeros((B, LT)).at[0, 0].set(1.0)
  (full_metrics, full_sums), (sparse_metrics, sparse_sums) = (
      eval_step_and_sums(params, b) for b in (full, sparse))
  merged = metrics_lib.merge_and_compute([full_metrics, sparse_metrics])
  sums = [full_sums, sparse_sums]
  total = lambda k: sum(float(s[k]) for s in sums)  # noqa: E731
  tokens = total("weight_sum")
  np.testing.assert_allclose(merged["loss"], (total("cross_ent_sum") + total("z_loss_sum"))
                             / tokens, rtol=1e-6)
  np.testing.assert_allclose(merged["cross_ent_loss"], total("cross_ent_sum") / tokens,
                             rtol=1e-6)
  np.testing.assert_allclose(merged["token_accuracy"], 100 * total("correct_sum") / tokens,
                             rtol=1e-6)
  assert merged["num_tokens"] == tokens
  per_batch = [metrics_lib.merge_and_compute([m])["loss"] for m in (full_metrics, sparse_metrics)]
  assert abs(np.mean(per_batch) - merged["loss"]) > 0.05  # the old per-batch mean differs


def test_a_batch_without_loss_weights_gives_no_nan(model_and_params, eval_step_and_sums,
                                                  compiled_train_step):
  from t5lite import metrics as metrics_lib
  model, params, axes = model_and_params
  full = jax.tree.map(jnp.asarray, _batch(0))
  empty = dict(full, decoder_loss_weights=jnp.zeros((B, LT)))
  step = lambda p, b: eval_step_and_sums(p, b)[0]  # noqa: E731
  alone = metrics_lib.merge_and_compute([step(params, empty)])
  assert alone == {"loss": 0.0, "cross_ent_loss": 0.0, "z_loss": 0.0, "token_accuracy": 0.0,
                   "num_tokens": 0.0}
  # Merged with a real batch it adds nothing.
  assert (metrics_lib.merge_and_compute([step(params, full), step(params, empty)])
          == metrics_lib.merge_and_compute([step(params, full)]))
  # The train step's per-step metrics are finite too.
  train_step, new_state, place = compiled_train_step
  _, metrics = train_step(new_state(), place(empty))
  assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
