"""T5X checkpoints: both on-disk formats, mapped to t5lite's parameter names.

T5X writes a step directory `checkpoint_<step>/` in one of two formats:

- Orbax (current T5X): `state/` holds every array of `TrainState.state_dict()`
  in zarr under an OCDBT key-value store (or one zarr directory per array in
  older Orbax), named by the dotted tree path (`target.encoder.layers_0...`).
- Legacy (the public T5X checkpoints): a msgpack file `checkpoint` whose
  leaves are either small arrays inlined in the file or tensorstore specs of
  zarr directories beside it.

Both are opened with tensorstore, one array at a time and one region at a
time (see `lazy`), so a process reads only the shards its devices hold.

Names. T5X's `t5x/examples/t5` and `decoder_only` networks use the same
names as t5lite, so the mapping only (a) drops the `target/` prefix and the
optimizer slots (`state/param_states/...`, `state/step`), (b) moves the
decoder-only embedding `decoder/token_embedder` to t5lite's top-level
`token_embedder`, and (c) splits 2-D attention kernels `[embed,
heads*head_dim]` into t5lite's `[embed, heads, head_dim]` (`out` the other
way round), taking `heads` from the relative-position table. Layers
stacked on one axis (`encoder/layers/...`, T5X's scalable_t5 with
`param_scan_axis`, 1 by default) are unstacked into `layers_{i}`, and
scalable_t5's table in every layer (`relative_posemb`) becomes the layer's
`relpos_bias` of a t5lite model with `relpos_per_layer=True`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import numpy as np
import tensorstore as ts
from flax import serialization

from t5lite import paths
from t5lite.errors import UserError
from t5lite.interop import gin_file, lazy


_ATTENTIONS = ("attention", "self_attention", "encoder_decoder_attention")
_STEP_DIR = re.compile(r"checkpoint_(\d+)$")


class T5xCheckpoint:
  """One T5X step directory, opened for reading.

  Attributes:
    path: the `checkpoint_<step>` directory.
    step: the training step it holds.
    format: 'orbax' or 'legacy'.
    arrays: T5X name (`target/encoder/...`, '/'-joined) -> LazyArray, for
      the parameters only (optimizer slots are not opened).
  """

  def __init__(self, path: str):
    self.path = find_step_dir(path)
    self.step = int(_STEP_DIR.search(self.path).group(1))
    if paths.Path(paths.join(self.path, "checkpoint")).is_file():
      self.format = "legacy"
      self.arrays = _legacy_arrays(self.path, "target")
    elif paths.Path(paths.join(self.path, "state")).is_dir():
      self.format = "orbax"
      self.arrays = _orbax_arrays(paths.join(self.path, "state"), "target")
    else:
      raise UserError(f"{self.path} is neither T5X format: it has no 'checkpoint' msgpack "
                      "file and no Orbax 'state/' directory.")
    if not self.arrays:
      raise UserError(f"{self.path} holds no model parameters (nothing under 'target').")

  def optimizer_arrays(self) -> dict[str, lazy.LazyArray]:
    """The optimizer's arrays: `state/step` and `state/param_states/<param>/<slot>`."""
    if self.format == "legacy":
      return _legacy_arrays(self.path, "state")
    return _orbax_arrays(paths.join(self.path, "state"), "state")


def is_t5x(path: str) -> bool:
  """Whether `path` is a T5X step directory or a directory of them."""
  try:
    find_step_dir(path)
    return True
  except ValueError:
    return False


def step_of(path: str) -> int:
  """The step of the T5X step directory `path` names (see `find_step_dir`)."""
  return int(_STEP_DIR.search(find_step_dir(path)).group(1))


def find_step_dir(path: str) -> str:
  """The `checkpoint_<step>` directory named by `path` (the newest one under it).

  Raises:
    ValueError: `path` is neither a T5X step directory nor holds one.
  """
  path = paths.absolute(path.rstrip("/"))
  directory = paths.Path(path)
  if _STEP_DIR.search(path) and directory.is_dir():
    return path
  steps = []
  if directory.is_dir():
    steps = [(int(m.group(1)), child.name) for child in directory.iterdir()
             if (m := _STEP_DIR.fullmatch(child.name)) and child.is_dir()]
  if not steps:
    raise UserError(f"{path} is not a T5X checkpoint: no checkpoint_<step> directory there.")
  return paths.join(path, max(steps)[1])


