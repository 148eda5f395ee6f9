"""Options and per-model state of the ``"int8"`` and ``"topk"`` communication hooks.

kwplug builds a hook's state once per DDP model, when ``accelerator.prepare(model)`` wraps it,
by calling the :class:`kwplug.CommHook`'s ``make_state(process_group, comm_state_option)``.
The factories here check every option first, so a misspelt key or a bad value fails before
DDP is built and before any collective runs.

Checkpoints save a state's residuals through its ``state_dict()``/``load_state_dict()``, with
the parameters of each residual's bucket, so that a resumed run runs its first step on the
saved buckets; resuming on another number of processes, the records' ``resize`` rule,
:func:`resize_residuals`, says what each new process starts from.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kwplug.validators import OptionSchema, Validator, number, strict_bool

__all__ = [
    "INT8_OPTIONS",
    "RESIZE_NOTE",
    "TOPK_OPTIONS",
    "BucketIndex",
    "Int8State",
    "Layout",
    "Origin",
    "ResidualMemory",
    "Tile",
    "TopKState",
    "make_int8_state",
    "make_topk_state",
    "residual_buckets",
    "resize_residuals",
]

#: The shapes of a bucket's parameters, in bucket order: what a residual's entries mean.
Layout = tuple[tuple[int, ...], ...]

#: A bucket's ``index()``: DDP's ``int``, or kwplug's canonical key (the sorted indices of its
#: parameters in ``model.parameters()``), which the records ask for with ``state_buckets``.
BucketIndex = int | tuple[int, ...]


def _bucket_index(index: Any) -> BucketIndex:
    # A saved key back as the hook sees it (a canonical key may come back as a list).
    if isinstance(index, (list, tuple)):
        return tuple(int(i) for i in index)
    return int(index)


#: Options of ``"int8"`` and their defaults.
INT8_OPTIONS: Mapping[str, Any] = {"chunk_size": 512, "error_feedback": False}

#: Options of ``"topk"`` and their defaults.
TOPK_OPTIONS: Mapping[str, Any] = {"ratio": 0.01, "error_feedback": True}


#: Where a parameter was first seen by a state, ``(bucket index, position in the bucket)``:
#: in DDP's initial buckets, which a new DDP builds the same way, so it names the same
#: parameter in the process that saved a checkpoint and in the one that resumes from it.
Origin = tuple[BucketIndex, int]

#: A tile of a bucket: a saved bucket's index and the positions, in the bucket being run, of
#: the saved bucket's parameters, in the saved bucket's order.
Tile = tuple[BucketIndex, tuple[int, ...]]


class ResidualMemory:
    """Error-feedback memory: one float32 residual per DDP bucket, keyed by bucket index, and
    the parameters of each bucket (by :data:`Origin`).

    A residual is only meaningful for the parameter layout it was accumulated for. DDP rebuilds
    its buckets after the first step (in the order gradients became ready), so each residual is
    stored with its bucket's :data:`Layout` and a bucket whose layout changed starts again
    from zeros. A checkpoint also saves which parameters each bucket held: on a resumed run's
    first step, still in DDP's initial buckets, :meth:`tiles` cuts each bucket into the saved
    ones, so that the hooks compute what the uninterrupted run did, bit for bit.
    """

    def __init__(self) -> None:
        self._live: dict[BucketIndex, tuple[Layout, torch.Tensor]] = {}
        self._restored: dict[BucketIndex, tuple[Layout, torch.Tensor]] = {}  # not used yet
        # id(parameter) -> (the parameter, kept so that its id is not reused; its origin)
        self._origins: dict[int, tuple[torch.Tensor, Origin]] = {}
        self._buckets: dict[BucketIndex, tuple[Origin, ...]] = {}
        self._saved_buckets: dict[BucketIndex, tuple[Origin, ...]] = {}
        self._decided: set[BucketIndex] = set()

    def members(self, index: BucketIndex, parameters: list[torch.Tensor]) -> tuple[Origin, ...]:
        """Record bucket ``index``'s parameters; their :data:`Origin`, in bucket order."""
        origins = []
        for position, parameter in enumerate(parameters):
            known = self._origins.get(id(parameter))
            if known is None:
                known = self._origins[id(parameter)] = (parameter, (index, position))
            origins.append(known[1])
        members = tuple(origins)
        if self._buckets.get(index) != members:  # a new layout (DDP rebuilt its buckets)
            mine = set(members)
            for other in [i for i, held in self._buckets.items() if mine.intersection(held)]:
                del self._buckets[other]
            self._buckets[index] = members
        return members

    def tiles(self, index: BucketIndex, members: tuple[Origin, ...]) -> list[Tile] | None:
        """How to cut bucket ``index`` (parameters ``members``) into the saved buckets.

        Returns:
            One :data:`Tile` per saved bucket, by saved index, when the checkpoint's buckets
            hold exactly this bucket's parameters in another grouping or order, on the first
            step after :meth:`load_state_dict`; else ``None``: run the bucket whole.
        """
        if not self._saved_buckets or index in self._decided:
            return None
        self._decided.add(index)  # DDP's first buckets are cut on their first step only
        if self._saved_buckets.get(index) == members:
            return None
        position = {origin: n for n, origin in enumerate(members)}
        tiles = [
            (saved, tuple(position[o] for o in origins))
            for saved, origins in sorted(self._saved_buckets.items(), key=_order)
            if origins and all(o in position for o in origins)
        ]
        covered = sorted(n for _, positions in tiles for n in positions)
        return tiles if tiles and covered == list(range(len(members))) else None

    def residual(
        self,
        index: BucketIndex,
        layout: Layout,
        like: torch.Tensor,
        members: tuple[Origin, ...] | None = None,
    ) -> torch.Tensor:
        """The residual of bucket ``index`` (a float32 tensor to update in place).

        Args:
            index: the bucket's ``index()``.
            layout: the bucket's :data:`Layout`.
            like: the bucket buffer; a new residual has its number of elements and device.
            members: the bucket's parameters (:meth:`members`), or ``None`` (not known).

        Returns:
            A 1-D ``torch.float32`` tensor of ``like.numel()`` elements on ``like.device``:
            the live residual when its layout matches, else a restored one with this layout
            (and these parameters, when the checkpoint and ``members`` tell), else zeros.
        """
        entry = self._live.get(index)
        if entry is not None and entry[0] == layout:
            return entry[1]
        restored = self._restored.get(index)
        saved = self._saved_buckets.get(index)
        # Two orders of parameters can have the same shapes: compare them when both are known.
        same = saved is None or members is None or saved == members
        if restored is not None and restored[0] == layout and same:
            del self._restored[index]
            tensor = restored[1].to(device=like.device, dtype=torch.float32)
        else:
            tensor = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        self._live[index] = (layout, tensor)
        return tensor

    def state_dict(self) -> dict[str, Any]:
        """A copy of every residual (CPU tensors) and of the buckets' parameters, by index.

        Returns:
            ``{"residuals": {index: {"layout": [[shape...], ...], "residual": Tensor}},
            "buckets": {index: [[bucket, position], ...]}}``; restored residuals not used yet
            are included.
        """
        entries = {**self._restored, **self._live}
        return {
            "residuals": {
                index: {"layout": [list(shape) for shape in layout], "residual": tensor.cpu()}
                for index, (layout, tensor) in entries.items()
            },
            "buckets": {
                index: [list(o) for o in members]
                for index, members in (self._buckets or self._saved_buckets).items()
            },
        }

    def keys(self) -> list[BucketIndex]:
        """The bucket indices holding a residual (live, or restored and not used yet)."""
        return list({**self._restored, **self._live})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace every residual with the ones :meth:`state_dict` returned (``"buckets"``
        may be missing: a checkpoint of an earlier version, resumed without tiling).

        Raises:
            KeyError: ``state`` lacks ``"residuals"`` or an entry lacks a key.
        """
        self._live.clear()
        self._restored = {
            _bucket_index(index): (
                tuple(tuple(int(d) for d in shape) for shape in entry["layout"]),
                entry["residual"].detach().to(torch.float32).clone(),
            )
            for index, entry in state["residuals"].items()
        }
        self._buckets.clear()
        self._decided.clear()
        self._saved_buckets = {
            _bucket_index(index): tuple((_bucket_index(b), int(n)) for b, n in origins)
            for index, origins in state.get("buckets", {}).items()
        }


def _order(item: tuple[BucketIndex, Any]) -> tuple[int, Any]:
    return (0, item[0]) if isinstance(item[0], int) else (1, item[0])  # DDP's order first


class _CheckpointedResiduals:
    """``state_dict``/``load_state_dict`` of a hook state holding a :class:`ResidualMemory`:
    what ``Accelerator.save_state`` saves per rank (the options are configuration)."""

    memory: ResidualMemory

    def state_dict(self) -> dict[str, Any]:
        """The residuals, for ``Accelerator.save_state`` (see :meth:`ResidualMemory.state_dict`)."""
        return self.memory.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the options stay as configured."""
        self.memory.load_state_dict(state)


