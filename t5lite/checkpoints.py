"""Orbax checkpoints under MODEL_DIR/checkpoints/<step>/.

Saves are asynchronous: the train loop hands the arrays to Orbax and goes on
while they are written; `wait_until_finished` blocks only at exit. Orbax
writes each step to a temporary directory and renames it when complete, so a
crash never leaves a step that looks finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorflow as tf
from absl import logging
from etils import epath
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import tensorstore_utils

from t5lite import interop, paths, tree_paths, write_errors
from t5lite.errors import UserError


CHECKPOINTS_SUBDIR = "checkpoints"

# TensorStore retries a failed request to a bucket 32 times, backing off up to
# 32 s each: with the server gone, a save would hang for a quarter of an hour
# before failing. Six retries over about a minute, like gcsfs (which writes
# the rest of a checkpoint), ride out a blip and fail a lost bucket promptly.
# Orbax builds the TensorStore context of every save and restore from these
# defaults.
BUCKET_RETRIES = {"max_retries": 6, "initial_delay": "1s", "max_delay": "16s"}
for _context in (tensorstore_utils._BASE_TS_CONTEXT,
                 tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
  _context["gcs_request_retries"] = BUCKET_RETRIES
_ITEM = "state"
_DATASET = "dataset"
# Siblings of CHECKPOINTS_SUBDIR that hold steps moved out of the restore
# order: never deleted, never restored, and no longer in the way of a new
# save at the same step.
UNREADABLE_SUBDIR = "checkpoints-unreadable"
ABANDONED_SUBDIR = "checkpoints-abandoned-after-{step}"


class CheckpointWriteError(write_errors.WriteError):
  """A checkpoint could not be written: full or read-only disk, a vanished
  checkpoints directory, or a file where it should be."""


class CheckpointReadError(UserError):
  """A checkpoint step exists but cannot be read (damaged or incomplete files)."""


class CheckpointMismatchError(UserError):
  """A readable checkpoint whose arrays do not fit this model and optimizer."""


# What reading damaged or missing checkpoint files raises: TensorStore's
# errors (DATA_LOSS, OUT_OF_RANGE, ...) and undecodable JSON are ValueErrors,
# a missing file is an OSError, a metadata file of another layout a KeyError.
_UNREADABLE = (OSError, ValueError, KeyError)

_reason = write_errors.reason


def _first_replica_writes_each_array() -> None:
  """Makes the first replica of each array shard write it whole, on every
  platform, as Orbax already does on GPUs.

  Orbax's default off GPUs (or on one whose JAX_PLATFORMS is unset) splits a
  replicated shard across its replicas, each copying its slice to the host
  through a sliced copy: one program compiled per slice shape and device
  before the first save can return (120 for the tiny MoE on 8 devices, 3-4 s
  of a blocked step), and thousands of dispatches at every save. The files
  are the same either way; only who writes which part changes. Orbax has no
  public constructor for the array-metadata store its default handler keeps,
  hence the one private import (`array_metadata_store`). Orbax warns of
  every override it is asked for; this one is meant, so its warning is
  dropped (one message, while the handler is registered), and a program
  that imports t5lite prints nothing for it.
  """
  def not_this_override(record) -> bool:
    return not record.getMessage().startswith('Type handler registry type "')

  absl_logger = logging.get_absl_logger()
  absl_logger.addFilter(not_this_override)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False),
        override=True)
  finally:
    absl_logger.removeFilter(not_this_override)


_first_replica_writes_each_array()


# TensorStore ends a message with the whole spec of the array it was reading:
# a screen of JSON after the reason.
_TENSORSTORE_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]", re.DOTALL)


def _read_reason(error: BaseException) -> str:
  """`_reason` of a failed read, without TensorStore's spec."""
  text = _TENSORSTORE_SPEC.sub("", str(error))
  return _reason(ValueError(text) if text != str(error) else error)


# How long a failed read waits for the reads still in flight beside it.
_DRAIN_SECONDS = 120.0


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that lets its tasks finish before it closes.

  Orbax runs the TensorStore reads of a checkpoint with `asyncio.gather` in a
  loop of its own, and closes that loop as soon as the first read fails. The
  other reads are still in flight: as each finishes, TensorStore's thread
  hands its result to the closed loop (`RuntimeError: Event loop is closed`,
  a traceback each), and those that failed too are logged whenever their
  tasks are collected (`Task exception was never retrieved`), at exit
  included. Closing only once they are done ends every read inside its loop,
  where `gather` takes their errors; the first one is still what Orbax raises.
  """

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      pending = asyncio.all_tasks(self)
      # With nothing pending, one pass still runs the callbacks already due
      # (gather's, which take the errors of reads that ended with the first).
      self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_SECONDS) if pending
                              else asyncio.sleep(0))
    super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
  _loop_factory = _DrainingEventLoop


@contextlib.contextmanager
def _reads_finished() -> Iterator[None]:
  """Orbax's reads in this block run in `_DrainingEventLoop`s: a failed read
  leaves nothing running behind it."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_DrainingPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


