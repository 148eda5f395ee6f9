"""``from accelerate.accelerator import Accelerator, DataLoaderConfiguration`` (Accelerate's
shipped test scripts write it) ports by renaming: every public class ``accelerate.accelerator``
holds that kwplug has somewhere is importable from ``kwplug.accelerator`` too."""

from __future__ import annotations

import importlib
import inspect

import pytest

import kwplug

accelerate_accelerator = pytest.importorskip("accelerate.accelerator")


def _kwplug_classes() -> dict[str, object]:
    found: dict[str, object] = {}
    for module in ("kwplug", "kwplug.utils", "kwplug.state"):
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", dir(mod)):
            found.setdefault(name, getattr(mod, name, None))
    return found


def test_accelerator_module_serves_accelerates_classes() -> None:
    kwplug_names = _kwplug_classes()
    shared = [
        name
        for name, value in vars(accelerate_accelerator).items()
        if not name.startswith("_") and inspect.isclass(value) and name in kwplug_names
    ]
    assert "DataLoaderConfiguration" in shared and "GradientAccumulationPlugin" in shared
    module = importlib.import_module("kwplug.accelerator")
    missing = [name for name in shared if getattr(module, name, None) is not kwplug_names[name]]
    assert missing == []


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        kwplug.accelerator.NoSuchThing  # noqa: B018
