"""Shared fixtures, and the test order.

Test order: modules with slow end-to-end cases first, so that the two
`make test` workers end together instead of one running a long case alone
at the end; before them the tests marked `longest` (the newcomer path of
`make docs-check`, several minutes alone). Each module stays in one piece
(its fixtures are set up once)."""

import gc
import os

import pytest

import gin
from t5lite import cli


# Tests compile with XLA's default settings, the programs users get; a test
# that needs other flags sets them in the processes it starts and says why.
# No persistent compilation cache outlives a test or is shared between two:
# each test's processes (the console scripts it starts, which turn JAX's
# cache on by default) get a private, empty directory (`_private_caches`),
# so a cached program of an earlier run or another test can neither hide a
# compile failure nor stand in for the code under test. Set before anything
# imports JAX, so that this process (the in-process tests) has no
# persistent cache at all.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


# As in t5lite's console scripts (t5lite/cli.py): a larger youngest GC
# generation while test modules import libraries and trace models, and what
# collection imported frozen, so later collections do not walk it again.
cli.collect_garbage_less_during_start_up()


def pytest_collection_finish(session):
  gc.freeze()


@pytest.fixture(autouse=True)
def _private_caches(tmp_path_factory, monkeypatch):
  """Each test's own compilation cache directory, for the processes it starts."""
  # It also stands in for t5lite's default directory under ~/.cache.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla-cache")))


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
