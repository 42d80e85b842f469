"""`t5lite-train --dry_run`: what a run would do, without compiling or writing.

The dry run receives exactly the arguments gin would pass to `train()`, runs
the same validation (`run_config.validate`, then the divisibility check of every
sharded parameter), builds the train state abstractly with `jax.eval_shape`
and prints:

- the parameter count, in total and per top-level module;
- a per-device memory estimate for parameters, gradients, optimizer state
  and activations;
- the partitioning table (parameter, shape, logical axes, mesh axes);
- the data (task, lengths, global / per-host / per-device batch);
- the schedule: the steps that checkpoint, evaluate, and where the run ends.

Nothing is compiled, MODEL_DIR is never created, and checkpoints already in
it are only listed (to find the step a real run would resume from).

Activation memory is an estimate: the tensors that autodiff keeps from the
forward pass for the backward pass, traced (`jax.make_jaxpr` of `jax.vjp`,
no compilation) at the per-device batch. Tracing follows the model's own
`remat_policy` and `scan_layers`, MoE dispatch and attention included,
except where the backend's compiler undoes the policy (on the CPU, remat
outside a scan; see `BaseModel.as_compiled_for`). XLA may fuse some of
those tensors away or add temporaries of its own, and activations split
over the `model` mesh axis are counted whole. `benchmarks/memory.py`
compares the estimate with what the compiled step allocates.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import jax
import numpy as np
from jax.extend import core as jax_core

from t5lite import axis_names as ax
from t5lite import checkpoints as ckpt_lib
from t5lite import paths, state_init, train_eval
from t5lite import report as report_lib
from t5lite import train as train_lib
from t5lite.data.datasets import DatasetConfig
from t5lite.periods import Periods
from t5lite.run_config import RunConfig


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel


# Longest list of steps printed in full; longer ones show their ends.
_MAX_LISTED_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Memory:
  """Estimated bytes on one device during a training step."""

  params: int
  gradients: int
  optimizer: int
  activations: int
  examples_per_device: int

  @property
  def total(self) -> int:
    return self.params + self.gradients + self.optimizer + self.activations


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which steps do what, from the step the run starts at to its last."""

  start: int
  start_from: str
  end: int
  epoch: int
  stats: int
  checkpoints: tuple[int, ...]
  kept: tuple[int, ...] | None
  evaluations: tuple[int, ...]
  evaluators: str


@dataclasses.dataclass(frozen=True)
class Report:
  """Everything the dry run prints."""

  model_dir: str
  model: str
  mesh: dict[str, int]
  devices: str
  params: tuple[state_init.ParamRow, ...]
  param_count: int
  modules: dict[str, int]
  expert_params: int
  active_params: int | None
  memory: Memory
  checkpoint_bytes: int
  data: tuple[str, ...]
  schedule: Schedule


def run(out: TextIO | None = None, **train_kwargs: Any) -> Report:
  """Validates and describes a training run; compiles and writes nothing.

  Args:
    out: where the report goes; stdout by default (process 0 only).
    **train_kwargs: the arguments `train.train` would receive.

  Returns:
    The report that was printed.

  Raises:
    TypeError: arguments `train()` would not accept (unknown or missing).
    ValueError: everything `train()` rejects before compiling.
  """
  args = inspect.signature(train_lib.train).bind(**train_kwargs)
  args.apply_defaults()
  # A seed drawn from the clock changes no shape, so any seed will do.
  seed = args.arguments["random_seed"]
  report = describe(RunConfig.from_train_arguments(args.arguments,
                                                   seed=0 if seed is None else seed))
  if jax.process_index() == 0:
    print(format_report(report), file=out or sys.stdout, flush=True)
  return report


