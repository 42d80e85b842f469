"""Replays a T5X training run in-process with T5X's own training code.

Shared by `t5x_chaos.py`, `make_bf16.py` and `deconly_b/make_deconly_b.py`.
Everything that trains is T5X's (google-research/t5x at cc342d41, unmodified):
`models.EncoderDecoderModel` / `models.DecoderOnlyModel` around the
`t5x/examples/t5` / `t5x/examples/decoder_only` networks,
`adafactor.Adafactor` with `standard_logical_factor_rules()`,
`partitioning.PjitPartitioner`, `utils.TrainStateInitializer` (which applies
the logical axes, so Adafactor factors its second moments exactly as in
`t5x.train`), T5X's Orbax restore (`utils.create_checkpoint_manager_and_restore`)
and `trainer.Trainer` with `utils.create_learning_rate_scheduler`. Steps are
driven as `t5x.train` drives them with `stats_period = 1`:
`Trainer.compile_train` on a dummy batch of ones, then `Trainer.train(batches, 1)`
per step, whose returned summary is what `t5x.train` writes to TensorBoard.

The models below carry the bindings of encdec_a/config.gin and
deconly_b/config.gin. The folder holding encdec_a/ is $T5X_TRAIN_FIXTURES,
else this folder.
"""

import dataclasses
import os
import tempfile

import jax
import numpy as np
import seqio
from absl import logging
from t5x import adafactor, models, partitioning, utils
from t5x import trainer as trainer_lib
from t5x.examples.decoder_only import network as decoder_only_network
from t5x.examples.t5 import network as t5_network


_HERE = os.path.dirname(os.path.abspath(__file__))
# The encdec_a run: beside this file when present, else the shared fixtures.
FIXTURES = os.environ.get("T5X_TRAIN_FIXTURES", _HERE)
ENCDEC_A = os.path.join(FIXTURES, "encdec_a")

# T5X warns once per parameter that Adafactor's factor rules fall back to
# its rank-2 heuristics; that is expected for these networks.
logging.set_verbosity(logging.ERROR)


def _optimizer():
  return adafactor.Adafactor(
    decay_rate=0.8,
    step_offset=0,
    logical_factor_rules=adafactor.standard_logical_factor_rules(),
  )


def _vocabulary():
  return seqio.ByteVocabulary(extra_ids=100)


def learning_rate_fn():
  """'constant * rsqrt_decay', base 1.0, warmup 100: 0.1 for steps <= 100."""
  return utils.create_learning_rate_scheduler(
    factors="constant * rsqrt_decay", base_learning_rate=1.0, warmup_steps=100
  )


def build_encdec_a_model(act_dtype="float32"):
  """T5X's EncoderDecoderModel with the bindings of encdec_a/config.gin."""
  config = t5_network.T5Config(
    vocab_size=384,
    dtype=act_dtype,
    emb_dim=128,
    num_heads=4,
    num_encoder_layers=2,
    num_decoder_layers=2,
    head_dim=32,
    mlp_dim=256,
    mlp_activations=("gelu", "linear"),
    dropout_rate=0.0,
    logits_via_embedding=False,
    float32_attention_logits=True,
  )
  return models.EncoderDecoderModel(
    module=t5_network.Transformer(config=config),
    input_vocabulary=_vocabulary(),
    output_vocabulary=_vocabulary(),
    optimizer_def=_optimizer(),
    label_smoothing=0.0,
    z_loss=1e-4,
    loss_normalizing_factor=None,
  )


def build_deconly_b_model():
  """T5X's DecoderOnlyModel with the bindings of deconly_b/config.gin."""
  config = decoder_only_network.TransformerConfig(
    vocab_size=384,
    dtype="float32",
    emb_dim=128,
    num_heads=4,
    num_layers=2,
    head_dim=32,
    mlp_dim=256,
    mlp_activations=("gelu", "linear"),
    dropout_rate=0.0,
    logits_via_embedding=True,
  )
  return models.DecoderOnlyModel(
    module=decoder_only_network.DecoderWrapper(config=config),
    vocabulary=_vocabulary(),
    optimizer_def=_optimizer(),
    label_smoothing=0.0,
    z_loss=1e-4,
    loss_normalizing_factor=None,
  )


def load_batches(path):
  """A batches.npz (key -> [steps, batch, length]) as a list of per-step dicts."""
  with np.load(path, allow_pickle=False) as f:
    arrays = {k: f[k] for k in f.files}
  num_steps = next(iter(arrays.values())).shape[0]
  return [{k: v[s] for k, v in arrays.items()} for s in range(num_steps)]


@dataclasses.dataclass
class Setup:
  model: models.BaseTransformerModel
  partitioner: partitioning.PjitPartitioner
  initializer: utils.TrainStateInitializer
  trainer_rng: jax.Array