@dataclasses.dataclass
class DatasetIteratorArgs(ocp.args.CheckpointArgs):
  """A tf.data iterator to save, or to restore into (in place)."""

  iterator: Any


class DatasetIteratorHandler(ocp.CheckpointHandler):
  """Saves each process's tf.data iterator position under dataset/process_<i>.

  Each process holds its own iterator (its own shard with
  `shard_by_host`), so each writes and reads its own file.
  """

  def _path(self, directory: epath.Path) -> str:
    return str(directory / f"process_{jax.process_index()}" / "iterator")

  def save(self, directory: epath.Path, args: DatasetIteratorArgs) -> None:
    tf.train.Checkpoint(iterator=args.iterator).write(self._path(directory))

  def restore(self, directory: epath.Path, args: DatasetIteratorArgs | None = None) -> Any:
    status = tf.train.Checkpoint(iterator=args.iterator).read(self._path(directory))
    status.assert_consumed()
    return args.iterator

  def metadata(self, directory: epath.Path) -> None:
    return None

  def close(self) -> None:
    pass


ocp.args.register_with_handler(DatasetIteratorHandler, for_save=True,
                               for_restore=True)(DatasetIteratorArgs)


@dataclasses.dataclass(frozen=True)
class SaveCheckpointConfig:
  """When to save and what to keep.

  Attributes:
    period: save every this many steps (and always at the last step).
    checkpoint_steps: further steps to save at, off the period.
    keep: keep only the newest this many checkpoints; None keeps all (the
      rule is `retained`).
    keep_every_n_steps: checkpoints at multiples of this are kept forever,
      whatever `keep` says.
    dtype: store parameters in this dtype (e.g. 'bfloat16'); the optimizer
      state stays as it is. Restoring casts back to the run's dtypes.
    save_dataset: also save each process's tf.data iterator, so a restart
      restores the data position instead of fast-forwarding the pipeline to
      it. Either way the data continues exactly; this trades a write per
      checkpoint (which grows with the shuffle buffer) for a faster restart
      (docs/checkpoints.md has figures).
  """

  period: int = 1000
  checkpoint_steps: Sequence[int] = ()
  keep: int | None = None
  keep_every_n_steps: int | None = None
  dtype: str | None = None
  save_dataset: bool = False


@dataclasses.dataclass(frozen=True)
class RestoreCheckpointConfig:
  """Where to restore from when MODEL_DIR has no checkpoint yet.

  A checkpoint in MODEL_DIR always wins, so a restarted run (fine-tune
  included) resumes its own full state; this config is read only when
  MODEL_DIR has none.

  Attributes:
    path: a checkpoints directory (mode 'latest') or one step directory such
      as `.../checkpoints/1000` (mode 'specific'); None restores nothing.
    mode: 'latest' or 'specific'.
    params_only: take only the parameters from `path` (fine-tuning): the step
      and the optimizer state start fresh, at step 0.
    assignment_map: ordered (regex, replacement) pairs that choose the
      checkpoint parameter each model parameter is read from. Paths are
      '/'-joined, like 'encoder/layers_0/mlp/wi_0/kernel'. The first regex
      that matches the whole model path (`re.fullmatch`) gives the
      checkpoint path `match.expand(replacement)` (so `\\1` and `\\g<name>`
      work); a None replacement keeps the parameter's fresh init. A path no
      regex matches is read from the same path. Needs params_only.
    fallback_to_scratch: parameters with no counterpart in the checkpoint
      keep their fresh init instead of failing. Needs params_only.
    strict: a shape mismatch between a parameter and its checkpoint array is
      an error; False keeps the fresh init of the parameter and logs a
      warning. Needs params_only.
  """

  path: str | None = None
  mode: str = "latest"
  params_only: bool = False
  assignment_map: Sequence[tuple[str, str | None]] = ()
  fallback_to_scratch: bool = False
  strict: bool = True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  save: SaveCheckpointConfig | None = None
  restore: RestoreCheckpointConfig | None = None


def validate_config(config: CheckpointConfig) -> None:
  """Cheap checks before anything is compiled or written.

  Raises:
    ValueError: a non-positive period or keep, an unknown restore mode, or
      params-only options that are malformed or set without params_only.
  """
  save = config.save
  if save is not None:
    if save.period <= 0:
      raise UserError(f"Checkpoint period {save.period} must be positive.")
    if save.keep is not None and save.keep <= 0:
      raise UserError(f"Checkpoint keep={save.keep} must be positive or None.")
    if save.keep_every_n_steps is not None and save.keep_every_n_steps <= 0:
      raise UserError(f"keep_every_n_steps={save.keep_every_n_steps} must be positive.")
    if any(int(s) <= 0 for s in save.checkpoint_steps):
      raise UserError(f"checkpoint_steps {list(save.checkpoint_steps)} must be positive.")
    if save.dtype is not None and save.dtype not in ("float32", "bfloat16", "float16"):
      raise UserError(f"Checkpoint dtype '{save.dtype}' is not supported; use float32, "
                      "bfloat16 or float16.")
  if config.restore is not None:
    _validate_restore(config.restore)


