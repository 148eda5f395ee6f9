"""Lazy re-exports (PEP 562) shared by ``kwplug``, ``kwplug.utils`` and ``kwplug.tracking``.

Each package lists its public names once, in a table ``name -> module``, and imports a name's
module only when the name is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

#: The built-in handler classes that ``kwplug``, ``kwplug.utils`` and ``kwplug.accelerator``
#: re-export from :mod:`kwplug.plugins` (Accelerate has them in all three places): the one list
#: of their names, from which those packages' tables derive (``kwplug.plugins`` maps each to
#: its module).
BUILTIN_HANDLERS: tuple[str, ...] = (
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
)


def exporter(
    namespace: MutableMapping[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace``.

    Args:
        namespace: the package's ``globals()``; a resolved name is stored there, so that
            later look-ups skip ``__getattr__``.
        exports: public name -> the module defining it (absolute, or relative to the package
            with a leading dot).

    Returns:
        ``(__getattr__, __dir__)``: ``__getattr__`` raises ``AttributeError`` for a name not
        in ``exports``; ``__dir__`` lists ``__all__``, ``exports`` and the dunder names.
    """
    package = str(namespace["__name__"])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        dunders = (n for n in namespace if n.startswith("__"))
        return sorted({*namespace.get("__all__", ()), *exports, *dunders})

    return __getattr__, __dir__
