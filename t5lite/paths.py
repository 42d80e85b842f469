"""Paths that name a local file or an object in a Google Cloud Storage bucket.

t5lite reads checkpoints, imports and gin files through `etils.epath`, the
path type Orbax itself uses, so `gs://bucket/dir` and `/mnt/dir` take the
same code. Objects in a bucket are read through fsspec's `gcsfs` and the
arrays in them through TensorStore's `gcs` driver; both authenticate with
the cloud library's application default credentials and honour the emulator
settings of their libraries (`STORAGE_EMULATOR_HOST`,
`TENSORSTORE_GCS_HTTP_URL`).

etils would send `gs://` through TensorFlow's file system whenever
TensorFlow is installed (it always is: SeqIO's data engine). That client's
endpoint is compiled in, so nothing but Google's servers can answer it, and
it would be a second copy of every request path beside TensorStore's. This
module makes etils use fsspec instead (`EPATH_USE_TF=false`, before etils
first looks at it); a user who has set the variable keeps their choice.

Writing to a bucket (MODEL_DIR, exports, predictions) is not supported yet:
`refuse_url` stops such a path in one line before anything starts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from etils import epath

from t5lite.errors import UserError


# etils reads this at the first `gs://` path it opens, which comes later.
os.environ.setdefault("EPATH_USE_TF", "false")

# `gs://bucket/dir`, `s3://...`, `hdfs://...`: a scheme, then "://".
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The schemes every layer t5lite reads through supports: etils/gcsfs for
# files, TensorStore for arrays, Orbax for its checkpoints.
READABLE_SCHEMES = ("gs",)

Path = epath.Path


def scheme(path: str | os.PathLike[str]) -> str | None:
  """'gs' for `gs://bucket/x`, None for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else None


def is_url(path: str | os.PathLike[str] | None) -> bool:
  """Whether `path` is a URL (`gs://...`) rather than a local path."""
  return bool(path) and scheme(path) is not None


def check_readable(name: str, path: str | None) -> None:
  """Refuses a URL of a storage t5lite cannot read, before anything starts.

  Raises:
    UserError: `path` is a URL whose scheme is not in `READABLE_SCHEMES`.
  """
  if path and is_url(path) and scheme(path) not in READABLE_SCHEMES:
    raise UserError(
        f"{name} '{path}' is a {scheme(path)}:// URL; t5lite reads gs:// buckets and local or "
        "mounted paths only: mount that storage with a FUSE client and give the mount's path "
        "(docs/checkpoints.md, \"Buckets\").")


def refuse_url(name: str, path: str | None) -> None:
  """Refuses a URL where t5lite does not take one yet (it writes only local files).

  Checked before anything is read or written, so that a URL is never taken
  for a relative local directory `gs:` under the working directory.

  Raises:
    UserError: `path` is a URL.
  """
  if is_url(path):
    raise UserError(f"{name} '{path}' is a URL; t5lite reads checkpoints from gs:// buckets, "
                    "but this path must be local or mounted (a bucket mounted with a FUSE "
                    "client such as gcsfuse works): give the path of the mount "
                    "(docs/checkpoints.md, \"Buckets\").")


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
      with Path(path).open("rb") as source, open(copy, "wb") as target:
        shutil.copyfileobj(source, target, 16 << 20)
      self._copies[path] = copy
    return self._copies[path]
