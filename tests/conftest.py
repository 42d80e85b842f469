"""Shared fixtures, and the test order.

Test order: modules with slow end-to-end cases first, so that the two
`make test` workers end together instead of one running a long case alone
at the end; before them the tests marked `longest` (the newcomer path of
`make docs-check`, several minutes alone). Each module stays in one piece
(its fixtures are set up once)."""

import gin
import pytest


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
