"""Out-of-memory helpers: ``find_executable_batch_size``, ``release_memory``, cache clearing.

The batch-size search follows Accelerate 1.10+ (the version in kwplug's test extra): on an
out-of-memory error the batch size becomes ``int(batch_size * 0.9)``, and the size found is
kept for the next call of the decorated function. Accelerate before 1.10 halved it; pass
``reduce_batch_size_fn`` for another policy.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from kwplug.validators import is_int

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]

R = TypeVar("R")

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

#: Substrings of the out-of-memory errors torch raises, by allocator.
_OOM_MESSAGES = (
    " out of memory",  # CUDA/HIP ("CUDA out of memory."), XPU, MPS ("MPS backend out of memory")
    "DefaultCPUAllocator: can't allocate memory",  # CPU, Linux/macOS
    "DefaultCPUAllocator: not enough memory",  # CPU, Windows
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN refusing a too-large batch
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Gaudi (HPU)
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Release the cached blocks of the current accelerator's allocator (``empty_cache``).

    Args:
        garbage_collection: run ``gc.collect()`` first (slow; frees tensors only reachable
            through reference cycles, such as a traceback's frames).
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
        return
    accelerator = getattr(torch, "accelerator", None)
    empty_cache = getattr(accelerator, "empty_cache", None)
    if accelerator is None or not callable(empty_cache) or not accelerator.is_available():
        return
    # CUDA not yet initialised has nothing cached; initialising it here would break a later
    # fork (DataLoader workers).
    if accelerator.current_accelerator().type != "cuda":
        empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references and free device memory: ``a, b = release_memory(a, b)``.

    Returns:
        A list of ``None``, one per argument, to assign back to the caller's names.
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` is an out-of-memory error a smaller batch may avoid.

    That is ``torch.OutOfMemoryError`` (CUDA, and other devices that raise it) or a
    ``RuntimeError`` whose message is a CPU, CUDA, XPU, MPS, HPU out-of-memory or cuDNN
    "not supported" error.
    """
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    message = str(exception)
    return any(part in message for part in _OOM_MESSAGES)


@overload
def find_executable_batch_size(
    function: Callable[..., R],
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[..., R]: ...


@overload
def find_executable_batch_size(
    function: None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]: ...


def find_executable_batch_size(
    function: Callable[..., R] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[..., R] | Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorator: call ``function(batch_size, *args, **kwargs)``, retrying with a smaller batch
    size while it runs out of memory.

    ``function`` takes the batch size as its first parameter; callers leave it out
    (``train(model, optimizer)``). Before each call, and after each out-of-memory error,
    garbage is collected and the device cache emptied. Any other exception propagates at once.
    The batch size reached is kept: a later call of the decorated function starts from it.

    Args:
        function: the function to decorate; ``None`` returns a decorator, so that
            ``@find_executable_batch_size(starting_batch_size=64)`` works.
        starting_batch_size: ``int`` >= 0, the first batch size tried (default 128).
        reduce_batch_size_fn: called with no arguments after each out-of-memory error; returns
            the next batch size. Default: ``int(batch_size * 0.9)``, as Accelerate >= 1.10.
            (Accelerate drops this argument in the decorator-with-arguments form; kwplug
            keeps it.)

    Returns:
        The decorated function, or a decorator when ``function`` is ``None``.

    Raises:
        TypeError: ``starting_batch_size`` is not an int. When the decorated function is
            called: the caller passed the batch size itself.
        ValueError: ``starting_batch_size`` is negative.
        RuntimeError: when the decorated function is called and the batch size reaches 0:
            ``"No executable batch size found, reached zero."``.
    """
    if not is_int(starting_batch_size):
        raise TypeError(f"starting_batch_size must be an int, got {starting_batch_size!r}")
    if starting_batch_size < 0:
        raise ValueError(f"starting_batch_size must be >= 0, got {starting_batch_size}")
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    return _BatchSizeSearch(function, starting_batch_size, reduce_batch_size_fn).wrapper()


class _BatchSizeSearch:
    """The state of one decorated function: the batch size to try next."""

    def __init__(
        self,
        function: Callable[..., Any],
        batch_size: int,
        reduce_batch_size_fn: Callable[[], int] | None,
    ) -> None:
        self.function = function
        self.batch_size = batch_size
        self.reduce = reduce_batch_size_fn or self._reduce_by_a_tenth
        parameters = inspect.signature(function).parameters.values()
        self.takes_var_positional = any(p.kind is p.VAR_POSITIONAL for p in parameters)
        self.positional = [p.name for p in parameters if p.kind in _POSITIONAL]

    def _reduce_by_a_tenth(self) -> int:
        return int(self.batch_size * 0.9)

    def wrapper(self) -> Callable[..., Any]:
        @functools.wraps(self.function)
        def search(*args: Any, **kwargs: Any) -> Any:
            clear_device_cache(garbage_collection=True)
            self._check_arguments(args)
            while True:
                if self.batch_size == 0:
                    raise RuntimeError("No executable batch size found, reached zero.")
                try:
                    return self.function(self.batch_size, *args, **kwargs)
                except Exception as error:
                    if not should_reduce_batch_size(error):
                        raise
                    # The traceback holds the failed attempt's tensors: drop it before freeing.
                    del error
                    clear_device_cache(garbage_collection=True)
                    self.batch_size = self.reduce()

        return search

    def _check_arguments(self, args: tuple[Any, ...]) -> None:
        # More positional arguments than the function takes beside the batch size: the caller
        # passed the batch size too. (Accelerate counts every parameter, so it misses this
        # with keyword-only parameters and refuses valid calls of a function taking *args.)
        if not self.takes_var_positional and len(self.positional) < len(args) + 1:
            name = getattr(self.function, "__name__", repr(self.function))
            rest = ", ".join(
                f"{p}={v!r}" for p, v in zip(self.positional[1:], args[1:], strict=False)
            )
            raise TypeError(
                f"Batch size was passed into `{name}` as the first argument when called. "
                f"Remove it, the decorator passes the batch size itself: `{name}({rest})`"
            )
