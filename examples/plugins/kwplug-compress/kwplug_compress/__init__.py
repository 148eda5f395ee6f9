"""kwplug-compress: int8-quantised and top-k sparsified DDP communication hooks for kwplug.

Installing the distribution registers this module under the ``kwplug.handlers`` entry point
``compress``. Its :func:`comm_hooks` implementation contributes two hook names to every
``kwplug.Accelerator``:

- ``"int8"``: each bucket quantised to int8 with a float32 scale per chunk
  (:func:`~kwplug_compress.hooks.int8_hook`; options ``chunk_size``, ``error_feedback``);
- ``"topk"``: top-k sparsification with error feedback
  (:func:`~kwplug_compress.hooks.topk_hook`; options ``ratio``, ``error_feedback``).

Select one with ``kwplug.DistributedDataParallelKwargs(comm_hook="topk",
comm_state_option={"ratio": 0.01})``. Only kwplug's public API is used (``kwplug.hookimpl``,
``kwplug.CommHook``). Each record also says how its per-rank residuals move to another number of
processes (``resize``: :func:`~kwplug_compress.state.resize_residuals`); nothing in kwplug
knows these hooks.
"""

from collections.abc import Mapping

import kwplug
from kwplug_compress.hooks import int8_bytes, int8_hook, topk_bytes, topk_count, topk_hook
from kwplug_compress.state import (
    RESIZE_NOTE,
    Int8State,
    ResidualMemory,
    TopKState,
    check_int8_options,
    check_topk_options,
    make_int8_state,
    make_topk_state,
    residual_buckets,
    resize_residuals,
)

__all__ = [
    "HOOK_NAMES",
    "RESIZE_NOTE",
    "Int8State",
    "ResidualMemory",
    "TopKState",
    "check_int8_options",
    "check_topk_options",
    "comm_hooks",
    "int8_bytes",
    "int8_hook",
    "make_int8_state",
    "make_topk_state",
    "residual_buckets",
    "resize_residuals",
    "topk_bytes",
    "topk_count",
    "topk_hook",
]

#: The hook names this plugin contributes.
HOOK_NAMES: tuple[str, ...] = ("int8", "topk")


@kwplug.hookimpl
def comm_hooks() -> Mapping[str, kwplug.CommHook]:
    """kwplug's ``comm_hooks`` hook: the ``"int8"`` and ``"topk"`` hooks by name.

    Returns:
        ``"int8"`` and ``"topk"`` :class:`kwplug.CommHook` records (hook, state factory,
        option check and resize rule; the states save themselves through their
        ``state_dict``/``load_state_dict``); kwplug records this plugin's entry point as their
        source.
    """
    # Looked up when called, so that a caller replacing a factory here is seen by kwplug; the
    # (frozen) records are built again only then, not for every Accelerator.
    parts: tuple[object, ...] = (int8_hook, make_int8_state, check_int8_options, RESIZE_NOTE)
    parts += (topk_hook, make_topk_state, check_topk_options, resize_residuals)
    records = _RECORDS.get(parts)
    if records is None:
        _RECORDS.clear()
        records = _RECORDS[parts] = _records()
    return dict(records)


# The records by name, keyed on the module-level objects they were built from.
_RECORDS: dict[tuple[object, ...], dict[str, kwplug.CommHook]] = {}


def _records() -> dict[str, kwplug.CommHook]:
    return {
        "int8": kwplug.CommHook(
            "int8",
            int8_hook,
            make_int8_state,
            check_options=check_int8_options,
            resize=resize_residuals,
            resize_note=RESIZE_NOTE,
        ),
        "topk": kwplug.CommHook(
            "topk",
            topk_hook,
            make_topk_state,
            check_options=check_topk_options,
            resize=resize_residuals,
            resize_note=RESIZE_NOTE,
        ),
    }
