"""What every t5lite console script does around its work: flags and Ctrl-C.

A mistyped flag is one line naming the closest known flag (exit 2), not
absl's two-line usage error (exit 1); a Ctrl-C at any moment before the
training loop takes it over (imports, gin parsing, tracing, compiling,
restoring) is one line and exit 130, not a `KeyboardInterrupt` traceback.

The entry functions of the console scripts (setup.py) are the outermost code
t5lite controls, so the handling starts there. Kept apart from `cli` so that
t5lite-vocab and t5lite-import share it without t5lite-train's flags.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from absl import app, flags

from t5lite.errors import UserError


USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what shells report for Ctrl-C


def closest_flag(name: str, known: Sequence[str]) -> str | None:
  """The known flag most like `name` (difflib's ratio, at least 0.6), or None."""
  close = difflib.get_close_matches(name, known, n=1)
  return close[0] if close else None


def flag_error_line(error: flags.Error, known: Sequence[str]) -> str:
  """absl's flag error as one line; an unknown flag gets the closest known one."""
  if isinstance(error, flags.UnrecognizedFlagError):
    close = closest_flag(error.flagname, known)
    hint = f"; did you mean --{close}?" if close else "."
    return f"Unknown flag --{error.flagname}{hint} --helpshort lists the flags."
  return f"{' '.join(str(error).split())}. --helpshort lists the flags."


def one_line(error: BaseException) -> str:
  """An error as one line: its class and message, whitespace squeezed, gin's
  call-site note dropped.

  A plain `UserError` is named `ValueError` (the family says how t5lite
  treats it, not what went wrong); its subclasses by their own names.
  """
  text = " ".join(str(error).split()).split(" In call to configurable ")[0]
  # Gin re-raises an error from a configurable as a subclass of it with the
  # same name (from gin.utils in older versions).
  name = next(c.__name__ for c in type(error).__mro__
              if c.__module__ != "gin.utils" and c.__name__ != UserError.__name__)
  return f"{name}: {text}"


def exit_on_user_error(program: str, work: Callable[[], str]) -> None:
  """Prints what `work` returns; a `UserError` it raises is one line and exit 2.

  For the console scripts that join no job (t5lite-vocab, t5lite-import);
  any other exception keeps its traceback.
  """
  try:
    text = work()
  except UserError as error:
    print(f"{program}: {one_line(error)}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)
  print(text)


def parse_flags(argv: Sequence[str], program: str) -> list[str]:
  """absl's flags parser, with a flag error as one line and exit 2.

  Args:
    argv: the command line, program name first.
    program: what the line starts with, e.g. `t5lite`.

  Returns:
    The arguments left after the flags, program name first.
  """
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as error:
    known = sorted(name for name in flags.FLAGS if len(name) > 1)
    print(f"{program}: {flag_error_line(error, known)}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def _importing(frame: FrameType | None) -> bool:
  """Whether `frame` runs inside an import: importlib's frames are below it."""
  while frame is not None:
    if frame.f_code.co_filename.startswith("<frozen importlib"):
      return True
    frame = frame.f_back
  return False


# How often a Ctrl-C that came during an import looks again whether the
# import is done.
_RECHECK_SECONDS = 0.05


def _first_ctrl_c(signum: int, frame: FrameType | None) -> None:
  # From now on SIGINT has the system's default action: a second Ctrl-C ends
  # the process at once, even in the middle of reporting the first.
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  _interrupt_outside_imports(signum, frame)


def _interrupt_outside_imports(signum: int, frame: FrameType | None) -> None:
  """Raises KeyboardInterrupt, or, during an import, a moment after it.

  An exception raised into a C extension's initialisation can crash the
  interpreter (jaxlib's does, with a segmentation fault); so while an import
  runs, a timer brings this function back until it is done.
  """
  if _importing(frame):
    _interrupt_a_moment_later()
    return
  raise KeyboardInterrupt


def _interrupt_a_moment_later() -> None:
  signal.signal(signal.SIGALRM, _interrupt_outside_imports)
  signal.setitimer(signal.ITIMER_REAL, _RECHECK_SECONDS)


def _redeliver_lost_interrupts(
    hook: Callable[[Any], None]) -> Callable[[Any], None]:
  """`sys.unraisablehook` that raises again, a moment later, a
  KeyboardInterrupt Python could not pass on.

  A signal handler runs wherever the main thread is, also in a garbage
  collector callback (JAX registers one) or a `__del__`; an exception raised
  there is reported as unraisable and dropped, and the Ctrl-C with it.
  """
  def unraisable(report: Any) -> None:
    if (report.exc_type is KeyboardInterrupt
        and threading.current_thread() is threading.main_thread()):
      _interrupt_a_moment_later()
      return
    hook(report)
  return unraisable


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
  """A Ctrl-C within the block takes effect at its end.

  For steps that must not be cut in two, such as creating the run lock's file
  and writing this process's name into it. Both ways a Ctrl-C arrives are
  held: SIGINT itself, and the re-check (SIGALRM) of one that came during an
  import (`_interrupt_outside_imports`).
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # only the main thread runs Python's signal handlers
    return
  caught: list[int] = []
  held = (signal.SIGINT, signal.SIGALRM)
  previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
              for signum in held}
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    for signum in dict.fromkeys(caught):
      signal.raise_signal(signum)  # to the handler it was meant for


@contextlib.contextmanager
def ctrl_c_as_one_line(interrupted: Callable[[], None]) -> Iterator[None]:
  """Within the block, a Ctrl-C that nothing else took over ends the process
  through `interrupted` instead of a `KeyboardInterrupt` traceback.

  The training loop takes SIGINT over (it saves the current step first);
  everywhere else (imports, gin parsing, tracing, compiling, restoring) the
  interrupt unwinds the stack, so locks are released and temporary files
  removed on the way, and `interrupted` is called at the top. An import
  under way is finished first (`_interrupt_outside_imports`), and an
  interrupt raised where Python drops it is raised again
  (`_redeliver_lost_interrupts`).

  Args:
    interrupted: prints the one line and ends the process with
      INTERRUPTED_EXIT; it is called with SIGINT back at the system's default
      action, so a second Ctrl-C ends the process at once.
  """
  signal.signal(signal.SIGINT, _first_ctrl_c)
  sys.unraisablehook = _redeliver_lost_interrupts(sys.unraisablehook)
  try:
    yield
  except KeyboardInterrupt:
    interrupted()


def run(main: Callable[[list[str]], None], argv: Sequence[str], program: str) -> None:
  """`app.run(main)` with a flag error as one line and exit 2 (`parse_flags`)."""
  app.run(main, argv=list(argv), flags_parser=functools.partial(parse_flags, program=program))


def exit_interrupted(program: str) -> None:
  """The `interrupted` of a console script that joins no job: one line, exit 130.

  `os._exit`, not `sys.exit`: no thread a library left running is waited for.
  """
  sys.stdout.flush()
  print(f"{program}: Interrupted: Stopped by Ctrl-C.", file=sys.stderr, flush=True)
  os._exit(INTERRUPTED_EXIT)
