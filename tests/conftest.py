"""Shared fixtures, and the test order.

Test order: modules with slow end-to-end cases first, so that the two
`make test` workers end together instead of one running a long case alone
at the end; before them the tests marked `longest` (the newcomer path of
`make docs-check`, several minutes alone). Each module stays in one piece
(its fixtures are set up once)."""

import gc
import os
import shutil
import tempfile

import pytest

import gin
from t5lite import cli


# Every JAX program one `pytest` run compiles, in its processes and in the
# processes its tests start (which inherit the environment), goes through one
# persistent compilation cache, so a program several tests build is compiled
# once. The directory is new for each run and removed at its end: nothing
# cached by an earlier run, or another user, stands in for the code under
# test. LLVM optimisation is off: it makes the compiled code faster, which
# the tiny test programs do not need, and costs a third of the suite's CPU
# time. The HLO and its partitioning are the same; results may differ in the
# last bits, and every comparison in the suite runs both sides under these
# flags or compares to a stated tolerance (the T5X parity worker runs at the
# default level, `tests/test_t5x_training.py`). Set before anything imports
# JAX; the `pytest-xdist` workers inherit them from the main process.
if "T5LITE_TEST_XLA_CACHE_OWNER" not in os.environ:
  os.environ["T5LITE_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="t5lite-test-xla-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(),
                                    "--xla_backend_optimization_level=0"])


def pytest_unconfigure(config):
  if os.environ.get("T5LITE_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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
