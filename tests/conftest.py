"""Test order: modules with slow end-to-end cases first, so that the two
`make test` workers end together instead of one running a long case alone
at the end. Each module stays in one piece (its fixtures are set up once)."""


def pytest_collection_modifyitems(config, items):
  slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.module.__name__ not in slow_modules)
