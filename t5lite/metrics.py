"""Metrics: weighted evaluation averages, TensorBoard writers, console progress.

Evaluation metrics are `clu.metrics` objects, one per batch, merged over the
batches of an evaluation before they are computed, so a batch counts by its
weight (its tokens or examples), as in T5X, and never as one equal vote.

Only the primary process writes files; the others log to the console only,
which keeps multi-host runs from writing duplicate event files.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence

import flax
import jax
import numpy as np
import tensorflow as tf
from absl import logging
from clu import asynclib, metric_writers
from clu import metrics as clu_metrics

from t5lite import paths, write_errors


@flax.struct.dataclass
class Average(clu_metrics.Average):
  """clu's weighted average `total / count` that is 0.0, not NaN, when
  nothing was counted (e.g. every loss weight of the evaluation was zero).

  Build it as `Average(total=sum of values * weights, count=sum of weights)`;
  `merge` adds totals and counts.
  """

  def compute(self) -> float:
    count = float(self.count)
    return float(self.total) / count if count else 0.0


@flax.struct.dataclass
class Sum(clu_metrics.Metric):
  """A total over batches (a count such as the evaluated tokens)."""

  total: jax.Array

  def merge(self, other: Sum) -> Sum:
    return type(self)(total=self.total + other.total)

  def compute(self) -> float:
    return float(self.total)


def merge_and_compute(per_batch: Sequence[Mapping[str, clu_metrics.Metric]]
                      ) -> dict[str, float]:
  """Fetches per-batch clu metrics in one transfer, merges them and computes.

  The totals are merged in float64 on the host, so many batches add up
  without float32 rounding.

  Args:
    per_batch: one `{name: Metric}` per batch, all with the same names.

  Returns:
    name -> value over all batches; {} for no batches.
  """
  if not per_batch:
    return {}
  fetched = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(list(per_batch)))
  merged = functools.reduce(lambda a, b: {k: a[k].merge(b[k]) for k in a}, fetched)
  return {k: float(m.compute()) for k, m in merged.items()}


def _failed_write(error: BaseException) -> BaseException | None:
  """The file error behind what clu's writer raised, or None for anything else.

  clu's asynchronous writer raises an `AsyncError` caused (through another
  `AsyncError`) by what its thread met; TensorFlow's summary ops, which do
  nothing but write the event file, report a failed write as an `OpError`.
  """
  while error is not None:
    if isinstance(error, (tf.errors.OpError, OSError)):
      return error
    if not isinstance(error, asynclib.AsyncError):
      return None
    error = error.__cause__
  return None


class SummaryWriter:
  """Writes scalars as TensorBoard events under `logdir`.

  The events are written on a background thread; a write that fails (a full
  or read-only disk) is raised by the next call as a `WriteError`, once.
  After that the writer writes nothing more and closes quietly. A `gs://`
  logdir gets the event file of a local folder (`paths.Mirror`), uploaded
  at every `flush`, at `close` and at a write `UPLOAD_SECONDS` after the
  last upload.

  Args:
    logdir: directory of the event files, e.g. MODEL_DIR/train.
    is_primary: False on processes other than 0 (console logging only).
  """

  UPLOAD_SECONDS = 60.0

  def __init__(self, logdir: str, is_primary: bool = True):
    self._logdir = logdir
    self._step: int | None = None  # of the latest call, for the message
    self._failed = False
    self._unraised: Exception | None = None
    self._mirror = paths.Mirror(logdir) if is_primary else None
    self._uploaded = time.monotonic()
    try:
      self._writer = metric_writers.create_default_writer(
          self._mirror.local if self._mirror else logdir, just_logging=not is_primary,
          asynchronous=True)
    except (tf.errors.OpError, OSError) as error:
      # The event file cannot be created: the first write says so, with its step.
      self._unraised = error

  def _call(self, write: Callable[[], None]) -> None:
    if self._failed:
      return
    try:
      if self._unraised is not None:
        raise self._unraised
      write()
    except (asynclib.AsyncError, tf.errors.OpError, OSError) as error:
      cause = _failed_write(error)
      if cause is None:
        raise
      self._failed = True
      raise write_errors.write_failed("TensorBoard summaries", self._logdir, self._step,
                                      cause) from error

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes `scalars` at `step`.

    Raises:
      write_errors.WriteError: this or an earlier write of the events failed.
    """
    self._step = step
    self._call(lambda: self._writer.write_scalars(
        step, {k: float(v) for k, v in scalars.items()}))
    if (self._mirror is not None and self._mirror.local != self._logdir
        and time.monotonic() - self._uploaded >= self.UPLOAD_SECONDS):
      self.flush()

  def _flush(self) -> None:
    self._writer.flush()
    if self._mirror is not None:
      self._mirror.sync()
      self._uploaded = time.monotonic()

  def flush(self) -> None:
    self._call(self._flush)

  def _close(self) -> None:
    self._writer.close()
    if self._mirror is not None:
      self._mirror.close()

  def close(self) -> None:
    self._call(self._close)


