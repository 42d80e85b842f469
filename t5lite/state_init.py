"""The train state: its abstract shapes and shardings, and where it comes from.

`state_specs` traces the model's initialisation without running it;
`init_or_restore` then builds the state by the restore priority: this run's
newest readable checkpoint, else a restore path (a t5lite, T5X or Hugging
Face checkpoint), else a fresh initialisation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.extend import core as jax_core

from t5lite import checkpoints as ckpt_lib
from t5lite import interop, optimizers, paths, tree_paths
from t5lite import metrics as metrics_lib
from t5lite.errors import UserError
from t5lite.feeder import TrainData, fast_forward
from t5lite.partitioning import Partitioner
from t5lite.train_state import TrainState, state_logical_axes


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


@dataclasses.dataclass(frozen=True)
class StateSpecs:
  """Abstract state, its logical axes and its shardings."""

  abstract: TrainState
  logical: TrainState
  shardings: TrainState


def state_specs(model: BaseModel, partitioner: Partitioner, input_shapes: Mapping[str, tuple],
                input_types: Mapping[str, Any], with_optimizer: bool = True
                ) -> tuple[StateSpecs, Callable[[jax.Array], TrainState]]:
  """Abstract train state, its shardings, and the function that initialises it.

  Without the optimizer (evaluation, inference, export: `model.optimizer` is
  not used and may be None), the state holds no optimizer state.
  """
  tx = model.optimizer if with_optimizer else optax.identity()

  def boxed_and_state(rng):
    variables = model.get_initial_variables(rng, input_shapes, input_types)
    # The logical axes are static metadata of the boxed parameters; the
    # optimizer may factor its statistics by them (T5X's Adafactor).
    return variables, TrainState.create(nn.unbox(variables["params"]), tx,
                                        nn.get_partition_spec(variables)["params"])

  # The model's initialisation is traced once, here: the jaxpr gives the
  # logical axes (on the boxed parameters) and the abstract state, and
  # `init` replays it, which jit traces in a fraction of the time that
  # tracing the model through Flax again would take (seconds of a short
  # run's start).
  closed, (boxed, abstract) = jax.make_jaxpr(boxed_and_state, return_shape=True)(
      jax.random.key(0))
  replay = jax_core.jaxpr_as_fun(closed)
  out_tree = jax.tree.structure((boxed, abstract))

  def init(rng):
    return jax.tree.unflatten(out_tree, replay(rng))[1]

  param_axes = nn.get_partition_spec(boxed)["params"]
  logical = state_logical_axes(abstract, param_axes)
  return StateSpecs(abstract, logical, partitioner.logical_to_sharding(logical)), init


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run starts, decided before anything is read or written.

  `kind` is "resume" (the newest of this run's own steps in `plan`),
  "import" (the parameters of a T5X or Hugging Face checkpoint),
  "import_state" (a T5X run's whole state, Adafactor included, at `step`), "params"
  (the parameters of a t5lite checkpoint), "restore" (a t5lite checkpoint's
  whole state, at `step`) or "fresh".
  """

  kind: str
  step: int
  plan: ckpt_lib.ResumePlan


def find_start(model_dir: str, restore_cfg: ckpt_lib.RestoreCheckpointConfig | None,
               resume_step: int | None = None) -> Start:
  """The restore priority that training and the dry run both follow: this
  run's own checkpoints first, then the restore path, else a fresh start.

  Raises:
    ValueError: `resume_step` is not a step of model_dir, the restore
      path holds no checkpoint, or asks for an optimizer state a foreign
      checkpoint does not have.
  """
  plan = ckpt_lib.plan_resume(model_dir, resume_step)
  if plan.candidates:
    return Start("resume", max(plan.candidates), plan)
  if restore_cfg is None or not restore_cfg.path:
    return Start("fresh", 0, plan)
  opened = ckpt_lib.open_checkpoint(restore_cfg.path, restore_cfg.mode)
  if opened.foreign and restore_cfg.assignment_map:
    raise UserError(f"{restore_cfg.path} is a {opened.kind} checkpoint, whose names t5lite "
                    "maps itself: remove RestoreCheckpointConfig.assignment_map.")
  if opened.kind == interop.T5X and not restore_cfg.params_only:
    return Start("import_state", opened.step, plan)
  if opened.foreign and not restore_cfg.params_only:
    raise UserError(f"{restore_cfg.path} is a {opened.kind} checkpoint, which holds "
                    "parameters only: set RestoreCheckpointConfig.params_only = True "
                    "(gin/runs/finetune.gin does).")
  if opened.foreign:
    return Start("import", 0, plan)
  if restore_cfg.params_only:
    return Start("params", 0, plan)
  return Start("restore", opened.step, plan)