def _open_zarr(spec: dict[str, Any], origin: str) -> lazy.LazyArray:
  try:
    store = ts.open(spec, open=True, read=True).result()
  except Exception as e:  # tensorstore raises ValueError or its own errors.
    raise UserError(f"{origin} cannot be read: {str(e).splitlines()[0]}") from None
  return lazy.LazyArray(tuple(store.shape), np.dtype(store.dtype.numpy_dtype),
                        lambda index: store[index].read().result(), origin)


def _orbax_arrays(state_dir: str, root: str) -> dict[str, lazy.LazyArray]:
  """The arrays of an Orbax `state/` item under `root` ('target' for the
  parameters, 'state' for the optimizer's), named by their tree paths."""
  metadata_file = paths.Path(paths.join(state_dir, "_METADATA"))
  if not metadata_file.is_file():
    raise UserError(f"{state_dir} has no _METADATA file: an incomplete Orbax checkpoint.")
  tree = json.loads(metadata_file.read_text()).get("tree_metadata", {})
  ocdbt = paths.Path(paths.join(state_dir, "manifest.ocdbt")).exists()
  arrays = {}
  for key in tree:
    names = [str(k) for k in ast.literal_eval(key)]
    if names[0] != root:
      continue
    dotted = ".".join(names)
    if ocdbt:
      kvstore = {"driver": "ocdbt", "base": paths.kvstore(state_dir), "path": dotted + "/"}
    else:
      kvstore = paths.kvstore(paths.join(state_dir, dotted))
    arrays["/".join(names)] = _open_zarr({"driver": "zarr", "kvstore": kvstore},
                                         f"{state_dir} array {dotted}")
  return arrays


def _legacy_arrays(step_dir: str, root: str) -> dict[str, lazy.LazyArray]:
  """The arrays of a legacy msgpack + tensorstore checkpoint under
  `optimizer/<root>` ('target' or 'state'), named `<root>/...`."""
  file = paths.join(step_dir, "checkpoint")
  with paths.Path(file).open("rb") as f:
    try:
      contents = serialization.msgpack_restore(f.read())
    except Exception as e:  # msgpack raises several unrelated types.
      raise UserError(f"{file} is not a readable T5X msgpack checkpoint ({e}).") from None
  target = contents.get("optimizer", {}).get(root) if isinstance(contents, dict) else None
  if not isinstance(target, dict):
    raise UserError(f"{file} has no optimizer/{root} tree: not a T5X checkpoint.")
  arrays = {}

  def visit(node: Any, names: list[str]) -> None:
    if isinstance(node, dict) and "driver" not in node:
      for key, child in node.items():
        visit(child, names + [str(key)])
      return
    name = "/".join([root] + names)
    if isinstance(node, dict):
      spec = dict(node)
      relative = spec["kvstore"]["path"]
      spec["kvstore"] = paths.kvstore(paths.join(step_dir, relative))
      arrays[name] = _open_zarr(spec, paths.join(step_dir, relative.rstrip("/")))
    else:
      arrays[name] = lazy.from_numpy(np.asarray(node), f"{file} array {'.'.join(names)}")

  visit(target, [])
  return arrays


def _heads_by_stack(params: dict[str, lazy.LazyArray]) -> dict[str, int]:
  """Heads per stack, from the relative-position tables `[heads, buckets]`."""
  heads = {}
  for name, array in params.items():
    match = re.fullmatch(r"(encoder|decoder)/(?:.*/)?(?:relpos_bias|relative_posemb)/"
                         r"rel_embedding", name)
    if match:
      heads[match.group(1)] = array.shape[0]
  return heads