def make_setup(model, example_batch, random_seed=0):
  """Partitioner and train-state initializer as `t5x.train` builds them."""
  partitioner = partitioning.PjitPartitioner(
    num_partitions=1,
    model_parallel_submesh=None,
    logical_axis_rules=partitioning.standard_logical_axis_rules(),
  )
  initializer = utils.TrainStateInitializer(
    optimizer_def=model.optimizer_def,
    init_fn=model.get_initial_variables,
    input_shapes={k: v.shape for k, v in example_batch.items()},
    input_types={k: v.dtype for k, v in example_batch.items()},
    partitioner=partitioner,
  )
  # As t5x.train: PRNGKey(seed) split into init and trainer (dropout) keys.
  _, trainer_rng = jax.random.split(jax.random.PRNGKey(random_seed), 2)
  return Setup(model, partitioner, initializer, trainer_rng)


def restore(setup, path, step):
  """T5X's Orbax restore of the checkpoint at `path` (params and optimizer)."""
  cfg = utils.RestoreCheckpointConfig(path=path, mode="specific", dtype="float32")
  with tempfile.TemporaryDirectory() as model_dir:
    train_state, _ = utils.create_checkpoint_manager_and_restore(
      setup.initializer,
      setup.partitioner,
      cfg,
      path,
      fallback_init_rng=None,
      model_dir=model_dir,
      use_orbax=True,
    )
  if train_state is None or int(train_state.step) != step:
    raise ValueError(f"could not restore step {step} from {path}")
  return train_state


def _global_batch(setup, batch):
  sharding = jax.sharding.NamedSharding(
    setup.partitioner.mesh, setup.partitioner.data_partition_spec
  )
  return {
    k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
    for k, v in batch.items()
  }


def train(setup, train_state, batches, keep_state_after=()):
  """Runs len(batches) T5X train steps from `train_state`.

  Returns (summaries, states): one dict of logged scalars per step (timing
  aside; float32 values, as written to TensorBoard), and the `flat_state`
  after each step number listed in keep_state_after.
  """
  trainer = trainer_lib.Trainer(
    model=setup.model,
    train_state=train_state,
    partitioner=setup.partitioner,
    eval_names=[],
    summary_dir=None,
    train_state_axes=setup.initializer.train_state_axes,
    rng=setup.trainer_rng,
    learning_rate_fn=learning_rate_fn(),
    num_microbatches=None,
  )
  dummy = {k: np.ones(v.shape, v.dtype) for k, v in batches[0].items()}
  trainer.compile_train(_global_batch(setup, dummy))
  batch_iter = iter([_global_batch(setup, b) for b in batches])
  summaries, kept = [], {}
  start = int(trainer.train_state.step)
  for i in range(len(batches)):
    summary = trainer.train(batch_iter, 1, start_step=start + i).result()
    summaries.append({k: _scalar(v) for k, v in summary.items() if not k.startswith("timing/")})
    if start + i + 1 in keep_state_after:
      kept[start + i + 1] = flat_state(trainer.train_state)
  trainer.close()
  return summaries, kept


def _scalar(value):
  # Rounded to float32, as T5X's TensorBoard summaries store every scalar.
  return float(np.float32(np.asarray(getattr(value, "value", value))))


def flat_params(train_state):
  """The parameters as host numpy arrays, keyed 'encoder/layers_0/...'."""
  return _flatten(train_state.params)


def flat_state(train_state):
  """The whole checkpointed state: 'target/...' parameters and 'state/...'
  (Adafactor slots v_row, v_col, v and the step), as host numpy arrays."""
  return _flatten(train_state.state_dict())


def _flatten(tree):
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    flat[name] = np.asarray(jax.device_get(leaf))
  return flat


def unequal_leaves(state, reference):
  """Names of the leaves of two flat states that are not bitwise equal."""
  if state.keys() != reference.keys():
    return sorted(state.keys() ^ reference.keys())
  return [k for k in sorted(state) if not np.array_equal(state[k], reference[k])]


def max_rel_param_diff(params, reference):
  """max over parameter tensors of max|p - ref| / max|ref|; and the worst tensor.

  Accepts `flat_params` or `flat_state` dicts (then only 'target/' entries count).
  """
  worst, worst_name = 0.0, None
  for name, ref in _params_only(reference).items():
    ref64 = ref.astype(np.float64)
    d = np.max(np.abs(params[name].astype(np.float64) - ref64)) / np.max(np.abs(ref64))
    if d > worst or worst_name is None:
      worst, worst_name = float(d), name
  return worst, worst_name


def global_rel_l2(params, reference):
  """||p - ref|| / ||ref|| over all parameters together (float64)."""
  reference = _params_only(reference)
  num = sum(np.sum((params[n].astype(np.float64) - r) ** 2) for n, r in reference.items())
  den = sum(np.sum(r.astype(np.float64) ** 2) for r in reference.values())
  return float(np.sqrt(num / den))


def _params_only(flat):
  if any(k.startswith("target/") for k in flat):
    return {k: v for k, v in flat.items() if k.startswith("target/")}
  return flat


# encdec_a helpers.


def encdec_a_batches():
  return load_batches(os.path.join(ENCDEC_A, "batches.npz"))


def encdec_a_setup(act_dtype="float32"):
  return make_setup(build_encdec_a_model(act_dtype), encdec_a_batches()[0])


def encdec_a_restore(setup, step):
  return restore(setup, os.path.join(ENCDEC_A, f"checkpoint_{step}"), step)
