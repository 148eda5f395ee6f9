"""Every rank trains with the same settings, or the job stops naming the one that differs.

At each ``Accelerator()`` of a job with more than one process, every rank describes what must
agree across ranks (:func:`describe`): ``mixed_precision``, gradient accumulation, the data
loader and scheduler options, every registered handler's settings (its attrs fields,
automatically, so a third-party handler's own options take part without code), the named
communication hooks, the loaded plugins with their distributions and versions, and the kwplug
and torch versions. The ranks exchange a short digest of that description in ONE
``torch.distributed.all_gather_object``; only when the digests differ do they exchange the full
descriptions, so that every rank raises the same :class:`~kwplug.errors.RankMismatchError`
naming each differing field and each rank's value. In one process nothing is exchanged.

The settings stay mutable after construction (``accelerator.gradient_accumulation_steps = 4``,
``accelerator.even_batches = False``, ``project_configuration.total_limit``...), so
:class:`LiveAgreement` compares the description again, as the settings are then, at kwplug's
later collectives: ``prepare`` of a model, the first ``backward`` after one, ``save_state``
(once every rank has arrived; a main-process-only save is no collective and compares
nothing) and ``load_state``. That comparison goes through the c10d store
(:func:`kwplug._runtime.meet`: a few store requests per rank, bounded by ``KWPLUG_RANK_WAIT``),
so that a rank that never arrives is named instead of waited for.

A handler field that may legitimately differ per rank opts out with
``attrs.field(metadata={kwplug.handler.AGREE: False})``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import hashlib
import json
import math
import os
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from kwplug._runtime import meet
from kwplug.errors import RankMismatchError
from kwplug.handler import AGREE, KwargsHandler
from kwplug.utils.dataclasses import GradientAccumulationPlugin

if TYPE_CHECKING:
    from kwplug.accelerator._options import _Options
    from kwplug.accelerator._setup import _Setup

#: What a rank reports for a field it does not have (a handler or plugin it lacks).
ABSENT = "<absent>"
#: Longest value quoted in a message, in characters (the attributes keep the whole value).
_SHOWN = 200
_DEPTH = 20  # nesting beyond this is described by type only (no recursion error)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs per process


@functools.cache
def _versions() -> dict[str, str]:
    """The kwplug and torch versions (read once per process: they cannot change in it).

    kwplug's comes from its built-in plugins' discovery records when there are any (reading
    the installed metadata again costs ~50 ms), else from ``kwplug.__version__``.
    """
    from kwplug._plugins import discover

    own = next((r.version for r in discover() if r.builtin), None)
    if own is None:  # what kwplug.__version__ reads (importing kwplug here would be a loop)
        import importlib_metadata

        own = importlib_metadata.version("kwplug")
    return {"kwplug version": str(own), "torch version": str(torch.__version__)}


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qualname is None:
        return type(obj).__qualname__
    return f"{module}.{qualname}" if module else str(qualname)


def canonical(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-safe data that is equal on two ranks exactly when the settings are:
    mappings with sorted string keys, sets sorted, ``timedelta`` in seconds, enums by value,
    attrs/dataclass instances by type and fields, callables and classes by qualified name,
    anything else by ``repr`` without memory addresses."""
    if isinstance(value, enum.Enum):  # before str/int: a str or int enum is sent as its value
        value = value.value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)  # subclasses as the base type: JSON and pickle alike
    if isinstance(value, str):
        return str(value)  # e.g. torch's TorchVersion
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else repr(value)
    if depth > _DEPTH:
        return f"<{type(value).__qualname__}>"
    deeper = depth + 1
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (torch.dtype, torch.device, os.PathLike)):
        return str(value)
    if isinstance(value, Mapping):
        items = {
            k if isinstance(k, str) else json.dumps(canonical(k, deeper)): canonical(v, deeper)
            for k, v in value.items()
        }
        return dict(sorted(items.items()))
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v, deeper) for v in value), key=json.dumps)
    if isinstance(value, (list, tuple)):
        return [canonical(v, deeper) for v in value]
    if isinstance(value, functools.partial):
        return {
            "partial": canonical(value.func, deeper),
            "args": canonical(value.args, deeper),
            "keywords": canonical(value.keywords, deeper),
        }
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return _name(value)
    if attrs.has(type(value)):
        fields = {f.name: getattr(value, f.name) for f in attrs.fields(type(value)) if f.eq}
        return {"type": _name(type(value)), **canonical(fields, deeper)}
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.compare}
        return {"type": _name(type(value)), **canonical(fields, deeper)}
    return _ADDRESS.sub("", repr(value))


