"""kwplug's testing kit (the ``kwplug_plugins`` sandbox fixture) for the kwplug-compress tests."""

pytest_plugins = ["kwplug.testing"]
