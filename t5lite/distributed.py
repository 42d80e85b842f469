"""Multi-process start-up through `jax.distributed` (NCCL on GPU, gloo on CPU).

Every process of a job runs the same command; the coordinator address and
this process's index come from flags or, when absent, from the cluster
environment that `jax.distributed.initialize()` detects (SLURM, Open MPI).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Flags that start a multi-process job.

  Attributes:
    multiprocess_gpu: start jax.distributed (GPU clusters); with no
      coordinator address the cluster environment is auto-detected.
    coordinator_address: 'host:port' of process 0.
    process_count: number of processes in the job.
    process_index: this process's index, 0 .. process_count - 1.
    initialization_timeout: seconds to wait for every process to join.
  """

  multiprocess_gpu: bool = False
  coordinator_address: str | None = None
  process_count: int | None = None
  process_index: int | None = None
  initialization_timeout: int = 300

  @property
  def enabled(self) -> bool:
    return self.multiprocess_gpu or self.coordinator_address is not None


def validate(config: DistributedConfig) -> None:
  """Rejects incomplete or contradictory flags before anything starts.

  Raises:
    ValueError: naming the flag to add or fix.
  """
  explicit = [config.coordinator_address, config.process_count, config.process_index]
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ValueError(
        "--coordinator_address, --process_count and --process_index must be given together "
        f"(got {config.coordinator_address!r}, {config.process_count!r}, "
        f"{config.process_index!r}); or pass only --multiprocess_gpu to detect them from "
        "the cluster environment.")
  if config.process_count is not None:
    if config.process_count < 1:
      raise ValueError(f"--process_count={config.process_count} must be at least 1.")
    if not 0 <= config.process_index < config.process_count:
      raise ValueError(f"--process_index={config.process_index} must be in "
                       f"[0, {config.process_count}).")
  if config.initialization_timeout <= 0:
    raise ValueError(
        f"--initialization_timeout={config.initialization_timeout} must be positive seconds.")


def initialize(config: DistributedConfig) -> None:
  """Starts jax.distributed when the flags ask for it; a no-op otherwise."""
  validate(config)
  if not config.enabled:
    return
  if not config.multiprocess_gpu:
    # Multi-process CPU runs (tests, laptops) need a CPU collectives backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=config.coordinator_address,
      num_processes=config.process_count,
      process_id=config.process_index,
      initialization_timeout=config.initialization_timeout)
