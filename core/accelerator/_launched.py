"""The plugins a launcher switched on: ``Accelerator()`` in a script started by ``accelerate
launch --use_fsdp``/``--use_parallelism_config`` (or a config file's ``distributed_type: FSDP``
/ ``parallelism_config``; ``kwplug launch`` alike) builds them itself, as Accelerate's does.

The core knows only Accelerate's keywords and the built-in entry points whose handler classes
they take; whether the launcher asked for one, and with which fields, is the handler class's
own ``from_launcher()`` (it reads Accelerate's variables), so nothing sharding-specific lives
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kwplug._contracts.environ import get as read_environ
from kwplug._plugins import discover
from kwplug.errors import MissingFeatureError
from kwplug.handler import KwargsHandler

#: Accelerate's plugin keyword -> the built-in entry point whose handler class it takes, and
#: the variable by which Accelerate's launcher switches it on; the mesh first, so that tensor
#: parallelism is applied before the data-parallel wrapper.
KEYWORDS: tuple[tuple[str, str, str], ...] = (
    ("parallelism_config", "parallelism", "ACCELERATE_USE_PARALLELISM_CONFIG"),
    ("fsdp_plugin", "fsdp", "ACCELERATE_USE_FSDP"),
)


def launched_handlers(
    given: dict[str, Any], kwargs_handlers: Sequence[KwargsHandler] | None = None
) -> dict[str, Any]:
    """``given`` (Accelerate's plugin keywords, by name), each ``None`` whose launcher switch
    (``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_PARALLELISM_CONFIG``) is ``"true"`` replaced by
    what its entry point's handler class builds from the launcher's variables
    (``from_launcher()``), unless ``kwargs_handlers`` already holds an instance of that class.

    Raises:
        TypeError: a ``from_launcher()`` answered something else than an instance of its
            class or ``None``.
        ValueError: what the handler class raises for a variable it does not take.
        kwplug.errors.MissingFeatureError: the launcher switched a plugin on and the built-in
            plugin failed to load (its default construction refused such a variable), naming
            why.
    """
    found = dict(given)
    for keyword, entry_point, switch in KEYWORDS:
        # Without the launcher's switch nothing is built (Accelerate's test, ``"true"`` in any
        # case), and nothing is looked up: a plain Accelerator() pays one dictionary read, and
        # a run that never asked for the plugin is not stopped by its failure to load.
        if found.get(keyword) is not None or read_environ(switch, "").lower() != "true":
            continue
        cls = _handler_class(keyword, entry_point)
        build = getattr(cls, "from_launcher", None)
        if cls is None or build is None:
            continue
        if isinstance(kwargs_handlers, (list, tuple)) and any(
            isinstance(h, cls) for h in kwargs_handlers
        ):
            continue
        handler = build()
        if handler is not None and not isinstance(handler, cls):
            raise TypeError(
                f"{cls.__qualname__}.from_launcher() must return a {cls.__qualname__} or None, "
                f"got {type(handler).__name__}"
            )
        found[keyword] = handler
    return found


def _handler_class(keyword: str, entry_point: str) -> Any:
    # The built-in plugin's class. A blocked one builds nothing (the user's choice; the
    # variables are the plugin's own to read). One that failed to load -- e.g. its default
    # construction refused a launcher's variable such as FSDP_VERSION=1 -- is an error here,
    # never a run without the plugin.
    for record in discover():
        if record.name != entry_point or not record.builtin:
            continue
        if record.loaded:
            return record.handler_class
        if record.status == "failed":
            raise MissingFeatureError(
                f"{keyword}: the built-in {entry_point!r} plugin failed to load ({record.error});"
                " it builds the plugin accelerate launch's variables ask for",
                feature=keyword,
                providers=((entry_point, record.error or "failed"),),
            )
    return None