def _unstack_layers(params: dict[str, lazy.LazyArray], axis: int
                    ) -> dict[str, lazy.LazyArray]:
  """`stack/layers/<sub>` stacked on `axis` -> `stack/layers_{i}/<sub>`."""
  out = {}
  for name, array in params.items():
    match = re.fullmatch(r"(encoder|decoder)/layers/(.*)", name)
    if not match:
      out[name] = array
      continue
    for i in range(array.shape[axis]):
      out[f"{match.group(1)}/layers_{i}/{match.group(2)}"] = lazy.take(array, axis, i)
  return out


def to_t5lite(checkpoint: T5xCheckpoint, layers_axis: int = 1) -> dict[str, lazy.LazyArray]:
  """The checkpoint's parameters under t5lite's unscanned names and shapes.

  Args:
    checkpoint: an opened T5X step directory.
    layers_axis: the axis stacked layers are stacked on (T5X's
      `param_scan_axis`); only read for checkpoints with `layers/` subtrees.

  Returns:
    t5lite parameter path (as in an unscanned t5lite model) -> LazyArray.

  Raises:
    ValueError: an attention kernel whose heads cannot be found.
  """
  return t5lite_names({name[len("target/"):]: array for name, array in checkpoint.arrays.items()},
                      layers_axis)


