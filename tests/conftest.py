"""Shared fixtures, and the test order.

Test order: modules with slow end-to-end cases first, so that the two
`make test` workers end together instead of one running a long case alone
at the end; before them the tests marked `longest` (the newcomer path of
`make docs-check`, several minutes alone). Each module stays contiguous in
that order, but pytest-xdist hands its tests out one at a time: a module
whose tests land on both workers sets its module fixtures up on each. Handing
out whole modules (`--dist loadfile`) would set them up once, but by the
suite's per-test times the two workers would then end further apart by about
what the repeated fixtures cost."""

import contextlib
import gc
import os
import shutil
import tempfile

import pytest

import gin
from t5lite import cli


# Tests compile at XLA's default optimisation level: the programs users get
# (a test marked `fast_compile` says why its processes do not; see below).
# No test reads a program that another test, or an earlier run, compiled:
# each test, and each module's shared fixtures, gets a new empty directory in
# $JAX_COMPILATION_CACHE_DIR, which the processes it starts inherit. The
# launches of one test share it, as a user's repeated launches share theirs;
# so do the commands a test runs in this process and the runs it wraps in
# `launch_cache` (tests/test_cli.py). Nothing else the test processes
# compile goes through a persistent cache.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(scope="module", autouse=True)
def module_compilation_cache():
  """The cache of a module's shared fixtures."""
  with _new_cache() as directory:
    yield directory


@pytest.fixture(autouse=True)
def private_compilation_cache(module_compilation_cache, request):
  """The test's own cache, and the optimisation level of the processes it
  starts: XLA's default, or level 0 for a test marked `fast_compile`, which
  must say why. Level 0 compiles the tiny models about three times faster.
  The documentation's commands (`make docs-check`) run at level 0: what they
  check is that each command runs and what it prints, not its numbers, which
  the tests of `make test` check on the same programs at the default level."""
  fast = request.node.get_closest_marker("fast_compile")
  if fast is not None and not (fast.args and isinstance(fast.args[0], str) and fast.args[0]):
    raise pytest.UsageError(f"{request.node.nodeid}: fast_compile needs its reason")
  with _new_cache() as directory, pytest.MonkeyPatch.context() as patch:
    if fast is not None or request.node.get_closest_marker("docs"):
      patch.setenv("XLA_FLAGS", " ".join([*os.environ.get("XLA_FLAGS", "").split(),
                                          "--xla_backend_optimization_level=0"]))
    yield directory


@contextlib.contextmanager
def _new_cache():
  directory = tempfile.mkdtemp(prefix="t5lite-test-xla-")
  try:
    with pytest.MonkeyPatch.context() as patch:
      patch.setenv("JAX_COMPILATION_CACHE_DIR", directory)
      yield directory
  finally:
    shutil.rmtree(directory, ignore_errors=True)


# As in t5lite's console scripts (t5lite/cli.py): a larger youngest GC
# generation while test modules import libraries and trace models, and what
# collection imported frozen, so later collections do not walk it again.
cli.collect_garbage_less_during_start_up()


def pytest_collection_finish(session):
  gc.freeze()


@pytest.fixture
def clean_gin():
  """An empty gin config before and after the test."""
  gin.config.clear_config(clear_constants=True)
  yield
  gin.config.clear_config(clear_constants=True)


def pytest_collection_modifyitems(config, items):
  slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: (item.get_closest_marker("longest") is None,
                              item.module.__name__ not in slow_modules))
