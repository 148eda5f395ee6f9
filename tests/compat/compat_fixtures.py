"""``accelerate.test_utils`` for the renamed copies of Accelerate's shipped test scripts.

The scripts import test fixtures (``RegressionDataset``, ``RegressionModel``,
``are_the_same_tensors``, ``assert_exception``, ``torch_device``) from ``accelerate.test_utils``.
They are test data, not the library under test, so both runs (Accelerate's and kwplug's) get the
same ones from this module, in place of ``accelerate.test_utils`` (the harness renames that
import). Their source is read from the installed accelerate at import time (never copied here)
and executed without importing ``accelerate``: a kwplug run must not run any of Accelerate.

``are_the_same_tensors`` calls the library (``AcceleratorState().device`` and ``gather``): it is
bound to the library under test (``COMPAT_LIBRARY``, ``kwplug`` or ``accelerate``), as a
renamed script's own code would be. ``torch_device`` is ``"cpu"``: the harness hides every GPU,
where accelerate's ``get_backend()`` gives ``"cpu"`` too.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch


def accelerate_dir() -> Path:
    """The installed accelerate package's folder, found without importing it."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("accelerate (the test extra) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _definitions(path: Path, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
    """Execute the top-level ``def``/``class`` statements ``names`` of ``path`` in ``namespace``."""
    source = path.read_text()
    nodes = {
        node.name: node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names
    }
    missing = sorted(set(names) - set(nodes))
    if missing:
        raise ImportError(f"{path} no longer defines {missing}")
    for name in names:
        node = nodes[name]
        # get_source_segment leaves the decorators out (``@contextmanager``): put them back.
        decorators = "".join(f"@{ast.unparse(d)}\n" for d in node.decorator_list)
        segment = ast.get_source_segment(source, node) or ""
        exec(compile(decorators + segment, str(path), "exec"), namespace)


def _library_names(library: str) -> dict[str, Any]:
    """``AcceleratorState`` and ``gather`` of the library under test (what testing.py imports)."""
    names: dict[str, Any] = {}
    for module, name in ((f"{library}.state", "AcceleratorState"), (f"{library}.utils", "gather")):
        try:
            names[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            message = f"{module}.{name} is not available: {error}"

            def unavailable(*args: Any, _message: str = message, **kwargs: Any) -> Any:
                raise ImportError(_message)

            names[name] = unavailable
    return names


_LIBRARY = os.environ.get("COMPAT_LIBRARY", "kwplug")
if _LIBRARY not in ("kwplug", "accelerate"):
    raise ValueError(f"COMPAT_LIBRARY must be 'kwplug' or 'accelerate', got {_LIBRARY!r}")

_namespace: dict[str, Any] = {
    "__name__": __name__,
    "np": np,
    "torch": torch,
    "contextmanager": contextlib.contextmanager,
    "Optional": Optional,
}
_TEST_UTILS = accelerate_dir() / "test_utils"
_definitions(_TEST_UTILS / "training.py", ("RegressionDataset", "RegressionModel"), _namespace)
_definitions(_TEST_UTILS / "testing.py", ("assert_exception",), _namespace)
_namespace.update(_library_names(_LIBRARY))
_definitions(_TEST_UTILS / "testing.py", ("are_the_same_tensors",), _namespace)

RegressionDataset = _namespace["RegressionDataset"]
RegressionModel = _namespace["RegressionModel"]
assert_exception = _namespace["assert_exception"]
are_the_same_tensors = _namespace["are_the_same_tensors"]
torch_device = "cpu"

__all__ = [
    "RegressionDataset",
    "RegressionModel",
    "are_the_same_tensors",
    "assert_exception",
    "torch_device",
]
