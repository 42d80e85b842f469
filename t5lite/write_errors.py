"""A write under MODEL_DIR that failed, whichever writer met the failure.

A full or read-only disk is one fault, whether the checkpoint, a TensorBoard
event file, config.gin, model-info.txt, the evaluation JSONL or the run lock
meets it first. Each writer turns the failure into a `WriteError` naming what
could not be written, where, at which step and the system's reason; the CLI
prints it as one line and exits with status 5 (README, exit status).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from t5lite import paths


_RERUN = "then rerun the same command; it resumes from the newest complete checkpoint."
ADVICE = f"Free disk space or make the directory writable (a file in its place must go), {_RERUN}"
BUCKET_ADVICE = f"Check that the bucket can be reached and written with these credentials, {_RERUN}"


def advice(where: str) -> str:
  """What to do about a failed write to `where`, a local path or a URL."""
  return BUCKET_ADVICE if paths.is_url(where) else ADVICE


# TensorFlow's errors start with the op that met them, "{{function_node ...}}".
_TF_OP_NAME = re.compile(r"^\{\{function_node [^}]*\}\}\s*")


class WriteError(OSError):
  """A file under MODEL_DIR could not be written: full or read-only disk, a
  vanished directory, or a file where a directory should be."""


def reason(error: BaseException) -> str:
  """The first line of an error, for a one-line message."""
  lines = _TF_OP_NAME.sub("", str(error)).strip().splitlines()
  text = " ".join(lines[0].split()) if lines else type(error).__name__
  # TensorStore and TensorFlow put the OS's reason ("No space left on device") last.
  return text if len(text) <= 400 else f"{text[:240]} ... {text[-150:]}"


def write_failed(what: str, where: str, step: int | None, error: BaseException) -> WriteError:
  """The one-line error for a failed write.

  Args:
    what: what was being written, e.g. 'TensorBoard summaries'.
    where: the file or directory.
    step: the training step the run was at; None when it has none.
    error: what the writer raised.
  """
  at = f" at step {step}" if step is not None else ""
  return WriteError(f"Could not write {what} to {where}{at}: {reason(error)}. {advice(where)}")


@contextlib.contextmanager
def writing(what: str, where: str, step: int | None = None) -> Iterator[None]:
  """Turns an OSError of the block into `write_failed(what, where, step, ...)`.

  Raises:
    WriteError: the block failed to write.
  """
  try:
    yield
  except WriteError:
    raise
  except OSError as error:
    raise write_failed(what, where, step, error) from error
