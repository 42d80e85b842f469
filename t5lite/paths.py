"""Paths that name a local file or an object in a Google Cloud Storage bucket.

t5lite reads and writes the files of a run, checkpoints, imports and gin
files through `etils.epath`, the path type Orbax itself uses, so
`gs://bucket/dir` and `/mnt/dir` take the same code. Objects in a bucket go
through fsspec's `gcsfs` and the arrays in them through TensorStore's `gcs`
driver; both authenticate with the cloud library's application default
credentials and honour the emulator settings of their libraries
(`STORAGE_EMULATOR_HOST`, `TENSORSTORE_GCS_HTTP_URL`).

etils would send `gs://` through TensorFlow's file system whenever
TensorFlow is installed (it always is: SeqIO's data engine). That client's
endpoint is compiled in, so nothing but Google's servers can answer it, and
it would be a second copy of every request path beside TensorStore's. This
module makes etils use fsspec instead (`EPATH_USE_TF=false`, before etils
first looks at it); a user who has set the variable keeps their choice. It
also turns off gcsfs's cache of listings, which would hide what other
processes write.

Every path a command takes can be in a bucket; `check_scheme` refuses a
URL of any other storage in one line before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import fsspec.config
from etils import epath

from t5lite.errors import UserError


# etils reads this at the first `gs://` path it opens, which comes later.
os.environ.setdefault("EPATH_USE_TF", "false")
# gcsfs would otherwise answer listings and existence checks from what this
# process listed before, blind to what another process (a restarted job, the
# other hosts of a job) wrote since.
fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)
# gcsfs logs each request that runs out of retries with its traceback, then
# raises; what raises reaches t5lite, which names the file and the reason in
# its one line.
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)

# `gs://bucket/dir`, `s3://...`, `hdfs://...`: a scheme, then "://".
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The schemes every layer t5lite reads through supports: etils/gcsfs for
# files, TensorStore for arrays, Orbax for its checkpoints. Orbax builds its
# TensorStore spec for gs:// alone and takes any other path for a local one
# (an s3:// directory fails its "should be absolute" check), so s3:// is
# refused whatever etils and TensorStore could do.
SCHEMES = ("gs",)

Path = epath.Path


def scheme(path: str | os.PathLike[str]) -> str | None:
  """'gs' for `gs://bucket/x`, None for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else None


def is_url(path: str | os.PathLike[str] | None) -> bool:
  """Whether `path` is a URL (`gs://...`) rather than a local path."""
  return bool(path) and scheme(path) is not None


def check_scheme(name: str, path: str | None) -> None:
  """Refuses a URL of a storage t5lite cannot read or write, before anything
  starts.

  Raises:
    UserError: `path` is a URL whose scheme is not in `SCHEMES`.
  """
  if path and is_url(path) and scheme(path) not in SCHEMES:
    raise UserError(
        f"{name} '{path}' is a {scheme(path)}:// URL; t5lite reads and writes gs:// buckets "
        "and local or mounted paths only: mount that storage with a FUSE client and give the "
        "mount's path (docs/checkpoints.md, \"Buckets\").")


def absolute(path: str) -> str:
  """`path` made absolute: a local path against the working directory, a URL as it is
  (without a trailing slash)."""
  if is_url(path):
    return path.rstrip("/")
  return os.path.abspath(path)


def join(path: str, *names: str) -> str:
  """`os.path.join` for local paths and URLs alike."""
  if is_url(path):
    return "/".join([path.rstrip("/"), *names])
  return os.path.join(path, *names)


def parent(path: str) -> str:
  """The directory holding `path`, for local paths and URLs alike."""
  if is_url(path):
    return path.rstrip("/").rsplit("/", 1)[0]
  return os.path.dirname(path)


def name(path: str) -> str:
  """The last component of `path`, for local paths and URLs alike."""
  return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(
      os.path.normpath(path))


def kvstore(directory: str) -> str:
  """The TensorStore key-value store URL of `directory`, ending in '/'."""
  if is_url(directory):
    return directory.rstrip("/") + "/"
  return "file://" + os.path.abspath(directory).rstrip("/") + "/"


def _copy(source: str, target: str) -> None:
  """Copies the file `source` to `target`, either local or in a bucket, in
  chunks (a checkpoint's files can be large)."""
  with Path(source).open("rb") as reader, Path(target).open("wb") as writer:
    shutil.copyfileobj(reader, writer, 16 << 20)


