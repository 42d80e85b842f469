"""The training data feeder: host batches into global device arrays.

`TrainData` builds the process's shard of the pipeline, assembles each
global batch from the rows this process holds, and builds the next batches
on a background thread while the device runs steps. A restart without a
saved iterator fast-forwards the deterministic pipeline instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from t5lite import metrics as metrics_lib
from t5lite.data import datasets
from t5lite.data.datasets import DatasetConfig
from t5lite.errors import UserError
from t5lite.partitioning import Partitioner
from t5lite.threads import Background


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


def global_batches(ds: Any, partitioner: Partitioner, global_batch: int) -> Iterator[dict]:
  """Yields global `jax.Array` batches from this host's tf.data batches."""
  shardings = partitioner.batch_shardings(
      {k: spec.shape for k, spec in ds.element_spec.items()})
  for batch in ds.as_numpy_iterator():
    yield partitioner.to_global(batch, shardings, global_batch)


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

  def __init__(self, model: BaseModel, cfg: DatasetConfig, partitioner: Partitioner,
               prefetch_batches: int = 2):
    if prefetch_batches < 0:
      raise UserError(f"prefetch_batches must be >= 0 (0 disables prefetching), got "
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
    # The batches' features as the model declares them (what its feature
    # converter makes of these lengths), known before the pipeline is built:
    # the train step is compiled for them while it builds, and the
    # pipeline is checked against them once built.
    shapes, types = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
    self._features = {k: ((cfg.batch_size,) + tuple(shapes[k][1:]), np.dtype(types[k]))
                      for k in shapes}
    self._partitioner = partitioner
    self._depth = prefetch_batches
    self._prefetcher: _Prefetcher | None = None
    # The pipeline is built when first needed (see `skip`), or in the
    # background from `build_in_background`, so a restart that fast-forwards
    # builds it once, at its position, not a second time.
    self._ds: Any = None
    self._iterator: Any = None
    self._unused_at: int | None = None  # position of a pipeline no batch was taken from
    self._building: Background | None = None
    # Where the background build puts the pipeline, until a batch is taken.
    self._planned: int | None = None
    if self.per_host:
      metrics_lib.log_line(
          f"Warning: train/DatasetConfig.shard_by_host=True: each of the {layout.num_shards} "
          "processes reads, shuffles and packs its own shard, so the data order depends on the "
          "number of processes; a restart on another number continues at the same step with "
          "other examples.")

  @property
  def iterator(self) -> Any:
    """The tf.data iterator (a checkpoint saves and restores its position);
    from the first batch unless `skip` placed it elsewhere."""
    self._wait_for_build()
    if self._iterator is None:
      self._build_at(0)
    self._unused_at = self._planned = None  # whoever holds it may move it
    return self._iterator

  @functools.cached_property
  def shardings(self) -> dict[str, Any]:
    """The global batches' shardings (no need to wait for the pipeline)."""
    return self._partitioner.batch_shardings(
        {k: shape for k, (shape, _) in self._features.items()})

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batches' shapes, dtypes and shardings, without values."""
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.shardings[k])
            for k, (shape, dtype) in self._features.items()}

  def global_shapes(self) -> dict[str, tuple[int, ...]]:
    """Shapes of the global batches this yields, e.g. for counting FLOPs."""
    return {k: shape for k, (shape, _) in self._features.items()}

  def _check_features(self, element_spec: dict[str, Any]) -> None:
    """The pipeline's batches are what the model declared, or a ValueError."""
    found = {k: (tuple(v.shape[1:]), np.dtype(v.dtype.as_numpy_dtype))
             for k, v in element_spec.items()}
    declared = {k: (shape[1:], dtype) for k, (shape, dtype) in self._features.items()}
    if found != declared:
      describe = lambda f: ", ".join(  # noqa: E731
          f"{k} {d.name}{list(s)}" for k, (s, d) in sorted(f.items()))
      raise UserError(
          f"the training pipeline yields features [{describe(found)}] but the model "
          f"declares [{describe(declared)}] for these feature lengths; make the task's "
          "output features and the model's feature converter agree.")

  def skip(self, num_batches: int) -> None:
    """Starts after the first `num_batches` batches of the run (a restart with
    no saved iterator): the pipeline is built anew and fast-forwarded.

    Built anew because a second iterator over the same tf.data shuffle draws
    another order. Always through `skip`, even `skip(0)` (which tf.data must
    not optimise away), so a saved iterator restores into the same graph
    whatever position it was saved at. A pipeline already built at
    `num_batches` that no batch was taken from is kept as it is, and one
    being built there in the background is not waited for (a restart
    restores its state meanwhile).
    """
    if self._planned == num_batches:
      return
    self._wait_for_build()
    self._planned = None
    if self._unused_at != num_batches:
      self._build_at(num_batches)

  def build_in_background(self, num_batches: int) -> None:
    """Starts building the pipeline at `num_batches` (as `skip` does) on a
    background thread; whatever needs it next waits for it and raises what
    building raised. Training's start-up initialises or restores the state
    meanwhile, which spends much of its time compiling or reading, not
    holding Python's interpreter lock."""
    self._wait_for_build()
    self._planned = num_batches
    self._building = Background(lambda: self._build_at(num_batches), "t5lite-data-build")

  def _wait_for_build(self) -> None:
    # Every caller waits (the loop's and the prefetch thread may both ask),
    # and a failed build keeps failing: nothing falls back to another position.
    if self._building is not None:
      self._building.result()

  def _build_at(self, num_batches: int) -> None:
    import tensorflow as tf  # the pipeline is tf.data already; imported where used
    options = tf.data.Options()
    options.experimental_optimization.noop_elimination = False
    ds = self._make().skip(num_batches).with_options(options)
    self._check_features(ds.element_spec)
    self._ds = _leave_cores_to_the_step(ds)
    self._iterator = iter(self._ds)
    self._unused_at = num_batches

  def __iter__(self) -> "TrainData":
    return self

  def _build(self) -> dict[str, jax.Array]:
    batch = {k: v.numpy()[self._rows] for k, v in next(self.iterator).items()}
    return self._partitioner.to_global(batch, self.shardings, self._global_batch)

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

  def close(self) -> None:
    """Stops the prefetch thread and waits for a background build still
    running: a process must not exit while TensorFlow builds on a daemon
    thread (it aborts). What a failed build raised has already reached
    whoever needed the data."""
    self.stop_prefetch()
    if self._building is not None:
      self._building.join()

  def __next__(self) -> dict[str, jax.Array]:
    if self._prefetcher is not None and self._prefetcher.remaining:
      return self._prefetcher.get()
    return self._build()


def fast_forward(data: TrainData, step: int) -> None:
  """Continues the data after the `step` batches a restored run already used."""
  if step:
    metrics_lib.log_line(f"Continuing the training data at batch {step}: the pipeline is "
                         "rebuilt and fast-forwarded (the checkpoint holds no iterator for "
                         "this run).")
  data.skip(step)
