"""`train()`: the gin-configured entrypoint and its epoch loop.

The body is a few named phases: validate everything cheap, build data, init
or restore the state, compile, then run epochs. An epoch is the largest step
count after which something has to happen (a checkpoint, an evaluation or a
garbage collection), so the inner loop only dispatches steps and never waits
for the device except at stats periods.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import seqio

from t5lite import actions as actions_lib
from t5lite import checkpoints as ckpt_lib
from t5lite import inference
from t5lite import interop
from t5lite import metrics as metrics_lib
from t5lite import run_lock
from t5lite import tree_paths
from t5lite.checkpoints import CheckpointConfig
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.models import moe
from t5lite.partitioning import Partitioner
from t5lite.train_state import TrainState, state_logical_axes


class TrainingStopped(Exception):
  """Training ended early on purpose; `exit_code` is what the CLI exits with."""

  exit_code = 1


class Diverged(TrainingStopped):
  """Training diverged (a NaN/Inf, an exploding update or a loss spike); the
  diverged steps were not checkpointed."""

  exit_code = 3


NonFiniteLossError = Diverged  # the name before loss spikes were caught too


class Preempted(TrainingStopped):
  """A preemption request arrived; the state at `step` was checkpointed."""

  exit_code = 143  # 128 + SIGTERM, what schedulers expect from a terminated job
  _what = "Preempted"

  def __init__(self, step: int):
    super().__init__(f"{self._what} at step {step}; checkpoint written. Rerun the same "
                     "command to continue from it.")
    self.step = step


class Interrupted(Preempted):
  """Ctrl-C (SIGINT) arrived; the state at `step` was checkpointed."""

  exit_code = 130  # 128 + SIGINT, what shells report for Ctrl-C
  _what = "Stopped by Ctrl-C"


_PREEMPTION = threading.Event()
_INTERRUPTED = threading.Event()  # the stop was asked with Ctrl-C (SIGINT)


def request_preemption(interrupted: bool = False) -> None:
  """Asks the running loop to checkpoint after the current step and stop.

  SIGTERM calls this, and SIGINT with `interrupted=True` (the run then exits
  with 130 instead of 143); so can a cloud preemption notice watcher. In a
  multi-process job the processes agree at the next stats period, and all
  of them checkpoint that step, whichever of them was asked.
  """
  if interrupted:
    _INTERRUPTED.set()
  _PREEMPTION.set()


@dataclasses.dataclass(frozen=True)
class Periods:
  """Step counts of the loop; every non-zero period is a multiple of `epoch`."""

  epoch: int
  checkpoint: int
  eval: int
  gc: int
  stats: int
  checkpoint_steps: tuple[int, ...] = ()

  def next_boundary(self, step: int) -> int:
    """The first step after `step` where the loop must stop for something."""
    end = (step // self.epoch + 1) * self.epoch
    return min([end] + [s for s in self.checkpoint_steps if s > step])


def compute_periods(*, total_steps: int, eval_period: int | None, checkpoint_period: int | None,
                    gc_period: int | None, stats_period: int | None,
                    checkpoint_steps: tuple[int, ...] = ()) -> Periods:
  """Epoch length = min of the eval, checkpoint and gc periods, checked for nesting.

  Args:
    total_steps: the run's final step (used when no period is set).
    eval_period / checkpoint_period / gc_period: 0 or None to disable.
    stats_period: steps between metric fetches; defaults to the epoch length.

  Returns:
    The validated `Periods`.

  Raises:
    ValueError: a negative period, or periods that are not multiples of each
      other (the message names both and suggests a fix).
  """
  _check_step_count("total_steps (TRAIN_STEPS)", total_steps)
  named = {"eval_period": eval_period or 0, "checkpoint_period": checkpoint_period or 0,
           "gc_period": gc_period or 0}
  for name, value in list(named.items()) + [("stats_period", stats_period or 0)]:
    _check_step_count(name, value)
    if value < 0:
      raise ValueError(f"{name}={value} must be positive (or 0 to disable).")
  active = sorted((v, k) for k, v in named.items() if v > 0)
  for (small, small_name), (big, big_name) in zip(active, active[1:]):
    if big % small:
      raise ValueError(
          f"{big_name}={big} is not a multiple of {small_name}={small}; periods must "
          f"divide each other, e.g. set {big_name}={(big // small + 1) * small}.")
  epoch = active[0][0] if active else max(total_steps, 1)
  return Periods(epoch=epoch, checkpoint=named["checkpoint_period"], eval=named["eval_period"],
                 gc=named["gc_period"], stats=stats_period or epoch,
                 checkpoint_steps=tuple(sorted(int(s) for s in checkpoint_steps)))


def _check_step_count(name: str, value: Any) -> None:
  """A step count must be an int (gin passes `'abc'` or `1e3` on as given)."""
  is_total = name.startswith("total_steps")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    example = "; e.g. --gin.TRAIN_STEPS=1000" if is_total else ""
    raise TypeError(f"{name} must be a whole number of steps, got {value!r} "
                    f"({type(value).__name__}){example}.")
  if is_total and value < 0:
    raise ValueError(f"{name}={value} must be 0 or more.")


def _check_vocabulary(model: Any, cfg: DatasetConfig) -> None:
  """The task's vocabulary must be the one the model was built for."""
  _, targets_vocab = datasets.get_vocabulary(cfg)
  model_vocab = model.output_vocabulary
  if (type(targets_vocab) is not type(model_vocab)
      or targets_vocab.vocab_size != model_vocab.vocab_size):
    raise ValueError(
        f"Task '{cfg.mixture_or_task_name}' uses {type(targets_vocab).__name__} with "
        f"{targets_vocab.vocab_size} tokens but the model was configured with "
        f"{type(model_vocab).__name__} with {model_vocab.vocab_size}; set the model's "
        "vocabulary (VOCABULARY) to the task's.")
  embed = getattr(getattr(model.module, "config", None), "vocab_size", None)
  if embed is not None and embed < targets_vocab.vocab_size:
    raise ValueError(
        f"Model vocab_size {embed} is smaller than the task vocabulary "
        f"({targets_vocab.vocab_size}); raise the model's vocab_size.")


def _check_writable(model_dir: str) -> None:
  """MODEL_DIR (or the directory it will be created in) must be writable."""
  path = os.path.abspath(model_dir)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"MODEL_DIR '{model_dir}' is not writable ('{path}' is not a writable "
                     "directory); choose another MODEL_DIR or fix its permissions.")