def _validate_restore(restore: RestoreCheckpointConfig) -> None:
  if restore.mode not in ("latest", "specific"):
    raise UserError(f"Unknown restore mode '{restore.mode}'; use 'latest' or 'specific'.")
  if not restore.params_only:
    used = [name for name, on in (("assignment_map", bool(restore.assignment_map)),
                                  ("fallback_to_scratch", restore.fallback_to_scratch),
                                  ("strict=False", not restore.strict)) if on]
    if used:
      raise UserError(f"Restore option(s) {', '.join(used)} only apply to a params-only "
                      "restore; set RestoreCheckpointConfig.params_only = True.")
  for entry in restore.assignment_map:
    if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str)
        or not isinstance(entry[1], (str, type(None)))):
      raise UserError(f"assignment_map entry {entry!r} must be a (regex, replacement or None) "
                      "pair of strings.")
    try:
      re.compile(entry[0])
    except re.error as e:
      raise UserError(f"assignment_map regex '{entry[0]}' does not compile: {e}.") from None


def retained(steps: Iterable[int], save: SaveCheckpointConfig | None) -> set[int]:
  """The keep rule: which of the steps in `checkpoints/` stay after a save.

  The newest `save.keep` steps stay (all of them when `keep` is None), and so
  does every step that is a multiple of `save.keep_every_n_steps`; the rest
  are deleted. Orbax applies it (through `KeepRule`) after each save to the
  finished steps in `checkpoints/` and the step being saved.

  Args:
    steps: the steps in `checkpoints/`, in any order.
    save: the run's save config; None keeps every step.

  Returns:
    The steps of `steps` that stay.
  """
  steps = set(steps)
  if save is None or save.keep is None:
    return steps
  every = save.keep_every_n_steps
  return set(sorted(steps)[-save.keep:]) | {s for s in steps if every and s % every == 0}


def kept_steps(existing: Iterable[int], saves: Iterable[int],
               save: SaveCheckpointConfig | None, set_aside: Iterable[int] = ()
               ) -> tuple[int, ...]:
  """The steps left in `checkpoints/` once a run has made its saves.

  `retained` runs after every save, so what stays is `retained` of every step
  there was, applied once after the last save: the newest `keep` of them all
  and the multiples of `keep_every_n_steps` stay. A run that saves no new step
  (nothing to train) deletes nothing.

  Args:
    existing: the finished steps in `checkpoints/` when the run starts.
    saves: the steps the run saves.
    save: the run's save config.
    set_aside: steps the run moves out of `checkpoints/` before its first
      save (with `train.resume_step`, those after it): they neither count
      against `keep` nor stay.

  Returns:
    The steps in `checkpoints/` at the end, ascending.
  """
  on_disk = set(existing) - set(set_aside)
  new = set(saves) - on_disk  # a save at a step that exists writes nothing
  if not new:
    return tuple(sorted(on_disk))
  return tuple(sorted(retained(on_disk | new, save)))


@dataclasses.dataclass(frozen=True)
class KeepRule(ocp.checkpoint_managers.PreservationPolicy):
  """`retained` as Orbax's preservation policy: the run deletes by the rule
  the dry run predicts with (`kept_steps`)."""

  save: SaveCheckpointConfig | None

  def should_preserve(self, checkpoints: Sequence[Any], *,
                      context: ocp.checkpoint_managers.PreservationContext) -> list[bool]:
    stay = retained((info.step for info in checkpoints), self.save)
    return [info.step in stay for info in checkpoints]


def _manager(directory: str, save: SaveCheckpointConfig | None = None, read_only: bool = False
             ) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      preservation_policy=KeepRule(save),
      # The directory appears with the first save: a run that stops before it
      # (a bad restore path, say) leaves no empty checkpoints/ behind.
      create=False, read_only=read_only, enable_async_checkpointing=not read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=(_ITEM, _DATASET))


def _shapes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
  return {name: tuple(leaf.shape) for name, leaf in tree_paths.leaves_by_name(tree).items()}


def _saved_shapes(step_dir: str) -> dict[str, tuple[int, ...]]:
  """The array shapes a checkpoint step records.

  Raises:
    CheckpointReadError: its metadata cannot be read or lists no arrays
      (damaged or missing files).
  """
  # The handler, not a Checkpointer: Checkpointer.metadata logs the error and
  # answers None, which loses the reason.
  handler = ocp.StandardCheckpointHandler()
  try:
    with _reads_finished():
      metadata = handler.metadata(epath.Path(step_dir) / _ITEM)
  except _UNREADABLE as e:
    raise CheckpointReadError(f"Checkpoint {step_dir} is unreadable: {_read_reason(e)}") from e
  finally:
    handler.close()
  saved = _shapes_by_path(metadata) if metadata is not None else {}
  if not saved:
    raise CheckpointReadError(f"Checkpoint {step_dir} is unreadable: its metadata lists no "
                              "arrays (damaged or missing files)")
  return saved