@dataclass(eq=False)
class Int8State(_CheckpointedResiduals):
    """State of the ``"int8"`` hook.

    Attributes:
        process_group: ``torch.distributed.ProcessGroup`` to exchange over, ``None`` = the
            default group (what kwplug passes).
        chunk_size: elements sharing one float32 scale (default 512, so the scales add
            4/512 of a byte per element to the int8 payload).
        error_feedback: carry each step's quantisation error into the next (default off:
            rounding to 1/254 of the chunk's range already loses little).
        memory: the residuals, used with ``error_feedback``.
        buffers: tensors the hook reuses every step, by (bucket index, role) (not
            checkpointed).
    """

    process_group: dist.ProcessGroup | None = None
    chunk_size: int = 512
    error_feedback: bool = False
    memory: ResidualMemory = field(default_factory=ResidualMemory)
    buffers: dict[tuple[BucketIndex, str], torch.Tensor] = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class TopKState(_CheckpointedResiduals):
    """State of the ``"topk"`` hook.

    Attributes:
        process_group: ``torch.distributed.ProcessGroup``, ``None`` = the default group.
        ratio: fraction of each bucket's elements every rank sends, in (0, 1] (default 0.01);
            ``k = max(1, ceil(ratio * numel))``.
        error_feedback: keep what was not sent and add it to the next step's gradient
            (default on; without it top-k sparsification loses most of the gradient).
        memory: the residuals, used with ``error_feedback``.
        buffers: tensors the hook reuses every step, by (bucket index, role) (not
            checkpointed).
    """

    process_group: dist.ProcessGroup | None = None
    ratio: float = 0.01
    error_feedback: bool = True
    memory: ResidualMemory = field(default_factory=ResidualMemory)
    buffers: dict[tuple[BucketIndex, str], torch.Tensor] = field(default_factory=dict, repr=False)