def describe(run: RunConfig) -> Report:
  """The dry run's findings for a run's settings (see `run`)."""
  trainer, periods = train_lib.checked_setup(run)
  model, partitioner, train_dataset_cfg = run.model, run.partitioner, run.train_dataset_cfg
  shapes, types = model.input_shapes_and_types(train_dataset_cfg.task_feature_lengths,
                                               train_dataset_cfg.pack)
  specs, _ = state_init.state_specs(model, partitioner, shapes, types)
  partitioner.check_divisible(specs.abstract, specs.logical)
  rows = state_init.param_rows(specs, partitioner)
  microbatches = trainer.num_microbatches or 1
  per_device = train_dataset_cfg.batch_size // partitioner.batch_size_divisor()
  examples = max(1, per_device // microbatches)
  activations = activation_bytes(model, shapes, types, specs.abstract.params, examples)
  return Report(
      model_dir=run.model_dir, model=_model_name(model), mesh=dict(partitioner.mesh.shape),
      devices=report_lib.devices(), params=tuple(rows),
      param_count=state_init.param_count(specs), modules=module_counts(rows),
      expert_params=_expert_params(rows), active_params=_active_params(model, rows),
      memory=Memory(params=sharded_bytes(specs.abstract.params, specs.shardings.params),
                    gradients=sharded_bytes(specs.abstract.params, specs.shardings.params),
                    optimizer=sharded_bytes(specs.abstract.opt_state,
                                            specs.shardings.opt_state),
                    activations=activations, examples_per_device=examples),
      checkpoint_bytes=_checkpoint_bytes(specs, run.checkpoint_cfg.save),
      data=tuple(data_lines(train_dataset_cfg, run.train_eval_dataset_cfg,
                            run.infer_eval_dataset_cfg, partitioner, run.eval_steps,
                            microbatches)),
      schedule=schedule(run, periods))


# ---------------------------------------------------------------------------
# Model and parameters


def module_counts(rows: Sequence[state_init.ParamRow]) -> dict[str, int]:
  """Parameters per top-level module (the first component of the path)."""
  counts: dict[str, int] = {}
  for row in rows:
    top = row.name.split("/")[0]
    counts[top] = counts.get(top, 0) + math.prod(row.shape)
  return counts


def _expert_params(rows: Sequence[state_init.ParamRow]) -> int:
  return sum(math.prod(r.shape) for r in rows if ax.EXPERT in r.logical)


def _active_params(model: BaseModel, rows: Sequence[state_init.ParamRow]) -> int | None:
  """Parameters one token passes through: experts count k / num_experts."""
  config = getattr(model.module, "config", None)
  experts = getattr(config, "num_experts", 0)
  if not experts:
    return None
  total = sum(math.prod(r.shape) for r in rows)
  expert = _expert_params(rows)
  return total - expert + expert * config.num_selected_experts // experts


def _model_name(model: BaseModel) -> str:
  vocab = model.output_vocabulary
  rows = getattr(getattr(model.module, "config", None), "vocab_size", None)
  return (f"{type(model).__name__} ({type(model.module).__name__}), "
          f"{type(vocab).__name__} of {vocab.vocab_size} ids"
          + (f" in {rows} embedding rows" if rows else ""))


# ---------------------------------------------------------------------------
# Memory


def _itemsize(dtype: Any) -> int:
  # PRNG key arrays have an extended dtype; their data are two uint32s.
  return getattr(dtype, "itemsize", 8)


def sharded_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes one device holds of a tree of arrays laid out by `shardings`."""
  leaves = jax.tree.leaves(abstract)
  placed = jax.tree.leaves(shardings)
  return sum(math.prod(s.shard_shape(tuple(a.shape))) * _itemsize(a.dtype)
             for a, s in zip(leaves, placed))


def activation_bytes(model: BaseModel, input_shapes: Mapping[str, tuple],
                     input_types: Mapping[str, Any], abstract_params: Any, examples: int) -> int:
  """Bytes of the tensors the backward pass keeps, for `examples` examples.

  Traces (never compiles) the training loss under `jax.vjp` and adds up
  the residuals the pullback closes over, except the parameters and
  inputs themselves. Remat and scan are what the model does as compiled
  on this backend (`BaseModel.as_compiled_for`: on the CPU, remat outside a
  scan saves nothing). A scanned, rematerialised stack recomputes each
  layer in full before taking its gradient, so the largest layer's own
  residuals (traced without remat) are added: once little else is kept,
  that working set is most of the step's memory.

  Args:
    model: gives `loss_fn`.
    input_shapes: feature -> batch-1 shape.
    input_types: feature -> dtype.
    abstract_params: the parameters as ShapeDtypeStructs.
    examples: examples per device (per microbatch).

  Returns:
    The estimate, in bytes.
  """
  batch = {k: jax.ShapeDtypeStruct((examples,) + tuple(s[1:]), input_types[k])
           for k, s in input_shapes.items()}

  def pullback_jaxpr(model):
    def residuals(params, batch):
      # Dropout on, as in training; the key is a traced input, not a constant.
      def loss(p):
        return model.loss_fn(p, batch, jax.random.key(0))[0]
      return jax.vjp(loss, params)[1]
    return jax.make_jaxpr(residuals)(abstract_params, batch).jaxpr

  model = model.as_compiled_for(jax.default_backend())
  jaxpr = pullback_jaxpr(model)
  inputs = {id(v) for v in jaxpr.invars}
  producers = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}

  def viewed(var):
    # A reshape is a view of the same buffer (XLA makes it a bitcast): a
    # kept reshape of a parameter, or of another kept tensor, costs nothing.
    eqn = producers.get(id(var))
    while eqn is not None and eqn.primitive.name == "reshape" and not hasattr(eqn.invars[0], "val"):
      var = eqn.invars[0]
      eqn = producers.get(id(var))
    return var

  seen, total = set(), 0
  for var in jaxpr.outvars:
    if hasattr(var, "val"):
      continue  # a constant
    var = viewed(var)
    if id(var) in inputs or id(var) in seen:
      continue  # a parameter/input handed through, or counted already
    seen.add(id(var))
    total += _nbytes(var.aval)
  recomputed = model.without_remat()
  if recomputed is not model and getattr(model.module.config, "scan_layers", False):
    total += max(_scan_step_bytes(pullback_jaxpr(recomputed)), default=0)
  return total


def _nbytes(aval: Any) -> int:
  return math.prod(aval.shape) * _itemsize(aval.dtype)


def _scan_step_bytes(jaxpr: Any) -> list[int]:
  """For each scan in `jaxpr` (and the jaxprs it calls, not a scan's own
  body), the bytes one iteration stacks into its outputs: a scanned
  layer's residuals for the backward pass."""
  steps = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      length, carries = eqn.params["length"], eqn.params["num_carry"]
      steps.append(sum(_nbytes(v.aval) // length for v in eqn.outvars[carries:]))
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      steps.extend(_scan_step_bytes(sub))
  return steps


def _checkpoint_bytes(specs: state_init.StateSpecs,
                      save: ckpt_lib.SaveCheckpointConfig | None) -> int:
  """Bytes of one checkpoint: parameters (in the save dtype) and optimizer state."""
  params = jax.tree.leaves(specs.abstract.params)
  itemsize = np.dtype(save.dtype).itemsize if save is not None and save.dtype else None
  total = sum(a.size * (itemsize or _itemsize(a.dtype)) for a in params)
  return total + sum(a.size * _itemsize(a.dtype) for a in jax.tree.leaves(specs.abstract.opt_state))


# ---------------------------------------------------------------------------
# Data and schedule


def data_lines(train_cfg: DatasetConfig, eval_cfg: DatasetConfig | None,
               infer_cfg: DatasetConfig | None, partitioner: Any, eval_steps: int,
               microbatches: int) -> list[str]:
  """What each dataset reads and how the global batch splits."""
  layout = partitioner.get_data_layout(train_cfg.batch_size)
  divisor = partitioner.batch_size_divisor()
  lines = [
      f"train       {_dataset(train_cfg)}",
      f"batch       global {train_cfg.batch_size} = {train_cfg.batch_size // layout.num_shards}"
      f" per host x {layout.num_shards} host(s); {train_cfg.batch_size // divisor} per device"
      f" x {divisor} data-parallel device(s)"
      + (f"; {microbatches} microbatches" if microbatches > 1 else ""),
  ]
  if eval_cfg is not None:
    names = train_eval.eval_task_names(eval_cfg)
    lines.append(f"train-eval  {_dataset(eval_cfg)}; {eval_steps} batches of "
                 f"{eval_cfg.batch_size}" + (f"; per task: {', '.join(names[1:])}"
                                              if len(names) > 1 else ""))
  lines.append(f"infer-eval  {_dataset(infer_cfg) + '; every example' if infer_cfg else 'off'}")
  return lines


def _dataset(cfg: DatasetConfig) -> str:
  lengths = ", ".join(f"{k} {v}" for k, v in cfg.task_feature_lengths.items())
  return (f"{cfg.mixture_or_task_name} ({cfg.split}{', packed' if cfg.pack else ''}"
          f"{', shuffled' if cfg.shuffle else ''}), lengths {lengths}")


def _start(model_dir: str, restore: ckpt_lib.RestoreCheckpointConfig | None,
           resume_step: int | None = None) -> tuple[int, str, state_init.Start]:
  """The step a run starts at (`state_init.find_start`), in words, and the
  decision itself."""
  start = state_init.find_start(model_dir, restore, resume_step)
  step, plan = start.step, start.plan
  if start.kind == "resume" and not plan.aside_subdir:
    return step, f"resumes from checkpoint {step} in MODEL_DIR", start
  if start.kind == "resume":
    return step, (f"resumes from checkpoint {step} in MODEL_DIR, train.resume_step; newer "
                  f"steps {list(plan.set_aside)} move to MODEL_DIR/{plan.aside_subdir}"), start
  if start.kind in ("import", "params"):
    return 0, f"parameters from {restore.path}, step 0", start
  if start.kind == "import_state":
    return step, (f"continues the T5X run of {restore.path} (parameters and Adafactor) at "
                  f"step {step}"), start
  if start.kind == "restore":
    return step, f"restores step {step} from {restore.path}", start
  return 0, "fresh start", start


def schedule(run: RunConfig, periods: Periods) -> Schedule:
  """The steps the loop checkpoints and evaluates at (`Periods.saves_at`,
  `.evaluates_at`), from the start and end training decides the same way
  (`state_init.find_start`, `RunConfig.end_step`), with the evaluators
  training builds (`RunConfig.evaluations`)."""
  model_dir, checkpoint_cfg = run.model_dir, run.checkpoint_cfg
  start, start_from, decided = _start(model_dir, checkpoint_cfg.restore, run.resume_step)
  end = run.end_step(start)
  evaluators = ", ".join(run.evaluations(periods))
  steps = range(start + 1, end + 1)
  saves = tuple(s for s in steps if periods.saves_at(s, end))
  evals: tuple[int, ...] = ()
  if evaluators:
    evals = tuple(s for s in steps if periods.evaluates_at(s, end))
    if run.run_eval_before_training and start < end:
      evals = (start,) + evals
  return Schedule(start=start, start_from=start_from, end=end, epoch=periods.epoch,
                  stats=periods.stats, checkpoints=saves,
                  kept=_kept(model_dir, saves, checkpoint_cfg.save, decided.plan.set_aside),
                  evaluations=evals,
                  evaluators=evaluators)


def _kept(model_dir: str, saves: Sequence[int], save: ckpt_lib.SaveCheckpointConfig | None,
          set_aside: Sequence[int]) -> tuple[int, ...] | None:
  """`checkpoints.kept_steps` for the steps in MODEL_DIR and the planned
  saves; None when `keep` is None (all are kept)."""
  if save is None or save.keep is None:
    return None
  existing = paths.join(model_dir, ckpt_lib.CHECKPOINTS_SUBDIR)
  on_disk = ckpt_lib.list_steps(existing)[1] if paths.Path(existing).is_dir() else []
  return ckpt_lib.kept_steps(on_disk, saves, save, set_aside)


# ---------------------------------------------------------------------------
# Formatting


def format_steps(steps: Sequence[int]) -> str:
  """'2, 4' or, for long lists, '200, 400, 600, ..., 99800, 100000 (500 steps)'."""
  if not steps:
    return "none"
  if len(steps) <= _MAX_LISTED_STEPS:
    return ", ".join(map(str, steps))
  head, tail = ", ".join(map(str, steps[:3])), ", ".join(map(str, steps[-2:]))
  return f"{head}, ..., {tail} ({len(steps)} steps)"


def format_bytes(n: float) -> str:
  """'512 B', '3.2 KiB', '771.2 MiB', '1.5 GiB', ..."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def _axes(axes: Sequence[Any]) -> str:
  def one(a):
    if a is None:
      return "-"
    return "+".join(a) if isinstance(a, (tuple, list)) else str(a)
  return "(" + ", ".join(one(a) for a in axes) + ")"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_report(r: Report) -> str:
  """The report as the text `--dry_run` prints."""
  exists = "exists" if paths.Path(r.model_dir).is_dir() else "does not exist yet; not created"
  total = r.param_count
  lines = [f"Dry run: nothing compiled, nothing written. MODEL_DIR {r.model_dir} ({exists}).",
           "", f"Model: {r.model}", f"Parameters: {total:,} total"]
  lines += _table([[name, f"{n:,}"] for name, n in r.modules.items()])
  if r.active_params is not None:
    lines.append(f"  of which experts {r.expert_params:,}; active per token "
                 f"{r.active_params:,}")
  m, s = r.memory, r.schedule
  lines += ["", f"Mesh: {_axes_sizes(r.mesh)} over {r.devices}",
            "Memory per device (estimate):",
            f"  parameters    {format_bytes(m.params):>10}",
            f"  gradients     {format_bytes(m.gradients):>10}",
            f"  optimizer     {format_bytes(m.optimizer):>10}",
            f"  activations   {format_bytes(m.activations):>10}  (kept for the backward pass at "
            f"{m.examples_per_device} examples per device; traced, not compiled)",
            f"  total         {format_bytes(m.total):>10}",
            f"Checkpoint size: {format_bytes(r.checkpoint_bytes)} per step", "",
            "Partitioning:"]
  lines += _table([["parameter", "shape", "logical axes", "mesh axes"]]
                  + [[p.name, str(p.shape), _axes(p.logical), _axes(p.mesh)] for p in r.params])
  lines += ["", "Data:"] + [f"  {line}" for line in r.data]
  lines += ["", "Schedule:",
            f"  steps       {s.start} -> {s.end} ({s.start_from}); {s.epoch} steps per epoch, "
            f"metrics every {s.stats}",
            f"  checkpoints {format_steps(s.checkpoints)}"
            + (f"; kept at the end: {format_steps(s.kept)}" if s.kept is not None else ""),
            f"  evaluation  {format_steps(s.evaluations)}"
            + (f" ({s.evaluators})" if s.evaluations else ""),
            f"  ends at     step {s.end}" if s.start < s.end
            else f"  ends at     step {s.start}: already there, nothing to train"]
  return "\n".join(lines)


def _axes_sizes(mesh: Mapping[str, int]) -> str:
  return " ".join(f"{k}={v}" for k, v in mesh.items())
