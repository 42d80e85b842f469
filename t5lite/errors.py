"""Errors in what the user gave t5lite: one line and exit status 2.

t5lite raises `UserError` on purpose where it checks the user's input: flags,
gin files and bindings, the run's settings against the model, the mesh and
the data, checkpoints, vocabularies and input files. The console scripts
print it as one line naming the problem and the fix, and exit with status 2.
Any other exception is a bug, in t5lite or in a library, and shows its
traceback (exit status 1): a shape error hours into training must never read
like a typo.

A `ValueError`, so that Python code calling t5lite and catching
`ValueError` for bad arguments keeps working.
"""

import re


class UserError(ValueError):
  """Input the user got wrong; the message names the problem and the fix."""


# `gs://bucket/dir`, `s3://...`, `hdfs://...`: a scheme, then "://".
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def refuse_url(name: str, path: str | None) -> None:
  """Refuses an object-storage URL where t5lite needs a local path.

  t5lite reads and writes its files with Python's `os` and `open`, which
  would take `gs://bucket/run` for a relative local path and write a
  directory `gs:` under the working directory. Checked before anything is
  read or written.

  Raises:
    UserError: `path` is a URL.
  """
  if path and _URL.match(str(path)):
    raise UserError(f"{name} '{path}' is a URL; t5lite reads and writes local or mounted "
                    "paths only (a bucket mounted with a FUSE client such as gcsfuse works): "
                    "give the path of the mount, see docs/checkpoints.md, \"MODEL_DIR on a "
                    "remote filesystem\".")
