"""Optimizer-state shardings are derived from the parameters' logical axes."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from t5lite import optimizers
from t5lite.train_state import TrainState, state_logical_axes


PARAMS = {"dense": {"kernel": jnp.zeros((256, 384))},   # factored by adafactor
          "scale": jnp.zeros((384,)),
          "tall": {"kernel": jnp.zeros((512, 130))}}    # larger dim first
AXES = {"dense": {"kernel": P("embed", "mlp")}, "scale": P("embed"),
        "tall": {"kernel": P("vocab", "embed")}}


def _axes(tx):
  state = jax.eval_shape(lambda: TrainState.create(PARAMS, tx, AXES))
  return state_logical_axes(state, AXES)


def _leaves_with_shapes(tree, axes):
  shapes = jax.tree.leaves(jax.eval_shape(lambda: tree))
  specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P))
  assert len(shapes) == len(specs)
  return list(zip([s.shape for s in shapes], specs))


def test_adamw_moments_copy_param_axes():
  tx = optimizers.adamw(1e-3)
  axes = _axes(tx)
  state = TrainState.create(PARAMS, tx)
  pairs = _leaves_with_shapes(state.opt_state, axes.opt_state)
  assert (((256, 384), P("embed", "mlp")) in pairs)
  assert (((512, 130), P("vocab", "embed")) in pairs)
  assert (((384,), P("embed")) in pairs)
  # Every leaf either mirrors a parameter or is a replicated scalar.
  for shape, spec in pairs:
    assert len(spec) in (0, len(shape))


def test_adafactor_factored_statistics_keep_their_axes_and_drop_the_reduced_one():
  tx = optimizers.adafactor(1e-2)
  axes = _axes(tx)
  state = TrainState.create(PARAMS, tx, AXES)
  pairs = _leaves_with_shapes(state.opt_state, axes.opt_state)
  # [256, 384] (embed, mlp): rows keep 'embed', columns keep 'mlp'; the
  # reduced dimension stays as size 1 and is not sharded.
  assert ((256, 1), P("embed", None)) in pairs
  assert ((1, 384), P(None, "mlp")) in pairs
  # [512, 130] (vocab, embed): T5X's size rule puts the smaller dim on the rows.
  assert ((1, 130), P(None, "embed")) in pairs
  assert ((512, 1), P("vocab", None)) in pairs
  # The norm scale is not factored: its second moment mirrors it.
  assert ((384,), P("embed")) in pairs
  assert axes.step == P()


def test_learning_rate_is_read_from_state():
  schedule = optimizers.rsqrt_with_warmup(1.0, warmup_steps=4)
  tx = optimizers.adafactor(schedule)
  state = TrainState.create(PARAMS, tx)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  # One compiled update, as the trainer has, instead of every op compiled alone.
  update = jax.jit(lambda s, g: s.apply_gradients(g))
  for _ in range(6):
    state = update(state, grads)
  # The sixth update (count 5) used 1/sqrt(5).
  assert jnp.allclose(optimizers.learning_rate_from_state(state.opt_state), 5 ** -0.5)
  assert int(state.step) == 6


def test_adamw_clips_by_global_norm():
  tx = optimizers.adamw(0.1, clip_norm=1.0, weight_decay=0.0)
  params = {"w": jnp.zeros((3,))}
  state = TrainState.create(params, tx)
  big = state.apply_gradients({"w": jnp.array([300.0, 400.0, 0.0])})
  small = TrainState.create(params, tx).apply_gradients({"w": jnp.array([0.6, 0.8, 0.0])})
  # Clipping makes the huge gradient identical to its unit-norm direction.
  assert jnp.allclose(big.params["w"], small.params["w"])


def test_schedules():
  cos = optimizers.warmup_cosine(1.0, warmup_steps=10, decay_steps=110, alpha=0.1, begin_value=0.0)
  assert jnp.isclose(cos(0), 0.0) and jnp.isclose(cos(10), 1.0) and jnp.isclose(cos(110), 0.1)
  assert jnp.isclose(cos(5), 0.5)
  assert jnp.isclose(cos(60), 0.55, atol=1e-6)  # halfway through the cosine
  rs = optimizers.rsqrt_with_warmup(2.0, warmup_steps=100)
  assert jnp.isclose(rs(1), 0.2) and jnp.isclose(rs(400), 0.1)


def test_expert_weight_statistics_keep_the_expert_axis():
  params = {"wi": jnp.zeros((8, 128, 384))}
  axes = {"wi": P("expert", "embed", "expert_mlp")}
  tx = optimizers.adafactor(1e-2)
  state = jax.eval_shape(lambda: TrainState.create(params, tx, axes))
  logical = state_logical_axes(state, axes)
  pairs = _leaves_with_shapes(TrainState.create(params, tx, axes).opt_state, logical.opt_state)
  # 'expert' is a batch axis: every expert has its own row and column statistics.
  assert ((8, 128, 1), P("expert", "embed", None)) in pairs
  assert ((8, 1, 384), P("expert", None, "expert_mlp")) in pairs


def test_state_specs_traces_the_model_once_and_init_replays_it_bitwise(monkeypatch):
  """`state_specs` traces the model's initialisation once; its `init` replays
  that trace (jit does not trace the model again) and gives bitwise the state
  that tracing the model afresh gives, with the shardings' structure."""
  from flax import linen as nn

  from t5lite import partitioning, state_init, testing

  # One layer a stack: the trace and its replay do not depend on the depth,
  # and each layer adds to the two initialisation programs compiled here.
  model = testing.tiny_encoder_decoder(optimizer=optimizers.adafactor(1e-2),
                                       num_encoder_layers=1, num_decoder_layers=1)
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4),
            "decoder_target_tokens": (1, 4), "decoder_loss_weights": (1, 4)}
  types = {k: jnp.float32 if k == "decoder_loss_weights" else jnp.int32 for k in shapes}
  calls = []
  traced = type(model).get_initial_variables
  monkeypatch.setattr(type(model), "get_initial_variables",
                      lambda self, *a, **k: calls.append(1) or traced(self, *a, **k))
  partitioner = partitioning.Partitioner(mesh_shape={"data": 1}, devices=jax.devices()[:1])
  specs, init_fn = state_init.state_specs(model, partitioner, shapes, types)
  state = jax.jit(init_fn)(jax.random.key(3))
  assert len(calls) == 1
  def create(rng):
    variables = traced(model, rng, shapes, types)
    return TrainState.create(nn.unbox(variables["params"]), model.optimizer,
                             nn.get_partition_spec(variables)["params"])
  afresh = jax.jit(create)(jax.random.key(3))
  # The optimizer is built again for the fresh trace, so compare the arrays' trees.
  assert jax.tree.structure(state.state_dict()) == jax.tree.structure(afresh.state_dict())
  assert jax.tree.structure(state) == jax.tree.structure(specs.abstract)
  # Compared in NumPy: eager jnp comparisons compile a program per leaf shape.
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(afresh)):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bool(np.all(np.asarray(got) == np.asarray(want)))
  assert any(bool(np.any(np.asarray(leaf) != 0)) for leaf in jax.tree.leaves(state.params))