def validate(*, model: Any, train_dataset_cfg: DatasetConfig, model_dir: str,
             train_eval_dataset_cfg: DatasetConfig | None,
             infer_eval_dataset_cfg: DatasetConfig | None, checkpoint_cfg: CheckpointConfig,
             partitioner: Partitioner, trainer: Any, periods_kwargs: Mapping[str, Any],
             actions: Mapping[str, Any] | None) -> Periods:
  """Every check that needs no compilation and writes nothing.

  Raises:
    ValueError: the first problem found, as one readable message.
  """
  ckpt_lib.validate_config(checkpoint_cfg)
  _check_writable(model_dir)
  save = checkpoint_cfg.save
  periods = compute_periods(checkpoint_period=save.period if save else 0,
                            checkpoint_steps=tuple(save.checkpoint_steps) if save else (),
                            **periods_kwargs)
  partitioner.validate()
  num_experts = getattr(getattr(model.module, "config", None), "num_experts", 0)
  if num_experts:
    moe.validate_expert_partitioning(num_experts, partitioner.mesh.shape["expert"])
  trainer.validate(train_dataset_cfg.batch_size)
  for cfg in (train_dataset_cfg, train_eval_dataset_cfg, infer_eval_dataset_cfg):
    if cfg is not None:
      eval_layout = partitioner.get_data_layout(cfg.batch_size)
      datasets.validate_dataset_config(cfg, num_shards=eval_layout.num_shards)
      _check_vocabulary(model, cfg)
  if infer_eval_dataset_cfg is not None and infer_eval_dataset_cfg.pack:
    raise ValueError(f"infer_eval/DatasetConfig.pack must be False (each example is decoded "
                     f"on its own) for '{infer_eval_dataset_cfg.mixture_or_task_name}'.")
  actions_lib.validate_actions(actions)
  return periods


# ---------------------------------------------------------------------------
# Data


def _to_global(batch: Mapping[str, np.ndarray], shardings: Mapping[str, Any],
               global_batch: int) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(
      shardings[k], v, (global_batch,) + v.shape[1:]) for k, v in batch.items()}


def global_batches(ds: Any, partitioner: Partitioner, global_batch: int) -> Iterator[dict]:
  """Yields global `jax.Array` batches from this host's tf.data batches."""
  shardings = {k: partitioner.batch_sharding(len(spec.shape))
               for k, spec in ds.element_spec.items()}
  for batch in ds.as_numpy_iterator():
    yield _to_global(batch, shardings, global_batch)