def check_matches(step_dir: str, abstract_state: Any) -> None:
  """Compares a checkpoint's array shapes with the model's before restoring.

  Raises:
    CheckpointReadError: the checkpoint's metadata cannot be read.
    CheckpointMismatchError: naming up to five mismatched, missing or
      unexpected variables.
  """
  _raise_mismatches(step_dir, _saved_shapes(step_dir), _shapes_by_path(abstract_state),
                    "this model and optimizer",
                    "Use the configuration it was trained with, or a new MODEL_DIR.")


def _raise_mismatches(step_dir: str, saved: Mapping[str, tuple[int, ...]],
                      wanted: Mapping[str, tuple[int, ...]], what: str, fix: str) -> None:
  # Parameters first: they are what a user recognises.
  order = lambda paths: sorted(paths, key=lambda p: (not p.startswith("params/"), p))  # noqa: E731
  problems = [f"{p} is {saved[p]} in the checkpoint but {wanted[p]} in the model"
              for p in order(set(saved) & set(wanted)) if saved[p] != wanted[p]]
  problems += [f"{p} is missing from the checkpoint" for p in order(set(wanted) - set(saved))]
  problems += [f"{p} is in the checkpoint but not in the model"
               for p in order(set(saved) - set(wanted))]
  if problems:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise CheckpointMismatchError(
        f"Checkpoint {step_dir} does not match {what}: "
        + "; ".join(problems[:5]) + more + ". " + fix)


def _saved_iterators(directory: str, step: int) -> int:
  """How many processes saved their data iterator in `step` (0: none)."""
  path = paths.Path(paths.join(directory, str(step), _DATASET))
  if not path.is_dir():
    return 0
  return sum(child.name.startswith("process_") for child in path.iterdir())


def holds_dataset(directory: str, step: int) -> bool:
  """Whether `step` of the checkpoints in `directory` holds data iterators
  this run can continue from.

  Each process saved its own iterator; with a different number of processes
  they do not fit this run, whose data is fast-forwarded instead.
  """
  return _saved_iterators(directory, step) == jax.process_count()


def _has_dataset(manager: ocp.CheckpointManager, step: int) -> bool:
  """`holds_dataset`, with a warning when the iterators are of another
  number of processes."""
  saved = _saved_iterators(str(manager.directory), step)
  if saved and saved != jax.process_count():
    logging.warning("Checkpoint %s holds data iterators of %d processes but this run has %d; "
                    "the data is fast-forwarded to that step instead.", step, saved,
                    jax.process_count())
  return saved == jax.process_count()


def _restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any,
             dataset_iterator: Any = None) -> tuple[Any, bool]:
  """Restores the state and, when saved and asked for, the data iterator.

  The state is read first and the iterator only once the state restored, so
  a damaged step never moves the iterator.

  Raises:
    CheckpointReadError: the step's files cannot be read.
    CheckpointMismatchError: the step belongs to another model.
  """
  step_dir = paths.join(str(manager.directory), str(step))
  check_matches(step_dir, abstract_state)
  try:
    with _reads_finished():
      state = manager.restore(step, args=ocp.args.Composite(
          **{_ITEM: ocp.args.StandardRestore(abstract_state)}))[_ITEM]
  except _UNREADABLE as e:
    raise CheckpointReadError(f"Checkpoint {step_dir} is unreadable: {_read_reason(e)}") from e
  with_data = dataset_iterator is not None and _has_dataset(manager, step)
  if with_data:
    with_data = _restore_iterator(manager, step, dataset_iterator)
  return state, with_data


def _restore_iterator(manager: ocp.CheckpointManager, step: int, iterator: Any) -> bool:
  """Restores a saved data iterator in place; False (the caller fast-forwards)
  when it was saved from another pipeline, e.g. by an older t5lite."""
  try:
    with _reads_finished():
      manager.restore(step, args=ocp.args.Composite(
          **{_DATASET: DatasetIteratorArgs(iterator)}))
  except (tf.errors.OpError, AssertionError) as e:
    logging.warning("The data iterator saved at step %d does not fit this pipeline (%s); "
                    "the data is fast-forwarded to that step instead.", step,
                    str(e).splitlines()[0])
    return False
  return True


def _cast_params(state_dict: Any, dtype: str | None) -> Any:
  if dtype is None:
    return state_dict
  cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      state_dict["params"])
  return {**state_dict, "params": cast}


