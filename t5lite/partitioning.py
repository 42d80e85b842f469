"""Partitioner: the device mesh, logical-axis rules and this host's data layout.

Models name every parameter and key activation dimension with a logical axis
(see `axis_names`). The rules here map those names to mesh axes, so data,
FSDP, tensor and expert parallelism are all rule choices over one mesh with
the axes `data`, `fsdp`, `expert`, `seq`, `model` (any of them may be 1).
This module knows nothing about a particular model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from t5lite import axis_names as ax
from t5lite import tree_paths
from t5lite.errors import UserError


MESH_AXES = ("data", "fsdp", "expert", "seq", "model")
# The batch dimension is split over every mesh axis that does not split
# parameters within a layer, so each device sees a distinct slice of data.
BATCH_MESH_AXES = ("data", "fsdp", "expert")

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]
MeshRules = Sequence[tuple[str, Mapping[str, int]]]


def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: LogicalRules | None = None,
    override_rules: LogicalRules | None = None,
) -> list[tuple[str, str | tuple[str, ...] | None]]:
  """T5X-style rules: batch over data, wide dimensions over `model`.

  Rules are read in order and, for each dimension of an array, the first rule
  whose mesh axes are still free wins. As in T5X, `additional_rules` are
  appended after the standard ones, so a T5X gin file ported unchanged means
  the same: they name logical axes the standard rules do not (e.g. a custom
  layer's) or serve as fallbacks, and never replace a standard rule. To
  replace one, use `override_rules` (t5lite only), which go first and win.

  Args:
    activation_partitioning_dims: 1 or 2; 2 also splits activations' embed
      dimension over `model`.
    parameter_partitioning_dims: 1 or 2; 2 also splits parameters' embed
      dimension over `data` (2-D weight sharding).
    additional_rules: rules appended after the standard ones (T5X).
    override_rules: rules placed before the standard ones, so they win.

  Returns:
    A list of (logical axis, mesh axes) pairs, plain data that gin can bind.

  Raises:
    ValueError: a partitioning dimension other than 1 or 2.
  """
  return _with_extra_rules(
      _standard_rules(activation_partitioning_dims, parameter_partitioning_dims),
      additional_rules, override_rules)


def _with_extra_rules(rules: list[tuple[str, Any]], additional_rules: LogicalRules | None,
                      override_rules: LogicalRules | None) -> list[tuple[str, Any]]:
  """`override_rules`, then `rules`, then `additional_rules`."""
  return ([tuple(r) for r in override_rules or []] + rules
          + [tuple(r) for r in additional_rules or []])


def _standard_rules(activation_partitioning_dims: int, parameter_partitioning_dims: int
                    ) -> list[tuple[str, Any]]:
  """The standard rules alone, for 1-D or 2-D activation / parameter sharding."""
  for name, dims in (("activation_partitioning_dims", activation_partitioning_dims),
                     ("parameter_partitioning_dims", parameter_partitioning_dims)):
    if dims not in (1, 2):
      raise UserError(f"{name}={dims} is not supported; use 1 or 2.")
  rules: list[tuple[str, Any]] = [
      # Experts claim the `expert` axis first; in an array that has both, the
      # batch then falls back to (data, fsdp), so tokens move to their
      # experts (all-to-all) instead of expert weights being gathered.
      (ax.EXPERT, "expert"),
      (ax.BATCH, BATCH_MESH_AXES),
      (ax.BATCH, ("data", "fsdp")),
      (ax.VOCAB, "model"),
      (ax.MLP, "model"),
      (ax.HEADS, "model"),
      (ax.EXPERT_MLP, "model"),
  ]
  if activation_partitioning_dims == 2:
    rules.append((ax.EMBED, "model"))
  if parameter_partitioning_dims == 2:
    rules.append((ax.EMBED, "data"))
  rules += [(ax.EMBED, None), (ax.KV, None), (ax.LENGTH, None),
            (ax.RELPOS_BUCKETS, None), (ax.LAYERS, None)]
  return rules


def fsdp_logical_axis_rules(additional_rules: LogicalRules | None = None,
                            override_rules: LogicalRules | None = None
                            ) -> list[tuple[str, str | tuple[str, ...] | None]]:
  """Fully sharded data parallel: parameters and optimizer state over `fsdp`.

  The batch splits over (`data`, `fsdp`, `expert`) as in the standard rules,
  and every parameter's embed dimension splits over `fsdp`, so each device
  holds 1/fsdp of the weights and gathers them layer by layer. Activations
  keep embed whole because their batch dimension already uses `fsdp`. Wide
  dimensions still go to `model`, so with a `model` axis this is 2-D FSDP+TP.

  Args:
    additional_rules: rules appended after the preset (as in
      `standard_logical_axis_rules`: they never replace a preset rule).
    override_rules: rules placed before the preset, so they win.

  Returns:
    Plain (logical axis, mesh axes) pairs.
  """
  rules = _standard_rules(1, 1)
  # Before the catch-all (embed, None) so it wins for parameters.
  rules.insert(rules.index((ax.EMBED, None)), (ax.EMBED, "fsdp"))
  return _with_extra_rules(rules, additional_rules, override_rules)


def select_mesh_shape(mesh_rules: MeshRules, selector: str) -> dict[str, int]:
  """First mesh rule whose regex matches `selector` (e.g. the device kind).

  Raises:
    ValueError: no rule matches; the message lists the patterns.
  """
  for pattern, shape in mesh_rules:
    if re.search(pattern, selector):
      return dict(shape)
  raise UserError(
      f"No mesh rule matches '{selector}'; patterns are {[p for p, _ in mesh_rules]}. Add a "
      "rule (a catch-all '.*' last) or pass --mesh_selector to pick one.")


@dataclasses.dataclass(frozen=True)
class DataLayout:
  """Which slice of the global batch this host reads.

  Attributes:
    shard_id: index of this host's slice of the batch.
    num_shards: number of distinct slices across hosts.
    is_first_host_in_replica_set: False when an earlier host reads the same
      slice (hosts that only hold model-parallel replicas of it).
  """

  shard_id: int
  num_shards: int
  is_first_host_in_replica_set: bool


def _resolve_mesh_shape(mesh_shape: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Turns {'data': -1, 'model': 2} into sizes for every axis in MESH_AXES."""
  unknown = sorted(set(mesh_shape) - set(MESH_AXES))
  if unknown:
    raise UserError(f"Unknown mesh axes {unknown}; allowed axes are {list(MESH_AXES)}.")
  sizes = [int(mesh_shape.get(name, 1)) for name in MESH_AXES]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise UserError(
        f"Invalid mesh shape {dict(mesh_shape)}: sizes must be positive, with at "
        "most one axis set to -1 (all remaining devices).")
  known = math.prod(s for s in sizes if s != -1)
  if free:
    if num_devices % known:
      raise UserError(
          f"Mesh shape {dict(mesh_shape)} needs a multiple of {known} devices, "
          f"but there are {num_devices}.")
    sizes[free[0]] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise UserError(
        f"Mesh shape {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices, "
        f"but there are {num_devices}; make the product of the axis sizes equal "
        "the device count or set one axis to -1.")
  return tuple(sizes)


def create_mesh(mesh_shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh over MESH_AXES with Auto axis types.

  Devices are ordered by (process, id) and the last axes vary fastest, so the
  `model` axis stays inside a host, where links are fastest.

  Args:
    mesh_shape: axis name -> size; missing axes have size 1, one may be -1.
    devices: devices to use; all devices by default.

  Returns:
    A `jax.sharding.Mesh` whose axes allow logical-rule sharding constraints.

  Raises:
    ValueError: the shape does not fit the devices, or `model` does not divide
      the devices of one host.
  """
  devices = list(devices if devices is not None else jax.devices())
  devices.sort(key=lambda d: (d.process_index, d.id))
  sizes = _resolve_mesh_shape(mesh_shape, len(devices))
  model_size = sizes[MESH_AXES.index("model")]
  local = len(devices) // max(1, len({d.process_index for d in devices}))
  if local % model_size:
    raise UserError(
        f"Model-parallel size {model_size} must divide the {local} devices of a "
        "host so that model-parallel groups never cross hosts.")
  grid = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


class Partitioner:
  """Owns the mesh and the logical-axis rules; turns logical axes into shardings.

  The mesh shape comes from the first of `mesh_rules`, `mesh_shape` or
  `num_partitions` that is set.

  Args:
    num_partitions: model-parallel size (T5X meaning): the `model` axis size,
      with `data` taking the remaining devices.
    mesh_shape: explicit axis sizes over MESH_AXES, e.g. {'fsdp': -1,
      'model': 2}; one axis may be -1 for "all remaining devices".
    mesh_rules: ordered (regex, mesh_shape) pairs matched against
      `mesh_selector`; the first match wins, so one gin file can serve
      several clusters.
    mesh_selector: string the rules are matched against; defaults to
      the device kind; `--mesh_selector` sets it.
    logical_axis_rules: rules; `standard_logical_axis_rules()` by default.
    devices: devices to build the mesh from; all devices by default.
  """

  def __init__(self,
               num_partitions: int | None = None,
               mesh_shape: Mapping[str, int] | None = None,
               mesh_rules: MeshRules | None = None,
               mesh_selector: str | None = None,
               logical_axis_rules: LogicalRules | None = None,
               devices: Sequence[jax.Device] | None = None):
    self._num_partitions = num_partitions
    self._mesh_shape = dict(mesh_shape) if mesh_shape is not None else None
    self._mesh_rules = [(p, dict(s)) for p, s in (mesh_rules or [])]
    self._mesh_selector = mesh_selector
    self._devices = devices
    self._rules = [tuple(r) for r in (logical_axis_rules or standard_logical_axis_rules())]
    self._mesh: Mesh | None = None

  def _resolved_mesh_shape(self) -> dict[str, int]:
    if self._mesh_rules:
      devices = self._devices or jax.devices()
      selector = self._mesh_selector or devices[0].device_kind
      shape = select_mesh_shape(self._mesh_rules, selector)
    elif self._mesh_shape is not None:
      shape = dict(self._mesh_shape)
    else:
      return {"data": -1, "model": int(self._num_partitions or 1)}
    if self._num_partitions not in (None, shape.get("model", 1)):
      raise UserError(
          f"num_partitions={self._num_partitions} contradicts the mesh shape {shape} "
          f"(model={shape.get('model', 1)}); set NUM_MODEL_PARTITIONS to match or drop it.")
    return shape

  @property
  def mesh(self) -> Mesh:
    """The device mesh, built on first use (after jax.distributed is up)."""
    if self._mesh is None:
      self._mesh = create_mesh(self._resolved_mesh_shape(), self._devices)
    return self._mesh

  def validate(self) -> None:
    """Builds the mesh so an impossible shape fails before anything compiles."""
    _ = self.mesh

  @contextlib.contextmanager
  def activate(self) -> Iterator[None]:
    """Sets the mesh and rules so `nn.with_logical_constraint` takes effect."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self._rules):
      yield

  def logical_to_mesh_spec(self, logical: PartitionSpec | Sequence[str | None]) -> PartitionSpec:
    """Maps one logical PartitionSpec to a mesh PartitionSpec."""
    return nn.logical_to_mesh_axes(tuple(logical), self._rules)

  def logical_to_sharding(self, logical_tree: Any) -> Any:
    """Maps a tree of logical PartitionSpecs to `NamedSharding`s on the mesh."""
    return jax.tree.map(
        lambda spec: NamedSharding(self.mesh, self.logical_to_mesh_spec(spec)),
        logical_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))

  def check_divisible(self, abstract_tree: Any, logical_tree: Any) -> None:
    """Every sharded dimension must split evenly over its mesh axes.

    Args:
      abstract_tree: arrays or ShapeDtypeStructs.
      logical_tree: matching tree of logical PartitionSpecs.

    Raises:
      ValueError: naming the first variable that does not divide, with its
        shape, logical axes and mesh axes.
    """
    flat = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
    specs = jax.tree.leaves(logical_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), logical in zip(flat, specs):
      mesh_spec = self.logical_to_mesh_spec(logical)
      for size, axes in zip(leaf.shape, mesh_spec):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        parts = math.prod(self.mesh.shape[n] for n in names)
        if size % parts:
          raise UserError(
              f"{tree_paths.path_name(path)} has shape {tuple(leaf.shape)} with logical axes "
              f"{tuple(logical)}, but "
              f"its dimension of size {size} is split over mesh axes {names} of total size "
              f"{parts}; choose sizes it divides (e.g. NUM_MODEL_PARTITIONS or the model "
              "dimensions) or change the partitioning rules.")

  def batch_sharding(self, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] input array."""
    spec = self.logical_to_mesh_spec((ax.BATCH,) + (None,) * (ndim - 1))
    return NamedSharding(self.mesh, spec)

  def batch_shardings(self, shapes: Mapping[str, Sequence[Any]]) -> dict[str, NamedSharding]:
    """The sharding of each feature of a batch, from its shape (only its rank matters).

    Training, train-eval, inference and the benchmarks place batches with it.
    """
    return {k: self.batch_sharding(len(shape)) for k, shape in shapes.items()}

  def to_global(self, rows: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding],
                global_batch: int) -> dict[str, jax.Array]:
    """Global arrays of `global_batch` rows from the rows this process holds
    (its `get_data_layout` slice)."""
    return {k: jax.make_array_from_process_local_data(
        shardings[k], v, (global_batch,) + v.shape[1:]) for k, v in rows.items()}

  def batch_size_divisor(self) -> int:
    """Number of slices the batch dimension is split into across devices."""
    spec = self.logical_to_mesh_spec((ax.BATCH,))[0]
    names = (spec,) if isinstance(spec, str) else tuple(spec or ())
    return math.prod(self.mesh.shape[n] for n in names)

  def get_data_layout(self, batch_size: int) -> DataLayout:
    """Tells this host which contiguous slice of the global batch it reads.

    Args:
      batch_size: global batch size.

    Returns:
      The `DataLayout` for `jax.process_index()`.

    Raises:
      ValueError: the batch does not split evenly over the data-parallel devices.
    """
    divisor = self.batch_size_divisor()
    if batch_size <= 0 or batch_size % divisor:
      raise UserError(
          f"Batch size {batch_size} must be a positive multiple of the "
          f"data-parallel size {divisor} (mesh {dict(self.mesh.shape)}); change "
          "BATCH_SIZE or the mesh.")
    slices = host_batch_slices(self.batch_sharding(1), batch_size)
    return layout_for_process(slices, jax.process_index(), batch_size)


  def partition(self, fn: Callable[..., Any], in_shardings: Any, out_shardings: Any,
                donate_argnums: Sequence[int] = (), static_argnums: Sequence[int] = ()
                ) -> "Partitioned":
    """Jits `fn` with shardings; calls run under this mesh and rules.

    Args:
      fn: a pure function.
      in_shardings / out_shardings: trees of `NamedSharding` (or None).
      donate_argnums: arguments whose buffers the result may reuse.
      static_argnums: arguments treated as compile-time constants.

    Returns:
      A `Partitioned`, called with the same arguments as `fn`.
    """
    return Partitioned(self, jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                     donate_argnums=tuple(donate_argnums),
                                     static_argnums=tuple(static_argnums)))


class Partitioned:
  """A function jitted with shardings; calling and lowering it both run under
  its partitioner's mesh and logical-axis rules.

  Attributes:
    jitted: the `jax.jit` function itself (its compilation cache, for tests).
  """

  def __init__(self, partitioner: Partitioner, jitted: Any):
    self._partitioner = partitioner
    self.jitted = jitted
    # What `prepare` compiled for calls like its arguments: None before,
    # False once a call did not fit it (calls then go through `jitted`).
    self._compiled: Any = None

  def prepare(self, *args: Any) -> None:
    """Compiles the program for calls like `args` now, not at the first call
    (e.g. while the first batch is still being built); args may be
    `jax.ShapeDtypeStruct`s with shardings. The compile goes through JAX's
    persistent cache like any other. A no-op once prepared."""
    if self._compiled is None:
      self._compiled = self.lower(*args).compile()

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self._compiled and not kwargs:
      try:
        return self._compiled(*args)
      except TypeError:  # other shapes or shardings than prepared for: jit them
        self._compiled = False
    with self._partitioner.activate():
      return self.jitted(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """`jax.jit(...).lower` under the mesh and rules; `.compile()` the result."""
    with self._partitioner.activate():
      return self.jitted.lower(*args, **kwargs)


def layout_for_process(slices: Mapping[int, tuple[int, int]], process: int,
                       batch_size: int) -> DataLayout:
  """The DataLayout of `process` given every process's rows of the batch.

  Processes holding the same rows (model-parallel replicas) get the same
  shard id, so they read the same examples; only the lowest-numbered one is
  first in its replica set.
  """
  mine = slices[process]
  size = mine[1] - mine[0]
  first = all(slices[p] != mine for p in sorted(slices) if p < process)
  return DataLayout(shard_id=mine[0] // size,
                    num_shards=batch_size // size, is_first_host_in_replica_set=first)


def host_batch_slices(sharding: NamedSharding, batch_size: int,
                      process_of: Callable[[jax.Device], int] | None = None
                      ) -> dict[int, tuple[int, int]]:
  """Maps each process to the [start, stop) rows of the batch its devices hold.

  Args:
    sharding: sharding of a [batch] array.
    batch_size: global batch size.
    process_of: device -> process index; `device.process_index` by default
      (tests pass another to lay one process's devices out as several hosts).
  """
  process_of = process_of or (lambda d: d.process_index)
  rows: dict[int, list[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map((batch_size,)).items():
    start, stop, _ = index[0].indices(batch_size)
    rows.setdefault(process_of(device), []).append((start, stop))
  slices = {}
  for process, spans in rows.items():
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    covered = sum(e - s for s, e in set(spans))
    if covered != stop - start:
      raise ValueError(
          f"Process {process} holds a non-contiguous part of the batch {sorted(set(spans))}; "
          "order the mesh so each host's devices are adjacent along the batch axes.")
    slices[process] = (start, stop)
  return slices