def residual_buckets(state: Int8State | TopKState) -> list[BucketIndex]:
    """A ``state_buckets`` rule for the ``"int8"`` and ``"topk"`` states: the bucket keys the
    state's residuals are kept under, for a record that asks kwplug for canonical buckets
    (the built-in records do not: see :class:`ResidualMemory`)."""
    return state.memory.keys()


#: What :func:`resize_residuals` does not carry over, as kwplug's resize warning names it.
RESIZE_NOTE = "every process starts from the saved rank 0's residuals"


def resize_residuals(
    saved: Mapping[str, Any], old_world_size: int, new_world_size: int
) -> dict[str, Any]:
    """The ``resize`` rule of the ``"int8"`` and ``"topk"`` records: what a process of a run
    with ``new_world_size`` processes loads of the residuals the saved rank 0 saved.

    A residual is what a rank still owes the average: the hooks add it to that rank's next
    gradient, and the average divides the ranks' sum by their number, so the ranks' *mean*
    residual is what the averaged gradient owes. Every new process starts from the saved rank
    0's residuals: the mean of the new residuals is then rank 0's, which is exactly the owed
    amount when growing from one process and rank 0's share of it, an estimate of the mean,
    when shrinking (the other ranks' residuals are not read). Layouts and the buckets'
    parameters are kept (they do not depend on the number of processes).

    Args:
        saved: what :meth:`ResidualMemory.state_dict` returned on the saved rank 0.
        old_world_size: processes that saved it.
        new_world_size: processes that load it.

    Returns:
        A copy of ``saved`` (the same residuals on every new process).

    Raises:
        KeyError: ``saved`` lacks ``"residuals"``.
    """
    del old_world_size, new_world_size  # the same rule whatever the sizes
    return {"residuals": dict(saved["residuals"]), "buckets": dict(saved.get("buckets", {}))}