def _sync_processes(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `Checkpointer.restore_newest` restored.

  Attributes:
    state: the restored state dict.
    step: its step.
    with_data: whether the data iterator was restored in place.
    unreadable: newer steps that could not be read (still on disk).
    warnings: one line for each of them, naming it and `step`.
  """

  state: Any
  step: int
  with_data: bool
  unreadable: tuple[int, ...]
  warnings: tuple[str, ...]


class Checkpointer:
  """Saves and restores the train state of one model_dir.

  A failed write raises `CheckpointWriteError` from the call that notices it
  (the next `save`, or `wait_until_finished`); after that the checkpointer
  stops waiting on Orbax, whose commit threads may never finish.

  Args:
    model_dir: the run's directory; checkpoints go to `model_dir/checkpoints`.
    save_config: None disables saving (restore still works).
  """

  def __init__(self, model_dir: str, save_config: SaveCheckpointConfig | None):
    # Orbax's array store needs absolute paths; users pass relative ones.
    self.model_dir = paths.absolute(model_dir)
    self.directory = paths.join(self.model_dir, CHECKPOINTS_SUBDIR)
    self._save_config = save_config
    self._in_flight: int | None = None  # the step of the save Orbax may still be writing
    self._failed: CheckpointWriteError | None = None
    self._manager = self._writing(None, lambda: _manager(self.directory, save_config))

  def _writing(self, step: int | None, write: Any) -> Any:
    """Runs `write`, turning any failure into a one-line CheckpointWriteError."""
    if self._failed is not None:
      raise self._failed
    try:
      return write()
    except jax.errors.JaxRuntimeError:
      raise  # a lost peer or failed device: the disk is not to blame
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore fail in many types
      what = f"checkpoint step {step}" if step is not None else "checkpoints"
      self._failed = CheckpointWriteError(
          f"Could not write {what} to {self.directory}: {_reason(e)}. "
          f"{write_errors.advice(self.directory)}")
      raise self._failed from e

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def unfinished_steps(self) -> list[int]:
    """Steps whose save never completed (a crash mid-write); never restored."""
    directory = paths.Path(self.directory)
    if not directory.is_dir():
      return []
    names = (p.name.split(".", 1)[0] for p in directory.iterdir()
             if ".orbax-checkpoint-tmp" in p.name)
    return sorted(int(n) for n in names if n.isdigit())

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state_dict: Any, dataset_iterator: Any = None) -> bool:
    """Starts an asynchronous save of `state_dict` at `step`.

    Args:
      step: the step the state is at.
      state_dict: arrays to save.
      dataset_iterator: this host's tf.data iterator, saved when the config
        has `save_dataset` (synchronously: it is small and must match `step`).

    Returns:
      False when a checkpoint for `step` already exists (nothing is written).

    Raises:
      CheckpointWriteError: this save, or the one before it, failed.
    """
    if self._failed is not None:
      raise self._failed
    self.wait_until_finished()  # Orbax waits for the previous save anyway; name its step
    self._check_not_vanished(step)
    if step in self._manager.all_steps():
      return False
    dtype = self._save_config.dtype if self._save_config else None
    items = {_ITEM: ocp.args.StandardSave(_cast_params(state_dict, dtype))}
    if dataset_iterator is not None and self._save_config and self._save_config.save_dataset:
      items[_DATASET] = DatasetIteratorArgs(dataset_iterator)
    self._in_flight = step
    return bool(self._writing(step, lambda: self._manager.save(
        step, args=ocp.args.Composite(**items), force=True)))

  def _check_not_vanished(self, step: int) -> None:
    """Refuses to save into a checkpoints directory deleted since its steps
    were saved or found: Orbax would quietly make a new, empty one, and the
    run would end as if nothing had been lost.

    Raises:
      CheckpointWriteError: the directory is gone, naming the steps it held.
    """
    known = sorted(self._manager.all_steps())  # Orbax's record, not a listing
    if not known or paths.Path(self.directory).is_dir():
      return
    self._failed = CheckpointWriteError(
        f"Could not write checkpoint step {step} to {self.directory}: the directory "
        f"vanished, and the saved step(s) {known} with it. Nothing more is saved there; "
        "restore the directory from a copy and rerun the same command, or rerun it to "
        "train again from the start.")
    raise self._failed

  def restore(self, step: int, abstract_state: Any, dataset_iterator: Any = None
              ) -> tuple[Any, bool]:
    """Restores `step` into the shapes, dtypes and shardings of `abstract_state`.

    Returns:
      (state_dict, whether `dataset_iterator` was restored in place).

    Raises:
      CheckpointReadError: the step's files cannot be read.
      CheckpointMismatchError: the step belongs to another model.
    """
    return _restore(self._manager, step, abstract_state, dataset_iterator)

  def restore_newest(self, steps: Sequence[int], abstract_state: Any,
                     dataset_iterator: Any = None) -> Restored:
    """Restores the newest of `steps` that reads cleanly.

    Raises:
      CheckpointReadError: none of `steps` can be read (the message names the
        newest; nothing is moved or deleted).
      CheckpointMismatchError: a readable step belongs to another model.
    """
    order = sorted(steps, reverse=True)
    failures: list[CheckpointReadError] = []
    for step in order:
      try:
        state, with_data = self.restore(step, abstract_state, dataset_iterator)
      except CheckpointReadError as e:
        failures.append(e)
        continue
      warnings = tuple(
          f"{e}; falling back to step {step}. Nothing is deleted: step {bad} moves "
          f"to MODEL_DIR/{UNREADABLE_SUBDIR}/." for bad, e in zip(order, failures))
      return Restored(state, step, with_data, tuple(order[:len(failures)]), warnings)
    others = f" (so are steps {order[1:]})" if len(order) > 1 else ""
    raise CheckpointReadError(
        f"{failures[0]}{others}. No checkpoint in MODEL_DIR restores; nothing was changed. "
        f"Move the damaged step directories out of {self.directory} to start from scratch, or "
        "use another MODEL_DIR.")

  def set_aside(self, steps: Sequence[int], subdir: str) -> str:
    """Moves step directories out of the restore order, into `model_dir/subdir`.

    They are kept as they are (nothing is deleted), are never restored, and
    no longer block a new save at the same step.

    Returns:
      The directory they are in now.
    """
    target = paths.join(self.model_dir, subdir)
    _sync_processes("t5lite_before_set_aside")  # every process has read the listing
    if jax.process_index() == 0:
      paths.makedirs(target)
      for step in steps:
        dest, k = paths.join(target, str(step)), 1
        while paths.Path(dest).exists():  # an earlier step of the same number is kept too
          dest, k = paths.join(target, f"{step}.{k}"), k + 1
        paths.move(paths.join(self.directory, str(step)), dest)
    _sync_processes("t5lite_after_set_aside")
    self._manager.reload()
    return target

  def wait_until_finished(self) -> None:
    """Waits for the save in flight; returns at once once a write has failed
    (that failure was raised already, and Orbax's threads may never finish).

    Raises:
      CheckpointWriteError: it failed.
    """
    if self._failed is None:
      self._writing(self._in_flight, self._manager.wait_until_finished)
      self._in_flight = None

  def close(self) -> None:
    """Finishes the save in flight and releases Orbax; a no-op after a failed write."""
    if self._failed is None:
      self._writing(self._in_flight, self._manager.close)


# The kinds of checkpoint `open_checkpoint` finds; a foreign one is
# `interop.T5X` or `interop.HUGGING_FACE`.
STEP_DIR = "t5lite step"
RUN_DIR = "t5lite run"


@dataclasses.dataclass(frozen=True)
class OpenedCheckpoint:
  """What a checkpoint path holds (see `open_checkpoint`).

  Attributes:
    kind: `STEP_DIR` (one step directory such as `<model_dir>/checkpoints/1000`),
      `RUN_DIR` (a model_dir or checkpoints directory, at its newest step),
      `interop.T5X` or `interop.HUGGING_FACE`.
    path: the path as given.
    directory: the checkpoints directory holding `step`; for a foreign
      checkpoint, `path` itself.
    step: the training step it holds: t5lite's or T5X's step, 0 for a
      Hugging Face folder.
  """

  kind: str
  path: str
  directory: str
  step: int

  @property
  def foreign(self) -> bool:
    """Whether interop reads it (T5X or Hugging Face), not t5lite's Orbax."""
    return self.kind not in (STEP_DIR, RUN_DIR)


def open_checkpoint(path: str, mode: str = "latest") -> OpenedCheckpoint:
  """The one answer to "what checkpoint is at `path`?", for every reader.

  Args:
    path: a T5X checkpoint (a `checkpoint_<step>` directory or one holding
      them), a Hugging Face folder, a t5lite step directory, or a t5lite
      model_dir or checkpoints directory.
    mode: for t5lite's own checkpoints, 'specific' (`path` is one step
      directory), 'latest' (its newest step) or 'auto' ('specific' when the
      last component of `path` is a number). A foreign checkpoint names its
      step itself.

  Returns:
    Its kind, directory and step; only directory listings are read.

  Raises:
    ValueError: `path` holds no checkpoint.
  """
  paths.check_scheme("The checkpoint path", path)
  foreign = interop.checkpoint_format(path)
  if foreign:
    return OpenedCheckpoint(foreign, path, path, interop.checkpoint_step(path))
  if mode == "auto":
    mode = "specific" if paths.name(path).isdigit() else "latest"
  if mode == "specific":
    root, name = paths.parent(paths.absolute(path)), paths.name(path)
    if not name.isdigit() or not paths.Path(path).is_dir():
      raise UserError(
          f"Restore path '{path}' is not a checkpoint step directory "
          "like '<model_dir>/checkpoints/1000'.")
    return OpenedCheckpoint(STEP_DIR, path, root, int(name))
  directory, steps = list_steps(path)
  if not steps:
    raise UserError(f"No checkpoint found under restore path '{path}'.")
  return OpenedCheckpoint(RUN_DIR, path, directory, max(steps))


def list_steps(path: str) -> tuple[str, list[int]]:
  """The finished checkpoint steps under a model_dir or checkpoints directory.

  Returns:
    (checkpoints directory, ascending steps); no steps when there are none.
  """
  path = paths.absolute(path)
  if paths.Path(paths.join(path, CHECKPOINTS_SUBDIR)).is_dir():
    path = paths.join(path, CHECKPOINTS_SUBDIR)
  if not paths.Path(path).is_dir():
    return path, []
  manager = _manager(path, read_only=True)
  try:
    return path, sorted(manager.all_steps())
  finally:
    manager.close()


@dataclasses.dataclass(frozen=True)
class ResumePlan:
  """Which of MODEL_DIR's own checkpoints a run restores.

  Attributes:
    candidates: steps to restore, newest first wins (`restore_newest`);
      empty when MODEL_DIR has none.
    set_aside: steps newer than `train.resume_step`, moved to `aside_subdir`
      once that step restored.
    aside_subdir: where they go, relative to MODEL_DIR; created even when
      nothing is newer, as the record that `resume_step` was applied.
    note: a line for the log, or ''.
  """

  candidates: tuple[int, ...]
  set_aside: tuple[int, ...] = ()
  aside_subdir: str = ""
  note: str = ""


def plan_resume(model_dir: str, resume_step: int | None) -> ResumePlan:
  """Decides where a run in `model_dir` resumes; reads directory listings only.

  Args:
    model_dir: the run's MODEL_DIR.
    resume_step: `train.resume_step`: restore this step instead of the
      newest, and set the newer ones aside (kept, never restored again). A
      rerun of the same command (after a preemption, say) finds them already
      set aside and resumes from its own newest checkpoint instead.

  Raises:
    ValueError: `resume_step` is not one of MODEL_DIR's checkpoint steps.
  """
  directory = paths.join(paths.absolute(model_dir), CHECKPOINTS_SUBDIR)
  steps = list_steps(directory)[1] if paths.Path(directory).is_dir() else []
  if resume_step is None:
    return ResumePlan(tuple(steps))
  subdir = ABANDONED_SUBDIR.format(step=resume_step)
  if paths.Path(paths.join(model_dir, subdir)).is_dir():
    return ResumePlan(tuple(steps), note=(
        f"train.resume_step={resume_step} was applied by an earlier run (the steps after it "
        f"are in MODEL_DIR/{subdir}); resuming from the newest checkpoint. To go back to step "
        f"{resume_step} again, rename that directory first."))
  if isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step not in steps:
    raise UserError(
        f"train.resume_step={resume_step!r} is not a checkpoint in {directory}; available "
        f"steps: {steps if steps else 'none'}. Pass one of them, or drop train.resume_step.")
  newer = tuple(s for s in steps if s > resume_step)
  return ResumePlan((resume_step,), newer, subdir)


def restore_from_path(config: RestoreCheckpointConfig, abstract_state: Any) -> tuple[Any, int]:
  """Restores the state named by an explicit restore config.

  Returns:
    (state_dict, step).

  Raises:
    CheckpointReadError: the step cannot be read (the message names it).
    CheckpointMismatchError: it belongs to another model.
  """
  opened = open_checkpoint(config.path, config.mode)
  directory, step = opened.directory, opened.step
  manager = _manager(directory, read_only=True)
  try:
    return _restore(manager, step, abstract_state)[0], step
  except CheckpointReadError as e:
    raise _naming_other_steps(e, directory) from e
  finally:
    manager.close()


def restore_params(config: RestoreCheckpointConfig, abstract_params: Any) -> tuple[Any, int]:
  """The parameters alone of the t5lite checkpoint an explicit restore config
  names, placed with the shardings `abstract_params` carry.

  The optimizer state is neither read nor compared: evaluation, inference and
  export need none, and a checkpoint trained with any optimizer serves them.

  Returns:
    (params, step).

  Raises:
    CheckpointReadError: the step cannot be read (the message names it).
    CheckpointMismatchError: its parameters are not this model's.
  """
  opened = open_checkpoint(config.path, config.mode)
  directory, step = opened.directory, opened.step
  step_dir = paths.join(directory, str(step))
  try:
    saved = _saved_shapes(step_dir)
  except CheckpointReadError as e:
    raise _naming_other_steps(e, directory) from e
  wanted = _shapes_by_path({"params": abstract_params})
  _raise_mismatches(step_dir, {p: s for p, s in saved.items() if p.startswith("params/")},
                    wanted, "this model", "Use the model configuration it was trained with.")
  item = {"params": abstract_params}
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    with _reads_finished():
      restored = checkpointer.restore(
          paths.join(step_dir, _ITEM),
          args=ocp.args.PyTreeRestore(
              item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
              partial_restore=True))
  except _UNREADABLE as e:
    unreadable = CheckpointReadError(f"Checkpoint {step_dir} is unreadable: {_read_reason(e)}")
    raise _naming_other_steps(unreadable, directory) from e
  finally:
    checkpointer.close()
  return restored["params"], step


def _naming_other_steps(error: CheckpointReadError, directory: str) -> CheckpointReadError:
  """`error` of an explicitly named step, with the way out."""
  return CheckpointReadError(f"{error}. Use another step (steps in {directory}: "
                             f"{list_steps(directory)[1]}), or replace this one from a copy.")


def abstract_with_shardings(state_dict: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the shardings restore should produce."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state_dict, shardings)


@dataclasses.dataclass(frozen=True)
class ParamsRestorePlan:
  """Which model parameters a params-only restore reads, and from where.

  Attributes:
    state_dir: the checkpoint step's state item directory.
    step: the checkpoint's step.
    sources: model parameter path -> checkpoint parameter path, for every
      parameter read from the checkpoint.
    fresh: model parameter paths that keep their fresh init.
    warnings: one line per parameter kept fresh for a shape mismatch.
  """

  state_dir: str
  step: int
  sources: Mapping[str, str]
  fresh: tuple[str, ...]
  warnings: tuple[str, ...]


def checkpoint_param_path(path: str, assignment_map: Sequence[tuple[str, str | None]]
                          ) -> str | None:
  """The checkpoint parameter a model parameter is read from; None keeps it fresh.

  The first regex of `assignment_map` that matches all of `path` decides;
  a path none matches maps to itself.
  """
  for pattern, replacement in assignment_map:
    match = re.fullmatch(pattern, path)
    if match:
      return None if replacement is None else match.expand(replacement)
  return path


def _describe(path: str, source: str) -> str:
  return path if source == path else f"{path} (read from {source})"


def plan_params_restore(config: RestoreCheckpointConfig, abstract_params: Any
                        ) -> ParamsRestorePlan:
  """Matches the model's parameters with a checkpoint's, reading metadata only.

  Args:
    config: an explicit restore with `params_only`.
    abstract_params: the model's parameter tree (arrays or ShapeDtypeStructs).

  Returns:
    The plan `load_params` carries out.

  Raises:
    CheckpointReadError: the checkpoint's metadata cannot be read.
    ValueError: no checkpoint at `config.path`; or, naming up to five
      parameters, a shape mismatch (when `strict`) or a parameter missing from
      the checkpoint (unless `fallback_to_scratch`).
  """
  opened = open_checkpoint(config.path, config.mode)
  directory, step = opened.directory, opened.step
  step_dir = paths.join(directory, str(step))
  state_dir = paths.join(step_dir, _ITEM)
  try:
    recorded = _saved_shapes(step_dir)
  except CheckpointReadError as e:
    raise _naming_other_steps(e, directory) from e
  saved = {path.removeprefix("params/"): shape for path, shape in recorded.items()
           if path.startswith("params/")}
  sources, fresh, warnings, problems = {}, [], [], []
  for path, shape in sorted(_shapes_by_path(abstract_params).items()):
    source = checkpoint_param_path(path, config.assignment_map)
    if source is None:
      fresh.append(path)
    elif source not in saved:
      fresh.append(path)
      if not config.fallback_to_scratch:
        problems.append(f"{_describe(path, source)} is missing from the checkpoint")
    elif saved[source] != shape:
      fresh.append(path)
      line = (f"{_describe(path, source)} is {saved[source]} in the checkpoint but {shape} "
              "in the model")
      (problems if config.strict else warnings).append(line)
    else:
      sources[path] = source
  if problems:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise UserError(
        f"Checkpoint {step_dir} does not fit this model's parameters: "
        + "; ".join(problems[:5]) + more + ". Map names with assignment_map, or set "
        "strict=False (shape mismatches) / fallback_to_scratch=True (missing parameters) "
        "to keep their fresh init.")
  warnings = tuple(f"Keeping the fresh init of {w}." for w in warnings)
  return ParamsRestorePlan(state_dir, step, sources, tuple(fresh), warnings)


def _nested(names: Sequence[str], leaf: Any) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path in names:
    *parents, name = path.split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = leaf
  return tree


def _read_host_params(state_dir: str, names: Sequence[str]) -> dict[str, np.ndarray]:
  """Reads only the named checkpoint parameters, as numpy arrays on the host."""
  if not names:
    return {}
  item = {"params": _nested(names, 0)}
  restore_args = {"params": _nested(names, ocp.RestoreArgs(restore_type=np.ndarray))}
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    with _reads_finished():
      restored = checkpointer.restore(
          state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                 partial_restore=True))
  except _UNREADABLE as e:
    step_dir = paths.parent(state_dir)
    unreadable = CheckpointReadError(f"Checkpoint {step_dir} is unreadable: {_read_reason(e)}")
    raise _naming_other_steps(unreadable, paths.parent(step_dir)) from e
  finally:
    checkpointer.close()
  return tree_paths.leaves_by_name(restored["params"])


def load_params(plan: ParamsRestorePlan, params: Any) -> Any:
  """Replaces the planned parameters of a freshly initialised tree.

  Each array read is cast to the parameter's dtype and placed with its
  sharding; the rest of `params` is returned as it is.

  Args:
    plan: from `plan_params_restore`.
    params: the fresh parameter tree of jax.Arrays.

  Returns:
    A tree like `params`.

  Raises:
    CheckpointReadError: the planned arrays cannot be read.
  """
  host = _read_host_params(plan.state_dir, sorted(set(plan.sources.values())))
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)

  def place(path: Any, fresh: jax.Array) -> jax.Array:
    source = plan.sources.get(tree_paths.path_name(path))
    if source is None:
      return fresh
    value = np.asarray(host[source]).astype(fresh.dtype)
    # Every process holds the whole host copy and hands over its own shards.
    return jax.make_array_from_callback(value.shape, fresh.sharding, lambda index: value[index])

  return jax.tree_util.tree_unflatten(treedef, [place(p, leaf) for p, leaf in flat])