def _text(value: Any) -> str:
    """How a canonical value reads in a message: its JSON text."""
    return value if value is ABSENT else json.dumps(value, sort_keys=True)


def handler_fields(handler: KwargsHandler) -> dict[str, Any]:
    """The settings of ``handler`` every rank must share: each attrs field that is a
    constructor argument, takes part in equality and is not marked ``AGREE: False``."""
    return {
        f.name: getattr(handler, f.name)
        for f in attrs.fields(type(handler))
        if f.init and f.eq and f.metadata.get(AGREE, True)
    }


def describe(setup: _Setup, options: _Options) -> dict[str, Any]:
    """Field name -> canonical (JSON-safe, see :func:`canonical`) value, for everything ranks
    must agree on.

    Field names are what messages show: ``kwplug version``, ``torch version``,
    ``plugin '<entry point>'``, ``mixed_precision``, ``gradient_accumulation_steps``,
    ``gradient_accumulation_plugin.<field>``, ``dataloader_config.<field>``,
    ``step_scheduler_with_optimizer``, ``project_config.<field>`` (``automatic_checkpoint_naming``,
    ``total_limit``, ``iteration``, ``save_on_each_node``, and ``project_dir is set``: whether
    there is one, not its path, which may differ per machine), ``<HandlerClass>.<field>`` for
    every registered handler (given or default-built), ``handlers`` (their classes),
    ``comm hook '<name>'``.
    """
    from kwplug._plugins import discover

    # Versions and plugins first: when they differ, the settings below differ because of them.
    fields: dict[str, Any] = dict(_versions())
    for record in discover():
        if record.loaded:
            fields[f"plugin {record.name!r}"] = f"{record.distribution} {record.version}"
    accumulation = options.gradient_accumulation
    fields["mixed_precision"] = setup.mixed_precision
    fields["gradient_accumulation_steps"] = accumulation.num_steps
    for f in attrs.fields(type(accumulation)):
        if f.name != "num_steps":
            fields[f"gradient_accumulation_plugin.{f.name}"] = getattr(accumulation, f.name)
    loader = options.dataloader_config
    for f in attrs.fields(type(loader)):
        fields[f"dataloader_config.{f.name}"] = getattr(loader, f.name)
    fields["step_scheduler_with_optimizer"] = options.step_scheduler_with_optimizer
    project = options.project_configuration
    fields["project_config.project_dir is set"] = project.project_dir is not None
    for name in ("automatic_checkpoint_naming", "total_limit", "iteration", "save_on_each_node"):
        fields[f"project_config.{name}"] = getattr(project, name)
    # Keyed by class, not by registered name: a handler passed with default settings and the
    # default instance of its class are the same settings.
    classes: dict[str, str] = {}
    handlers = [p for _, p in setup.plugins.list_name_plugin() if isinstance(p, KwargsHandler)]
    for plugin in sorted(handlers, key=lambda h: _name(type(h))):
        cls = type(plugin)
        label = cls.__qualname__ if cls.__qualname__ not in classes else _name(cls)
        classes[label] = _name(cls)
        for key, value in handler_fields(plugin).items():
            fields[f"{label}.{key}"] = value
    fields["handlers"] = sorted(classes.values())
    for name, hook in setup.comm_hooks.items():
        fields[f"comm hook {name!r}"] = hook
    return {key: canonical(value) for key, value in fields.items()}


def digest(description: Mapping[str, Any]) -> str:
    """A short (32 hex digits) sha256 digest of a description, independent of key order."""
    payload = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def check_ranks_agree(setup: _Setup, options: _Options) -> None:
    """Raise on every rank when the ranks of this job built their Accelerators differently.

    Costs one ``all_gather_object`` of a 32-character digest per Accelerator when the world
    size is above 1 (nothing in one process); the full descriptions are gathered only when
    the digests differ. Every rank must construct each Accelerator: a rank that does not is
    waited for up to the process group's timeout (``InitProcessGroupKwargs.timeout``).

    Raises:
        kwplug.errors.RankMismatchError: on every rank, naming each field whose value differs
            and each rank's value.
        RuntimeError: the other ranks did not construct an Accelerator within the process
            group's timeout (torch's error is chained).
    """
    world_size = setup.process.world_size
    if world_size <= 1 or not dist.is_initialized():
        return
    description = describe(setup, options)
    digests = _gather(digest(description), setup)
    if len(set(digests)) == 1:
        return
    descriptions: list[dict[str, Any]] = _gather(description, setup)
    raise mismatch_error(descriptions)


