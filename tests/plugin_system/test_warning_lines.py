"""kwplug's warnings name the user's line: ``kwplug.errors.user_stacklevel`` skips kwplug's
frames (and the folders it is given), whatever depth the warning is issued at."""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from kwplug.errors import PluginLoadWarning
from kwplug.testing import PluginSandbox


def test_a_discovery_warning_names_the_line_that_triggered_discovery(
    kwplug_plugins: PluginSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kwplug_broken_plugin.py").write_text("raise RuntimeError('broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwplug_plugins.add("kwplug_broken_plugin", name="broken")  # discovery, in kwplug
    (warning,) = [w for w in caught if issubclass(w.category, PluginLoadWarning)]
    assert "broken" in str(warning.message)
    assert warning.filename == __file__


def test_frames_of_the_given_folders_are_skipped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kwplug_library_like.py").write_text(
        textwrap.dedent(
            """
            import os
            import warnings

            from kwplug.errors import user_stacklevel

            HERE = os.path.dirname(os.path.abspath(__file__))


            def warn(skip_here):
                extra = (HERE,) if skip_here else ()
                warnings.warn("inner", UserWarning, stacklevel=user_stacklevel(*extra))


            def outer(skip_here):
                warn(skip_here)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    library = importlib.import_module("kwplug_library_like")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            library.outer(False)  # stacklevel 2: the caller of warn, in the library
            library.outer(True)  # the library's frames skipped: this line
        assert [Path(w.filename).name for w in caught] == [
            "kwplug_library_like.py",
            Path(__file__).name,
        ]
    finally:
        sys.modules.pop("kwplug_library_like", None)


def test_an_unknown_plugin_control_names_the_line_that_triggered_discovery(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kwplug

    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "no-such-plugin-warning-line")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwplug.discover(refresh=True)  # discovery, in kwplug, warns about the unknown name
    (warning,) = [w for w in caught if "no-such-plugin-warning-line" in str(w.message)]
    assert issubclass(warning.category, PluginLoadWarning)
    assert warning.filename == __file__