def read_scalar_events(logdir: str, tag: str) -> list[tuple[int, float, float]]:
  """(step, wall time, value) of every `tag` summary `SummaryWriter` wrote
  to `logdir`, in the order written: what TensorBoard shows, read back (for
  tests and benchmarks)."""
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
  acc.Reload()
  if tag in acc.Tags().get("scalars", []):
    return [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]
  from tensorflow.python.framework import tensor_util  # clu writes tensor summaries
  return [(e.step, e.wall_time, float(tensor_util.MakeNdarray(e.tensor_proto)))
          for e in acc.Tensors(tag)]


def read_scalars(logdir: str, tag: str) -> dict[int, float]:
  """{step: value} of the `tag` summaries in `logdir` (see `read_scalar_events`)."""
  return {step: value for step, _, value in read_scalar_events(logdir, tag)}


def fetch(per_step: Sequence[Mapping[str, jax.Array]]) -> list[dict[str, float]]:
  """Brings a stats period of per-step device metrics to the host in one transfer."""
  return [{k: float(v) for k, v in m.items()} for m in jax.device_get(list(per_step))]


# Per-step counts that a stats period reports as totals rather than means
# (trainer.optimizer_metrics produces them).
SUMMED_METRICS = frozenset({"optimizer/skipped_steps"})


