"""One trainer per MODEL_DIR: a live holder refuses a second one, a stale lock does not."""

import json
import os
import select
import socket
import subprocess
import sys
import time

import pytest
from test_bad_input import _snapshot
from test_cli import TINY, run_cli

from t5lite import run_lock


# Holds the lock on argv[1] until its stdin closes; says "held" once it has it.
HOLDER = """
import sys
from t5lite import run_lock
with run_lock.hold(sys.argv[1], heartbeat_seconds=3600):
  print("held", flush=True)
  sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
  """A live process holding the lock of tmp_path/run."""
  model_dir = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(model_dir)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  try:
    assert select.select([proc.stdout], [], [], 60)[0], "the holder did not start"
    assert proc.stdout.readline() == "held\n"
    yield model_dir, proc.pid
  finally:
    proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def _record(model_dir):
  with open(model_dir / run_lock.LOCK_FILE) as f:
    return json.load(f)


def test_live_holder_on_this_host_refuses_and_is_named(holder):
  model_dir, pid = holder
  with pytest.raises(run_lock.ModelDirInUse,
                     match=rf"in use by another t5lite-train \(host {socket.gethostname()}, "
                     rf"pid {pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC\); wait for it"):
    run_lock.acquire(str(model_dir))
  assert _record(model_dir)["pid"] == pid  # the holder's record is left alone


def test_lock_is_released_and_removed_at_exit(tmp_path):
  model_dir = tmp_path / "run"
  with run_lock.hold(str(model_dir)):
    assert _record(model_dir)["pid"] == os.getpid()
    with pytest.raises(run_lock.ModelDirInUse):  # a second holder, even in this process
      run_lock.acquire(str(model_dir))
  assert not model_dir.exists()  # created for the lock, left empty: removed
  (model_dir / "checkpoints").mkdir(parents=True)
  with run_lock.hold(str(model_dir)):
    pass
  assert os.listdir(model_dir) == ["checkpoints"]


def _write_record(model_dir, host, pid, age=0.0):
  model_dir.mkdir(parents=True, exist_ok=True)
  path = model_dir / run_lock.LOCK_FILE
  path.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - age}))
  os.utime(path, (time.time() - age, time.time() - age))


def _dead_pid():
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, timeout=60, check=True)
  return int(proc.stdout)


def test_stale_lock_of_a_dead_process_is_taken_over_with_one_line(tmp_path):
  model_dir = tmp_path / "run"
  dead = _dead_pid()
  _write_record(model_dir, socket.gethostname(), dead)
  lines = []
  lock = run_lock.acquire(str(model_dir), log=lines.append)
  try:
    assert _record(model_dir)["pid"] == os.getpid()
  finally:
    lock.release()
  assert len(lines) == 1 and f"pid {dead}" in lines[0] and "gone" in lines[0]


def test_other_host_counts_as_alive_until_its_heartbeat_is_stale(tmp_path):
  model_dir = tmp_path / "run"
  _write_record(model_dir, "node-17", 4242, age=10)
  with pytest.raises(run_lock.ModelDirInUse, match=r"host node-17, pid 4242"):
    run_lock.acquire(str(model_dir))
  _write_record(model_dir, "node-17", 4242, age=run_lock.STALE_AFTER_SECONDS + 10)
  lines = []
  run_lock.acquire(str(model_dir), log=lines.append).release()
  assert len(lines) == 1 and "host node-17, pid 4242" in lines[0]


def test_heartbeat_refreshes_the_lock_file(tmp_path):
  model_dir = tmp_path / "run"
  lock = run_lock.acquire(str(model_dir), heartbeat_seconds=0.05)
  try:
    path = model_dir / run_lock.LOCK_FILE
    os.utime(path, (0, 0))
    deadline = time.time() + 30
    while os.stat(path).st_mtime == 0 and time.time() < deadline:
      time.sleep(0.05)
    assert os.stat(path).st_mtime > 0
  finally:
    lock.release()


@pytest.mark.slow
def test_second_trainer_exits_2_naming_the_holder_and_writes_nothing(holder, tmp_path):
  model_dir, pid = holder
  before = _snapshot(model_dir)
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{model_dir}'"], cwd=str(tmp_path), timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert f"is in use by another t5lite-train (host {socket.gethostname()}, pid {pid}," in last
  assert _snapshot(model_dir) == before


# A Ctrl-C after the lock file is created, before this process holds it
# (while it writes its name into it): the signal itself, or the re-check
# (SIGALRM) of a Ctrl-C that came during an import and was put off until
# the import was done (`console`).
_CTRL_C_WHILE_TAKING = """
import os, signal, sys
# As a shell starts a command: Ctrl-C's default handling, nothing blocked,
# whatever this test's process inherited from the test runner.
print("inherited:", signal.getsignal(signal.SIGINT),
      sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), file=sys.stderr)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGALRM])
signal.signal(signal.SIGINT, signal.default_int_handler)
from t5lite import console, run_lock
signal.signal(signal.SIGALRM, console._interrupt_outside_imports)
write = run_lock._write_holder
def write_after_ctrl_c(fd, holder):
  os.kill(os.getpid(), getattr(signal, sys.argv[2]))
  write(fd, holder)
run_lock._write_holder = write_after_ctrl_c
try:
  with run_lock.hold(sys.argv[1]):
    print("ran the phase", flush=True)
except KeyboardInterrupt:
  print("KeyboardInterrupt; left behind:", os.path.exists(sys.argv[1]), flush=True)
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGALRM"])
def test_ctrl_c_while_the_lock_is_taken_leaves_no_lock_behind(tmp_path, signal_name):
  out = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_TAKING, str(tmp_path / "run"),
                        signal_name], capture_output=True, text=True, timeout=120)
  # The interrupt waits for the lock to be held, then releases it (and the
  # directory it created) on its way out.
  assert out.stdout == "KeyboardInterrupt; left behind: False\n", out.stderr[-3000:]
