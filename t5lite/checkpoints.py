"""Orbax checkpoints under MODEL_DIR/checkpoints/<step>/.

Saves are asynchronous: the train loop hands the arrays to Orbax and goes on
while they are written; `wait_until_finished` blocks only at exit. Orbax
writes each step to a temporary directory and renames it when complete, so a
crash never leaves a step that looks finished.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINTS_SUBDIR = "checkpoints"
_ITEM = "state"


@dataclasses.dataclass(frozen=True)
class SaveCheckpointConfig:
  """When to save and what to keep.

  Attributes:
    period: save every this many steps (and always at the last step).
    keep: keep only the newest this many checkpoints; None keeps all.
  """

  period: int = 1000
  keep: int | None = None


@dataclasses.dataclass(frozen=True)
class RestoreCheckpointConfig:
  """Where to restore from when MODEL_DIR has no checkpoint yet.

  Attributes:
    path: a checkpoints directory (mode 'latest') or one step directory such
      as `.../checkpoints/1000` (mode 'specific').
    mode: 'latest' or 'specific'.
  """

  path: str | None = None
  mode: str = "latest"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  save: SaveCheckpointConfig | None = None
  restore: RestoreCheckpointConfig | None = None


def validate_config(config: CheckpointConfig) -> None:
  """Cheap checks before anything is compiled or written.

  Raises:
    ValueError: a non-positive period or keep, or an unknown restore mode.
  """
  if config.save is not None:
    if config.save.period <= 0:
      raise ValueError(f"Checkpoint period {config.save.period} must be positive.")
    if config.save.keep is not None and config.save.keep <= 0:
      raise ValueError(f"Checkpoint keep={config.save.keep} must be positive or None.")
  if config.restore is not None and config.restore.mode not in ("latest", "specific"):
    raise ValueError(
        f"Unknown restore mode '{config.restore.mode}'; use 'latest' or 'specific'.")


def _manager(directory: str, keep: int | None = None, read_only: bool = False
             ) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not read_only, read_only=read_only,
      enable_async_checkpointing=not read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=(_ITEM,))


def _restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> Any:
  args = ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(abstract_state)})
  return manager.restore(step, args=args)[_ITEM]


class Checkpointer:
  """Saves and restores the train state of one model_dir.

  Args:
    model_dir: the run's directory; checkpoints go to `model_dir/checkpoints`.
    save_config: None disables saving (restore still works).
  """

  def __init__(self, model_dir: str, save_config: SaveCheckpointConfig | None):
    # Orbax's array store needs absolute paths; users pass relative ones.
    self.directory = os.path.join(os.path.abspath(model_dir), CHECKPOINTS_SUBDIR)
    self._save_config = save_config
    keep = save_config.keep if save_config else None
    self._manager = _manager(self.directory, keep=keep)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state_dict: Any) -> bool:
    """Starts an asynchronous save of `state_dict` at `step`.

    Returns:
      False when a checkpoint for `step` already exists (nothing is written).
    """
    if step in self._manager.all_steps():
      return False
    args = ocp.args.Composite(**{_ITEM: ocp.args.StandardSave(state_dict)})
    return bool(self._manager.save(step, args=args, force=True))

  def restore(self, step: int, abstract_state: Any) -> Any:
    """Restores `step` into the shapes, dtypes and shardings of `abstract_state`."""
    return _restore(self._manager, step, abstract_state)

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def resolve_restore_path(config: RestoreCheckpointConfig) -> tuple[str, int]:
  """Finds (checkpoints directory, step) for an explicit restore path.

  Raises:
    ValueError: the path holds no checkpoint.
  """
  path = os.path.abspath(config.path)
  if config.mode == "specific":
    root, name = os.path.split(path.rstrip("/"))
    if not name.isdigit() or not os.path.isdir(path):
      raise ValueError(
          f"Restore path '{config.path}' is not a checkpoint step directory "
          "like '<model_dir>/checkpoints/1000'.")
    return root, int(name)
  if os.path.isdir(os.path.join(path, CHECKPOINTS_SUBDIR)):
    path = os.path.join(path, CHECKPOINTS_SUBDIR)
  step = _manager(path, read_only=True).latest_step() if os.path.isdir(path) else None
  if step is None:
    raise ValueError(f"No checkpoint found under restore path '{config.path}'.")
  return path, step


def restore_from_path(config: RestoreCheckpointConfig, abstract_state: Any) -> tuple[Any, int]:
  """Restores the state named by an explicit restore config.

  Returns:
    (state_dict, step).
  """
  directory, step = resolve_restore_path(config)
  manager = _manager(directory, read_only=True)
  try:
    return _restore(manager, step, abstract_state), step
  finally:
    manager.close()


def abstract_with_shardings(state_dict: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the shardings restore should produce."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state_dict, shardings)
