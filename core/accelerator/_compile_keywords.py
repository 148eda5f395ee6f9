"""Accelerate's ``Accelerator(dynamo_backend=..., dynamo_plugin=...)``: one more handler.

Compilation is a plugin's (the built-in entry point ``dynamo``, ``TorchDynamoPlugin``,
answering the ``compile_model`` hook): the core only turns the two keywords into a handler
passed with ``kwargs_handlers`` -- ``dynamo_plugin`` as it is, ``dynamo_backend`` as the
``dynamo`` entry point's handler class built with ``backend=dynamo_backend`` -- and knows
nothing of ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kwplug._plugins import discover
from kwplug.errors import MissingFeatureError
from kwplug.handler import KwargsHandler

#: The entry point whose handler class ``dynamo_backend=`` builds.
ENTRY_POINT = "dynamo"


def with_compile_handler(
    handlers: Sequence[KwargsHandler] | None, dynamo_backend: Any, dynamo_plugin: Any
) -> Sequence[KwargsHandler] | None:
    """``handlers`` and, last, the handler ``dynamo_backend``/``dynamo_plugin`` ask for.

    Raises:
        ValueError: both keywords given (Accelerate's error); a bad backend (the handler's).
        TypeError: ``dynamo_plugin`` is not a handler instance; ``handlers`` is not a list
            (left to the Accelerator's own check otherwise).
        kwplug.errors.MissingFeatureError: ``dynamo_backend`` given while the ``dynamo``
            plugin is not loaded (blocked, failed), naming why.
    """
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError(
            "You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one."
        )
    if dynamo_plugin is None and dynamo_backend is None:
        return handlers
    if dynamo_plugin is None:
        dynamo_plugin = _handler_class()(backend=dynamo_backend)
    elif not isinstance(dynamo_plugin, KwargsHandler):
        raise TypeError(
            "dynamo_plugin must be a TorchDynamoPlugin (a kwplug handler instance), got "
            f"{type(dynamo_plugin).__name__}"
        )
    if handlers is None:
        return [dynamo_plugin]
    if not isinstance(handlers, (list, tuple)):
        return handlers  # the Accelerator's check names the wrong type
    return [*handlers, dynamo_plugin]


def _handler_class() -> Any:
    records = [r for r in discover() if r.name == ENTRY_POINT and r.builtin]
    loaded = [r for r in records if r.loaded and r.handler_class is not None]
    if loaded:
        return loaded[0].handler_class
    why = "not installed"
    if records:
        why = records[0].status + (f": {records[0].error}" if records[0].error else "")
    raise MissingFeatureError(
        f"dynamo_backend= needs the built-in {ENTRY_POINT!r} plugin, which is not loaded "
        f"({why}); see `kwplug plugins` and KWPLUG_BLOCK_PLUGINS/KWPLUG_PLUGINS",
        feature="dynamo_backend",
        hook="compile_model",
    )
