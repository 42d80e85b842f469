"""One trainer per MODEL_DIR: an exclusive lock file, MODEL_DIR/train.lock.

The file records who holds it (host, pid, start time) for the message a
second trainer prints. Liveness on the same host comes from an OS lock
(`fcntl.flock`) on the file: the kernel drops it when the holder dies, even
by SIGKILL, so a lock left by a killed job never blocks a restart. A holder
on another host of a shared filesystem (where flock may not reach across
hosts) counts as alive while it refreshes the file's modification time, every
`HEARTBEAT_SECONDS`; a file from another host not refreshed for
`STALE_AFTER_SECONDS` is taken over. The holder removes the file when done.

A MODEL_DIR in a bucket (`gs://`) has no file locks: the lock is an object
created only if none exists (a generation precondition, which the bucket
checks atomically). Its holder rewrites it every `HEARTBEAT_SECONDS`, each
time only over the generation it wrote; a lock object of a dead process on
this host, or of any holder that has not rewritten it for
`STALE_AFTER_SECONDS`, is taken over. A trainer killed on one host is
restarted at once on the same host, after `STALE_AFTER_SECONDS` on another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

from t5lite import console, paths, write_errors
from t5lite.errors import UserError


LOCK_FILE = "train.lock"
HEARTBEAT_SECONDS = 30.0
# Several missed heartbeats, and room for clock skew between hosts.
STALE_AFTER_SECONDS = 300.0
OBJECT_RETRY_SECONDS = 20.0


class ModelDirInUse(UserError):
  """Another live trainer holds the MODEL_DIR (a user error: exit 2)."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds (or held) a lock file."""

  host: str
  pid: int
  started: float

  def describe(self) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
    return f"host {self.host}, pid {self.pid}, started {when}"


def _this_process() -> Holder:
  return Holder(host=socket.gethostname(), pid=os.getpid(), started=time.time())


def _read_holder(fd: int) -> Holder | None:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode("utf-8", "replace")
  try:
    record = json.loads(text)
    return Holder(host=str(record["host"]), pid=int(record["pid"]),
                  started=float(record["started"]))
  except (ValueError, KeyError, TypeError):
    return None  # empty (being written) or not ours: nothing to name