def _schema(hook: str, defaults: Mapping[str, Any], value: Validator) -> OptionSchema:
    # kwplug's shared option checker: unknown keys first (a misspelt key is the likeliest
    # mistake; the message names what is accepted, with defaults), then every value.
    first = next(iter(defaults))
    return OptionSchema(
        {first: value, "error_feedback": strict_bool},
        name=f"comm_state_option of the {hook!r} hook",
        defaults=defaults,
        label=f"comm_state_option[{{key!r}}] of the {hook!r} hook",
        unknown="unknown option(s) {names} in {name}; accepted: {accepted}",
        accepted_item="{key} (default {default!r})",
    )


_INT8_SCHEMA = _schema(
    "int8", INT8_OPTIONS, number(integer=True, ge=1, description="an int >= 1 (elements per scale)")
)
_TOPK_SCHEMA = _schema(
    "topk",
    TOPK_OPTIONS,
    number(gt=0, le=1, description="a float in (0, 1] (the fraction of each bucket sent)"),
)


def make_int8_state(
    process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> Int8State:
    """Build the ``"int8"`` hook's state; options as :func:`check_int8_options` (which
    raises what this raises)."""
    chunk_size, error_feedback = check_int8_options(options)
    return Int8State(process_group, chunk_size, error_feedback)


def check_int8_options(options: Mapping[str, Any]) -> tuple[int, bool]:
    """Check the ``"int8"`` hook's ``DistributedDataParallelKwargs.comm_state_option``
    (kwplug calls it through ``CommHook.check_options``, with no process group needed).

    Args:
        options: ``chunk_size`` (``int`` >= 1, default 512 elements per float32 scale) and
            ``error_feedback`` (``bool``, default ``False``).

    Returns:
        ``(chunk_size, error_feedback)`` with the defaults filled in.

    Raises:
        ValueError: an unknown key (the message lists the accepted ones with their defaults),
            or ``chunk_size < 1``.
        TypeError: ``options`` is not a mapping, ``chunk_size`` is not an ``int`` (``bool``
            is refused), or ``error_feedback`` is not a ``bool``.
    """
    values = _INT8_SCHEMA.check(options)
    return values["chunk_size"], values["error_feedback"]


def make_topk_state(
    process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> TopKState:
    """Build the ``"topk"`` hook's state; options as :func:`check_topk_options` (which
    raises what this raises)."""
    ratio, error_feedback = check_topk_options(options)
    return TopKState(process_group, ratio, error_feedback)


def check_topk_options(options: Mapping[str, Any]) -> tuple[float, bool]:
    """Check the ``"topk"`` hook's ``DistributedDataParallelKwargs.comm_state_option``
    (kwplug calls it through ``CommHook.check_options``, with no process group needed).

    Args:
        options: ``ratio`` (a float in (0, 1], default 0.01: the fraction of each bucket sent)
            and ``error_feedback`` (``bool``, default ``True``).

    Returns:
        ``(ratio, error_feedback)`` with the defaults filled in.

    Raises:
        ValueError: an unknown key (the message lists the accepted ones with their defaults),
            or ``ratio`` outside (0, 1] (NaN included).
        TypeError: ``options`` is not a mapping, ``ratio`` is not a real number (``bool`` is
            refused; an ``int`` such as ``1`` is accepted), or ``error_feedback`` is not a
            ``bool``.
    """
    values = _TOPK_SCHEMA.check(options)
    ratio = values["ratio"]
    return float(ratio), values["error_feedback"]
