"""Foreign checkpoints: T5X (both formats) and Hugging Face folders.

This package is the only place that knows a foreign format. Each reader
turns its checkpoint into t5lite's unscanned parameter names with t5lite's
shapes, as `lazy.LazyArray`s (`t5x.to_t5lite`, `huggingface.to_t5lite`);
`load_params` then fits them to the model being built (stacking layers for
`scan_layers`, blocks for scanned MoE stacks), checks every name and shape
before reading anything, and reads each array straight into its target
sharding.

Callers ask `checkpoints.open_checkpoint(path)` what a path holds (it asks
`checkpoint_format` and `checkpoint_step` here) and, for a foreign one,
call `load_params` instead of restoring an Orbax checkpoint of t5lite's own.
A T5X run's Adafactor state continues in t5lite's Adafactor
(`load_t5x_adafactor`): its statistics are matched to t5lite's by meaning
(which dimensions are rows and columns) and refused when they do not fit.
`t5x_recipe` reads a T5X run's config.gin for `t5lite-import`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from t5lite import tree_paths
from t5lite.errors import UserError
from t5lite.interop import gin_file, hf_tokenizer, huggingface, lazy, t5x


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


T5X = "t5x"
HUGGING_FACE = "huggingface"
_MAX_PROBLEMS = 3


def checkpoint_format(path: str | None) -> str | None:
  """'t5x', 'huggingface', or None for anything else (t5lite's own, or nothing)."""
  if not path:
    return None
  if huggingface.is_huggingface(path):
    return HUGGING_FACE
  if t5x.is_t5x(path):
    return T5X
  return None


def checkpoint_step(path: str) -> int:
  """The training step a foreign checkpoint holds (T5X's step; 0 for Hugging Face)."""
  if checkpoint_format(path) == T5X:
    return t5x.step_of(path)
  return 0


@dataclasses.dataclass(frozen=True)
class Description:
  """What a foreign checkpoint holds, enough to write its model's gin file.

  Attributes:
    kind: `T5X` or `HUGGING_FACE`.
    text: what the checkpoint is, in words ("T5X ... checkpoint (step 10)").
    network: `gin_file.ENCODER_DECODER` or `DECODER_ONLY`.
    fields: the `TransformerConfig` fields of its model.
    vocabulary: ('byte' | 'sentencepiece' | 'unknown', model file or None).
  """
  kind: str
  text: str
  network: str
  fields: dict[str, Any]
  vocabulary: tuple[str, str | None]


def describe(path: str) -> Description:
  """What the foreign checkpoint at `path` holds.

  Raises:
    ValueError: not a foreign checkpoint, unreadable, or an architecture
      t5lite does not have.
  """
  kind = checkpoint_format(path)
  if kind == HUGGING_FACE:
    folder = huggingface.HuggingFaceFolder(path)
    huggingface.to_t5lite(folder)  # every array present and placed
    return Description(kind, f"Hugging Face {folder.model_type} folder",
                       gin_file.ENCODER_DECODER, huggingface.model_config(folder),
                       folder.vocabulary())
  if kind == T5X:
    checkpoint = t5x.T5xCheckpoint(path)
    network, fields, vocabulary = t5x.model_fields(checkpoint)
    return Description(kind, f"T5X {checkpoint.format} checkpoint (step {checkpoint.step})",
                       network, fields, vocabulary)
  raise UserError(f"{path} is neither a T5X checkpoint (checkpoint_<step>/) nor a Hugging "
                  "Face folder (config.json + *.safetensors).")


@dataclasses.dataclass(frozen=True)
class ModelGin:
  """The gin file `t5lite-import` writes for a foreign checkpoint.

  Attributes:
    found: what `describe` found there.
    recipe: the training recipe of a T5X checkpoint's run, None for a
      Hugging Face folder or a T5X checkpoint without its config.gin.
    text: the gin file.
  """
  found: Description
  recipe: gin_file.Recipe | None
  text: str


def model_gin(path: str) -> ModelGin:
  """The gin file of a foreign checkpoint's model (absolute `path`): what
  `describe` finds and, for a T5X checkpoint, its run's recipe.

  Raises:
    ValueError: as `describe` and `t5x_recipe.for_checkpoint` do.
  """
  from t5lite.interop import t5x_recipe
  found = describe(path)
  recipe = t5x_recipe.for_checkpoint(path, found.network) if found.kind == T5X else None
  return ModelGin(found, recipe, gin_file.model_gin(found.network, found.fields,
                                                   found.vocabulary, path, recipe))


def read_foreign(path: str) -> tuple[dict[str, lazy.LazyArray], str]:
  """Opens a foreign checkpoint.

  Returns:
    (t5lite unscanned path -> LazyArray, a one-line description of the source).

  Raises:
    ValueError: not a foreign checkpoint, or unreadable.
  """
  kind = checkpoint_format(path)
  if kind == HUGGING_FACE:
    folder = huggingface.HuggingFaceFolder(path)
    return huggingface.to_t5lite(folder), f"Hugging Face {folder.model_type} folder {path}"
  if kind == T5X:
    checkpoint = t5x.T5xCheckpoint(path)
    return (t5x.to_t5lite(checkpoint),
            f"T5X {checkpoint.format} checkpoint {checkpoint.path} (step {checkpoint.step})")
  raise UserError(f"{path} is neither a T5X checkpoint (checkpoint_<step>/) nor a Hugging "
                  "Face folder (config.json + *.safetensors).")


def _block_interval(targets: dict[str, Any], stack: str) -> int:
  """Layers per scanned block of a scanned MoE stack (`stack/layers/layers_{j}`)."""
  positions = {int(m.group(1)) for name in targets
               if (m := re.match(rf"{stack}/layers/layers_(\d+)/", name))}
  return max(positions) + 1


def _source_names(name: str, target: Any, targets: dict[str, Any]) -> list[str]:
  """The unscanned source names one target parameter is made of, in order.

  One name for an unscanned parameter; one per layer (or per block) for a
  parameter of a scanned stack, which stacks them on its leading axis.
  """
  block = re.fullmatch(r"(encoder|decoder)/layers/layers_(\d+)/(.*)", name)
  scanned = re.fullmatch(r"(encoder|decoder)/layers/(.*)", name)
  if block:
    stack, j, rest = block.group(1), int(block.group(2)), block.group(3)
    interval = _block_interval(targets, stack)
    wanted = [f"{stack}/layers_{b * interval + j}/{rest}" for b in range(target.shape[0])]
  elif scanned:
    stack, rest = scanned.groups()
    wanted = [f"{stack}/layers_{i}/{rest}" for i in range(target.shape[0])]
  else:
    wanted = [name]
  return wanted


def plan(sources: dict[str, lazy.LazyArray], abstract_params: Any, description: str
         ) -> dict[str, lazy.LazyArray]:
  """Matches every model parameter with the checkpoint, before reading any data.

  Args:
    sources: from `read_foreign`.
    abstract_params: the model's parameter tree (ShapeDtypeStructs).
    description: the source, for messages.

  Returns:
    model parameter path -> LazyArray of exactly its shape.

  Raises:
    ValueError: naming up to three problems: a parameter missing from the
      checkpoint, an array the model has no place for (another
      architecture), or a shape that differs from the gin file's.
  """
  targets = tree_paths.leaves_by_name(abstract_params)
  used, chosen, missing, shapes = set(), {}, [], []
  for name, target in targets.items():
    wanted = [name] if name in sources else _source_names(name, target, targets)
    used.update(wanted)
    absent = [w for w in wanted if w not in sources]
    if absent:
      missing.append(absent[0])
      continue
    found = sources[name] if wanted == [name] else lazy.stack([sources[w] for w in wanted])
    if tuple(found.shape) != tuple(target.shape):
      shapes.append(f"{found.origin} is {tuple(found.shape)} as t5lite's {name}, but the "
                    f"model (gin file) has {tuple(target.shape)}")
    chosen[name] = found
  extra = [sources[name].origin for name in sorted(set(sources) - used)]
  problems = [f"{len(missing)} model parameter(s) missing from it (first: {missing[0]})"
              ] if missing else []
  if extra:
    problems.append(f"{len(extra)} of its array(s) have no place in the model (first: "
                    f"{extra[0]})")
  problems += shapes[:_MAX_PROBLEMS]
  if len(shapes) > _MAX_PROBLEMS:
    problems.append(f"{len(shapes) - _MAX_PROBLEMS} more shape mismatch(es)")
  if problems:
    raise UserError(f"{description} does not match the model: " + "; ".join(problems)
                    + ". Use the gin file `t5lite-import` writes for this checkpoint.")
  return chosen


def check_fits(path: str, abstract_params: Any) -> None:
  """Raises the ValueError of `plan` if the checkpoint does not fit; reads no data."""
  sources, description = read_foreign(path)
  plan(sources, abstract_params, description)


def load_params(path: str, abstract_params: Any) -> Any:
  """Reads a foreign checkpoint's parameters into the model's sharded tree.

  Args:
    path: a T5X checkpoint or a Hugging Face folder.
    abstract_params: the model's parameter tree of ShapeDtypeStructs with
      their target shardings.

  Returns:
    A tree like `abstract_params` of jax.Arrays, each read region by region
    into its sharding (a process reads only what its devices hold).

  Raises:
    ValueError: see `read_foreign` and `plan`; nothing is read before every
      parameter has been matched.
  """
  sources, description = read_foreign(path)
  chosen = plan(sources, abstract_params, description)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
  leaves = []
  for key_path, target in flat:
    leaves.append(lazy.materialize(chosen[tree_paths.path_name(key_path)], target))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _plan_t5x_adafactor(path: str, abstract_params: Any, abstract_slots: Any
                        ) -> tuple[lazy.LazyArray, dict[str, dict[str, lazy.LazyArray | None]]]:
  """(T5X's step, field -> t5lite parameter name -> slot or None), checked
  against the configured Adafactor's slots before any data is read."""
  if checkpoint_format(path) != T5X:
    raise UserError(f"{path} holds no optimizer state t5lite can continue (only T5X "
                    "checkpoints do): fine-tune from its parameters "
                    "(RestoreCheckpointConfig.params_only = True).")
  checkpoint = t5x.T5xCheckpoint(path)
  if any(re.match(r"target/(encoder|decoder)/layers/", name) for name in checkpoint.arrays):
    raise UserError(f"{checkpoint.path} stacks its layers (scan): t5lite continues only the "
                    "optimizer state of unstacked T5X checkpoints; fine-tune from its "
                    "parameters (RestoreCheckpointConfig.params_only = True).")
  layout = t5x.t5x_layout(checkpoint)
  slots = checkpoint.optimizer_arrays()
  if "state/step" not in slots:
    raise UserError(f"{checkpoint.path} has no optimizer step (state/step).")
  targets = tree_paths.leaves_by_name(abstract_params)
  fields = {f: tree_paths.leaves_by_name(getattr(abstract_slots, f))
            for f in ("v_row", "v_col", "v", "m")}
  chosen: dict[str, dict[str, lazy.LazyArray | None]] = {f: {} for f in fields}
  problems = []
  for name, target in targets.items():
    sources = _source_names(name, target, targets)
    stacked = sources != [name]
    per_layer = []
    for source in sources:
      shapes = {"param": tuple(target.shape[1:] if stacked else target.shape)}
      for f, leaves in fields.items():
        shape = tuple(leaves[name].shape)
        shapes[f] = shape[1:] if stacked and len(shape) == len(target.shape) else shape
      try:
        per_layer.append(t5x.adafactor_slots(checkpoint, source, shapes, layout, slots))
      except ValueError as e:
        problems.append(str(e))
        break
    if len(per_layer) != len(sources):
      continue
    for f in fields:
      parts = [layer[f] for layer in per_layer]
      chosen[f][name] = (None if parts[0] is None else
                         lazy.stack(parts) if stacked else parts[0])
  if problems:
    more = f"; and {len(problems) - _MAX_PROBLEMS} more" if len(problems) > _MAX_PROBLEMS else ""
    raise UserError(f"The Adafactor state of {checkpoint.path} does not fit the configured "
                    f"optimizer: {'; '.join(problems[:_MAX_PROBLEMS])}{more}. Configure "
                    "optimizers.adafactor as the T5X run did (t5lite-import writes it), or "
                    "fine-tune from its parameters (RestoreCheckpointConfig.params_only = "
                    "True).")
  return slots["state/step"], chosen


def check_t5x_adafactor_fits(path: str, abstract_params: Any, abstract_slots: Any) -> None:
  """Raises the ValueError of `load_t5x_adafactor` if the T5X optimizer state
  does not fit the configured Adafactor; reads no data but the step."""
  _plan_t5x_adafactor(path, abstract_params, abstract_slots)


def load_t5x_adafactor(path: str, abstract_params: Any, fresh_slots: Any) -> tuple[int, Any]:
  """A T5X checkpoint's Adafactor state (step and slots) in t5lite's layout.

  Args:
    path: a T5X checkpoint (unstacked layers).
    abstract_params: the model's parameter tree of ShapeDtypeStructs.
    fresh_slots: the configured Adafactor's freshly initialised state
      (`adafactor.AdafactorState` of sharded arrays); its placeholders are
      kept, every statistic is read into its sharding.

  Returns:
    (T5X's step, `fresh_slots` with T5X's statistics and momentum; its
    `count` is left for the caller to set).

  Raises:
    ValueError: not a T5X checkpoint, stacked layers, or slots that do not
      fit (another factoring, momentum on one side only).
  """
  step, chosen = _plan_t5x_adafactor(path, abstract_params, fresh_slots)
  loaded = {}
  for f, by_name in chosen.items():
    flat, treedef = jax.tree_util.tree_flatten_with_path(getattr(fresh_slots, f))
    leaves = []
    for key_path, fresh in flat:
      source = by_name[tree_paths.path_name(key_path)]
      leaves.append(fresh if source is None else lazy.materialize(
          source, jax.ShapeDtypeStruct(fresh.shape, fresh.dtype, sharding=fresh.sharding)))
    loaded[f] = jax.tree_util.tree_unflatten(treedef, leaves)
  return int(step.read()), fresh_slots._replace(**loaded)


def export_fields(model: BaseModel) -> dict[str, Any]:
  """The `TransformerConfig` fields of a model that has a Hugging Face counterpart.

  Raises:
    ValueError: not a t5lite encoder-decoder, or a variant Hugging Face's
      T5 / Switch Transformers code does not have.
  """
  from t5lite.models import transformer  # the models are interop's only target
  module = model.module
  if not isinstance(module, transformer.EncoderDecoder):
    raise UserError(f"Only encoder-decoder models have a Hugging Face counterpart; this "
                    f"model's network is {type(module).__name__}.")
  fields = dataclasses.asdict(module.config)
  huggingface.hf_config(fields)
  return fields


def _unscan(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Unstacks scanned layers (`layers/...`, `layers/layers_{j}/...`) into `layers_{i}`."""
  blocks: dict[str, int] = {}
  for name in params:
    if m := re.match(r"(encoder|decoder)/layers/layers_(\d+)/", name):
      blocks[m.group(1)] = max(blocks.get(m.group(1), 0), int(m.group(2)) + 1)
  out = {}
  for name, value in params.items():
    block = re.fullmatch(r"(encoder|decoder)/layers/layers_(\d+)/(.*)", name)
    scanned = re.fullmatch(r"(encoder|decoder)/layers/(.*)", name)
    if block:
      stack, j, rest = block.group(1), int(block.group(2)), block.group(3)
      for b, layer in enumerate(value):
        out[f"{stack}/layers_{b * blocks[stack] + j}/{rest}"] = layer
    elif scanned:
      for i, layer in enumerate(value):
        out[f"{scanned.group(1)}/layers_{i}/{scanned.group(2)}"] = layer
    else:
      out[name] = value
  return out


def check_export_target(output_dir: str, source: str, overwrite: bool = False) -> None:
  """Raises the ValueError of `export_huggingface` for a folder it may not
  write; see `huggingface.check_export_target`."""
  huggingface.check_export_target(output_dir, source, overwrite)


def export_huggingface(params: Any, fields: dict[str, Any], output_dir: str,
                       vocabulary: Any, write: bool = True, *, source: str, step: int = 0,
                       overwrite: bool = False) -> list[str]:
  """Writes a t5lite encoder-decoder's parameters as a Hugging Face folder.

  Args:
    params: the model's parameter tree (jax or numpy arrays; every process
      must call this in a multi-process job, which gathers them).
    fields: from `export_fields`.
    output_dir: the folder to write: new, empty, or a previous export of
      `source` (`huggingface.check_export_target`); written whole or not at
      all.
    vocabulary: the model's input vocabulary: the folder gets its tokenizer
      files (`hf_tokenizer.files`; a SentencePiece model is also copied as
      `spiece.model`) and its special ids.
    write: whether this process writes (in a multi-process job, only one
      should; all of them gather).
    source: the checkpoint the parameters come from, recorded in the
      folder's `huggingface.MARKER`.
    step: its training step, recorded with it.
    overwrite: replace whatever folder `output_dir` is.

  Returns:
    The files written (none when `write` is False).

  Raises:
    ValueError: the folder holds something else than a previous export of
      `source` and `overwrite` is False; nothing is written then.
  """
  from jax.experimental import multihost_utils
  host = {name: np.asarray(multihost_utils.process_allgather(value, tiled=True))
          for name, value in tree_paths.leaves_by_name(params).items()}
  if not write:
    return []
  return huggingface.export(_unscan(host), fields, output_dir,
                            hf_tokenizer.describe(vocabulary), source=source, step=step,
                            overwrite=overwrite)