def data_position(start: Start, model_dir: str) -> int:
  """The batch the training data starts at for `start`, known before any
  state is read: the resumed step, unless that step saved its data iterator
  (restored into the pipeline built at batch 0); the restored step of a
  restore path; else 0. A resume that falls back past an unreadable step
  moves the data once more, to the step it restored.
  """
  if start.kind == "resume":
    checkpoints = paths.join(model_dir, ckpt_lib.CHECKPOINTS_SUBDIR)
    return 0 if ckpt_lib.holds_dataset(checkpoints, start.step) else start.step
  return start.step if start.kind in ("restore", "import_state") else 0


def init_or_restore(*, specs: StateSpecs, init_fn: Callable[[jax.Array], TrainState],
                    partitioner: Partitioner, checkpointer: ckpt_lib.Checkpointer,
                    restore_cfg: ckpt_lib.RestoreCheckpointConfig | None,
                    seed: int, start: Start, data: TrainData | None = None
                    ) -> tuple[TrainState, int]:
  """Newest readable checkpoint in model_dir, else an explicit restore path, else fresh init.

  The data continues where the restored step left it: from the saved
  iterator when the checkpoint has one for this process count, else by
  fast-forwarding the deterministic pipeline that many batches.
  A params-only restore (fine-tuning) starts from the fresh init, replaces
  the parameters the checkpoint provides and starts at step 0; the latest
  checkpoint in model_dir still wins over it, so a restarted fine-tune
  resumes its own full state. Unreadable newer steps, and with
  `train.resume_step` the steps after it, are moved out of the way (never
  deleted) once a step has restored.

  `start` is `find_start`'s decision, made by the caller (training makes
  it first, to build the data at its position meanwhile) from `restore_cfg`.

  Returns:
    (state, step it starts from).

  Raises:
    ValueError: the explicit restore path does not fit the model, or no step
      of model_dir can be read (checked before anything is written to
      model_dir).
  """
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.state_dict(),
                                              specs.shardings.state_dict())
  # Init under jit with output shardings: a large model is created already
  # split over the devices, never whole on one.
  init = partitioner.partition(init_fn, in_shardings=None, out_shardings=specs.shardings)
  unfinished = [s for s in checkpointer.unfinished_steps()
                if start.kind != "resume" or s > start.step]
  if unfinished:
    logging.warning("Ignoring unfinished checkpoint(s) at step(s) %s in %s; restoring the last "
                    "complete one.", unfinished, checkpointer.directory)
  if start.kind == "resume":
    restored = _restore_own(checkpointer, start.plan, abstract, data)
    if data is not None and not restored.with_data:
      fast_forward(data, restored.step)
    return specs.abstract.restore_state(restored.state), restored.step
  if start.kind in ("import", "import_state"):
    state = _import_foreign(specs, restore_cfg, partitioner, start.kind == "import_state")
    if data is not None and start.step:
      fast_forward(data, start.step)
    return state, start.step
  if start.kind == "params":
    plan = ckpt_lib.plan_params_restore(restore_cfg, specs.abstract.params)  # before init
    for warning in plan.warnings:
      logging.warning("%s", warning)
    state = init(jax.random.key(seed))
    state = state.replace(params=ckpt_lib.load_params(plan, state.params))
    metrics_lib.log_line(f"Restored {len(plan.sources)} parameters from step {plan.step} of "
                         f"{restore_cfg.path} ({len(plan.fresh)} kept fresh); starting at step 0")
    return state, 0
  if start.kind == "restore":
    restored, step = ckpt_lib.restore_from_path(restore_cfg, abstract)
    metrics_lib.log_line(f"Restored step {step} from {restore_cfg.path}")
    if data is not None:
      fast_forward(data, step)
    return specs.abstract.restore_state(restored), step
  return init(jax.random.key(seed)), 0


def _restore_own(checkpointer: ckpt_lib.Checkpointer, plan: ckpt_lib.ResumePlan,
                 abstract: Any, data: TrainData | None) -> ckpt_lib.Restored:
  """Restores model_dir's newest readable candidate, then sets aside what
  must not be restored next time (see `checkpoints.plan_resume`)."""
  if plan.note:
    metrics_lib.log_line(plan.note)
  metrics_lib.log_line(f"Restoring step {max(plan.candidates)} from {checkpointer.directory}")
  # The pipeline at batch 0 is used only for a checkpoint with an iterator to
  # restore into; otherwise `fast_forward` places it at the restored step.
  with_iterator = data is not None and ckpt_lib.holds_dataset(checkpointer.directory,
                                                              max(plan.candidates))
  restored = checkpointer.restore_newest(plan.candidates, abstract,
                                         data.iterator if with_iterator else None)
  for warning in restored.warnings:
    logging.warning("%s", warning)
  if restored.unreadable:
    checkpointer.set_aside(restored.unreadable, ckpt_lib.UNREADABLE_SUBDIR)
  if plan.aside_subdir:
    where = checkpointer.set_aside(plan.set_aside, plan.aside_subdir)
    metrics_lib.log_line(f"Resuming from step {restored.step} (train.resume_step): newer "
                         f"step(s) {list(plan.set_aside)} moved to {where}, not deleted.")
  return restored


