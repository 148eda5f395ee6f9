"""``InitProcessGroupKwargs``: answers ``init_process_group`` with
``torch.distributed.init_process_group``."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import attrs
import torch.distributed as dist

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.validators import shown

DEFAULT_BACKEND = "nccl"
_NCCL_TIMEOUT = timedelta(seconds=600)
_OTHER_TIMEOUT = timedelta(seconds=1800)
#: Shortest accepted ``timeout``, in seconds.
MIN_TIMEOUT_SECONDS = 1
_ACCEPTED_TIMEOUT = (
    f"accepted: a datetime.timedelta or a number of seconds of at least {MIN_TIMEOUT_SECONDS}"
)


def _seconds(duration: timedelta | None) -> str:
    # str(timedelta) reads "-1 day, 23:59:55" for -5 s; messages speak in seconds.
    return "None" if duration is None else f"{duration.total_seconds():g} s"


def _to_timedelta(value: Any) -> Any:
    # Accept plain seconds as a convenience; anything else is left for the validator.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except (OverflowError, ValueError):  # NaN, infinite or beyond timedelta's range
            raise ValueError(
                f"'timeout' must be a finite number of seconds up to {_seconds(timedelta.max)}, "
                f"got {shown(value)}"
            ) from None
    return value


def _lower(value: Any) -> Any:
    # Backend names are case-insensitive in torch ("NCCL" == "nccl"); store them lower-case.
    return value.strip().lower() if isinstance(value, str) else value


def _check_backend(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:  # torch then picks each device's default backend
        return
    if isinstance(value, str) and not value:
        raise ValueError(
            f"'{attribute.name}' must not be empty: give a backend name such as 'nccl', 'gloo'"
        )
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be None or a backend name (str) such as 'nccl', 'gloo', "
            f"'mpi', 'xccl', got {value!r}"
        )
    known = {b for b in dist.Backend.backend_list if b != "undefined"}
    if ":" in value:  # a device-to-backend map, "cpu:gloo,cuda:nccl"
        for part in value.split(","):
            device, sep, backend = part.strip().partition(":")
            if not (sep and device.strip() and backend.strip().lower() in known):
                raise ValueError(
                    f"'{attribute.name}' map entry {part.strip()!r} of {value!r} is not "
                    f"'device:backend' with a backend among {sorted(known)}; accepted forms: "
                    "'gloo' or 'cpu:gloo,cuda:nccl'"
                )
        return
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
    if value.total_seconds() < MIN_TIMEOUT_SECONDS:
        # Below a second no rendezvous completes: the run would fail later with a timeout
        # that looks like a network problem.
        raise ValueError(
            f"'{attribute.name}' must be at least {MIN_TIMEOUT_SECONDS} second, got "
            f"{attribute.name}={_seconds(value)}; {_ACCEPTED_TIMEOUT}"
        )


_INIT_METHOD_FORMS = "'env://', 'tcp://host:port' or 'file:///path/to/file'"


def _check_init_method(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be None or a URL str such as {_INIT_METHOD_FORMS}, "
            f"got {value!r}"
        )
    parsed = urlparse(value)
    well_formed = (
        (parsed.scheme == "env" and value.startswith("env://"))
        or (parsed.scheme == "file" and bool(parsed.path))
        or (parsed.scheme == "tcp" and bool(parsed.hostname) and _has_port(parsed))
    )
    if not well_formed:
        # "localhost:1234" parses as scheme "localhost": torch would fail much later.
        raise ValueError(
            f"'{attribute.name}' must be None or one of {_INIT_METHOD_FORMS}, got {value!r}"
        )


def _has_port(parsed: Any) -> bool:
    try:
        return parsed.port is not None
    except ValueError:  # a port that is not a number or out of range
        return False


@attrs.define
class _LiveGroup:
    """What this process's groups were formed with (per process, like the group itself).

    Attributes:
        formed: how many default groups kwplug has formed in this process.
        group: the last one (compared by identity with ``dist.group.WORLD``).
        timeout: its timeout (torch has no public getter for it).
    """

    formed: int = 0
    group: Any = None
    timeout: timedelta | None = None


_live = _LiveGroup()


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
            used as given. ``None`` lets torch pick every device's default backend
            (``init_process_group(backend=None)``: gloo for CPU tensors, nccl for CUDA ones).
        init_method: ``str`` URL or ``None`` (default: ``"env://"``, torchrun's variables).
        timeout: ``datetime.timedelta``, seconds (``int``/``float``) or ``None``: how long
            collectives and the rendezvous may wait before failing. ``None`` resolves at
            construction from ``backend``: 600 s for nccl, 1800 s otherwise (and follows later
            assignments to ``backend``). With the default ``"nccl"`` on CPU the process group
            runs gloo with the 600 s the field resolved to.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: an unknown backend (or a malformed ``device:backend`` map), an
            ``init_method`` not of the form ``env://``, ``tcp://host:port`` or
            ``file:///path``, or a timeout below :data:`MIN_TIMEOUT_SECONDS`.
    """

    backend: str | None = attrs.field(
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

    def _resolve(self, timeout: timedelta | None, *backend: str | None) -> timedelta:
        self._timeout_resolved = timeout is None
        return self.default_timeout(*backend or (self.backend,)) if timeout is None else timeout

    def _backend_changed(self, backend: str | None) -> str | None:
        if self._timeout_resolved:  # keep "None means the backend's default" true
            object.__setattr__(self, "timeout", self._resolve(None, backend))
        return backend

    @staticmethod
    def default_timeout(backend: str | None) -> timedelta:
        """The timeout ``None`` resolves to: 600 s for nccl, 1800 s for other backends and
        for ``backend=None`` (torch's ``default_pg_timeout``)."""
        return _NCCL_TIMEOUT if backend == "nccl" else _OTHER_TIMEOUT

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from ``InitProcessGroupKwargs()``, with ``timeout`` exactly
        when it was given (as Accelerate, whose default is the unresolved ``timeout=None``).

        ``InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=600))`` keeps its
        600 s although that equals the nccl default, so a user who passes ``to_kwargs()`` to
        torch gets the timeout they set; a resolved timeout is left to torch's own default.
        """
        kwargs = super().to_kwargs()
        kwargs.pop("timeout", None)
        if not self._timeout_resolved:
            kwargs["timeout"] = self.timeout
        return kwargs

    def resolved_backend(self, device_type: str) -> str | None:
        """The backend used on ``device_type``: the device's default for the default
        ``"nccl"`` on a device without NCCL (``"gloo"`` on CPU), else ``backend`` (``None``:
        torch picks per device)."""
        if self.backend == DEFAULT_BACKEND and device_type != "cuda":
            return dist.Backend.default_device_backend_map.get(device_type, "gloo")
        return self.backend

    def _fresh_store(self, world_size: int, rank: int) -> Any:
        """torch's own ``env://`` rendezvous, namespaced by torchrun's restart attempt and by
        how many groups this process formed before.

        torchrun's agent keeps one store for the whole job, and a destroyed group's keys stay
        in it: the next group (after ``end_training()``, or after ``torchrun --max-restarts``
        restarted the workers) reads the same keys, so a rank that arrives first finds the
        previous group's peer addresses, connects to a closed socket and fails ("Connection
        reset by peer") -- 4 runs in 5 when a rank arrives 3 s late. A ``PrefixStore`` per
        (``TORCHELASTIC_RESTART_COUNT``, group number) keeps every group apart; ``None`` (plain
        ``init_method``) for a first group outside restarts.
        """
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
        if self.init_method is not None or (attempt == "0" and _live.formed == 0):
            return None
        from torch.distributed import PrefixStore, rendezvous  # type: ignore[attr-defined]

        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=self.timeout))
        return PrefixStore(f"kwplug/attempt_{attempt}/group_{_live.formed}", store)

    @hookimpl
    def validate_setup(self, device_type: str) -> None:
        """When a process group already exists, check that it has this handler's settings.

        A handler equal to the default one asks for nothing and is not checked.

        Raises:
            ValueError: the live group's backend or timeout (when kwplug formed it) differs
                from this handler's; the message names both values.
        """
        if not (dist.is_available() and dist.is_initialized()) or self == type(self)():
            return
        differences = []
        backend = self.resolved_backend(device_type)
        live_backend = str(dist.get_backend())
        if backend is not None and ":" not in backend and backend != live_backend:
            differences.append(f"backend {backend!r} (the live group runs {live_backend!r})")
        if _live.group is dist.group.WORLD and self.timeout != _live.timeout:
            differences.append(
                f"timeout {_seconds(self.timeout)} (the live group has {_seconds(_live.timeout)})"
            )
        if differences:
            raise ValueError(
                f"InitProcessGroupKwargs asks for {' and '.join(differences)}, but the default "
                "process group already exists and would be kept as it is; call "
                "end_training() on the earlier Accelerator first, or pass the same settings"
            )

    @hookimpl
    def init_process_group(self, device_type: str, world_size: int, rank: int) -> bool | None:
        """Initialise the default process group from the resolved fields (not ``to_kwargs()``:
        a non-default backend with a timeout equal to the nccl default would lose it).

        Raises:
            RuntimeError: the rendezvous or the backend failed within ``timeout``; the message
                names the rank, the backend and the address (the torch error is chained).
        """
        if world_size <= 1:
            return None
        backend = self.resolved_backend(device_type)
        try:
            store = self._fresh_store(world_size, rank)
            dist.init_process_group(
                backend=backend,
                init_method=None if store is not None else self.init_method,
                store=store,
                timeout=self.timeout,
                world_size=world_size,
                rank=rank,
            )
        except RuntimeError as exc:  # torch's message carries a C++ stack; keep its first line
            where = self.init_method or (
                f"env:// at {os.environ.get('MASTER_ADDR', '?')}:"
                f"{os.environ.get('MASTER_PORT', '?')}"
            )
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RuntimeError(
                f"rank {rank}/{world_size} could not initialise the {backend} process group "
                f"({where}, timeout {_seconds(self.timeout)}): {type(exc).__name__}: {first_line}"
            ) from exc
        _live.formed += 1
        _live.group = dist.group.WORLD
        _live.timeout = self.timeout
        return True
