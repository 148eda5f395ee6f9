"""pytest fixtures of :mod:`kwplug.testing` (``pytest_plugins = ["kwplug.testing"]``)."""

from __future__ import annotations

from collections.abc import Iterator

import pluggy

try:
    import pytest
except ModuleNotFoundError as error:  # the kit's fixtures are pytest's: name the extra
    if error.name != "pytest":
        raise
    raise ModuleNotFoundError(
        "kwplug.testing needs pytest: pip install 'kwplug[testing]'", name="pytest"
    ) from error

from kwplug.testing.sandbox import PluginSandbox


@pytest.fixture
def kwplug_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginSandbox]:
    """A :class:`~kwplug.testing.PluginSandbox` for this test: discovery sees kwplug's
    built-ins plus what the test adds (``kwplug_plugins.add(MyHandler)``) or keeps
    (``kwplug_plugins.keep_installed("my-dist")``); ``KWPLUG_*`` variables are cleared and
    everything is restored afterwards."""
    with PluginSandbox(directory=tmp_path_factory.mktemp("kwplug-plugins")) as sandbox:
        yield sandbox


@pytest.fixture
def kwplug_plugin_manager(kwplug_plugins: PluginSandbox) -> pluggy.PluginManager:
    """The pluggy ``PluginManager`` an Accelerator without ``kwargs_handlers`` would build in
    the sandbox (built-in defaults only, unless the test added plugins before requesting it)."""
    return kwplug_plugins.plugin_manager()