def _import_foreign(specs: StateSpecs, restore_cfg: ckpt_lib.RestoreCheckpointConfig,
                    partitioner: Partitioner, with_optimizer: bool) -> TrainState:
  """A train state around the parameters of a T5X or Hugging Face checkpoint.

  With `with_optimizer` (a T5X checkpoint restored whole), T5X's Adafactor
  statistics and step continue in the configured `optimizers.adafactor`,
  as T5X itself would continue the run. Otherwise the optimizer state is
  initialised from the parameters and the run starts at step 0 (a
  fine-tune). Either way under jit with the state's shardings.

  Raises:
    ValueError: the checkpoint does not fit the model, or its optimizer
      state does not fit the configured optimizer.
  """
  abstract = ckpt_lib.abstract_with_shardings(specs.abstract.params, specs.shardings.params)
  params = interop.load_params(restore_cfg.path, abstract)
  state = state_from_params(specs, partitioner, params)
  if not with_optimizer:
    metrics_lib.log_line(f"Imported {len(jax.tree.leaves(params))} parameters from "
                         f"{restore_cfg.path}; optimizer state fresh, starting at step 0")
    return state
  step, slots = interop.load_t5x_adafactor(restore_cfg.path, specs.abstract.params,
                                           t5x_adafactor_slots(state.opt_state))
  opt_state = optimizers.with_adafactor_state(state.opt_state, slots, step)
  metrics_lib.log_line(f"Imported the parameters and Adafactor state of {restore_cfg.path}; "
                       f"continuing T5X's run at step {step}")
  return state.replace(step=jax.numpy.asarray(step, state.step.dtype), opt_state=opt_state)


def state_from_params(specs: StateSpecs, partitioner: Partitioner, params: Any) -> TrainState:
  """A state at step 0 around `params` (placed with `specs.shardings.params`),
  with the optimizer's fresh state, built under jit with the state's shardings."""
  tx = specs.abstract.tx
  create = partitioner.partition(lambda p: TrainState.create(p, tx),
                                 in_shardings=(specs.shardings.params,),
                                 out_shardings=specs.shardings)
  return create(params)


def t5x_adafactor_slots(opt_state: Any) -> Any:
  """The configured optimizer's Adafactor state, which a T5X run's state continues.

  Raises:
    ValueError: the optimizer is not `optimizers.adafactor`.
  """
  slots = optimizers.adafactor_state(opt_state)
  if slots is None:
    raise UserError("Restoring a T5X checkpoint whole continues its Adafactor, but the "
                    "configured optimizer is not optimizers.adafactor: configure it (the gin "
                    "file t5lite-import writes does), or fine-tune from the parameters only "
                    "(RestoreCheckpointConfig.params_only = True).")
  return slots


@dataclasses.dataclass(frozen=True)
class ParamRow:
  """One parameter of the partitioning table."""

  name: str
  shape: tuple[int, ...]
  logical: tuple[str | None, ...]
  mesh: tuple[Any, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def param_rows(specs: StateSpecs, partitioner: Partitioner) -> list[ParamRow]:
  """One row per parameter: path, shape, logical axes and mesh axes; the
  table of model-info.txt and of the dry run."""
  flat = jax.tree_util.tree_flatten_with_path(specs.abstract.params)[0]
  logical = jax.tree.leaves(specs.logical.params,
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return [ParamRow(name=tree_paths.path_name(path), shape=tuple(leaf.shape), logical=tuple(spec),
                   mesh=tuple(partitioner.logical_to_mesh_spec(spec)))
          for (path, leaf), spec in zip(flat, logical)]


def param_count(specs: StateSpecs) -> int:
  """The model's parameter count, as model-info.txt, the run's banner and the
  dry run all give it."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(specs.abstract.params))


def write_model_info(path: str, specs: StateSpecs, partitioner: Partitioner) -> None:
  """One line per parameter (`param_rows`): name, size, shape, logical axes,
  mesh partition spec; then the totals and the mesh."""
  rows = param_rows(specs, partitioner)
  lines = [f"Variable {row.name:60s} size {row.size:<12d} shape {str(row.shape):22s} "
           f"logical {row.logical} partition {row.mesh}" for row in rows]
  opt_total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(specs.abstract.opt_state))
  lines.append(f"Total number of parameters: {param_count(specs)}")
  lines.append(f"Total number of optimizer-state values: {opt_total}")
  lines.append(f"Mesh: {dict(partitioner.mesh.shape)}")
  paths.write_whole(path, "\n".join(lines) + "\n")
