"""Parsing Python on two threads at once is safe once `t5lite.threads` is
imported (CPython gh-106905), and `Background` hands back values and errors."""

import ast
import gc
import sys
import threading
import time

import pytest

from t5lite import threads


# 300 small functions: a parse long enough for the collector to run inside it.
_LONG_SOURCE = "\n".join(f"def f{i}(a, b):\n  return [a + b * {i} for _ in range(3)]"
                         for i in range(300))


class _YieldsWhenCollected:
  """A finalizer that gives the interpreter lock away, as TensorFlow's do."""

  def __del__(self):
    time.sleep(0)


def _parse_on_two_threads(parse, seconds: float, short_parse=None) -> list[BaseException]:
  """Parses a long source with `parse` on this thread while another thread
  parses short ones (with `short_parse`, by default `parse`) and the
  collector runs finalizers; returns the SystemErrors seen."""
  short_parse = short_parse or parse
  stop, errors = threading.Event(), []

  def short_parses():
    while not stop.is_set():
      try:
        short_parse("(1, 2)")
      except SystemError as e:
        errors.append(e)

  threshold = gc.get_threshold()
  gc.set_threshold(50)
  other = threading.Thread(target=short_parses, daemon=True)
  other.start()
  try:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not errors:
      for _ in range(200):  # reference cycles only the collector frees
        garbage = [_YieldsWhenCollected()]
        garbage.append(garbage)
      del garbage
      try:
        parse(_LONG_SOURCE)
      except SystemError as e:
        errors.append(e)
  finally:
    stop.set()
    other.join()
    gc.set_threshold(*threshold)
  return errors


def test_versions_with_the_race_are_the_ones_cpython_names():
  assert threads._parse_races((3, 11, 7, "final", 0))
  assert not threads._parse_races((3, 11, 8, "final", 0))
  assert threads._parse_races((3, 12, 1, "final", 0))
  assert not threads._parse_races((3, 12, 2, "final", 0))
  assert not threads._parse_races((3, 13, 0, "final", 0))


def test_parses_on_two_threads_never_fail_once_t5lite_threads_is_imported():
  if threads._parse_races(sys.version_info):
    unguarded = ast.parse.__wrapped__
    # The harness reproduces the fault with this interpreter's own parse ...
    errors = _parse_on_two_threads(unguarded, seconds=10)
    assert errors and "recursion depth mismatch" in str(errors[0])
    assert ast.parse is not unguarded
  else:  # a fixed interpreter is left as it is
    assert not hasattr(ast.parse, "_t5lite_serialized")
  # ... and sees none through the parse every library calls.
  assert _parse_on_two_threads(ast.parse, seconds=3) == []
  assert _parse_on_two_threads(ast.parse, seconds=1, short_parse=ast.literal_eval) == []


def test_the_installed_parse_is_still_the_parse():
  tree = ast.parse("a = [1, 2]")
  assert ast.dump(tree) == ast.dump(compile("a = [1, 2]", "<s>", "exec", ast.PyCF_ONLY_AST))
  assert ast.literal_eval("{'a': (1, 2.5)}") == {"a": (1, 2.5)}
  if threads._parse_races(sys.version_info):
    threads._serialize_ast_parse()  # a second install does not wrap twice
    assert not hasattr(ast.parse.__wrapped__, "__wrapped__")


def test_background_returns_the_value_and_raises_the_error_every_time():
  assert threads.Background(lambda: 41 + 1, "t5lite-test").result() == 42

  def fails():
    raise KeyError("k")

  failing = threads.Background(fails, "t5lite-test")
  failing.join()
  for _ in range(2):
    with pytest.raises(KeyError):
      failing.result()