def average(fetched: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """Per-period scalars: the mean of each metric, the sum of `SUMMED_METRICS`."""
  if not fetched:
    return {}
  reduce = lambda k: np.sum if k in SUMMED_METRICS else np.mean  # noqa: E731
  return {k: float(reduce(k)([m[k] for m in fetched])) for k in fetched[0]}


def format_duration(seconds: float) -> str:
  seconds = int(max(0, seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# Dense peak FLOP/s of one chip (vendor datasheets, no sparsity) by a
# substring of jax's `device_kind` (the first match wins, so specific variants
# come first) and by the dtype of the matmul inputs. MFU counts against the
# peak of the dtype the model computes in: float32 matmuls at JAX's default
# precision run on TF32 tensor cores on these GPUs and as one bfloat16 pass
# on TPUs, so their float32 figure is that rate.
PEAK_FLOPS_PER_DEVICE = {
    "H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12},
    "H200": {"bfloat16": 989e12, "float32": 494e12},
    "GH200": {"bfloat16": 989e12, "float32": 494e12},
    "B200": {"bfloat16": 2250e12, "float32": 1100e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "L4": {"bfloat16": 121e12, "float32": 60e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12},
}


def peak_dtype(compute_dtype: str | None) -> str:
  """The row of `PEAK_FLOPS_PER_DEVICE` for a model computing in
  `compute_dtype`: 16-bit floats take the bfloat16 peak, anything else
  (or unknown) the float32 one."""
  return "bfloat16" if compute_dtype in ("bfloat16", "float16") else "float32"


def peak_flops_per_second(devices: Sequence[jax.Device] | None = None,
                          per_device: float | None = None,
                          compute_dtype: str | None = None) -> float | None:
  """Peak FLOP/s of all `devices` (default: every device of the job) for
  matmuls in `compute_dtype`: from `per_device` when given, else from the
  datasheet table, else None."""
  devices = list(devices or jax.devices())
  if per_device is not None:
    return per_device * len(devices)
  kind = devices[0].device_kind
  for name, peaks in PEAK_FLOPS_PER_DEVICE.items():
    if name in kind:
      return peaks[peak_dtype(compute_dtype)] * len(devices)
  return None


class Progress:
  """Tracks throughput between stats periods and prints one line each time.

  Args:
    total_steps: the step the run ends at, for the ETA.
    start_step: the step training starts from.
    flops_per_step: model FLOPs of one training step of the global batch
      (see `BaseModel.train_flops_per_step`), or None; adds model FLOP/s.
    peak_flops_per_second: the devices' peak, or None; with `flops_per_step`
      adds model FLOPs utilisation (MFU).
  """

  def __init__(self, total_steps: int, start_step: int, flops_per_step: float | None = None,
               peak_flops_per_second: float | None = None):
    self._total = total_steps
    self._last_step = start_step
    self._last_time = time.perf_counter()
    self._flops = flops_per_step
    self._peak = peak_flops_per_second if flops_per_step else None

  def reset_clock(self, step: int) -> None:
    """Restarts timing, e.g. after a compile or an evaluation pause."""
    self._last_step, self._last_time = step, time.perf_counter()

  def timing(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
    """steps/s, seqs/s and tokens/s since the last call."""
    now = time.perf_counter()
    elapsed = max(now - self._last_time, 1e-9)
    steps = max(step - self._last_step, 1)
    self._last_step, self._last_time = step, now
    rate = steps / elapsed
    timing = {
        "timing/steps_per_second": rate,
        "timing/seqs_per_second": rate * scalars.get("num_examples", 0.0),
        "timing/target_tokens_per_second": rate * scalars.get("num_tokens", 0.0),
    }
    if self._flops:
      timing["timing/model_flops_per_second"] = rate * self._flops
    if self._peak:
      timing["timing/mfu"] = rate * self._flops / self._peak
    return timing

  def line(self, step: int, scalars: Mapping[str, float]) -> str:
    rate = scalars.get("timing/steps_per_second", 0.0)
    eta = (self._total - step) / rate if rate > 0 else float("nan")
    eta_text = format_duration(eta) if np.isfinite(eta) else "?"
    return (f"step {step}/{self._total}  loss {scalars.get('loss', float('nan')):.4f}  "
            f"lr {scalars.get('learning_rate', float('nan')):.3g}  {rate:.2f} steps/s  "
            f"{scalars.get('timing/target_tokens_per_second', 0.0):.0f} tokens/s  "
            + _flops_text(scalars) + f"ETA {eta_text}")


def _flops_text(scalars: Mapping[str, float]) -> str:
  """Model TFLOP/s and MFU for the progress line, where known."""
  text = ""
  if "timing/model_flops_per_second" in scalars:
    flops = scalars["timing/model_flops_per_second"]
    text += (f"{flops / 1e12:.3g} TFLOP/s  " if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s  ")
  if "timing/mfu" in scalars:
    text += f"MFU {100 * scalars['timing/mfu']:.1f}%  "
  return text


def log_line(text: str) -> None:
  """Console output: printed by process 0, logged by the others."""
  if jax.process_index() == 0:
    print(text, flush=True)
  else:
    logging.info("%s", text)


def format_table(title: str, rows: Mapping[str, Mapping[str, float]],
                 skip: Sequence[str] = ("num_tokens", "num_examples")) -> str:
  """Metrics of several tasks as a small aligned text table.

  Args:
    title: first line, e.g. "train-eval at step 1000".
    rows: task -> metric -> value.
    skip: metric names left out (counts rather than results).

  Returns:
    The title, a header of metric names and one row per task.
  """
  columns = sorted({k for metrics in rows.values() for k in metrics if k not in skip})
  width = max([len("task")] + [len(task) for task in rows])
  cells = {c: max(len(c), 10) for c in columns}
  lines = [title, "  " + "task".ljust(width) + "".join(f"  {c:>{cells[c]}}" for c in columns)]
  for task, metrics in rows.items():
    values = "".join(f"  {_cell(metrics.get(c), cells[c])}" for c in columns)
    lines.append("  " + task.ljust(width) + values)
  return "\n".join(lines)


def _cell(value: float | None, width: int) -> str:
  if value is None:
    return "-".rjust(width)
  return f"{value:>{width}.4f}" if abs(value) < 1e5 else f"{value:>{width}.4g}"