def _gather(obj: Any, setup: _Setup) -> list[Any]:
    out: list[Any] = [None] * setup.process.world_size
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:  # gloo/nccl timeouts and peers that went away
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"rank {setup.process.rank}/{setup.process.world_size}: comparing Accelerator settings "
            "across ranks failed; every rank must construct each Accelerator(), and the other "
            f"ranks did not within the process group's timeout ({first})"
        ) from exc
    return out


def mismatch_error(
    descriptions: Sequence[Mapping[str, Any]], at: str | None = None
) -> RankMismatchError:
    """The error for ``descriptions`` (one per rank, in rank order) that do not all agree;
    ``at``: the kwplug call that compared them (``None``: ``Accelerator()``)."""
    order = list(descriptions[0])
    for other in descriptions[1:]:
        order += [key for key in other if key not in descriptions[0]]
    mismatches = {
        key: values
        for key in dict.fromkeys(order)
        if len(set(values := tuple(_text(d.get(key, ABSENT)) for d in descriptions))) > 1
    }
    parts = [f"{key}: {_per_rank(values)}" for key, values in mismatches.items()]
    field = next(iter(mismatches))
    when = (
        "constructed Accelerator() with different settings"
        if at is None
        else f"reached {at} with different settings (compared again at prepare, the first "
        "backward, save_state and load_state: a setting assigned after Accelerator() on some "
        "ranks only counts)"
    )
    return RankMismatchError(
        f"the ranks of this job {when}; "
        f"{'; '.join(parts)}. Every rank must pass the same settings and run the same "
        "kwplug, torch and plugins",
        field=field,
        values=mismatches[field],
        mismatches=mismatches,
    )


def _per_rank(values: Sequence[str]) -> str:
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ", ".join(f"{_shown(v)} on {_ranks(r)}" for v, r in ranks.items())


def _shown(value: str) -> str:
    return value if len(value) <= _SHOWN else f"{value[:_SHOWN]}... ({len(value)} characters)"


def _ranks(ranks: list[int]) -> str:
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


@attrs.define
class LiveAgreement:
    """An Accelerator's settings compared again, as they are now, at its later collectives.

    Attributes:
        setup: what the Accelerator resolved at construction.
        options: its keywords as resolved at construction (the live values replace the
            mutable ones: accumulation, data loader and project configuration, scheduler).
        owner: the Accelerator, weakly (it holds this object).
        backward_due: the first ``backward`` after a ``prepare`` of a model compares (one
            attribute read per step; cleared by that comparison).
    """

    setup: _Setup
    options: _Options
    owner: weakref.ref[Any]
    backward_due: bool = False

    def description(self, at: str) -> dict[str, Any]:
        """:func:`describe` of the live settings, with ``"kwplug call": at`` first;
        ``project_config.iteration`` only at a collective ``save_state`` (where every rank
        names the folder from it): saves by the main process alone advance its iteration
        only, legitimately, until a ``load_state`` sets every rank's."""
        accelerator: Any = self.owner()  # alive: it is the caller
        options = attrs.evolve(
            self.options,
            gradient_accumulation=GradientAccumulationPlugin(
                **accelerator.gradient_state.plugin_kwargs
            ),
            dataloader_config=accelerator.dataloader_config,
            project_configuration=accelerator.project_configuration,
            step_scheduler_with_optimizer=accelerator.step_scheduler_with_optimizer,
        )
        described = {"kwplug call": at, **describe(self.setup, options)}
        if at != "save_state":
            described.pop("project_config.iteration", None)
        return described

    def check(self, at: str) -> None:
        """Compare the live settings across ranks at ``at`` (``"prepare"``, ``"backward"``,
        ``"save_state"``, ``"load_state"``); nothing in one process.

        Raises:
            kwplug.errors.RankMismatchError: on every rank, naming each differing setting
                and each rank's value.
            kwplug.errors.RankTimeoutError: a rank did not reach ``at`` within
                ``KWPLUG_RANK_WAIT`` seconds (default: the process group's timeout).
        """
        process = self.setup.process
        if process.world_size <= 1 or not dist.is_initialized():
            return
        described = self.description(at)
        found = meet(
            "agree",
            at,
            process.rank,
            process.world_size,
            digest(described),
            lambda: json.dumps(described),  # key order: the message's field order
        )
        if found is not None:
            raise mismatch_error([json.loads(text) for text in found], at=at)
