"""Multi-host launch with real processes on localhost.

Each job runs 2 processes with fake CPU devices, joined through
`--coordinator_address/--process_count/--process_index` (or the SLURM
environment) over gloo; training runs are compared with one process on the
same number of devices.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from multihost import BIN, free_port, run_two_processes, start_job
from test_cli import SHALLOW, TINY
from test_interruptions import assert_bitwise_equal, checkpoint_state

from t5lite import distributed


# The processes these tests start compile at XLA's optimisation level 0
# (tests/conftest.py).
pytestmark = pytest.mark.fast_compile(
    "these tests check how a job's processes start, agree, stop and resume: exit statuses, "
    "messages, checkpoints, and runs compared with runs of the same programs; the optimised "
    "programs' numbers are checked by the training and parity tests")


# Unshuffled, unpacked arithmetic problems (no random preprocessing): the
# global batch holds the same examples whether 1 or 2 processes read it, so
# the losses must agree. Only the row order inside a batch differs. One layer
# per stack: nothing a job's processes agree on depends on depth.
TRAIN = [*TINY, *SHALLOW, "--gin.MIXTURE_OR_TASK_NAME='t5lite_arithmetic'",
         "--gin.train/datasets.DatasetConfig.shuffle=False",
         "--gin.train/datasets.DatasetConfig.pack=False",
         "--gin.BATCH_SIZE=8", "--gin.STATS_PERIOD=1", "--gin.EVAL_PERIOD=0",
         "--gin.CHECKPOINT_PERIOD=2", "--gin.checkpoints.SaveCheckpointConfig.save_dataset=True"]


def _no_cluster_env():
  # The tests must not pick up a real scheduler's variables.
  return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}


def _start(args, tmp_path, name, processes):
  """Starts a training run on the same 2-device mesh: 1 process with 2 devices
  or 2 processes with 1 each (the fewest that still split the work)."""
  log_dir = str(tmp_path / "logs" / name)
  if processes == 1:
    return start_job(lambda i: args, cwd=str(tmp_path), log_dir=log_dir, count=1,
                     devices_per_process=2, with_distributed_flags=False)
  return start_job(lambda i: args, cwd=str(tmp_path), log_dir=log_dir, count=2,
                   devices_per_process=1)


def _finished(job):
  results = job.wait(timeout=600)
  assert all(r.returncode == 0 for r in results), job.describe()
  return results


# ---------------------------------------------------------------------------
# Flags, in-process and through the CLI


@pytest.mark.parametrize("config, message", [
    (dict(coordinator_address="localhost:1234", process_count=2),
     "must be given together .* --multiprocess_gpu"),
    (dict(coordinator_address="localhost:1234", process_count=2, process_index=2),
     r"--process_index=2 must be in \[0, 2\)"),
    (dict(coordinator_address="localhost", process_count=2, process_index=0),
     "--coordinator_address='localhost' must be 'host:port'"),
    (dict(coordinator_address="localhost:99999", process_count=2, process_index=0),
     "must be 'host:port'"),
    (dict(multiprocess_gpu=True, heartbeat_timeout=0),
     "--heartbeat_timeout=0 must be a positive number of seconds"),
    (dict(multiprocess_gpu=True, initialization_timeout=-1),
     "--initialization_timeout=-1 must be a positive number of seconds"),
])
def test_contradictory_or_incomplete_flags_are_named(config, message):
  with pytest.raises(ValueError, match=message):
    distributed.validate(distributed.DistributedConfig(**config))


def test_valid_flags_pass():
  for address in ("localhost:1234", "10.0.0.1:80", "[::1]:8476", "node-001.cluster:1"):
    distributed.validate(distributed.DistributedConfig(
        coordinator_address=address, process_count=4, process_index=3))
  assert not distributed.DistributedConfig().enabled


@pytest.mark.parametrize("script, args, message", [
    ("t5lite-train", ["--coordinator_address=localhost:1234", "--process_count=2"],
     "must be given together"),
    ("t5lite-eval", ["--coordinator_address=localhost:1234", "--process_count=2",
                     "--process_index=5"], r"--process_index=5 must be in \[0, 2\)"),
    ("t5lite-infer", ["--multiprocess_gpu", "--heartbeat_timeout=0"],
     "--heartbeat_timeout=0 must be a positive number of seconds"),
])
def test_cli_rejects_bad_flags_with_one_line_before_starting(tmp_path, script, args, message):
  out = subprocess.run([os.path.join(BIN, script), *TINY, f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
                        *args], cwd=str(tmp_path), env=dict(_no_cluster_env(), JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("t5lite: ValueError: ") and re.search(message, last), last
  assert "Joining" not in out.stdout and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_multiprocess_gpu_outside_a_cluster_says_what_to_pass(tmp_path):
  out = subprocess.run([os.path.join(BIN, "t5lite-train"), *TINY, "--multiprocess_gpu",
                        f"--gin.MODEL_DIR='{tmp_path / 'r'}'"], cwd=str(tmp_path),
                       env=dict(_no_cluster_env(), JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert "found no cluster environment (SLURM or Open MPI)" in last
  assert "--coordinator_address, --process_count and --process_index" in last


# ---------------------------------------------------------------------------
# The watchdog's verdicts, with a fake coordination client


class _FakeClient:
  def key_value_set(self, *args, **kwargs):
    pass


def _watchdog(count, index, timeout=10):
  job = distributed.Job("node0:1234", count, index, None)
  return distributed.Watchdog(_FakeClient(), job, timeout)


def _alive(**counters):
  return [(f"t5lite_watchdog/alive/{p[1:]}", str(c)) for p, c in counters.items()]


def test_watchdog_names_silent_peers_only_after_the_timeout():
  dog = _watchdog(count=4, index=2)
  t = time.monotonic()
  dog.record(_alive(p0=1, p1=1, p3=1), t)
  assert dog.verdict(t + 10) is None
  # Process 1 keeps counting; 0 and 3 fall silent.
  dog.record(_alive(p0=1, p1=2, p3=1), t + 9)
  code, message = dog.verdict(t + 10.5)
  assert code == distributed.PEER_LOST_EXIT
  assert message.startswith("processes 0 and 3 of 4 stopped responding: no heartbeat for 10 s")


def test_watchdog_blames_the_coordinator_when_it_cannot_be_reached():
  dog = _watchdog(count=2, index=1)
  t = time.monotonic()
  dog.record(_alive(p0=1), t)
  assert dog.verdict(t + 9) is None
  code, message = dog.verdict(t + 11)
  assert code == distributed.PEER_LOST_EXIT
  assert message.startswith("process 0 of 2 (the coordinator at node0:1234) stopped responding")
  # Once this process is finishing, the coordinator may shut down first; a
  # peer that falls silent before it announced its own finish is still named.
  dog.announce("done", "")
  assert dog.verdict(t + 11)[1].startswith(
      "process 0 of 2 stopped responding: no heartbeat for 10 s")


def test_watchdog_repeats_a_failed_peers_message_and_status():
  dog = _watchdog(count=3, index=0)
  dog.record([("t5lite_watchdog/failed/2", "2|ValueError: bad config")], time.monotonic())
  assert dog.verdict(time.monotonic()) == (
      2, "process 2 of 3 failed (ValueError: bad config); stopping this one too.")


def test_watchdog_ignores_peers_that_finished():
  dog = _watchdog(count=3, index=0)
  t = time.monotonic()
  dog.record([("t5lite_watchdog/done/1", ""), ("t5lite_watchdog/stopped/2", "")], t + 50)
  assert dog.verdict(t + 55) is None


# ---------------------------------------------------------------------------
# Real processes (slow)


@pytest.mark.slow
def test_each_process_places_its_rows_of_one_global_batch(tmp_path):
  # Started from SLURM's variables with --multiprocess_gpu alone, as srun would.
  port = free_port()

  def slurm(i):
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "JAX_COORDINATOR_PORT": str(port)}

  results = run_two_processes(lambda i: ["data", "--multiprocess_gpu"], cwd=str(tmp_path),
                              script="multihost_worker.py", env_fn=slurm,
                              with_distributed_flags=False, timeout=300)
  assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
  got = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
  for i, g in enumerate(got):
    assert (g["process_index"], g["process_count"], g["devices"],
            g["local_devices"]) == (i, 2, 8, 4)
    assert (g["shard_id"], g["num_shards"]) == (i, 2)
    assert g["placed_from_local_rows"]
  rows0, rows1 = got[0]["local_rows"], got[1]["local_rows"]
  assert len(rows0) == len(rows1) == 4 and rows0 != rows1
  # Both see the same global batch, process 0's rows then process 1's: the
  # very batch one process reading everything gets (shuffled, packed and
  # span-corrupted alike), so the order does not depend on the process count.
  from multihost_worker import data_config

  from t5lite.data import datasets
  from t5lite.models import models
  whole = next(datasets.get_dataset(data_config(), 0, 1,
                                    models.EncoderDecoderModel.FEATURE_CONVERTER_CLS)
               .as_numpy_iterator())["encoder_input_tokens"].tolist()
  assert got[0]["global_rows"] == got[1]["global_rows"] == rows0 + rows1 == whole


def _kill_once_saved(job, step_dir, timeout=600):
  """SIGKILLs every process of `job` as soon as checkpoint `step_dir` is complete
  (Orbax renames a step into place when committed)."""
  deadline = time.monotonic() + timeout
  while not os.path.isdir(step_dir) and time.monotonic() < deadline:
    assert all(p.poll() is None for p in job.procs.values()), job.describe()
    time.sleep(0.05)
  job.kill_all()
  assert os.path.isdir(step_dir), job.describe()
  assert all(p.returncode == -signal.SIGKILL for p in job.procs.values()), job.describe()


def _latest_step(model_dir):
  return max(int(s) for s in os.listdir(model_dir / "checkpoints") if s.isdigit())


# The shipped headline configs as they are (their data pipelines, seeds and
# checkpoint settings, no save_dataset), shrunk by the tiny overlay to one
# layer per stack (depth changes nothing a restart restores; the MoE's one
# layer is its MoE layer, MOE_LAYER_INTERVAL 1, so that each stack routes);
# evaluation is off because it never touches the training data or state. Each config is killed
# once and restarted on the other process count: the dense fine-tuning run
# killed in 1 process and continued in 2, the MoE pretraining run (the span
# corruption pipeline, whose random preprocessing is replayed) killed in 2 and
# continued in 1, so a 1-process checkpoint continues in 2 processes and a
# 2-process checkpoint in 1, where the uninterrupted run went. The dense
# pretraining config adds nothing to these two: its model is the fine-tuning
# run's, its pipeline and optimizer the MoE run's. Restarts on the count a run was killed
# on follow the same restore path with a layout that matches; they are run in 1
# process by test_interruptions.py, test_sigterm_and_ctrl_c_checkpoint_the_
# current_step_exit_143_and_130_and_resume_loses_nothing (the losses of an
# uninterrupted run), and in 2 by
# test_sigterm_to_one_process_checkpoints_the_
# same_step_everywhere_then_a_killed_peer_stops_the_survivor (not bitwise).
@pytest.mark.slow
@pytest.mark.parametrize("headline, killed_in", [("pretrain_moe", 2), ("finetune_dense", 1)])
def test_sigkill_then_restart_on_the_other_process_count_equals_uninterrupted_run_bitwise(
    tmp_path, headline, killed_in):
  common = [f"--gin_file=gin/{headline}.gin", "--gin_file=gin/testing/local_tiny.gin",
            "--gin.TRAIN_STEPS=8", "--gin.CHECKPOINT_PERIOD=2", "--gin.EVAL_PERIOD=0",
            "--gin.STATS_PERIOD=1", "--gin.DROPOUT_RATE=0.1",
            *SHALLOW]
  if headline == "pretrain_moe":
    common.append("--gin.MOE_LAYER_INTERVAL=1")

  def args(name):
    return [*common, f"--gin.MODEL_DIR='{tmp_path / name}'"]

  # One uninterrupted reference serves both counts: on 2 devices every
  # cross-device sum adds two numbers, whose order does not matter, so 1
  # process with 2 devices and 2 processes with 1 each compute bitwise the
  # same state. The killed run starts once the reference has compiled its
  # step (the same program, then read from the compilation cache), and is
  # killed once it saved step 2; the restart, with the same command on the
  # other count, finishes.
  killed = tmp_path / "killed"
  restarted_in = 3 - killed_in
  straight = _start(args("straight"), tmp_path, "straight", 1)
  jobs = [straight]
  try:
    straight.wait_for_output(0, "step 1/8", timeout=600)
    jobs.append(_start(args("killed"), tmp_path, "killed", killed_in))
    _kill_once_saved(jobs[-1], killed / "checkpoints" / "2")
    saved = _latest_step(killed)
    jobs.append(_start(args("killed"), tmp_path, "finished", restarted_in))
    finished = _finished(jobs[-1])
    _finished(straight)
    assert_bitwise_equal(checkpoint_state(tmp_path / "straight" / "checkpoints" / "8"),
                         checkpoint_state(killed / "checkpoints" / "8"))
    # The restart really restored the killed run's step and replayed the data
    # after it.
    out = finished[0].stdout
    assert saved < 8 and re.search(rf"Restoring step {saved}\b", out), out
    assert re.search(rf"Continuing the training data at batch {saved}\b", out), out
    assert "step 8/8" in out
    # Process 0 alone reports progress and writes the run's files: one events
    # file per launch, whatever its process count.
    two_processes = jobs[1 if killed_in == 2 else 2]
    first, second = (two_processes.output(i)[0] for i in (0, 1))
    assert re.search(r"step \d/8", first)
    assert not re.search(r"step \d/8", second), second
    assert len(os.listdir(killed / "train")) == 2
  finally:  # nothing outlives a failure
    for job in jobs:
      job.kill_all()


# Two jobs in one test, so that the second (the same programs) reads what the
# first compiled from the compilation cache.
@pytest.mark.slow
def test_sigterm_to_one_process_checkpoints_the_same_step_everywhere_then_a_killed_peer_stops_the_survivor(  # noqa: E501
    tmp_path):
  model_dir = tmp_path / "run"

  def start(name, **kwargs):
    return start_job(lambda i: [*TRAIN, f"--gin.MODEL_DIR='{model_dir}'",
                                "--gin.TRAIN_STEPS=100000", "--gin.CHECKPOINT_PERIOD=50000",
                                "--gin.STATS_PERIOD=2"],
                     cwd=str(tmp_path), log_dir=str(tmp_path / "logs" / name), **kwargs)

  job = start("sigterm")
  job.wait_for_output(0, "step 4/", timeout=300)
  job.procs[1].send_signal(signal.SIGTERM)  # only process 1 is told
  results = job.wait(timeout=120)
  assert [r.returncode for r in results] == [143, 143], job.describe()
  steps = [int(s) for s in os.listdir(model_dir / "checkpoints") if s.isdigit()]
  assert len(steps) == 1 and steps[0] % 2 == 0 and steps[0] >= 4, steps
  assert f"Preempted at step {steps[0]}" in results[0].stderr, results[0].stderr[-2000:]
  saved = os.listdir(model_dir / "checkpoints" / str(steps[0]) / "dataset")
  assert sorted(n for n in saved if n.startswith("process_")) == ["process_0", "process_1"]

  # The same command restarts from that checkpoint in 2 processes; once
  # training is really under way again, process 1 is killed.
  heartbeat = 5
  job = start("sigkill", heartbeat_timeout=heartbeat)
  job.wait_for_output(0, f"step {steps[0] + 2}/", timeout=300)
  assert f"Restoring step {steps[0]}" in job.output(0)[0], job.describe()
  job.kill(1)
  killed_at = time.monotonic()
  survivor, killed = job.wait(timeout=120)
  assert killed.returncode == -9
  assert survivor.returncode == distributed.PEER_LOST_EXIT, job.describe()
  assert "process 1 of 2 stopped responding: no heartbeat for 5 s" in survivor.last_error_line()
  # Silence is noticed after `heartbeat` s; the rest is polling and exiting.
  assert survivor.ended_at - killed_at < heartbeat + 10, survivor.ended_at - killed_at


@pytest.mark.slow
def test_peer_that_never_arrives_stops_process_0_within_the_initialization_timeout(tmp_path):
  port = free_port()
  job = start_job(lambda i: [*TINY, f"--gin.MODEL_DIR='{tmp_path / 'run'}'"], cwd=str(tmp_path),
                  log_dir=str(tmp_path / "logs"), indices=[0], initialization_timeout=5,
                  port=port)
  job.wait_for_output(0, "Joining the 2-process job", timeout=120)
  joining_at = time.monotonic()
  (result,) = job.wait(timeout=120)
  assert result.returncode == distributed.PEER_LOST_EXIT, job.describe()
  assert result.last_error_line().startswith(
      f"t5lite: process 1 of 2 did not join the job at localhost:{port} within 5 s.")
  assert result.ended_at - joining_at < 5 + 5, result.ended_at - joining_at
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_failing_peer_stops_the_others_with_its_message(tmp_path):
  # Only process 1 is given a MODEL_DIR inside a file, which cannot exist.
  blocker = tmp_path / "a-file"
  blocker.write_text("")

  def args(i):
    model_dir = tmp_path / "run" if i == 0 else blocker / "run"
    return [*TRAIN, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=4"]

  started = time.monotonic()
  ok, bad = run_two_processes(args, cwd=str(tmp_path), heartbeat_timeout=60)
  assert bad.returncode == 2, bad.stderr[-3000:]
  assert f"MODEL_DIR '{blocker / 'run'}' is not writable" in bad.last_error_line()
  # Process 0 stops with the same status, naming process 1 and its reason,
  # without waiting for the 60 s heartbeat timeout.
  assert ok.returncode == 2, ok.stderr[-3000:]
  assert ok.last_error_line().startswith("t5lite: process 1 of 2 failed (ValueError: MODEL_DIR")
  assert ok.ended_at - started < 60


@pytest.mark.slow
def test_lost_coordinator_stops_the_other_process(tmp_path):
  # Process 0 hosts the coordination service. JAX notices its loss at once
  # (the service's socket closes) and aborts with its own message naming the
  # leader; on a host that vanishes without closing sockets, the watchdog
  # names it after the heartbeat timeout. Either way nothing hangs.
  heartbeat = 5
  job = start_job(lambda i: ["hold"], cwd=str(tmp_path), log_dir=str(tmp_path / "logs"),
                  script="multihost_worker.py", heartbeat_timeout=heartbeat)
  job.wait_for_output(1, "collectives running", timeout=120)
  job.kill(0)
  killed_at = time.monotonic()
  _, other = job.wait(timeout=60)
  assert other.returncode != 0
  assert ("leader task was preempted/died" in other.stderr
          or "process 0 of 2 (the coordinator at localhost:" in other.stderr), other.stderr[-3000:]
  assert other.ended_at - killed_at < heartbeat + 10
