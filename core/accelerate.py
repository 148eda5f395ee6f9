"""kwplug under Accelerate's name and version, for scripts that test ``accelerate.__version__``.

Third-party scripts gate features on Accelerate's version, e.g. diffusers' training scripts::

    import accelerate
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
        accelerator.register_save_state_pre_hook(save_model_hook)

After ``import kwplug as accelerate`` such a test reads kwplug's own version (``0.x``) and the
hooks are silently never registered. Port the bare import as::

    import kwplug.accelerate as accelerate

This module is kwplug's top-level namespace (every name resolves to ``kwplug``'s own object:
``accelerate.Accelerator is kwplug.Accelerator``; ``accelerate.utils`` and the other
submodules are kwplug's) with one difference: ``__version__`` is :data:`ACCELERATE_VERSION`,
the Accelerate release whose API kwplug mirrors (the one its differential tests run against,
``constraints.txt``), so a version gate behaves as on that release. ``kwplug.__version__``
stays kwplug's own (packaging, bug reports): only this face answers with Accelerate's.
"""

from __future__ import annotations

import importlib
from typing import Any

import kwplug

#: The Accelerate release whose API kwplug mirrors (``constraints.txt`` pins the same one; a
#: test checks them against each other and against the installed Accelerate).
ACCELERATE_VERSION = "1.16.0"

__version__ = ACCELERATE_VERSION
__all__ = [name for name in kwplug.__all__ if name != "__version__"]


def __getattr__(name: str) -> Any:
    # kwplug's public names and submodules (`accelerate.utils.set_seed`), resolved on first use
    # as kwplug's own lazy exports are.
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(kwplug, name)
    except AttributeError:
        pass
    try:
        return importlib.import_module(f"kwplug.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"kwplug.{name}":
            raise
    raise AttributeError(f"module 'kwplug.accelerate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__", "ACCELERATE_VERSION"})