class LocalCopies:
  """Local files with the contents of paths: a local path is its own file, an
  object in a bucket is copied once into a private temporary folder, removed
  when this object is collected.

  For readers that need a file of the operating system (safetensors maps its
  files into memory and reads only the tensors asked for).
  """

  def __init__(self):
    self._folder: tempfile.TemporaryDirectory[str] | None = None
    self._copies: dict[str, str] = {}

  def file(self, path: str) -> str:
    """A local file holding what `path` holds."""
    if not is_url(path):
      return path
    if path not in self._copies:
      if self._folder is None:
        self._folder = tempfile.TemporaryDirectory(prefix="t5lite-")
      copy = os.path.join(self._folder.name, f"{len(self._copies)}-{name(path)}")
      _copy(path, copy)
      self._copies[path] = copy
    return self._copies[path]


def write_whole(path: str, text: str) -> None:
  """Writes `text` to `path` whole or not at all: a write that fails (a full
  disk) or is interrupted leaves an earlier file as it was.

  A local file is written beside and renamed into place. An object in a
  bucket is replaced by one upload, which readers see whole or not at all.
  """
  if is_url(path):
    Path(path).write_text(text)
    return
  try:
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(path + ".tmp")
    raise


def makedirs(path: str) -> None:
  """`os.makedirs(path, exist_ok=True)`; nothing for a bucket, which has no
  directories (an object's name holds its folders)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


class Mirror:
  """A local folder for writers that write only local files, copied to
  `target` when asked: TensorFlow's writers, through which TensorBoard events
  and seqio's JSONL go, since TensorFlow's own `gs://` client is not used
  (see the module docstring).

  For a local `target` the folder is `target` itself and `sync` does
  nothing. For a bucket it is a private temporary folder, and `sync` uploads
  each file that changed since the last `sync`, whole: an object is replaced
  in one upload, so a reader sees the file as of some `sync`.

  Attributes:
    target: where the files belong.
    local: where writers write them.
  """

  def __init__(self, target: str):
    self.target = target
    self._folder = tempfile.TemporaryDirectory(prefix="t5lite-") if is_url(target) else None
    self.local = self._folder.name if self._folder else target
    self._synced: dict[str, tuple[int, int]] = {}

  def sync(self) -> None:
    """Uploads what changed (a no-op for a local target).

    Raises:
      OSError: an upload failed.
    """
    if self._folder is None:
      return
    for root, _, files in os.walk(self.local):
      for file in files:
        local = os.path.join(root, file)
        relative = os.path.relpath(local, self.local)
        stat = os.stat(local)
        if self._synced.get(relative) == (stat.st_size, stat.st_mtime_ns):
          continue
        _copy(local, join(self.target, *relative.split(os.sep)))
        self._synced[relative] = (stat.st_size, stat.st_mtime_ns)

  def close(self) -> None:
    """A last `sync`, then the local folder of a bucket target is removed."""
    try:
      self.sync()
    finally:
      if self._folder is not None:
        self._folder.cleanup()


def files_under(folder: epath.Path) -> Iterator[epath.Path]:
  """Every file under `folder`, at any depth (etils globs no `**` in a bucket)."""
  for child in folder.iterdir():
    if child.is_dir():
      yield from files_under(child)
    else:
      yield child


def copy_tree(source: str, destination: str) -> list[epath.Path]:
  """Copies the file or folder `source` to `destination`, file by file, either
  side local or in a bucket; returns the files copied."""
  root = Path(source)
  files = list(files_under(root)) if root.is_dir() else [root]
  for file in files:
    relative = os.fspath(file)[len(os.fspath(root)):].lstrip("/")
    target = join(destination, *relative.split("/")) if relative else destination
    if not is_url(target):
      os.makedirs(os.path.dirname(target), exist_ok=True)
    _copy(os.fspath(file), target)
  return files


def move(source: str, destination: str) -> None:
  """Renames the file or folder `source` to `destination`.

  A bucket has no rename: each object under `source` is copied, then all are
  removed, so an interruption leaves both copies, never neither.
  """
  if not is_url(source):
    os.rename(source, destination)
    return
  for file in copy_tree(source, destination):
    file.unlink()
