"""Diagnostic only (``python tests/compat/compat_harness.py --lenient``), never the test.

A literal rename stops a script at its first missing kwplug module or name, so every check
of it reads "not run". To see what each check would meet beyond the imports, the lenient
rename imports every name from this module instead: a name is taken from the first public
kwplug module that has it, and a name no kwplug module has is a placeholder that raises
``ImportError`` when used, so only the checks that use it fail.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public kwplug modules searched, in this order.
MODULES = (
    "kwplug",
    "kwplug.utils",
    "kwplug.data",
    "kwplug.accelerator",
    "kwplug.optimizer",
    "kwplug.scheduler",
    "kwplug.tracking",
    "kwplug.local_sgd",
    "kwplug.utils.operations",
    "kwplug.utils.dataclasses",
    "kwplug.state",
    "kwplug.data_loader",
    "kwplug.logging",
)


class Missing:
    """A name kwplug does not have: any use raises ImportError naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"kwplug has no {self._name} (lenient import placeholder)")

    __call__ = _fail

    def __getattr__(self, attr: str) -> Any:
        self._fail()


def __getattr__(name: str) -> Any:
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    return Missing(name)