def _leave_cores_to_the_step(ds: Any) -> Any:
  """Runs the training pipeline on its own threads, at most half the cores.

  Left alone, tf.data spreads its work over a pool as large as the machine
  and over several threads per operation; on a CPU host those threads then
  preempt the threads of the compiled step, which waits for its slowest
  thread. The pipeline needs far less than half the machine to keep up (see
  benchmarks/run.py, input pipeline).
  """
  import tensorflow as tf  # the pipeline is tf.data already; imported where used
  options = tf.data.Options()
  options.threading.private_threadpool_size = max(1, (os.cpu_count() or 2) // 2)
  options.threading.max_intra_op_parallelism = 1
  return ds.with_options(options)


class _Prefetcher:
  """Builds a fixed number of batches in a background thread, a few ahead.

  The thread takes exactly `count` batches from `produce` (unless stopped),
  so the tf.data iterator behind it never runs past what the caller asked
  for, and its checkpointed position stays exact.

  Args:
    produce: returns the next batch (device arrays).
    count: batches to build.
    depth: most batches built but not yet taken.
  """

  def __init__(self, produce: Callable[[], Any], count: int, depth: int):
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._held: list = []  # a batch built when stop() came, still owed to the caller
    self.remaining = count
    self._thread = threading.Thread(target=self._run, args=(produce, count),
                                    name="t5lite-prefetch", daemon=True)
    self._thread.start()

  def _run(self, produce: Callable[[], Any], count: int) -> None:
    for _ in range(count):
      if self._stop.is_set():
        return
      try:
        item = produce()
      except BaseException as e:  # handed to the consumer, which re-raises it
        item = _Failure(e)
      while True:
        try:
          self._queue.put(item, timeout=0.05)
          break
        except queue.Full:
          if self._stop.is_set():
            self._held.append(item)
            return
      if isinstance(item, _Failure):
        return

  def get(self) -> Any:
    """The next batch, waiting for it if needed."""
    item = self._queue.get()
    self.remaining -= 1
    if isinstance(item, _Failure):
      raise item.error
    return item

  def stop(self) -> list:
    """Stops building; returns the batches built but not taken, in order."""
    self._stop.set()
    self._thread.join()
    left = []
    while not self._queue.empty():
      left.append(self._queue.get())
    left += self._held
    for item in left:
      if isinstance(item, _Failure):
        raise item.error
    return left


@dataclasses.dataclass(frozen=True)
class _Failure:
  """An exception raised while building a batch in the background."""

  error: BaseException


class TrainData:
  """This process's training batches as global arrays.

  By default every process builds the same global pipeline (one shard,
  batched at the global batch size) and keeps only the rows of its own
  devices, so the data order is a function of the global step alone: 1 or
  N processes, and a restart on another process count, see the same
  batches. With `cfg.shard_by_host` each process reads its own shard
  instead, and the order depends on the process count.

  Holds the tf.data iterator itself so checkpoints can save its position.
  `prefetch(n)` builds the next `n` batches, device transfer included, in a
  background thread while the steps run; the loop asks for exactly the
  batches it will use before its next possible stop, so when it saves, the
  iterator is where the last step left it.

  Args:
    model: gives the feature converter.
    cfg: the training dataset config.
    partitioner: gives the data layout and the batch shardings.
    prefetch_batches: most batches built ahead of the step; 0 builds each one
      when the loop asks for it.
  """

  def __init__(self, model: Any, cfg: DatasetConfig, partitioner: Partitioner,
               prefetch_batches: int = 2):
    if prefetch_batches < 0:
      raise ValueError(f"prefetch_batches must be >= 0 (0 disables prefetching), got "
                       f"{prefetch_batches}.")
    layout = partitioner.get_data_layout(cfg.batch_size)
    self.per_host = cfg.shard_by_host and layout.num_shards > 1
    shard = (layout.shard_id, layout.num_shards) if self.per_host else (0, 1)
    rows = cfg.batch_size // layout.num_shards
    # The rows of the global batch this process's devices hold.
    self._rows = slice(None) if self.per_host else slice(layout.shard_id * rows,
                                                         (layout.shard_id + 1) * rows)
    self._make = functools.partial(datasets.get_dataset, cfg, *shard,
                                   model.FEATURE_CONVERTER_CLS, num_epochs=None)
    self._global_batch = cfg.batch_size
    self._depth = prefetch_batches
    self._prefetcher: _Prefetcher | None = None
    self.skip(0)
    if self.per_host:
      metrics_lib.log_line(
          f"Warning: train/DatasetConfig.shard_by_host=True: each of the {layout.num_shards} "
          "processes reads, shuffles and packs its own shard, so the data order depends on the "
          "number of processes; a restart on another number continues at the same step with "
          "other examples.")
    self.shardings = {k: partitioner.batch_sharding(len(spec.shape))
                      for k, spec in self._ds.element_spec.items()}

  def global_shapes(self) -> dict[str, tuple[int, ...]]:
    """Shapes of the global batches this yields, e.g. for counting FLOPs."""
    return {k: (self._global_batch,) + tuple(v.shape[1:])
            for k, v in self._ds.element_spec.items()}

  def input_shapes(self) -> tuple[dict, dict]:
    """Shapes (batch 1) and dtypes of the model inputs, for initialisation."""
    spec = self._ds.element_spec
    return ({k: (1,) + tuple(v.shape[1:]) for k, v in spec.items()},
            {k: v.dtype.as_numpy_dtype for k, v in spec.items()})

  def skip(self, num_batches: int) -> None:
    """Starts after the first `num_batches` batches of the run (a restart with
    no saved iterator): the pipeline is built anew and fast-forwarded.

    Built anew because a second iterator over the same tf.data shuffle draws
    another order. Always through `skip`, even `skip(0)` (which tf.data must
    not optimise away), so a saved iterator restores into the same graph
    whatever position it was saved at.
    """
    import tensorflow as tf  # the pipeline is tf.data already; imported where used
    options = tf.data.Options()
    options.experimental_optimization.noop_elimination = False
    ds = self._make().skip(num_batches).with_options(options)
    self._ds = _leave_cores_to_the_step(ds)
    self.iterator = iter(self._ds)

  def __iter__(self) -> "TrainData":
    return self

  def _build(self) -> dict[str, jax.Array]:
    batch = {k: v.numpy()[self._rows] for k, v in next(self.iterator).items()}
    return _to_global(batch, self.shardings, self._global_batch)

  def prefetch(self, num_batches: int) -> None:
    """Starts building the next `num_batches` batches in the background.

    Any earlier prefetch must have been consumed or stopped.
    """
    if self._prefetcher is not None and self._prefetcher.remaining:
      raise RuntimeError("prefetch() called before the previous batches were used; call "
                         "stop_prefetch() first.")
    self._prefetcher = None
    if self._depth and num_batches > 0:
      self._prefetcher = _Prefetcher(self._build, num_batches, self._depth)

  def stop_prefetch(self) -> list[dict[str, jax.Array]]:
    """Stops the background thread; returns the batches it already took from
    the iterator and that no step has used yet, in order."""
    prefetcher, self._prefetcher = self._prefetcher, None
    return prefetcher.stop() if prefetcher is not None else []

  def __next__(self) -> dict[str, jax.Array]:
    if self._prefetcher is not None and self._prefetcher.remaining:
      return self._prefetcher.get()
    return self._build()


# ---------------------------------------------------------------------------
# State


@dataclasses.dataclass(frozen=True)
class StateSpecs:
  """Abstract state, its logical axes and its shardings."""

  abstract: TrainState
  logical: TrainState
  shardings: TrainState


def model_input_shapes(model: Any, cfg: DatasetConfig) -> tuple[dict, dict]:
  # Only the element spec is read; nothing is iterated.
  ds = datasets.get_dataset(cfg, 0, 1, model.FEATURE_CONVERTER_CLS, num_epochs=1)
  spec = ds.element_spec
  shapes = {k: (1,) + tuple(v.shape[1:]) for k, v in spec.items()}
  types = {k: v.dtype.as_numpy_dtype for k, v in spec.items()}
  return shapes, types


def state_specs(model: Any, partitioner: Partitioner, input_shapes: Mapping[str, tuple],
                input_types: Mapping[str, Any]) -> tuple[StateSpecs, Callable[[jax.Array], TrainState]]:
  """Abstract train state, its shardings, and the function that initialises it."""
  def boxed_and_state(rng):
    variables = model.get_initial_variables(rng, input_shapes, input_types)
    return variables, TrainState.create(nn.unbox(variables["params"]), model.optimizer)

  def init(rng):
    return boxed_and_state(rng)[1]

  # One trace gives both the logical axes (on the boxed parameters) and the
  # abstract state; tracing a large model is seconds of a short run's start.
  boxed, abstract = jax.eval_shape(boxed_and_state, jax.random.key(0))
  param_axes = nn.get_partition_spec(boxed)["params"]
  logical = state_logical_axes(abstract, param_axes)
  return StateSpecs(abstract, logical, partitioner.logical_to_sharding(logical)), init


def _fast_forward(data: TrainData, step: int) -> None:
  """Continues the data after the `step` batches a restored run already used."""
  if step:
    metrics_lib.log_line(f"Continuing the training data at batch {step}: the pipeline is "
                         "rebuilt and fast-forwarded (the checkpoint holds no iterator for "
                         "this run).")
  data.skip(step)


def init_or_restore(*, specs: StateSpecs, init_fn: Callable[[jax.Array], TrainState],
                    partitioner: Partitioner, checkpointer: ckpt_lib.Checkpointer,
                    restore_cfg: ckpt_lib.RestoreCheckpointConfig | None,
                    seed: int, data: TrainData | None = None,
                    resume_step: int | None = None) -> tuple[TrainState, int]:
  """Newest readable checkpoint in model_dir, else an explicit restore path, else fresh init.

  The data continues where the restored step left it: from the saved
  iterator when the checkpoint has one for this process count, else by
  fast-forwarding the deterministic pipeline that many batches.
  A params-only restore (fine-tuning) starts from the fresh init, replaces
  the parameters the checkpoint provides and starts at step 0; the latest
  checkpoint in model_dir still wins over it, so a restarted fine-tune
  resumes its own full state. Unreadable newer steps, and with
  `resume_step` the steps after it, are moved out of the way (never
  deleted) once a step has restored.

  Returns:
    (state, step it starts from).

  Raises:
    ValueError: the explicit restore path does not fit the model, no step of
      model_dir can be read, or `resume_step` is not one of its steps
      (checked before anything is written to model_dir).
  """
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.state_dict(),
                                              specs.shardings.state_dict())
  # Init under jit with output shardings: a large model is created already
  # split over the devices, never whole on one.
  init = partitioner.partition(init_fn, in_shardings=None, out_shardings=specs.shardings)
  plan = ckpt_lib.plan_resume(checkpointer.model_dir, resume_step)
  latest = max(plan.candidates) if plan.candidates else None
  unfinished = [s for s in checkpointer.unfinished_steps() if latest is None or s > latest]
  if unfinished:
    metrics_lib.log_line(f"Warning: ignoring unfinished checkpoint(s) at step(s) {unfinished} "
                         f"in {checkpointer.directory}; restoring the last complete one.")
  if latest is not None:
    restored = _restore_own(checkpointer, plan, abstract, data)
    if data is not None and not restored.with_data:
      _fast_forward(data, restored.step)
    return specs.abstract.restore_state(restored.state), restored.step
  if restore_cfg is not None and interop.checkpoint_format(restore_cfg.path):
    return _import_foreign(specs, restore_cfg, partitioner), 0
  if restore_cfg is not None and restore_cfg.path and restore_cfg.params_only:
    plan = ckpt_lib.plan_params_restore(restore_cfg, specs.abstract.params)  # before init
    for warning in plan.warnings:
      metrics_lib.log_line(warning)
    state = init(jax.random.key(seed))
    state = state.replace(params=ckpt_lib.load_params(plan, state.params))
    metrics_lib.log_line(f"Restored {len(plan.sources)} parameters from step {plan.step} of "
                         f"{restore_cfg.path} ({len(plan.fresh)} kept fresh); starting at step 0")
    return state, 0
  if restore_cfg is not None and restore_cfg.path:
    restored, step = ckpt_lib.restore_from_path(restore_cfg, abstract)
    metrics_lib.log_line(f"Restored step {step} from {restore_cfg.path}")
    if data is not None:
      _fast_forward(data, step)
    return specs.abstract.restore_state(restored), step
  return init(jax.random.key(seed)), 0


