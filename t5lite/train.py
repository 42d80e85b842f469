"""`train()`: the gin-configured entrypoint and its epoch loop.

`train()` turns its arguments into a `RunConfig`, validates everything cheap,
then runs the phases, each from the module named for it: the data
(`feeder`), the state (`state_init`), the evaluators (`train_eval`,
`inference`), then the epochs, with the console report from `report`. An
epoch is the largest step count after which something has to happen (a
checkpoint, an evaluation or a garbage collection; see `periods`), so the
inner loop only dispatches steps and never waits for the device except at
stats periods, where `divergence` judges the fetched metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax

from t5lite import actions as actions_lib
from t5lite import checkpoints as ckpt_lib
from t5lite import interop, paths, report, run_config, run_lock, state_init, stops, write_errors
from t5lite import metrics as metrics_lib
from t5lite.checkpoints import CheckpointConfig
from t5lite.data.datasets import DatasetConfig
from t5lite.divergence import DivergenceCheck, DivergenceLimits, stop_message
from t5lite.feeder import TrainData
from t5lite.partitioning import Partitioned, Partitioner
from t5lite.periods import Periods
from t5lite.run_config import RunConfig
from t5lite.stops import Diverged, Interrupted, Preempted
from t5lite.train_eval import Evaluators, build_evaluators
from t5lite.train_state import TrainState


if TYPE_CHECKING:
  from t5lite.models.models import BaseModel
  from t5lite.trainer import Trainer


# ---------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class _Loop:
  """The pieces the epoch loop drives."""

  step_fn: Partitioned
  data: TrainData
  checkpointer: ckpt_lib.Checkpointer
  writer: metrics_lib.SummaryWriter
  progress: metrics_lib.Progress
  periods: Periods
  evaluators: Evaluators
  actions: Mapping[actions_lib.ActionMode, list]
  train_task: str
  total_steps: int
  divergence: DivergenceCheck = dataclasses.field(
      default_factory=lambda: DivergenceCheck(DivergenceLimits()))


def _check_divergence(loop: _Loop, fetched: list[dict[str, float]], step: int) -> None:
  """Raises `Diverged` before anything of the stats period ending at `step`
  is written. Process 0's verdict is broadcast, so every process stops at
  the same stats period."""
  problem = loop.divergence.first_problem(fetched, step - len(fetched) + 1)
  if actions_lib.broadcast_decision(int(problem is not None)):
    raise Diverged(stop_message(problem or f"in the stats period before step {step} (found by "
                                "process 0)", loop.checkpointer.all_steps()))


def _write_stats(loop: _Loop, step: int, pending: list) -> actions_lib.Stop | None:
  fetched = metrics_lib.fetch(pending)
  _check_divergence(loop, fetched, step)
  scalars = metrics_lib.average(fetched)
  scalars.update(loop.progress.timing(step, scalars))
  loop.writer.write_scalars(step, scalars)
  metrics_lib.log_line(loop.progress.line(step, scalars))
  pending.clear()
  return actions_lib.run_actions(loop.actions, actions_lib.ActionMode.TRAIN, step,
                                 {loop.train_task: scalars})


def evaluate_all(loop: _Loop, step: int, params: Any) -> actions_lib.Stop | None:
  """Train-eval and inference eval at `step`, then their actions."""
  stop = None
  evaluator, infer_evaluator = loop.evaluators.get()
  if evaluator:
    results = evaluator.evaluate(step, params)
    stop = actions_lib.run_actions(loop.actions, actions_lib.ActionMode.TRAIN_EVAL, step,
                                   results)
  if infer_evaluator:
    results = infer_evaluator.evaluate(step, params)
    stop = actions_lib.run_actions(loop.actions, actions_lib.ActionMode.INFER_EVAL, step,
                                   results) or stop
  loop.progress.reset_clock(step)
  return stop


def _end_of_epoch(loop: _Loop, step: int, state: TrainState) -> actions_lib.Stop | None:
  """Checkpoint, evaluate and collect garbage when their periods come due."""
  if loop.periods.saves_at(step, loop.total_steps):
    loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  stop = None
  if loop.periods.evaluates_at(step, loop.total_steps):
    stop = evaluate_all(loop, step, state.params)
  if loop.periods.gc and step % loop.periods.gc == 0:
    gc.collect()
  return stop


def run_epochs(loop: _Loop, state: TrainState, start_step: int
               ) -> tuple[TrainState, int, actions_lib.Stop | None]:
  """Runs steps from start_step to total_steps, epoch by epoch, unless an
  action stops training first.

  Returns:
    (state, last step run, the action's Stop or None).
  """
  step, pending = start_step, []
  while step < loop.total_steps:
    epoch_end = min(loop.total_steps, loop.periods.next_boundary(step))
    while step < epoch_end:
      # Up to the next stats period, the loop only dispatches steps: it never
      # waits for the device, and the next batches are built meanwhile.
      stats_end = min(epoch_end, (step // loop.periods.stats + 1) * loop.periods.stats)
      loop.data.prefetch(stats_end - step)
      if step == start_step:  # the step's program, loaded (or compiled) while
        # the first batches are built rather than after the first arrives
        loop.step_fn.prepare(state, loop.data.abstract_batch())
      while step < stats_end:
        state, step_metrics = loop.step_fn(state, next(loop.data))
        loop.evaluators.start()  # after the first step's trace (see train_eval.Evaluators)
        step += 1
        pending.append(step_metrics)
        if jax.process_count() == 1 and stops.PREEMPTION.is_set():
          _preempt(loop, step, state, pending)
      if jax.process_count() > 1 and stops.any_process_preempted(pending):
        _preempt(loop, step, state, pending)
      stop = _write_stats(loop, step, pending)
      if stop:
        return _stop(loop, step, state, stop)
    stop = _end_of_epoch(loop, step, state)
    if stop:
      return _stop(loop, step, state, stop)
  return state, step, None


def _stop(loop: _Loop, step: int, state: TrainState, stop: actions_lib.Stop
          ) -> tuple[TrainState, int, actions_lib.Stop]:
  """Ends training for an action: keeps the step unless its state is bad."""
  if not stop.save:
    raise Diverged(stop_message(f"at step {step}: {stop.reason}", loop.checkpointer.all_steps()))
  if loop.periods.checkpoint:
    loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  metrics_lib.log_line(f"Stopped at step {step}: {stop.reason}.")
  return state, step, stop


def _preempt(loop: _Loop, step: int, state: TrainState, pending: list) -> None:
  """Checkpoints the finished step (closing waits for the write) and stops.

  Batches already taken from the iterator are trained on first (at most the
  prefetch depth plus one), so the saved iterator position matches the step.
  """
  for batch in loop.data.stop_prefetch():
    state, step_metrics = loop.step_fn(state, batch)
    step += 1
    pending.append(step_metrics)
  if pending:
    _write_stats(loop, step, pending)  # also refuses to save a diverged state
  loop.checkpointer.save(step, state.state_dict(), loop.data.iterator)
  raise (Interrupted if stops.INTERRUPTED.is_set() else Preempted)(step)


def train(*,
          model: BaseModel,
          train_dataset_cfg: DatasetConfig,
          train_eval_dataset_cfg: DatasetConfig | None = None,
          infer_eval_dataset_cfg: DatasetConfig | None = None,
          checkpoint_cfg: CheckpointConfig = CheckpointConfig(),
          partitioner: Partitioner,
          trainer_cls: Callable[..., Trainer],
          model_dir: str,
          total_steps: int,
          eval_steps: int = 10,
          eval_period: int = 1000,
          relative_steps: int | None = None,
          stats_period: int | None = None,
          random_seed: int | None = 0,
          actions: Mapping[str, Any] | None = None,
          run_eval_before_training: bool = False,
          gc_period: int = 0,
          prefetch_batches: int = 2,
          peak_flops_per_device: float | None = None,
          max_update_ratio: float | None = 1.0,
          loss_spike_factor: float | None = 3.0,
          loss_spike_window: int = 100,
          summarize_config_fn: Callable[[str], None] | None = None,
          resume_step: int | None = None) -> tuple[int, TrainState]:
  """Trains `model` on `train_dataset_cfg`, checkpointing into `model_dir`.

  Args:
    model: a `models.BaseModel` (module, vocabularies, optimizer, loss).
    train_dataset_cfg: training data; `batch_size` is the global batch.
    train_eval_dataset_cfg: held-out data for teacher-forced evaluation.
    infer_eval_dataset_cfg: data for inference evaluation (decoding and the
      tasks' seqio metrics), run with the train-eval every `eval_period`;
      must not be packed.
    checkpoint_cfg: save period/keep and the explicit restore path.
    partitioner: mesh and logical-axis rules.
    trainer_cls: called as trainer_cls(model=..., partitioner=...,
      dropout_seed=...); gin binds the rest (e.g. num_microbatches).
    model_dir: where checkpoints, summaries, config.gin and model-info.txt go.
    total_steps: the step to train up to (absolute).
    eval_steps: batches per train-eval.
    eval_period: steps between train-evals; 0 disables.
    relative_steps: if set, train this many steps past the restored step
      instead of up to `total_steps`.
    stats_period: steps between metric fetches and progress lines; defaults
      to the epoch length.
    random_seed: seeds init and dropout; None draws one from the clock.
    actions: mode ('TRAIN', 'TRAIN_EVAL', 'INFER_EVAL') -> list of
      `actions.EarlyStopping` / `actions.TerminateOnNan`, run on that mode's
      metrics; one that fires ends training (see `t5lite.actions`).
    run_eval_before_training: also evaluate at the start step.
    gc_period: steps between Python garbage collections; 0 leaves gc on.
    prefetch_batches: training batches built and sent to the devices in a
      background thread while earlier steps run; 0 builds each batch when
      its step is dispatched.
    peak_flops_per_device: peak FLOP/s of one device for matmuls in the
      dtype the model computes in, for the MFU of the progress line and
      `timing/mfu`; None takes the datasheet figure of that dtype for the
      GPUs and TPUs in `metrics.PEAK_FLOPS_PER_DEVICE` and shows model FLOP/s
      alone on other devices (on a CPU, bind the matmul peak of the model's
      dtype that `make bench` measures).
    max_update_ratio: training stops (exit 3) at a step whose update is larger
      than this multiple of the parameters' norm; None disables. A NaN or
      Inf loss, gradient norm or parameter norm always stops it.
    loss_spike_factor: training stops at a step where the median loss of the
      last 10 steps exceeds this multiple of the median loss of the
      `loss_spike_window` steps before them; None disables. Either way
      nothing of that stats period is saved, so the newest checkpoint
      predates the divergence (see docs/checkpoints.md).
    loss_spike_window: steps in that reference median; the check starts once
      a run or restart has trained that many steps plus 10.
    summarize_config_fn: called with model_dir on process 0 once inputs are
      validated (the CLI writes config.gin with it).
    resume_step: restore this step of model_dir's checkpoints instead of the
      newest (`--gin.train.resume_step=N`, e.g. to go back before a
      divergence). The newer steps are moved, not deleted, to
      MODEL_DIR/checkpoints-abandoned-after-N/, so they neither block the
      new saves nor get restored again; a rerun of the same command then
      resumes from its own newest checkpoint.

  Returns:
    (final step, final TrainState); the final step is earlier than the
    target when an action stopped training.

  Raises:
    ValueError: invalid configuration, before anything compiles or is written.
    checkpoints.CheckpointWriteError: a checkpoint could not be written.
  """
  arguments = dict(locals())
  run = RunConfig.from_train_arguments(arguments, seed=run_config.resolve_seed(random_seed))
  trainer, periods = checked_setup(run)
  return _run(run, trainer, periods)


def checked_setup(run: RunConfig) -> tuple[Any, Periods]:
  """The trainer and the periods of a run, after every check that needs no
  compile. `train()` and its dry run both start here, so the dry run
  refuses exactly what training refuses."""
  trainer = run.trainer_cls(model=run.model, partitioner=run.partitioner, dropout_seed=run.seed)
  return trainer, run_config.validate(run, trainer)


def _prepare_model_dir(model_dir: str, summarize_config_fn: Callable[[str], None] | None,
                       step: int) -> None:
  """MODEL_DIR, with config.gin written by `summarize_config_fn`.

  Raises:
    write_errors.WriteError: either could not be written.
  """
  with write_errors.writing("config.gin", model_dir, step):
    paths.makedirs(model_dir)
    if jax.process_index() == 0 and summarize_config_fn is not None:
      summarize_config_fn(model_dir)


def _build_loop(run: RunConfig, periods: Periods, data: TrainData,
                checkpointer: ckpt_lib.Checkpointer, step_fn: Partitioned,
                evaluators: Evaluators, start: int, end: int) -> _Loop:
  """The writers and the loop's pieces around the step, the data and the evaluators."""
  writer = metrics_lib.SummaryWriter(paths.join(run.model_dir, "train"),
                                     jax.process_index() == 0)
  progress = report.progress(run.model, data, start, end, run.peak_flops_per_device)
  return _Loop(step_fn=step_fn, data=data, checkpointer=checkpointer, writer=writer,
               progress=progress, periods=periods, evaluators=evaluators, actions=run.actions,
               train_task=run.train_dataset_cfg.mixture_or_task_name,
               total_steps=end, divergence=DivergenceCheck(run.divergence))


def _close(loop: _Loop, failing: BaseException | None = None) -> None:
  """Flushes every writer and waits for the checkpoint write in flight.

  Args:
    loop: the loop's pieces.
    failing: the error already on its way out, if any; a failed write found
      here is then logged, not raised, so that error is the one reported;
      but a preemption promises its checkpoint, so its failure is raised.

  Raises:
    checkpoints.CheckpointWriteError: the last write failed.
    write_errors.WriteError: the summaries could not be written.
  """
  try:
    try:
      loop.data.close()
    finally:
      try:
        loop.checkpointer.wait_until_finished()
        loop.checkpointer.close()
      except ckpt_lib.CheckpointWriteError as e:
        if failing is None or isinstance(failing, Preempted):
          raise
        metrics_lib.log_line(f"Warning: {e}")
  except BaseException as e:
    failing = e
    raise
  finally:
    _close_writers(loop, failing)


def _close_writers(loop: _Loop, failing: BaseException | None) -> None:
  """Closes the summary writers. A failed write found here is raised when
  nothing else is on its way out; with a failed write on its way out it is
  the same fault, said once; with any other error it is logged."""
  first = None
  for close in (loop.writer.close, loop.evaluators.close):
    try:
      close()
    except write_errors.WriteError as e:
      if failing is None and first is None:
        first = e
      elif not isinstance(failing or first, write_errors.WriteError):
        metrics_lib.log_line(f"Warning: {e}")
  if first is not None:
    raise first


def _holding_model_dir_lock(phase: Callable[..., Any]) -> Callable[..., Any]:
  """`phase(run, ...)` holding the lock of `run.model_dir` (see
  `t5lite.run_lock`): one trainer per model_dir, taken once per job, on
  process 0, after validation and before anything is written; released
  when `phase` returns or raises."""
  @functools.wraps(phase)
  def locked(run: RunConfig, *args: Any) -> Any:
    with run_lock.hold(run.model_dir, enabled=jax.process_index() == 0):
      return phase(run, *args)
  return locked


@_holding_model_dir_lock
def _run(run: RunConfig, trainer: Trainer, periods: Periods) -> tuple[int, TrainState]:
  """The phases after validation: state, model_dir, loop, then the epochs."""
  model, partitioner, train_cfg = run.model, run.partitioner, run.train_dataset_cfg
  restore = run.checkpoint_cfg.restore
  data = TrainData(model, train_cfg, partitioner, run.prefetch_batches)
  # Built while the state is traced, initialised or restored, at the batch
  # the run will start from.
  planned = state_init.find_start(run.model_dir, restore, run.resume_step)
  data.build_in_background(state_init.data_position(planned, run.model_dir))
  specs, init_fn = state_init.state_specs(model, partitioner, *model.input_shapes_and_types(
      train_cfg.task_feature_lengths, train_cfg.pack))
  partitioner.check_divisible(specs.abstract, specs.logical)  # before anything is written
  if planned.kind in ("import", "import_state"):
    interop.check_fits(restore.path, specs.abstract.params)  # reads metadata only
  if planned.kind == "import_state":
    interop.check_t5x_adafactor_fits(restore.path, specs.abstract.params,
                                     state_init.t5x_adafactor_slots(specs.abstract.opt_state))
  checkpointer = ckpt_lib.Checkpointer(run.model_dir, run.checkpoint_cfg.save)
  step_fn = trainer.compile_train_step(specs.shardings, data.shardings)
  state, start = state_init.init_or_restore(
      specs=specs, init_fn=init_fn, partitioner=partitioner, checkpointer=checkpointer,
      restore_cfg=restore, seed=run.seed, start=planned, data=data)
  end = run.end_step(start)
  if start >= end:  # a rerun of a finished job leaves its config.gin as it was
    metrics_lib.log_line(f"Already at step {start} (target {end}); nothing to train.")
    data.close()  # the pipeline a restart builds in the background, never used
    checkpointer.close()
    return start, state
  # Only now, with the checkpoint known to fit the model, is anything written.
  _prepare_model_dir(run.model_dir, run.summarize_config_fn, start)
  if jax.process_index() == 0:
    info = paths.join(run.model_dir, "model-info.txt")
    with write_errors.writing("model-info.txt", info, start):
      state_init.write_model_info(info, specs, partitioner)

  evaluators = build_evaluators(run, trainer, periods, specs.shardings.params)
  loop = _build_loop(run, periods, data, checkpointer, step_fn, evaluators, start, end)
  metrics_lib.log_line(report.banner(model=model, specs=specs, partitioner=partitioner,
                                     train_cfg=train_cfg, periods=periods, start=start, end=end,
                                     checkpointer=checkpointer))
  began = time.perf_counter()
  if periods.gc:
    gc.disable()  # collected every gc_period steps instead, away from the hot loop
  try:
    with stops.SignalsToPreemption():
      stop = None
      if run.run_eval_before_training:
        stop = evaluate_all(loop, start, state.params)
      if stop:
        state, end, _ = _stop(loop, start, state, stop)
      else:
        state, end, _ = run_epochs(loop, state, start)
  except BaseException as error:
    _close(loop, failing=error)
    raise
  else:
    _close(loop)
  finally:
    gc.enable()
  metrics_lib.log_line(report.summary(model_dir=run.model_dir, checkpointer=checkpointer,
                                      start=start, end=end,
                                      seconds=time.perf_counter() - began))
  return end, state