def _write_holder(fd: int, holder: Holder) -> None:
  os.ftruncate(fd, 0)
  os.lseek(fd, 0, os.SEEK_SET)
  os.write(fd, json.dumps(dataclasses.asdict(holder)).encode() + b"\n")
  os.fsync(fd)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _flock(fd: int) -> bool | None:
  """True: locked; False: another process holds it; None: the filesystem
  has no flock (then only the recorded holder tells)."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError as error:
    if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    return None


def _live_holder(fd: int, locked: bool | None, me: Holder) -> Holder | None:
  """The recorded holder if it is still alive, given what flock said."""
  holder = _read_holder(fd)
  if locked is False:
    return holder or Holder(host="unknown", pid=0, started=os.fstat(fd).st_mtime)
  if holder is None or holder.pid == me.pid and holder.host == me.host:
    return None
  if holder.host == me.host:
    # flock said free, so the holder is gone; without flock ask the kernel.
    return holder if locked is None and _pid_alive(holder.pid) else None
  age = time.time() - os.fstat(fd).st_mtime
  return holder if age < STALE_AFTER_SECONDS else None


def _same_file(fd: int, path: str) -> bool:
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


class _Heartbeat:
  """Calls `_refresh` every `seconds` on a daemon thread, until it answers
  False or `_stop_beating`."""

  def _start_beating(self, seconds: float) -> None:
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, args=(seconds,), name="t5lite-run-lock",
                                    daemon=True)
    self._thread.start()

  def _beat(self, seconds: float) -> None:
    while not self._stop.wait(seconds):
      if not self._refresh():
        return

  def _refresh(self) -> bool:
    raise NotImplementedError

  def _stop_beating(self) -> None:
    self._stop.set()
    self._thread.join()


class _Lock(_Heartbeat):
  """A held lock: the open file and the heartbeat thread refreshing it."""

  def __init__(self, fd: int, path: str, created_dir: str | None, heartbeat_seconds: float):
    self._fd = fd
    self._path = path
    self._created_dir = created_dir
    self._start_beating(heartbeat_seconds)

  def _refresh(self) -> bool:
    with contextlib.suppress(OSError):
      os.utime(self._path)
    return True

  def release(self) -> None:
    self._stop_beating()
    with contextlib.suppress(OSError):
      if _same_file(self._fd, self._path):
        os.unlink(self._path)  # before the unlock: a waiter re-checks the inode
    os.close(self._fd)
    if self._created_dir:
      with contextlib.suppress(OSError):
        os.rmdir(self._created_dir)  # only if still empty: the run wrote nothing


class _ObjectLock(_Heartbeat):
  """A held lock object in a bucket and the heartbeat thread rewriting it."""

  def __init__(self, blob: Any, record: str, heartbeat_seconds: float):
    self._blob = blob
    self._record = record
    self._start_beating(heartbeat_seconds)

  def _refresh(self) -> bool:
    from google.api_core import exceptions
    try:  # only over the generation this holder wrote last
      self._blob.upload_from_string(self._record, if_generation_match=self._blob.generation,
                                    retry=_object_retry())
    except exceptions.PreconditionFailed:
      logging.warning("The lock %s was taken over by another trainer.", self._blob.name)
      return False
    except (exceptions.GoogleAPIError, OSError) as error:  # the next beat tries again
      logging.warning("Could not refresh the lock %s: %s", self._blob.name, error)
    return True

  def release(self) -> None:
    """Removes the lock object. A bucket that cannot be reached (the run is
    stopping because of it, as likely as not) leaves it behind, with a
    warning: a restart on this host takes it over at once, another host
    after `STALE_AFTER_SECONDS`."""
    from google.api_core import exceptions
    self._stop_beating()
    try:
      self._blob.delete(if_generation_match=self._blob.generation, retry=_object_retry())
    except (exceptions.NotFound, exceptions.PreconditionFailed):
      pass  # taken over meanwhile: not ours to remove
    except (exceptions.GoogleAPIError, OSError) as error:
      logging.warning("Could not remove the lock %s (%s); a restart on this host takes it "
                      "over, one on another host after %d s.", _blob_url(self._blob),
                      write_errors.reason(error), STALE_AFTER_SECONDS)


def _object_retry() -> Any:
  """Retries of a request about the lock object, for `OBJECT_RETRY_SECONDS`
  (the library's default is 120 s: with the bucket out of reach, a run that
  stops would wait that long twice, for the last heartbeat and the removal)."""
  from google.cloud.storage.retry import DEFAULT_RETRY
  return DEFAULT_RETRY.with_timeout(OBJECT_RETRY_SECONDS)


def _stale_object(blob: Any, me: Holder) -> Holder | None:
  """The holder a lock object names, if that holder is gone; else raises."""
  from google.api_core import exceptions
  try:
    blob.reload()  # its generation and the time of its last heartbeat
    text = blob.download_as_text(if_generation_match=blob.generation)
  except (exceptions.NotFound, exceptions.PreconditionFailed):
    return None  # released or rewritten meanwhile: look again
  try:
    record = json.loads(text)
    holder = Holder(host=str(record["host"]), pid=int(record["pid"]),
                    started=float(record["started"]))
  except (ValueError, KeyError, TypeError):
    holder = Holder(host="unknown", pid=0, started=blob.updated.timestamp())
  if holder.host == me.host:
    alive = _pid_alive(holder.pid)  # this process too: another acquire holds it
  else:
    alive = time.time() - blob.updated.timestamp() < STALE_AFTER_SECONDS
  if alive:
    raise ModelDirInUse(
        f"MODEL_DIR '{paths.parent(_blob_url(blob))}' is in use by another t5lite-train "
        f"({holder.describe()}); wait for it to finish or stop it, or choose another MODEL_DIR.")
  return holder


def _blob_url(blob: Any) -> str:
  return f"gs://{blob.bucket.name}/{blob.name}"


def _acquire_object(model_dir: str, log: Callable[[str], None], heartbeat_seconds: float
                    ) -> _ObjectLock:
  """`acquire` for a MODEL_DIR in a bucket."""
  from google.api_core import exceptions
  from google.cloud import storage
  bucket, _, folder = model_dir.removeprefix("gs://").partition("/")
  blob = storage.Client().bucket(bucket).blob(
      "/".join(p for p in (folder.strip("/"), LOCK_FILE) if p))
  me = _this_process()
  record = json.dumps(dataclasses.asdict(me)) + "\n"
  precondition = 0  # create only if there is no lock object
  for _ in range(5):
    try:
      with write_errors.writing("the run lock", _blob_url(blob)):
        blob.upload_from_string(record, if_generation_match=precondition)
      return _ObjectLock(blob, record, heartbeat_seconds)
    except exceptions.PreconditionFailed:
      pass
    stale = _stale_object(blob, me)
    if stale is None:
      precondition = 0
      continue
    log(f"Taking over the lock of a trainer that is gone ({stale.describe()}) in "
        f"{_blob_url(blob)}.")
    precondition = blob.generation
  raise ModelDirInUse(f"Could not take the lock {_blob_url(blob)}: it keeps changing; is "
                      "another t5lite-train starting on the same MODEL_DIR?")


def acquire(model_dir: str, log: Callable[[str], None] = logging.warning,
            heartbeat_seconds: float = HEARTBEAT_SECONDS) -> _Lock | _ObjectLock:
  """Takes MODEL_DIR's lock, creating MODEL_DIR if needed.

  Args:
    model_dir: the run's directory.
    log: gets one line when a stale lock (its holder dead) is taken over.
    heartbeat_seconds: how often the holder refreshes the file's mtime.

  Returns:
    The held lock; call `release()` (or use `hold`).

  Raises:
    ModelDirInUse: a live trainer holds it; the message names it.
    write_errors.WriteError: the lock file could not be written.
  """
  if paths.is_url(model_dir):
    return _acquire_object(model_dir, log, heartbeat_seconds)
  path = os.path.join(model_dir, LOCK_FILE)
  me = _this_process()
  for _ in range(5):  # the holder may remove the file (or MODEL_DIR) as we open it
    created = None if os.path.isdir(model_dir) else os.path.abspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
      continue
    locked = _flock(fd)
    if locked and not _same_file(fd, path):
      os.close(fd)
      continue
    holder = _live_holder(fd, locked, me)
    if holder is not None:
      os.close(fd)
      raise ModelDirInUse(
          f"MODEL_DIR '{model_dir}' is in use by another t5lite-train ({holder.describe()}); "
          "wait for it to finish or stop it, or choose another MODEL_DIR.")
    stale = _read_holder(fd)
    if stale is not None and (stale.host, stale.pid) != (me.host, me.pid):
      log(f"Taking over the lock of a trainer that is gone ({stale.describe()}) in {path}.")
    try:
      _write_holder(fd, me)
    except OSError as error:  # a full or read-only disk: the run could write nothing
      with contextlib.suppress(OSError):
        if _same_file(fd, path):
          os.unlink(path)  # no empty lock file left behind to puzzle the next run
      os.close(fd)
      raise write_errors.write_failed("the run lock", path, None, error) from error
    return _Lock(fd, path, created, heartbeat_seconds)
  raise ModelDirInUse(f"Could not take the lock {path}: it keeps changing; is another "
                      "t5lite-train starting on the same MODEL_DIR?")


@contextlib.contextmanager
def hold(model_dir: str, enabled: bool = True, log: Callable[[str], None] = logging.warning,
         heartbeat_seconds: float = HEARTBEAT_SECONDS) -> Iterator[None]:
  """`acquire` for the duration of a `with` block; nothing when not enabled
  (processes other than 0 of a multi-process job)."""
  if not enabled:
    yield
    return
  lock = None
  try:
    with console.interrupts_held():
      lock = acquire(model_dir, log=log, heartbeat_seconds=heartbeat_seconds)
    yield
  finally:
    if lock is not None:
      with console.interrupts_held():
        lock.release()