def _restore_own(checkpointer: ckpt_lib.Checkpointer, plan: ckpt_lib.ResumePlan,
                 abstract: Any, data: TrainData | None) -> ckpt_lib.Restored:
  """Restores model_dir's newest readable candidate, then sets aside what
  must not be restored next time (see `checkpoints.plan_resume`)."""
  if plan.note:
    metrics_lib.log_line(plan.note)
  metrics_lib.log_line(f"Restoring step {max(plan.candidates)} from {checkpointer.directory}")
  restored = checkpointer.restore_newest(plan.candidates, abstract,
                                         data.iterator if data is not None else None)
  for warning in restored.warnings:
    metrics_lib.log_line(warning)
  if restored.unreadable:
    checkpointer.set_aside(restored.unreadable, ckpt_lib.UNREADABLE_SUBDIR)
  if plan.aside_subdir:
    where = checkpointer.set_aside(plan.set_aside, plan.aside_subdir)
    metrics_lib.log_line(f"Resuming from step {restored.step} (train.resume_step): newer "
                         f"step(s) {list(plan.set_aside)} moved to {where}, not deleted.")
  return restored


def _import_foreign(specs: StateSpecs, restore_cfg: ckpt_lib.RestoreCheckpointConfig,
                    partitioner: Partitioner) -> TrainState:
  """A fresh train state around the parameters of a T5X or Hugging Face checkpoint.

  Only the parameters are imported (a foreign optimizer's slots do not fit
  t5lite's optimizer); the optimizer state is initialised from them, under
  jit with the state's shardings, and the run starts at step 0.

  Raises:
    ValueError: `params_only` is off, or the checkpoint does not fit the model.
  """
  if not restore_cfg.params_only or restore_cfg.assignment_map:
    raise ValueError(f"{restore_cfg.path} is a {interop.checkpoint_format(restore_cfg.path)} "
                     "checkpoint, which gives parameters only: set "
                     "RestoreCheckpointConfig.params_only = True (gin/runs/finetune.gin does) "
                     "and no assignment_map.")
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.params, specs.shardings.params)
  params = interop.load_params(restore_cfg.path, abstract)
  tx = specs.abstract.tx
  create = partitioner.partition(lambda p: TrainState.create(p, tx),
                                 in_shardings=(specs.shardings.params,),
                                 out_shardings=specs.shardings)
  metrics_lib.log_line(f"Imported {len(jax.tree.leaves(params))} parameters from "
                       f"{restore_cfg.path}; optimizer state fresh, starting at step 0")
  return create(params)


def write_model_info(path: str, specs: StateSpecs, partitioner: Partitioner) -> None:
  """One line per parameter: name, shape, logical axes, mesh partition spec."""
  flat_abs = jax.tree_util.tree_flatten_with_path(specs.abstract.params)[0]
  flat_log = jax.tree.leaves(specs.logical.params,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  lines, total = [], 0
  for (key_path, leaf), logical in zip(flat_abs, flat_log):
    name = tree_paths.path_name(key_path)
    mesh_spec = partitioner.logical_to_mesh_spec(logical)
    total += int(np.prod(leaf.shape))
    lines.append(f"Variable {name:60s} size {int(np.prod(leaf.shape)):<12d} "
                 f"shape {str(tuple(leaf.shape)):22s} logical {tuple(logical)} "
                 f"partition {tuple(mesh_spec)}")
  opt_total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(specs.abstract.opt_state))
  lines.append(f"Total number of parameters: {total}")
  lines.append(f"Total number of optimizer-state values: {opt_total}")
  lines.append(f"Mesh: {dict(partitioner.mesh.shape)}")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------
# Evaluation during training


def eval_task_names(cfg: DatasetConfig) -> list[str]:
  """The evaluated names: the task, or a mixture and each of its tasks that
  has the split."""
  provider = datasets.get_mixture_or_task(cfg.mixture_or_task_name, cfg.module)
  names = [cfg.mixture_or_task_name]
  if isinstance(provider, seqio.Mixture):
    names += [t.name for t in provider.tasks if cfg.split in t.splits]
  return names


class TrainEvaluator:
  """Teacher-forced metrics on `eval_steps` batches of a held-out split.

  A mixture is evaluated as a whole and task by task. Each evaluation reads
  the same first batches, so numbers are comparable across steps. Results
  go to MODEL_DIR/training_eval/<task>/.
  """

  def __init__(self, *, model: Any, cfg: DatasetConfig, partitioner: Partitioner,
               trainer: Any, params_shardings: Any, eval_steps: int, model_dir: str):
    layout = partitioner.get_data_layout(cfg.batch_size)
    self._partitioner, self._batch = partitioner, cfg.batch_size
    self._steps = eval_steps
    self._datasets, self._writers = {}, {}
    for name in eval_task_names(cfg):
      self._datasets[name] = datasets.get_dataset(
          dataclasses.replace(cfg, mixture_or_task_name=name), layout.shard_id,
          layout.num_shards, model.FEATURE_CONVERTER_CLS, num_epochs=None)
      self._writers[name] = metrics_lib.SummaryWriter(
          os.path.join(model_dir, "training_eval", name), jax.process_index() == 0)
    spec = next(iter(self._datasets.values())).element_spec
    shardings = {k: partitioner.batch_sharding(len(s.shape)) for k, s in spec.items()}
    self._step_fn = trainer.compile_eval_step(params_shardings, shardings)

  def evaluate(self, step: int, params: Any) -> dict[str, dict[str, float]]:
    """Metrics of each evaluated name at `step`: {task: {metric: value}}."""
    out = {}
    for name, ds in self._datasets.items():
      batches = global_batches(ds.take(self._steps), self._partitioner, self._batch)
      # Merged clu metrics: each batch weighs by its tokens (or rows), not 1.
      results = metrics_lib.merge_and_compute([self._step_fn(params, b) for b in batches])
      self._writers[name].write_scalars(step, results)
      self._writers[name].flush()
      out[name] = results
    metrics_lib.log_line(metrics_lib.format_table(f"train-eval at step {step}", out))
    return out

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()


# ---------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class _Loop:
  """The pieces the epoch loop drives."""

  step_fn: Callable[..., Any]
  data: TrainData
  checkpointer: ckpt_lib.Checkpointer
  writer: metrics_lib.SummaryWriter
  progress: metrics_lib.Progress
  periods: Periods
  evaluator: TrainEvaluator | None
  infer_evaluator: inference.InferenceEvaluator | None
  actions: Mapping[actions_lib.ActionMode, list]
  train_task: str
  total_steps: int
  divergence: DivergenceCheck = dataclasses.field(
      default_factory=lambda: DivergenceCheck(DivergenceLimits()))


