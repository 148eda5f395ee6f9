"""``ProfileKwargs``: answers the ``make_profiler`` hook with ``torch.profiler.profile``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.validators import OptionSchema, number, strict_bool

TraceHandler = Callable[[torch.profiler.profile], Any]

#: Activity names accepted in ``ProfileKwargs.activities``, each the lower-case name of a
#: ``torch.profiler.ProfilerActivity`` member (a member missing from an older torch counts as
#: "not available").
ACTIVITY_NAMES: tuple[str, ...] = ("cpu", "cuda", "xpu", "mtia", "hpu")

#: Keys accepted in ``ProfileKwargs.schedule_option``: arguments of ``torch.profiler.schedule``.
SCHEDULE_KEYS: tuple[str, ...] = ("wait", "warmup", "active", "repeat", "skip_first")


def _activity(name: str) -> ProfilerActivity | None:
    """The ``ProfilerActivity`` member called ``name`` (``"cuda"`` -> ``CUDA``), or ``None``."""
    member = getattr(ProfilerActivity, name.upper(), None)
    return member if isinstance(member, ProfilerActivity) else None


def available_activities() -> tuple[str, ...]:
    """The names in :data:`ACTIVITY_NAMES` this torch build can profile (from
    ``torch.profiler.supported_activities()``), in :data:`ACTIVITY_NAMES` order."""
    supported = torch.profiler.supported_activities()  # type: ignore[no-untyped-call]
    return tuple(name for name in ACTIVITY_NAMES if _activity(name) in supported)


def _normalize_activities(value: Any) -> Any:
    # Lower-case, de-duplicated tuple of names; ProfilerActivity members become their names.
    # Anything that is not a list/tuple of str/ProfilerActivity is left for the validator.
    if not isinstance(value, (list, tuple)):
        return value
    names: list[Any] = []
    for item in value:
        if isinstance(item, ProfilerActivity):
            item = item.name.lower()
        elif isinstance(item, str):
            item = item.strip().lower()
        if item not in names:
            names.append(item)
    return tuple(names)


def _check_activities(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    # The field keeps the user's list (as Accelerate does); the checks read its normal form.
    value = _normalize_activities(value)
    accepted = ", ".join(map(repr, ACTIVITY_NAMES))
    if isinstance(value, (str, ProfilerActivity)):
        raise TypeError(
            f"'{attribute.name}' must be None or a list of activity names, got the single value "
            f"{value!r}; pass a list, e.g. [{str(value).rsplit('.', 1)[-1].lower()!r}]"
        )
    if not isinstance(value, tuple):
        raise TypeError(
            f"'{attribute.name}' must be None or a list/tuple of activity names among "
            f"{accepted}, got {value!r} of type {type(value).__name__}"
        )
    if not value:
        raise ValueError(
            f"'{attribute.name}' must name at least one activity among {accepted}; "
            "pass None for the default (CPU plus the Accelerator's device)"
        )
    for item in value:
        if not isinstance(item, str):
            raise TypeError(
                f"'{attribute.name}' items must be activity names (str) among {accepted}, got "
                f"{item!r} of type {type(item).__name__}"
            )
        if item not in ACTIVITY_NAMES:
            raise ValueError(
                f"'{attribute.name}' has unknown activity {item!r}; accepted: {accepted}"
            )
    available = available_activities()
    missing = [item for item in value if item not in available]
    if missing:
        raise ValueError(
            f"'{attribute.name}' asks for {', '.join(map(repr, missing))}, not available in "
            f"this torch build/machine (torch.profiler.supported_activities()); available: "
            f"{', '.join(map(repr, available))}"
        )


def _copy_mapping(value: Any) -> Any:
    # A private dict copy, so that later changes to the caller's mapping do not bypass the
    # validator; anything else is left for the validator.
    return dict(value) if isinstance(value, Mapping) else value


#: What ``ProfileKwargs.schedule_option`` accepts: ``int`` step counts, ``active`` >= 1
#: (required), the others >= 0.
SCHEDULE_SCHEMA = OptionSchema(
    {key: number(integer=True, ge=1 if key == "active" else 0) for key in SCHEDULE_KEYS},
    name="schedule_option",
    required=("active",),
    label="'{name}[{key!r}]'",
    unknown="'{name}' has unknown key(s) {names}; accepted: {accepted}",
    missing="'{name}' needs the key {names} (number of recorded steps per cycle, >= 1); "
    "the other keys ({accepted}) default to 0",
)


def _check_schedule_option(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(
            f"'{attribute.name}' must be None or a dict with keys among "
            f"{', '.join(map(repr, SCHEDULE_KEYS))} (arguments of torch.profiler.schedule), "
            f"got {value!r} of type {type(value).__name__}"
        )
    SCHEDULE_SCHEMA.check(value)


# build(rank=...): an int >= 0 (None was replaced by the actual rank).
_RANK = OptionSchema({"rank": number(integer=True, ge=0)}, label="{key}")

# attrs's own message names the field and says "must be callable".
_OPTIONAL_CALLABLE = attrs.validators.optional(attrs.validators.is_callable())


def _check_dir(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise TypeError(
            f"'{attribute.name}' must be None, a str or an os.PathLike (e.g. pathlib.Path) "
            f"naming a directory, got {value!r} of type {type(value).__name__}"
        )
    if not os.fspath(value):
        raise ValueError(
            f"'{attribute.name}' must be a non-empty directory path (use '.' for the current "
            "directory), got ''"
        )


@attrs.define
class ProfileKwargs(KwargsHandler):
    """Options of ``torch.profiler.profile`` for ``Accelerator.profile()``.

    ``with accelerator.profile(ProfileKwargs(...)) as prof:`` enters the profiler built by
    :meth:`build`; without a handler, the one registered with the Accelerator (a default
    ``ProfileKwargs()`` unless ``kwargs_handlers`` holds one) builds it. Inside, call
    ``prof.step()`` once per training step when ``schedule_option`` is set; after the block,
    ``prof.key_averages()`` and ``prof.export_chrome_trace(path)`` read the results of the last
    recorded cycle.

    :meth:`to_kwargs` returns the fields that differ from ``ProfileKwargs()`` (``activities``
    as the user gave it), including the kwplug-only ``output_trace_dir``.

    Attributes:
        activities: ``None`` (default) or a list/tuple of activity names among ``"cpu"``,
            ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"`` (``torch.profiler.ProfilerActivity``
            members are accepted too). Maps to ``torch.profiler.profile(activities=...)`` as
            ``ProfilerActivity.CPU``, ``.CUDA``, ... ``None`` means CPU plus the activity of
            the Accelerator's device when that device is not the CPU and its activity is
            available. Stored as given (the same list, as Accelerate keeps it); names are
            case-insensitive and duplicates are ignored when the profiler is built.
        schedule_option: ``None`` (default: record every step from entry to exit as one trace)
            or a ``dict`` of ``int`` step counts with keys among ``"wait"``, ``"warmup"``,
            ``"active"`` (required, >= 1), ``"repeat"``, ``"skip_first"`` (each >= 0,
            missing ones are 0; ``repeat=0`` cycles until the profiler exits). Maps to
            ``torch.profiler.profile(schedule=torch.profiler.schedule(**schedule_option))``:
            after ``skip_first`` steps, each cycle waits ``wait`` steps, warms up for
            ``warmup`` steps and records ``active`` steps; a trace is ready at the end of each
            cycle. Units: calls of ``prof.step()``. Stored as a copy.
        on_trace_ready: ``None`` (default) or a callable taking the profiler, called by torch
            each time a trace is ready (``torch.profiler.profile(on_trace_ready=...)``): once
            per completed schedule cycle, or once at exit without a schedule. With
            ``output_trace_dir`` it is called after the trace file is written.
        record_shapes: ``bool``, default ``False``; record operator input shapes
            (``torch.profiler.profile(record_shapes=...)``; see
            ``prof.key_averages(group_by_input_shape=True)``).
        profile_memory: ``bool``, default ``False``; track tensor memory allocation and
            release, in bytes (``torch.profiler.profile(profile_memory=...)``).
        with_stack: ``bool``, default ``False``; record Python/C++ source locations of ops
            (``torch.profiler.profile(with_stack=...)``).
        with_flops: ``bool``, default ``False``; estimate FLOPs of matrix multiplications and
            2D convolutions (``torch.profiler.profile(with_flops=...)``).
        with_modules: ``bool``, default ``False``; record the ``nn.Module`` hierarchy of ops
            (TorchScript models only; ``torch.profiler.profile(with_modules=...)``).
        output_trace_dir: ``None`` (default) or a directory (``str`` or ``os.PathLike``).
            kwplug's own option: :meth:`build` creates the directory, and each ready trace is
            written there with ``prof.export_chrome_trace`` as
            ``trace_rank{rank}_step{step}.json``. ``step`` is ``prof.step_num`` when the trace
            became ready: the step just begun when ``prof.step()`` completed a cycle, or the
            current step when leaving the context ended it (0 without a schedule). A name that
            exists already gets ``_1``, ``_2``, ... instead of being replaced, so ranks, cycles
            and successive runs never overwrite each other. A schedule that never reached a
            recording step writes no file.

    Raises:
        TypeError: a field has the wrong type (a bare ``str`` for ``activities``, ``0``/``1``
            for a ``bool`` field, a non-``int`` schedule count, a non-callable
            ``on_trace_ready``, ...).
        ValueError: an unknown activity name or one not available here (the message lists
            the accepted and the available ones), an empty ``activities``, an unknown
            ``schedule_option`` key or a missing ``"active"``, a count out of range, an empty
            ``output_trace_dir``.
    """

    #: ``torch.device.type`` -> the profiler activity that traces that device.
    DEVICE_ACTIVITY: ClassVar[dict[str, str]] = {
        "cuda": "cuda",
        "xpu": "xpu",
        "mtia": "mtia",
        "hpu": "hpu",
    }

    activities: Sequence[str | ProfilerActivity] | None = attrs.field(
        default=None, validator=_check_activities
    )
    schedule_option: dict[str, int] | None = attrs.field(
        default=None, converter=_copy_mapping, validator=_check_schedule_option
    )
    on_trace_ready: TraceHandler | None = attrs.field(default=None, validator=_OPTIONAL_CALLABLE)
    record_shapes: bool = attrs.field(default=False, validator=strict_bool)
    profile_memory: bool = attrs.field(default=False, validator=strict_bool)
    with_stack: bool = attrs.field(default=False, validator=strict_bool)
    with_flops: bool = attrs.field(default=False, validator=strict_bool)
    with_modules: bool = attrs.field(default=False, validator=strict_bool)
    output_trace_dir: str | os.PathLike[str] | None = attrs.field(
        default=None, validator=_check_dir
    )

    def resolved_activities(self, device_type: str = "cpu") -> list[ProfilerActivity]:
        """The ``ProfilerActivity`` list passed to torch for an Accelerator on
        ``device_type``: ``activities`` as given, or CPU plus the device's activity."""
        if self.activities is not None:
            names: tuple[str, ...] = _normalize_activities(self.activities)
        else:
            names = ("cpu",)
            device_activity = self.DEVICE_ACTIVITY.get(device_type)
            if device_activity is not None and device_activity in available_activities():
                names += (device_activity,)
        members = [_activity(name) for name in names]
        return [member for member in members if member is not None]

    def build(self, device_type: str = "cpu", rank: int | None = None) -> torch.profiler.profile:
        """Build (without starting) the ``torch.profiler.profile`` these options describe.

        Args:
            device_type: ``torch.device.type`` of the device being trained on; chooses the
                default activities.
            rank: global rank of this process, used in trace file names; ``None`` means the
                ``torch.distributed`` rank when a process group is initialised, else 0.

        Returns:
            An unstarted profiler: enter it with ``with``, or call ``start()``/``stop()``.

        Raises:
            TypeError, ValueError: a field was made invalid after construction (e.g. the
                ``schedule_option`` dict was changed in place); ``rank`` is not an int
                (``TypeError``) or is negative (``ValueError``).
        """
        attrs.validate(self)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        _RANK.check({"rank": rank})
        schedule = None
        if self.schedule_option is not None:
            options = {"wait": 0, "warmup": 0, **self.schedule_option}
            schedule = torch.profiler.schedule(**options)
        on_trace_ready = self.on_trace_ready
        if self.output_trace_dir is not None:
            on_trace_ready = _chrome_trace_writer(
                os.fspath(self.output_trace_dir), rank, then=self.on_trace_ready
            )
        return torch.profiler.profile(
            activities=self.resolved_activities(device_type),
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )

    @hookimpl
    def make_profiler(self, device_type: str, rank: int) -> torch.profiler.profile:
        """The profiler of :meth:`build` for this Accelerator's device type and rank."""
        return self.build(device_type, rank)


def _chrome_trace_writer(
    directory: str, rank: int, then: TraceHandler | None = None
) -> TraceHandler:
    """An ``on_trace_ready`` that writes each ready trace to a new file in ``directory``,
    then calls ``then(prof)``. Creates ``directory`` now."""
    os.makedirs(directory, exist_ok=True)

    def write(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(_reserve_path(directory, f"trace_rank{rank}_step{prof.step_num}"))
        if then is not None:
            then(prof)

    return write


def _reserve_path(directory: str, stem: str) -> str:
    """Create an empty ``{stem}.json`` (or ``{stem}_{n}.json``) that did not exist, and return
    its path: exclusive creation keeps concurrent writers from sharing a name."""
    n = 0
    while True:
        path = os.path.join(directory, f"{stem}_{n}.json" if n else f"{stem}.json")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        return path
