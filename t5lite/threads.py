"""Work on background threads, and what makes that safe on every Python
t5lite supports.

t5lite builds its data pipelines and evaluators on background threads while
the main thread traces and compiles. Both sides parse Python source as they
go: TensorFlow's AutoGraph converts SeqIO's functions (`ast.parse` of their
source), gin formats and parses literals (`ast.literal_eval`), `inspect`
parses the signatures of builtins. CPython before 3.11.8 (and 3.12.0-3.12.1)
keeps the recursion depth of turning a parse into `ast` objects in one
process-wide counter (CPython gh-106905); when the garbage collector hands
the interpreter lock to another thread in the middle of one parse and that
thread parses too, the first fails with `SystemError: AST constructor
recursion depth mismatch`. AutoGraph then runs SeqIO's packing function
unconverted, and the run stops with "Iterating over a symbolic `tf.Tensor`
is not allowed". On those versions, importing this module makes `ast.parse`
take one process-wide lock, so parses never overlap.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any


def _parse_races(version: tuple[int, ...]) -> bool:
  """Whether this CPython's `ast.parse` is unsafe on two threads at once."""
  return version[:3] < (3, 11, 8) or (3, 12, 0) <= version[:3] < (3, 12, 2)


def _serialize_ast_parse() -> None:
  """Makes `ast.parse` (and so `ast.literal_eval`, AutoGraph, `inspect`)
  take one lock; reentrant, since a garbage-collected finalizer may parse
  on the same thread in the middle of a parse."""
  if getattr(ast.parse, "_t5lite_serialized", False):
    return
  parse = ast.parse
  lock = threading.RLock()

  @functools.wraps(parse)
  def serialized_parse(*args: Any, **kwargs: Any) -> Any:
    with lock:
      return parse(*args, **kwargs)

  serialized_parse._t5lite_serialized = True  # type: ignore[attr-defined]
  ast.parse = serialized_parse


if _parse_races(sys.version_info):
  _serialize_ast_parse()


class Background:
  """`fn()` on a daemon thread; `result()` waits for it and returns its value
  or raises what it raised (every time it is asked)."""

  def __init__(self, fn: Callable[[], Any], name: str):
    self._value: Any = None
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
    self._thread.start()

  def _run(self, fn: Callable[[], Any]) -> None:
    try:
      self._value = fn()
    except BaseException as e:  # raised again by result(), in the caller's thread
      self._error = e

  def join(self) -> None:
    """Waits for `fn` to end, whatever it returns or raises."""
    self._thread.join()

  def result(self) -> Any:
    self._thread.join()
    if self._error is not None:
      raise self._error
    return self._value