@dataclasses.dataclass(frozen=True)
class DivergenceLimits:
  """When a training step counts as diverged, besides a NaN or Inf loss,
  gradient norm or parameter norm (see docs/checkpoints.md for the defaults).

  Attributes:
    max_update_ratio: largest norm of one update as a multiple of the norm
      of the parameters it changes; None disables this check.
    loss_spike_factor: largest median loss of the last `SPIKE_STEPS` steps as
      a multiple of the median loss of the `loss_spike_window` steps before
      them; None disables this check.
    loss_spike_window: steps in that reference median; the spike check starts
      once the run (or the restart) has trained that many plus `SPIKE_STEPS`.

  Raises:
    ValueError: a ratio that is not a number above 0, a factor not above 1,
      or a window below 1.
  """

  max_update_ratio: float | None = 1.0
  loss_spike_factor: float | None = 3.0
  loss_spike_window: int = 100

  def __post_init__(self):
    for name in ("max_update_ratio", "loss_spike_factor"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not value > (0 if name == "max_update_ratio" else 1)):
        bound = "above 0" if name == "max_update_ratio" else "above 1"
        raise ValueError(f"train.{name}={value!r} must be a number {bound}, or None to "
                         "disable that divergence check.")
    window = self.loss_spike_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
      raise ValueError(f"train.loss_spike_window={window!r} must be a whole number of steps "
                       ">= 1.")


# A loss spike is judged on the median of this many steps, not on one step:
# single small batches are noisy, by up to 11x the median at low losses
# (docs/checkpoints.md), while a diverging run stays high.
SPIKE_STEPS = 10


class DivergenceCheck:
  """Finds the first diverged step of a stats period, before any of it is saved.

  A step's loss and gradient describe the parameters it started from; its
  update ratio and parameter norm describe the parameters it produced, the
  ones a checkpoint would save. Steps the optimizer skipped
  (`skip_and_clip_by_global_norm`) changed nothing and are not judged.
  """

  def __init__(self, limits: DivergenceLimits):
    self.limits = limits
    # The reference window, then the SPIKE_STEPS - 1 steps before the one judged.
    self._losses: collections.deque = collections.deque(
        maxlen=limits.loss_spike_window + SPIKE_STEPS - 1)

  def first_problem(self, fetched: list[dict[str, float]], first_step: int) -> str | None:
    """What went wrong at the first diverged step of `fetched`, or None.

    Args:
      fetched: per-step metrics of consecutive steps.
      first_step: the step number of `fetched[0]`.
    """
    for offset, metrics in enumerate(fetched):
      if metrics.get("optimizer/skipped_steps"):
        continue
      problem = self._problem(metrics)
      if problem:
        return f"at step {first_step + offset}: {problem}"
      if "loss" in metrics:
        self._losses.append(metrics["loss"])
    return None

  def _problem(self, metrics: dict[str, float]) -> str | None:
    for name, what in (("loss", "the loss"), ("grad_norm", "the gradient norm"),
                       ("param_norm", "the parameter norm")):
      if name in metrics and not math.isfinite(metrics[name]):
        return f"{what} became {metrics[name]}"
    ratio, limit = metrics.get("update_ratio"), self.limits.max_update_ratio
    if ratio is not None and limit is not None and ratio > limit:
      return (f"the update was {ratio:.3g} times the norm of the parameters (limit "
              f"max_update_ratio={limit:g})")
    factor, losses = self.limits.loss_spike_factor, list(self._losses)
    if factor is not None and "loss" in metrics and len(losses) == self._losses.maxlen:
      window = self.limits.loss_spike_window
      before = float(np.median(losses[:window]))
      recent = float(np.median(losses[window:] + [metrics["loss"]]))
      if recent > factor * before:
        return (f"the median loss of the last {SPIKE_STEPS} steps, {recent:.4g}, was "
                f"{recent / before:.3g} times the median {before:.4g} of the {window} steps "
                f"before them (limit loss_spike_factor={factor:g})")
    return None


def _diverged_message(loop: _Loop, problem: str) -> str:
  """The stop line: what diverged where, what is on disk, how to go on."""
  saved = loop.checkpointer.all_steps()
  if not saved:
    return (f"Training diverged {problem}; stopped without saving it (no checkpoint yet). "
            "Rerun with a lower learning rate (or gradient clipping).")
  listed = ", ".join(str(s) for s in saved[-5:])
  return (f"Training diverged {problem}; stopped without saving it, the newest checkpoint "
          f"is step {saved[-1]}. Rerun with a lower learning rate (or gradient clipping) to "
          "continue from it, or restart from an earlier saved step (steps "
          f"{'..., ' if len(saved) > 5 else ''}{listed}) with "
          "--gin.train.resume_step=N.")


def _check_divergence(loop: _Loop, fetched: list[dict[str, float]], step: int) -> None:
  """Raises `Diverged` before anything of the stats period ending at `step`
  is written. Process 0's verdict is broadcast, so every process stops at
  the same stats period."""
  problem = loop.divergence.first_problem(fetched, step - len(fetched) + 1)
  if actions_lib.broadcast_decision(int(problem is not None)):
    raise Diverged(_diverged_message(loop, problem or "in the stats period before step "
                                     f"{step} (found by process 0)"))


def _write_stats(loop: _Loop, step: int, pending: list) -> actions_lib.Stop | None:
  fetched = metrics_lib.fetch(pending)
  _check_divergence(loop, fetched, step)
  scalars = metrics_lib.average(fetched)
  scalars.update(loop.progress.timing(step, scalars))
  loop.writer.write_scalars(step, scalars)
  metrics_lib.log_line(loop.progress.line(step, scalars))
  pending.clear()
  return actions_lib.run_actions(loop.actions, actions_lib.ActionMode.TRAIN, step,
                                 {loop.train_task: scalars})


def evaluate_all(loop: _Loop, step: int, params: Any) -> actions_lib.Stop | None:
  """Train-eval and inference eval at `step`, then their actions."""
  stop = None
  if loop.evaluator:
    results = loop.evaluator.evaluate(step, params)
    stop = actions_lib.run_actions(loop.actions, actions_lib.ActionMode.TRAIN_EVAL, step,
                                   results)
  if loop.infer_evaluator:
    results = loop.infer_evaluator.evaluate(step, params)
    stop = actions_lib.run_actions(loop.actions, actions_lib.ActionMode.INFER_EVAL, step,
                                   results) or stop
  loop.progress.reset_clock(step)
  return stop


def _end_of_epoch(loop: _Loop, step: int, state: TrainState) -> actions_lib.Stop | None:
  """Checkpoint, evaluate and collect garbage when their periods come due."""
  last = step == loop.total_steps
  due = loop.periods.checkpoint and step % loop.periods.checkpoint == 0
  if loop.periods.checkpoint and (due or last or step in loop.periods.checkpoint_steps):
    loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  stop = None
  if loop.periods.eval and (step % loop.periods.eval == 0 or last):
    stop = evaluate_all(loop, step, state.params)
  if loop.periods.gc and step % loop.periods.gc == 0:
    gc.collect()
  return stop


