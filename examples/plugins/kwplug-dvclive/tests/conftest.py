"""kwplug's testing kit: the ``kwplug_plugins`` sandbox fixture (and friends)."""

pytest_plugins = ["kwplug.testing"]
