"""``InitProcessGroupKwargs``: answers ``init_process_group`` with
``torch.distributed.init_process_group``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl

DEFAULT_BACKEND = "nccl"
_NCCL_TIMEOUT = timedelta(seconds=600)
_OTHER_TIMEOUT = timedelta(seconds=1800)


def _to_timedelta(value: Any) -> Any:
    # Accept plain seconds as a convenience; anything else is left for the validator.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except (OverflowError, ValueError):  # NaN, infinite or beyond timedelta's range
            raise ValueError(
                f"'timeout' must be a finite number of seconds up to {timedelta.max}, got {value!r}"
            ) from None
    return value


def _lower(value: Any) -> Any:
    # Backend names are case-insensitive in torch ("NCCL" == "nccl"); store them lower-case.
    return value.strip().lower() if isinstance(value, str) else value


def _check_backend(instance: Any, attribute: attrs.Attribute[str], value: Any) -> None:
    if isinstance(value, str) and not value:
        raise ValueError(
            f"'{attribute.name}' must not be empty: give a backend name such as 'nccl', 'gloo'"
        )
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be a backend name (str) such as 'nccl', 'gloo', 'mpi', "
            f"'xccl', got {value!r}"
        )
    if ":" in value:  # "cpu:gloo,cuda:nccl" device-to-backend maps are passed through
        return
    known = {b for b in dist.Backend.backend_list if b != "undefined"}
    if value.lower() not in known:
        raise ValueError(
            f"'{attribute.name}' must be one of {sorted(known)} (or 'device:backend,...'), "
            f"got {value!r}"
        )


def _check_timeout(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, timedelta):
        raise TypeError(
            f"'{attribute.name}' must be a datetime.timedelta, seconds (int/float) or None, "
            f"got {value!r} of type {type(value).__name__}"
        )
    if value.total_seconds() <= 0:
        raise ValueError(f"'{attribute.name}' must be positive, got {value}")


def _check_init_method(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be None or a URL str such as 'env://' or "
            f"'tcp://host:port', got {value!r}"
        )


@attrs.define
class InitProcessGroupKwargs(KwargsHandler):
    """Options of ``torch.distributed.init_process_group``, used under ``torchrun``.

    When ``WORLD_SIZE > 1`` and no default process group exists, the Accelerator calls
    ``torch.distributed.init_process_group(backend, init_method=init_method, timeout=timeout,
    world_size=WORLD_SIZE, rank=RANK)``. In a single process nothing is initialised, whatever
    the backend.

    Attributes:
        backend: ``str`` (case-insensitive, stored lower-case), default ``"nccl"``. The default
            means "nccl on CUDA, the device's own
            default otherwise" (gloo on CPU, from ``torch.distributed.Backend.
            default_device_backend_map``); any other backend (``"gloo"``, ``"mpi"``, ...) is
            used as given.
        init_method: ``str`` URL or ``None`` (default: ``"env://"``, torchrun's variables).
        timeout: ``datetime.timedelta``, seconds (``int``/``float``) or ``None``: how long
            collectives and the rendezvous may wait before failing. ``None`` resolves at
            construction from ``backend``: 600 s for nccl, 1800 s otherwise (and follows later
            assignments to ``backend``). With the default ``"nccl"`` on CPU the process group
            runs gloo with the 600 s the field resolved to.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: an unknown backend or a non-positive timeout.
    """

    backend: str = attrs.field(
        default=DEFAULT_BACKEND,
        converter=_lower,
        validator=_check_backend,
        on_setattr=[
            attrs.setters.convert,
            attrs.setters.validate,
            lambda i, a, v: i._backend_changed(v),
        ],
    )
    init_method: str | None = attrs.field(default=None, validator=_check_init_method)
    timeout: timedelta | None = attrs.field(
        default=None,
        converter=_to_timedelta,
        validator=_check_timeout,
        on_setattr=[attrs.setters.convert, attrs.setters.validate, lambda i, a, v: i._resolve(v)],
    )
    # Whether the timeout was resolved from the backend (then it follows backend changes).
    _timeout_resolved: bool = attrs.field(
        init=False, default=False, repr=False, eq=False, on_setattr=attrs.setters.NO_OP
    )

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "timeout", self._resolve(self.timeout))

    def _resolve(self, timeout: timedelta | None, backend: str | None = None) -> timedelta:
        self._timeout_resolved = timeout is None
        return self.default_timeout(backend or self.backend) if timeout is None else timeout

    def _backend_changed(self, backend: str) -> str:
        if self._timeout_resolved:  # keep "None means the backend's default" true
            object.__setattr__(self, "timeout", self._resolve(None, backend))
        return backend

    @staticmethod
    def default_timeout(backend: str) -> timedelta:
        """The timeout ``None`` resolves to: 600 s for nccl, 1800 s for other backends."""
        return _NCCL_TIMEOUT if backend == "nccl" else _OTHER_TIMEOUT

    def resolved_backend(self, device_type: str) -> str:
        """The backend used on ``device_type``: the device's default for the default
        ``"nccl"`` on a device without NCCL (``"gloo"`` on CPU), else ``backend``."""
        if self.backend == DEFAULT_BACKEND and device_type != "cuda":
            return dist.Backend.default_device_backend_map.get(device_type, "gloo")
        return self.backend

    @hookimpl
    def init_process_group(self, device_type: str, world_size: int, rank: int) -> bool | None:
        """Initialise the default process group from the resolved fields (not ``to_kwargs()``:
        a non-default backend with a timeout equal to the nccl default would lose it)."""
        if world_size <= 1:
            return None
        dist.init_process_group(
            backend=self.resolved_backend(device_type),
            init_method=self.init_method,
            timeout=self.timeout,
            world_size=world_size,
            rank=rank,
        )
        return True