def run_epochs(loop: _Loop, state: TrainState, start_step: int
               ) -> tuple[TrainState, int, actions_lib.Stop | None]:
  """Runs steps from start_step to total_steps, epoch by epoch, unless an
  action stops training first.

  Returns:
    (state, last step run, the action's Stop or None).
  """
  step, pending = start_step, []
  while step < loop.total_steps:
    epoch_end = min(loop.total_steps, loop.periods.next_boundary(step))
    while step < epoch_end:
      # Up to the next stats period, the loop only dispatches steps: it never
      # waits for the device, and the next batches are built meanwhile.
      stats_end = min(epoch_end, (step // loop.periods.stats + 1) * loop.periods.stats)
      loop.data.prefetch(stats_end - step)
      while step < stats_end:
        state, step_metrics = loop.step_fn(state, next(loop.data))
        step += 1
        pending.append(step_metrics)
        if jax.process_count() == 1 and _PREEMPTION.is_set():
          _preempt(loop, step, state, pending)
      if jax.process_count() > 1 and _any_process_preempted(pending):
        _preempt(loop, step, state, pending)
      stop = _write_stats(loop, step, pending)
      if stop:
        return _stop(loop, step, state, stop)
    stop = _end_of_epoch(loop, step, state)
    if stop:
      return _stop(loop, step, state, stop)
  return state, step, None


def _stop(loop: _Loop, step: int, state: TrainState, stop: actions_lib.Stop
          ) -> tuple[TrainState, int, actions_lib.Stop]:
  """Ends training for an action: keeps the step unless its state is bad."""
  if not stop.save:
    raise Diverged(_diverged_message(loop, f"at step {step}: {stop.reason}"))
  if loop.periods.checkpoint:
    loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  metrics_lib.log_line(f"Stopped at step {step}: {stop.reason}.")
  return state, step, stop


def _any_process_preempted(pending: list) -> bool:
  """Whether any process got SIGTERM or Ctrl-C: every process must checkpoint
  the same step, so a multi-process job agrees at each stats period (one
  small all-gather) instead of acting on its own signal mid-period.

  The all-gather waits for the steps dispatched before it: otherwise one
  process can start it while another is still in a step's collective, and
  on CPU (gloo) the two then wait for each other until the context times out.
  """
  from jax.experimental import multihost_utils
  jax.block_until_ready(pending)
  # 0: go on, 1: preemption asked, 2: Ctrl-C; one Ctrl-C makes every process exit 130.
  code = int(_PREEMPTION.is_set()) + int(_INTERRUPTED.is_set())
  codes = multihost_utils.process_allgather(np.asarray([code], np.int32))
  if np.any(codes == 2):
    _INTERRUPTED.set()
  return bool(np.any(codes))


def _preempt(loop: _Loop, step: int, state: TrainState, pending: list) -> None:
  """Checkpoints the finished step (closing waits for the write) and stops.

  Batches already taken from the iterator are trained on first (at most the
  prefetch depth plus one), so the saved iterator position matches the step.
  """
  for batch in loop.data.stop_prefetch():
    state, step_metrics = loop.step_fn(state, batch)
    step += 1
    pending.append(step_metrics)
  if pending:
    _write_stats(loop, step, pending)  # also refuses to save a diverged state
  loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  raise (Interrupted if _INTERRUPTED.is_set() else Preempted)(step)


class _SignalsToPreemption:
  """Within the loop, SIGTERM and Ctrl-C (SIGINT) request a clean preemption
  instead of killing; after a Ctrl-C, a second one kills at once."""

  def __enter__(self):
    _PREEMPTION.clear()
    _INTERRUPTED.clear()
    self._installed = threading.current_thread() is threading.main_thread()
    if self._installed:
      self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM,
                                                      lambda *_: request_preemption()),
                        signal.SIGINT: signal.signal(signal.SIGINT, _interrupt)}
    return self

  def __exit__(self, *exc):
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous[signal.SIGTERM])
      if not _INTERRUPTED.is_set():  # else a second Ctrl-C must still end the process
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
    _PREEMPTION.clear()


def _interrupt(*_: Any) -> None:
  """The first Ctrl-C: checkpoint the current step and stop (exit 130)."""
  # From now on SIGINT has the system's default action, so a second Ctrl-C
  # ends the process at once, even while it waits for a checkpoint write
  # (the half-written step is never restored).
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  if jax.process_index() == 0:
    os.write(2, b"t5lite: Ctrl-C: saving the current step, then exiting; press Ctrl-C again "
                b"to exit at once without saving.\n")
  request_preemption(interrupted=True)


def _resolve_seed(random_seed: int | None) -> int:
  if random_seed is not None:
    return int(random_seed)
  seed = int(time.time() * 1000) % (2**31)
  if jax.process_count() > 1:
    # Clocks differ between hosts; every process must init and drop out alike.
    from jax.experimental import multihost_utils
    seed = int(multihost_utils.broadcast_one_to_all(np.asarray(seed, np.int32)))
  metrics_lib.log_line(f"random_seed not set; using {seed}")
  return seed


