"""The lazily exporting packages (``kwplug``, ``kwplug.utils``, ``kwplug.plugins``) list each
name once at run time (``_EXPORTS``); their ``TYPE_CHECKING`` imports, which give mypy the
same names, must import exactly those names from exactly those modules."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect

import pytest


def _type_checking_imports(package: str) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(importlib.import_module(package)))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )
    found: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname in (None, alias.name), f"{package}: {alias.name} renamed"
            found[alias.name] = node.module
    return found


@pytest.mark.parametrize("package", ["kwplug", "kwplug.utils", "kwplug.plugins"])
def test_type_checking_imports_match_the_exports_table(package: str) -> None:
    module = importlib.import_module(package)
    exports = {  # kwplug.plugins names its modules relative to itself
        name: importlib.util.resolve_name(where, package) for name, where in module._EXPORTS.items()
    }
    assert _type_checking_imports(package) == exports
    assert sorted(set(module.__all__) - {"__version__"}) == sorted(exports)


def test_the_builtin_handler_names_are_one_list() -> None:
    from kwplug._contracts.lazy import BUILTIN_HANDLERS

    plugins = importlib.import_module("kwplug.plugins")
    assert set(BUILTIN_HANDLERS) <= set(plugins._EXPORTS)
    for package in ("kwplug", "kwplug.utils", "kwplug.accelerator"):
        module = importlib.import_module(package)
        for name in BUILTIN_HANDLERS:
            assert getattr(module, name) is getattr(plugins, name), (package, name)


def test_data_loader_serves_every_kwplug_data_name() -> None:
    data = importlib.import_module("kwplug.data")
    data_loader = importlib.import_module("kwplug.data_loader")
    assert set(data.__all__) <= set(data_loader.__all__)
    for name in data_loader.__all__:
        assert hasattr(data_loader, name), name
    assert data_loader.BatchSamplerShard is data.BatchSamplerShard