def t5lite_names(params: dict[str, lazy.LazyArray], layers_axis: int = 1
                 ) -> dict[str, lazy.LazyArray]:
  """`to_t5lite` on arrays named and shaped like T5X's parameters (without
  the `target/` prefix): also what maps a parameter-shaped optimizer slot."""
  params = _unstack_layers(params, layers_axis)
  # scalable_t5 keeps a table in every layer (t5lite: relpos_per_layer=True).
  params = {name.replace("/relative_posemb/", "/relpos_bias/"): array
            for name, array in params.items()}
  if "decoder/token_embedder/embedding" in params:
    params["token_embedder/embedding"] = params.pop("decoder/token_embedder/embedding")
  heads = _heads_by_stack(params)
  out = {}
  for name, array in params.items():
    parts = name.split("/")
    if len(array.shape) == 2 and len(parts) >= 3 and parts[-3] in _ATTENTIONS:
      stack = parts[0]
      if stack not in heads:
        raise UserError(f"{array.origin}: no relative-position table in {stack} to tell "
                        "its number of heads.")
      h = heads[stack]
      if parts[-2] == "out":
        array = lazy.split_axis(array, 0, (h, array.shape[0] // h))
      else:
        array = lazy.split_axis(array, 1, (h, array.shape[1] // h))
    out[name] = array
  return out


def operative_config(step_dir: str) -> tuple[str | None, str]:
  """T5X's config.gin of the run, from the model_dir above the step directory.

  Returns:
    (its path, its text), or (None, '') when there is none.
  """
  parent = paths.parent(step_dir)
  # The model_dir, or one level up for step directories kept in a subfolder.
  for folder in (parent, paths.parent(parent)):
    path = paths.join(folder, "config.gin")
    if paths.Path(path).is_file():
      return path, paths.Path(path).read_text()
  return None, ""


def _vocabulary(config: str) -> tuple[str, str | None]:
  """The vocabulary the run's config.gin names, as ('byte' | 'sentencepiece' | 'unknown', path)."""
  macro = re.search(r"^VOCABULARY\s*=\s*@([\w.]+)\(\)", config, re.MULTILINE)
  name = macro.group(1) if macro else ""
  if name.endswith("ByteVocabulary"):
    return "byte", None
  model_file = re.search(r"sentencepiece_model_file\s*=\s*\\?\s*'([^']+)'", config)
  if name.endswith("SentencePieceVocabulary") and model_file:
    return "sentencepiece", model_file.group(1)
  return "unknown", None


def model_fields(checkpoint: T5xCheckpoint) -> tuple[str, dict[str, Any], tuple[str, str | None]]:
  """The network, `TransformerConfig` fields and vocabulary of a T5X checkpoint.

  Sizes come from the arrays; the activations and the vocabulary from the
  run's config.gin next to the step directory when there is one (T5X writes
  it), else gated GELU for `wi_0`/`wi_1` kernels and ReLU for a single `wi`.

  Returns:
    (gin_file.ENCODER_DECODER or DECODER_ONLY, fields, vocabulary).
  """
  params = to_t5lite(checkpoint)
  _, config = operative_config(checkpoint.path)
  emb = params["token_embedder/embedding"].shape
  per_layer = "decoder/relpos_bias/rel_embedding" not in params
  relpos = params["decoder/layers_0/relpos_bias/rel_embedding" if per_layer
                  else "decoder/relpos_bias/rel_embedding"].shape
  depth = {stack: len({m.group(1) for name in params
                       if (m := re.match(rf"{stack}/layers_(\d+)/", name))})
           for stack in ("encoder", "decoder")}
  mlp = "decoder/layers_0/mlp/"
  gated = f"{mlp}wi_0/kernel" in params
  activations = re.search(r"mlp_activations\s*=\s*\(([^)]*)\)", config)
  fields = {
      "vocab_size": emb[0], "emb_dim": emb[1], "num_heads": relpos[0],
      "num_encoder_layers": depth["encoder"], "num_decoder_layers": depth["decoder"],
      "head_dim": params["decoder/layers_0/self_attention/query/kernel"].shape[2],
      "mlp_dim": params[f"{mlp}{'wi_0' if gated else 'wi'}/kernel"].shape[1],
      "mlp_activations": (tuple(ast.literal_eval(f"({activations.group(1)})")) if activations
                          else (("gelu", "linear") if gated else ("relu",))),
      "logits_via_embedding": "decoder/logits_dense/kernel" not in params,
      "relative_attention_num_buckets": relpos[1],
      "relative_attention_max_distance": 128,
  }
  if per_layer:
    fields["relpos_per_layer"] = True
  network = gin_file.ENCODER_DECODER if depth["encoder"] else gin_file.DECODER_ONLY
  return network, fields, _vocabulary(config)


# ---------------------------------------------------------------------------
# Adafactor state


def t5x_layout(checkpoint: T5xCheckpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
  """t5lite unscanned parameter name -> (T5X parameter path, T5X shape)."""
  tagged = {name[len("target/"):]: lazy.LazyArray(array.shape, array.dtype, array.reader,
                                                   name[len("target/"):])
            for name, array in checkpoint.arrays.items()}
  shapes = {name[len("target/"):]: tuple(array.shape)
            for name, array in checkpoint.arrays.items()}
  return {name: (array.origin, shapes[array.origin])
          for name, array in t5lite_names(tagged).items()}


def _groups(shape: tuple[int, ...], t5x_shape: tuple[int, ...]) -> list[tuple[int, ...]] | None:
  """t5lite dimensions grouped into T5X's (consecutive products), or None."""
  groups, d = [], 0
  for size in t5x_shape:
    group, product = [], 1
    while d < len(shape) and (product < size or not group):
      group.append(d)
      product *= shape[d]
      d += 1
    if product != size:
      return None
    groups.append(tuple(group))
  return groups if d == len(shape) else None


def _reduced_dims(param: tuple[int, ...], statistic: tuple[int, ...]) -> set[int]:
  return {d for d, (n, m) in enumerate(zip(param, statistic)) if m == 1 and n != 1}


def _factored_slots(name: str, shapes: dict[str, tuple[int, ...]], t5x_shape: tuple[int, ...],
                    t5x_row: lazy.LazyArray, t5x_col: lazy.LazyArray
                    ) -> tuple[lazy.LazyArray, lazy.LazyArray]:
  """T5X's v_row, v_col as t5lite's, matched by meaning: T5X factored its
  matrix by size (rows: the smaller dimension, the first on a tie)."""
  param = shapes["param"]
  groups = _groups(param, t5x_shape)
  if len(t5x_shape) != 2 or groups is None:
    raise UserError(f"{name}: T5X's factored statistics of a {t5x_shape} parameter cannot be "
                    "placed")
  order = np.argsort(t5x_shape)
  t5x_rows, t5x_cols = int(order[-2]), int(order[-1])
  if t5x_row.shape != (t5x_shape[t5x_rows],) or t5x_col.shape != (t5x_shape[t5x_cols],):
    raise UserError(f"{name}: T5X's v_row {t5x_row.shape} / v_col {t5x_col.shape} are not its "
                    f"size rule's for {t5x_shape}")
  ours_rows = _reduced_dims(param, shapes["v_col"])  # v_col reduces the rows
  ours_cols = _reduced_dims(param, shapes["v_row"])
  as_t5x = lambda dims: {i for i, g in enumerate(groups) if set(g) & dims}  # noqa: E731
  if (as_t5x(ours_rows), as_t5x(ours_cols)) == ({t5x_rows}, {t5x_cols}):
    pair = t5x_row, t5x_col
  elif (as_t5x(ours_rows), as_t5x(ours_cols)) == ({t5x_cols}, {t5x_rows}):
    # The estimate is symmetric in rows and columns; only the names differ.
    pair = t5x_col, t5x_row
  else:
    raise UserError(f"{name}: T5X factored it over other dimensions than the configured "
                    "Adafactor does")
  return lazy.reshape(pair[0], shapes["v_row"]), lazy.reshape(pair[1], shapes["v_col"])


def adafactor_slots(checkpoint: T5xCheckpoint, name: str, shapes: dict[str, tuple[int, ...]],
                    layout: dict[str, tuple[str, tuple[int, ...]]],
                    slots: dict[str, lazy.LazyArray]) -> dict[str, lazy.LazyArray | None]:
  """One parameter's T5X Adafactor slots in t5lite's layout.

  Args:
    checkpoint: the T5X checkpoint (for messages).
    name: t5lite's unscanned parameter name.
    shapes: t5lite's shapes of 'param', 'v_row', 'v_col', 'v', 'm' (the
      statistics keep every dimension, reduced ones with size 1).
    layout: from `t5x_layout`.
    slots: `T5xCheckpoint.optimizer_arrays()`.

  Returns:
    field -> LazyArray of t5lite's shape, or None where t5lite keeps a
    placeholder.

  Raises:
    ValueError: the slots do not fit (another factoring, momentum on one
      side only, a parameter T5X does not have).
  """
  if name not in layout:
    raise UserError(f"{name}: not in {checkpoint.path}")
  t5x_name, t5x_shape = layout[name]
  found = {field: slots.get(f"state/param_states/{t5x_name}/{field}")
           for field in ("v_row", "v_col", "v", "m")}
  if any(array is None for array in found.values()):
    raise UserError(f"{name}: {checkpoint.path} has no Adafactor slots (v_row, v_col, v, m) "
                    f"for {t5x_name}")
  size = int(np.prod(t5x_shape))
  t5x_factored = found["v"].size == 1 and size > 1
  ours_factored = int(np.prod(shapes["v"])) == 1 and size > 1
  if t5x_factored != ours_factored:
    kind = lambda factored: "factored" if factored else "full"  # noqa: E731
    raise UserError(f"{name}: T5X keeps a {kind(t5x_factored)} second moment, the configured "
                    f"Adafactor a {kind(ours_factored)} one")
  out = {"v_row": None, "v_col": None, "v": None, "m": None}
  if ours_factored:
    out["v_row"], out["v_col"] = _factored_slots(name, shapes, t5x_shape, found["v_row"],
                                                 found["v_col"])
  else:
    out["v"] = lazy.reshape(found["v"], shapes["v"])
  t5x_momentum = found["m"].size == size and size > 1
  ours_momentum = tuple(shapes["m"]) == tuple(shapes["param"]) and size > 1
  if t5x_momentum != ours_momentum:
    raise UserError(f"{name}: T5X's state {'has' if t5x_momentum else 'has no'} momentum (m) "
                    f"but the configured Adafactor {'has' if ours_momentum else 'has none'} "
                    "(optimizers.adafactor.beta1)")
  if ours_momentum:
    out["m"] = lazy.reshape(found["m"], shapes["m"])
  return out