def train(*,
          model: Any,
          train_dataset_cfg: DatasetConfig,
          train_eval_dataset_cfg: DatasetConfig | None = None,
          infer_eval_dataset_cfg: DatasetConfig | None = None,
          checkpoint_cfg: CheckpointConfig = CheckpointConfig(),
          partitioner: Partitioner,
          trainer_cls: Callable[..., Any],
          model_dir: str,
          total_steps: int,
          eval_steps: int = 10,
          eval_period: int = 1000,
          relative_steps: int | None = None,
          stats_period: int | None = None,
          random_seed: int | None = 0,
          actions: Mapping[str, Any] | None = None,
          run_eval_before_training: bool = False,
          gc_period: int = 0,
          prefetch_batches: int = 2,
          peak_flops_per_device: float | None = None,
          max_update_ratio: float | None = 1.0,
          loss_spike_factor: float | None = 3.0,
          loss_spike_window: int = 100,
          summarize_config_fn: Callable[[str], None] | None = None,
          resume_step: int | None = None) -> tuple[int, TrainState]:
  """Trains `model` on `train_dataset_cfg`, checkpointing into `model_dir`.

  Args:
    model: a `models.BaseModel` (module, vocabularies, optimizer, loss).
    train_dataset_cfg: training data; `batch_size` is the global batch.
    train_eval_dataset_cfg: held-out data for teacher-forced evaluation.
    infer_eval_dataset_cfg: data for inference evaluation (decoding and the
      tasks' seqio metrics), run with the train-eval every `eval_period`;
      must not be packed.
    checkpoint_cfg: save period/keep and the explicit restore path.
    partitioner: mesh and logical-axis rules.
    trainer_cls: called as trainer_cls(model=..., partitioner=...,
      dropout_seed=...); gin binds the rest (e.g. num_microbatches).
    model_dir: where checkpoints, summaries, config.gin and model-info.txt go.
    total_steps: the step to train up to (absolute).
    eval_steps: batches per train-eval.
    eval_period: steps between train-evals; 0 disables.
    relative_steps: if set, train this many steps past the restored step
      instead of up to `total_steps`.
    stats_period: steps between metric fetches and progress lines; defaults
      to the epoch length.
    random_seed: seeds init and dropout; None draws one from the clock.
    actions: mode ('TRAIN', 'TRAIN_EVAL', 'INFER_EVAL') -> list of
      `actions.EarlyStopping` / `actions.TerminateOnNan`, run on that mode's
      metrics; one that fires ends training (see `t5lite.actions`).
    run_eval_before_training: also evaluate at the start step.
    gc_period: steps between Python garbage collections; 0 leaves gc on.
    prefetch_batches: training batches built and sent to the devices in a
      background thread while earlier steps run; 0 builds each batch when
      its step is dispatched.
    peak_flops_per_device: peak FLOP/s of one device, for the MFU of the
      progress line and `timing/mfu`; None takes the datasheet figure of the
      GPUs and TPUs in `metrics.PEAK_FLOPS_PER_DEVICE` and shows model FLOP/s
      alone on other devices (on a CPU, bind the matmul peak `make bench`
      measures).
    max_update_ratio: training stops (exit 3) at a step whose update is larger
      than this multiple of the parameters' norm; None disables. A NaN or
      Inf loss, gradient norm or parameter norm always stops it.
    loss_spike_factor: training stops at a step where the median loss of the
      last 10 steps exceeds this multiple of the median loss of the
      `loss_spike_window` steps before them; None disables. Either way
      nothing of that stats period is saved, so the newest checkpoint
      predates the divergence (see docs/checkpoints.md).
    loss_spike_window: steps in that reference median; the check starts once
      a run or restart has trained that many steps plus 10.
    summarize_config_fn: called with model_dir on process 0 once inputs are
      validated (the CLI writes config.gin with it).
    resume_step: restore this step of model_dir's checkpoints instead of the
      newest (`--gin.train.resume_step=N`, e.g. to go back before a
      divergence). The newer steps are moved, not deleted, to
      MODEL_DIR/checkpoints-abandoned-after-N/, so they neither block the
      new saves nor get restored again; a rerun of the same command then
      resumes from its own newest checkpoint.

  Returns:
    (final step, final TrainState); the final step is earlier than the
    target when an action stopped training.

  Raises:
    ValueError: invalid configuration, before anything compiles or is written.
    checkpoints.CheckpointWriteError: a checkpoint could not be written.
  """
  divergence = DivergenceLimits(max_update_ratio=max_update_ratio,
                                loss_spike_factor=loss_spike_factor,
                                loss_spike_window=loss_spike_window)
  seed = _resolve_seed(random_seed)
  trainer, periods = checked_setup(
      model=model, trainer_cls=trainer_cls, seed=seed, train_dataset_cfg=train_dataset_cfg,
      train_eval_dataset_cfg=train_eval_dataset_cfg,
      infer_eval_dataset_cfg=infer_eval_dataset_cfg, checkpoint_cfg=checkpoint_cfg,
      partitioner=partitioner, model_dir=model_dir, actions=actions, total_steps=total_steps,
      eval_period=eval_period, gc_period=gc_period, stats_period=stats_period,
      peak_flops_per_device=peak_flops_per_device)
  return _run(model=model, trainer=trainer, partitioner=partitioner, periods=periods,
              train_cfg=train_dataset_cfg, eval_cfg=train_eval_dataset_cfg,
              infer_cfg=infer_eval_dataset_cfg,
              actions=actions_lib.validate_actions(actions), checkpoint_cfg=checkpoint_cfg, model_dir=model_dir, total_steps=total_steps,
              relative_steps=relative_steps, eval_steps=eval_steps, seed=seed,
              run_eval_before_training=run_eval_before_training,
              prefetch_batches=prefetch_batches, peak_flops_per_device=peak_flops_per_device,
              summarize_config_fn=summarize_config_fn, divergence=divergence,
              resume_step=resume_step)


def checked_setup(*, model: Any, trainer_cls: Callable[..., Any], seed: int,
                  train_dataset_cfg: DatasetConfig,
                  train_eval_dataset_cfg: DatasetConfig | None,
                  infer_eval_dataset_cfg: DatasetConfig | None,
                  checkpoint_cfg: CheckpointConfig, partitioner: Partitioner, model_dir: str,
                  actions: Mapping[str, Any] | None, total_steps: int, eval_period: int,
                  gc_period: int, stats_period: int | None,
                  peak_flops_per_device: float | None) -> tuple[Any, Periods]:
  """The trainer and the periods of a `train()` call, after every check that
  needs no compile. `train()` and its dry run both start here, so the dry run
  refuses exactly what training refuses."""
  if peak_flops_per_device is not None and not peak_flops_per_device > 0:
    raise ValueError(f"train.peak_flops_per_device must be a positive FLOP/s figure or None, "
                     f"got {peak_flops_per_device!r}.")
  trainer = trainer_cls(model=model, partitioner=partitioner, dropout_seed=seed)
  periods = validate(
      model=model, train_dataset_cfg=train_dataset_cfg, model_dir=model_dir,
      train_eval_dataset_cfg=train_eval_dataset_cfg,
      infer_eval_dataset_cfg=infer_eval_dataset_cfg, checkpoint_cfg=checkpoint_cfg,
      partitioner=partitioner, trainer=trainer, actions=actions,
      periods_kwargs=dict(total_steps=total_steps, eval_period=eval_period,
                          gc_period=gc_period, stats_period=stats_period))
  return trainer, periods


def _prepare_model_dir(model_dir: str, summarize_config_fn: Callable[[str], None] | None
                       ) -> None:
  os.makedirs(model_dir, exist_ok=True)
  if jax.process_index() == 0 and summarize_config_fn is not None:
    summarize_config_fn(model_dir)


def _build_loop(*, model, trainer, partitioner, periods, data, eval_cfg, infer_cfg, actions,
                train_task, specs, checkpointer, model_dir, start, end, eval_steps,
                peak_flops_per_device=None, divergence=DivergenceLimits()) -> _Loop:
  """The compiled step, the evaluators and the writers around the data."""
  step_fn = trainer.compile_train_step(specs.shardings, data.shardings)
  evaluator = infer_evaluator = None
  if eval_cfg is not None and periods.eval:
    evaluator = TrainEvaluator(model=model, cfg=eval_cfg, partitioner=partitioner,
                               trainer=trainer, params_shardings=specs.shardings.params,
                               eval_steps=eval_steps, model_dir=model_dir)
  if infer_cfg is not None and periods.eval:
    infer_evaluator = inference.InferenceEvaluator(
        model=model, cfg=infer_cfg, partitioner=partitioner,
        params_shardings=specs.shardings.params, output_dir=model_dir)
  writer = metrics_lib.SummaryWriter(os.path.join(model_dir, "train"), jax.process_index() == 0)
  progress = _progress(model, data, start, end, peak_flops_per_device)
  return _Loop(step_fn=step_fn, data=data, checkpointer=checkpointer, writer=writer,
               progress=progress, periods=periods, evaluator=evaluator,
               infer_evaluator=infer_evaluator, actions=actions, train_task=train_task,
               total_steps=end, divergence=DivergenceCheck(divergence))


def _progress(model: Any, data: TrainData, start: int, end: int,
              peak_flops_per_device: float | None = None) -> metrics_lib.Progress:
  """Throughput tracking, with model FLOP/s (and MFU where the devices'
  peak is known) when the model can count its FLOPs."""
  count = getattr(model, "train_flops_per_step", None)
  flops = count(data.global_shapes()) if count else None
  return metrics_lib.Progress(end, start, flops_per_step=flops,
                              peak_flops_per_second=metrics_lib.peak_flops_per_second(
                                  per_device=peak_flops_per_device))


