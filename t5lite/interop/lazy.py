"""Arrays read on demand, one region at a time, from a foreign checkpoint.

An importer describes every parameter of the target model as a `LazyArray`:
a shape, a dtype and a function that reads any rectangular region. Layout
changes (transposes, split head axes, stacked or unstacked layers) are
compositions that map a region of the result to the region of the source
they need, so `materialize` asks each process for exactly the shards its
devices hold: no process ever reads the whole model unless it holds it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from t5lite.errors import UserError


Index = tuple[slice, ...]


def _normalize(index: Index, shape: Sequence[int]) -> Index:
  """Concrete `start:stop` slices (step 1) for every axis of `shape`."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, dim in zip(index, shape):
    start, stop, step = s.indices(dim)
    if step != 1:
      raise ValueError(f"Strided reads are not supported (step {step}).")
    out.append(slice(start, stop))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class LazyArray:
  """An array whose regions are read only when asked for.

  Attributes:
    shape: the array's shape.
    dtype: the stored dtype (reads return it; `materialize` casts).
    reader: `index -> np.ndarray` for a tuple of concrete slices, one per
      axis; returns exactly that region.
    origin: where the data lives (file and name), for error messages.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  reader: Callable[[Index], np.ndarray]
  origin: str

  def read(self, index: Index = ()) -> np.ndarray:
    """Reads the region `index` (slices; missing trailing axes mean all)."""
    return np.asarray(self.reader(_normalize(index, self.shape)))

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def from_numpy(value: np.ndarray, origin: str) -> LazyArray:
  """A LazyArray over an array already in memory (e.g. inlined in a file)."""
  value = np.asarray(value)
  return LazyArray(tuple(value.shape), value.dtype, lambda index: value[index], origin)


def transpose(x: LazyArray) -> LazyArray:
  """The transpose of a 2-D array, e.g. a torch `[out, in]` weight as `[in, out]`."""
  if len(x.shape) != 2:
    raise UserError(f"{x.origin}: expected a 2-D array to transpose, got shape {x.shape}.")
  return LazyArray(x.shape[::-1], x.dtype, lambda index: x.read(index[::-1]).T, x.origin)


def split_axis(x: LazyArray, axis: int, sizes: tuple[int, int]) -> LazyArray:
  """Splits `axis` into two, major first: `[..., a*b, ...]` -> `[..., a, b, ...]`.

  This is how a `[embed, heads*head_dim]` kernel (heads-major) becomes
  `[embed, heads, head_dim]`.
  """
  major, minor = sizes
  if x.shape[axis] != major * minor:
    raise UserError(f"{x.origin}: axis {axis} of shape {x.shape} does not split into "
                    f"{major} x {minor}.")
  shape = x.shape[:axis] + (major, minor) + x.shape[axis + 1:]

  def reader(index: Index) -> np.ndarray:
    rows, cols = index[axis], index[axis + 1]
    source = index[:axis] + (slice(rows.start * minor, rows.stop * minor),) + index[axis + 2:]
    block = x.read(source)
    block = block.reshape(block.shape[:axis] + (rows.stop - rows.start, minor)
                          + block.shape[axis + 1:])
    return block[(slice(None),) * (axis + 1) + (cols,)]

  return LazyArray(shape, x.dtype, reader, x.origin)


def take(x: LazyArray, axis: int, position: int) -> LazyArray:
  """`x[..., position, ...]` along `axis`: one layer of a stacked array."""
  shape = x.shape[:axis] + x.shape[axis + 1:]

  def reader(index: Index) -> np.ndarray:
    source = index[:axis] + (slice(position, position + 1),) + index[axis:]
    return np.squeeze(x.read(source), axis=axis)

  return LazyArray(shape, x.dtype, reader, f"{x.origin}[layer {position}]")


def stack(parts: Sequence[LazyArray]) -> LazyArray:
  """Stacks equal-shaped arrays on a new leading axis (layers or experts)."""
  first = parts[0]
  for part in parts[1:]:
    if part.shape != first.shape:
      raise UserError(f"Cannot stack {part.origin} {part.shape} with {first.origin} "
                      f"{first.shape}: the stacked arrays differ in shape.")

  def reader(index: Index) -> np.ndarray:
    chosen = parts[index[0]]
    if not chosen:
      return np.zeros((0,) + tuple(s.stop - s.start for s in index[1:]), first.dtype)
    return np.stack([p.read(index[1:]) for p in chosen])

  return LazyArray((len(parts),) + first.shape, first.dtype, reader, first.origin)


def _squeeze(x: LazyArray) -> LazyArray:
  """`x` without its size-1 axes."""
  kept = [d for d, n in enumerate(x.shape) if n != 1]
  if len(kept) == len(x.shape):
    return x

  def reader(index: Index) -> np.ndarray:
    it = iter(index)
    source = tuple(next(it) if d in kept else slice(0, 1) for d in range(len(x.shape)))
    return x.read(source).reshape([s.stop - s.start for s in index])

  return LazyArray(tuple(x.shape[d] for d in kept), x.dtype, reader, x.origin)


def _expand(x: LazyArray, shape: tuple[int, ...]) -> LazyArray:
  """`x` with size-1 axes inserted to make `shape` (whose other sizes are x's)."""
  kept = [d for d, n in enumerate(shape) if n != 1]

  def reader(index: Index) -> np.ndarray:
    block = x.read(tuple(index[d] for d in kept))
    return block.reshape([s.stop - s.start for s in index])

  return LazyArray(tuple(shape), x.dtype, reader, x.origin)


def reshape(x: LazyArray, shape: Sequence[int]) -> LazyArray:
  """`x` reshaped (row-major) by splitting axes and adding or removing size-1
  axes, e.g. a T5X `[heads*head_dim]` statistic as `[1, heads, head_dim]`.

  Raises:
    ValueError: a reshape that would merge axes or move data across them.
  """
  shape = tuple(int(n) for n in shape)
  x = _squeeze(x)
  wanted = [n for n in shape if n != 1]
  axis, position = 0, 0
  while axis < len(wanted):
    if position >= len(x.shape):
      raise UserError(f"{x.origin}: cannot reshape {x.shape} to {shape}.")
    if x.shape[position] == wanted[axis]:
      axis, position = axis + 1, position + 1
      continue
    if x.shape[position] % wanted[axis] or x.shape[position] == wanted[axis]:
      raise UserError(f"{x.origin}: cannot reshape {x.shape} to {shape}.")
    x = split_axis(x, position, (wanted[axis], x.shape[position] // wanted[axis]))
  if len(x.shape) != len(wanted):
    raise UserError(f"{x.origin}: cannot reshape {x.shape} to {shape}.")
  return _expand(x, shape)


def materialize(x: LazyArray, target: jax.ShapeDtypeStruct) -> jax.Array:
  """Reads `x` into a global jax.Array with the target's sharding and dtype.

  Each process reads only the regions its addressable devices hold (and
  each region once, however many of its devices replicate it).

  Raises:
    ValueError: the shapes differ.
  """
  if tuple(x.shape) != tuple(target.shape):
    raise UserError(f"{x.origin} has shape {x.shape} but the model expects "
                    f"{tuple(target.shape)}.")
  cache: dict[tuple, np.ndarray] = {}

  def callback(index: Index) -> np.ndarray:
    key = tuple((s.start, s.stop) for s in _normalize(index, x.shape))
    if key not in cache:
      cache[key] = np.asarray(x.read(index), dtype=target.dtype)
    return cache[key]

  sharding = target.sharding
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.make_array_from_callback(tuple(target.shape), sharding, callback)
