"""``tqdm``: Accelerate's progress bar that shows on the main process only."""

from __future__ import annotations

from typing import Any

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` progress bar, disabled on every process but local rank 0 of each
    node when ``main_process_only`` (Accelerate's wrapper).

    Args:
        *args: ``tqdm``'s own positional arguments (the iterable first).
        main_process_only: ``bool``, default ``True``.
        **kwargs: ``tqdm``'s own keyword arguments (``disable=True`` still disables).

    Raises:
        ImportError: ``tqdm`` is not installed (``pip install tqdm``, or kwplug's
            ``examples`` extra).
        ValueError: a ``bool`` as the first positional argument (Accelerate's old calling
            convention; pass ``main_process_only=`` instead).
    """
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError as exc:
        raise ImportError(
            "kwplug.utils.tqdm needs the tqdm package: pip install tqdm (or kwplug[examples])"
        ) from exc
    if args and isinstance(args[0], bool):
        raise ValueError(
            "kwplug.utils.tqdm: a bool as the first argument is not supported; pass "
            "main_process_only=True/False"
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from kwplug._process.environment import ProcessInfo

        disable = ProcessInfo.current().local_rank != 0
    return _tqdm(*args, disable=disable, **kwargs)