def _close(loop: _Loop, failing: BaseException | None = None) -> None:
  """Flushes every writer and waits for the checkpoint write in flight.

  Args:
    loop: the loop's pieces.
    failing: the error already on its way out, if any; a failed write found
      here is then logged, not raised, so that error is the one reported;
      but a preemption promises its checkpoint, so its failure is raised.

  Raises:
    checkpoints.CheckpointWriteError: the last write failed.
  """
  try:
    loop.data.stop_prefetch()
  finally:
    try:
      loop.checkpointer.wait_until_finished()
      loop.checkpointer.close()
    except ckpt_lib.CheckpointWriteError as e:
      if failing is None or isinstance(failing, Preempted):
        raise
      metrics_lib.log_line(f"Warning: {e}")
    finally:
      loop.writer.close()
      for evaluator in (loop.evaluator, loop.infer_evaluator):
        if evaluator:
          evaluator.close()


def _holding_model_dir_lock(run: Callable[..., Any]) -> Callable[..., Any]:
  """`run(model_dir=..., ...)` holding MODEL_DIR's lock (see `t5lite.run_lock`):
  one trainer per model_dir, taken once per job, on process 0, after
  validation and before anything is written; released when `run` returns
  or raises."""
  @functools.wraps(run)
  def locked(**kwargs: Any) -> Any:
    with run_lock.hold(kwargs["model_dir"], enabled=jax.process_index() == 0,
                       log=metrics_lib.log_line):
      return run(**kwargs)
  return locked


@_holding_model_dir_lock
def _run(*, model, trainer, partitioner, periods, train_cfg, eval_cfg, infer_cfg, actions,
         checkpoint_cfg,
         model_dir, total_steps, relative_steps, eval_steps, seed, run_eval_before_training,
         prefetch_batches, peak_flops_per_device, summarize_config_fn,
         divergence=DivergenceLimits(), resume_step=None) -> tuple[int, TrainState]:
  """The phases after validation: state, model_dir, loop, then the epochs."""
  data = TrainData(model, train_cfg, partitioner, prefetch_batches)
  specs, init_fn = state_specs(model, partitioner, *data.input_shapes())
  partitioner.check_divisible(specs.abstract, specs.logical)  # before anything is written
  restore = checkpoint_cfg.restore
  if restore is not None and interop.checkpoint_format(restore.path):
    interop.check_fits(restore.path, specs.abstract.params)  # reads metadata only
  checkpointer = ckpt_lib.Checkpointer(model_dir, checkpoint_cfg.save)
  state, start = init_or_restore(specs=specs, init_fn=init_fn, partitioner=partitioner,
                                 checkpointer=checkpointer, restore_cfg=checkpoint_cfg.restore,
                                 seed=seed, data=data, resume_step=resume_step)
  end = start + relative_steps if relative_steps is not None else total_steps
  if start >= end:  # a rerun of a finished job leaves its config.gin as it was
    metrics_lib.log_line(f"Already at step {start} (target {end}); nothing to train.")
    checkpointer.close()
    return start, state
  # Only now, with the checkpoint known to fit the model, is anything written.
  _prepare_model_dir(model_dir, summarize_config_fn)
  if jax.process_index() == 0:
    write_model_info(os.path.join(model_dir, "model-info.txt"), specs, partitioner)

  loop = _build_loop(model=model, trainer=trainer, partitioner=partitioner, periods=periods,
                     data=data, eval_cfg=eval_cfg, infer_cfg=infer_cfg, actions=actions,
                     train_task=train_cfg.mixture_or_task_name, specs=specs,
                     checkpointer=checkpointer, model_dir=model_dir, start=start, end=end,
                     eval_steps=eval_steps, peak_flops_per_device=peak_flops_per_device,
                     divergence=divergence)
  metrics_lib.log_line(_banner(model=model, specs=specs, partitioner=partitioner,
                               train_cfg=train_cfg, periods=periods, start=start, end=end,
                               checkpointer=checkpointer))
  began = time.perf_counter()
  if periods.gc:
    gc.disable()  # collected every gc_period steps instead, away from the hot loop
  try:
    with _SignalsToPreemption():
      stop = None
      if run_eval_before_training:
        stop = evaluate_all(loop, start, state.params)
      if stop:
        state, end, _ = _stop(loop, start, state, stop)
      else:
        state, end, _ = run_epochs(loop, state, start)
  except BaseException as error:
    _close(loop, failing=error)
    raise
  else:
    _close(loop)
  finally:
    gc.enable()
  metrics_lib.log_line(_summary(model_dir=model_dir, checkpointer=checkpointer, start=start,
                                end=end, seconds=time.perf_counter() - began))
  return end, state


def _count(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _banner(*, model, specs, partitioner, train_cfg, periods, start, end, checkpointer) -> str:
  """What is about to run: devices, mesh, model size, data, schedule."""
  devices = jax.devices()
  mesh = " x ".join(f"{k} {v}" for k, v in partitioner.mesh.shape.items() if v > 1) or "1 device"
  params = _count(specs.abstract.params)
  layout = partitioner.get_data_layout(train_cfg.batch_size)
  lengths = ", ".join(f"{k} {v}" for k, v in train_cfg.task_feature_lengths.items())
  save = (f"checkpoints every {periods.checkpoint} steps and at the end"
          if periods.checkpoint else "no checkpoints")
  evals = f"evaluation every {periods.eval} steps" if periods.eval else "no evaluation"
  return "\n".join([
      f"t5lite: training {type(model.module).__name__} ({params / 1e6:.2f}M parameters, "
      f"{_count(specs.abstract.opt_state) / 1e6:.2f}M optimizer values)",
      f"  devices: {len(devices)} x {devices[0].device_kind} in {jax.process_count()} "
      f"process(es); mesh: {mesh}",
      f"  data: {train_cfg.mixture_or_task_name} ({train_cfg.split}), global batch "
      f"{train_cfg.batch_size} ({train_cfg.batch_size // layout.num_shards} per host), "
      f"lengths {lengths}",
      f"  steps {start} -> {end}; {save} into {checkpointer.directory}; {evals}"])


def _summary(*, model_dir, checkpointer, start, end, seconds) -> str:
  """Where everything went, once the run is over."""
  ran = end - start
  rate = f", {ran / seconds:.2f} steps/s" if ran and seconds > 0 else ""
  written = [d for d in ("train", "training_eval", inference.INFERENCE_EVAL_DIR)
             if os.path.isdir(os.path.join(model_dir, d))]
  steps = ckpt_lib.list_steps(checkpointer.directory)[1]
  return "\n".join([
      f"Finished at step {end}: {ran} steps in {metrics_lib.format_duration(seconds)}{rate}.",
      f"  checkpoints: {checkpointer.directory} (steps {steps})",
      f"  summaries:   {', '.join(os.path.join(model_dir, d) for d in written)}",
      f"  view with:   tensorboard --logdir {model_dir}"])

