"""How :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` cuts a real DDP bucket into
canonical buckets, and the canonical layout a hook's state records for checkpoints.

A plan says, for one real bucket, which canonical buckets (keys) it holds and where each one's
gradients lie in the real buffer. The keys come, in this order of preference, from the
state's *bucket layout* when a checkpoint restored it (:data:`BUCKET_LAYOUT`: the canonical
keys of the saving run's last step, in the order its hook ran them, which checkpoints save
even when the state keeps nothing per bucket), from the keys the state holds
(``state_buckets``), or else from the real bucket itself.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from kwplug.plugins.ddp_comm_hooks._common import GradBucket

#: Key of a :class:`~kwplug.plugins.ddp_comm_hooks.CanonicalBucket`: its parameters' indices in
#: ``model.parameters()``, in the bucket's canonical order (the order DDP's bucket held them
#: when the hook's state first got the key, or the parameters' own order).
BucketKey = tuple[int, ...]

#: Attribute of a hook's state that opts into a recorded bucket layout:
#: :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` (with ``state_buckets``) sets it,
#: at each step's last bucket, to that step's canonical keys in the order the hook ran them
#: (DDP's bucket order). Saved with the state and restored, it comes first when the hook cuts
#: a real bucket (until the hook records its own): a resumed run's first step (DDP's initial
#: layout) cuts its buckets as the saving run's last step did, whatever else the state holds.
#: ``None``: no step yet.
BUCKET_LAYOUT = "kwplug_bucket_layout"

#: A recorded bucket layout: canonical keys, in the order the hook ran them.
BucketLayout = tuple[BucketKey, ...]


@attrs.frozen
class Group:
    """One canonical bucket cut from a real bucket: the real-bucket positions of its
    parameters in canonical order, their element offsets in the real buffer and sizes."""

    key: BucketKey
    positions: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    # 0 when the parameters lie in canonical order, back to back, at the start of the real
    # buffer: the canonical buffer is a slice of it, no copy. A group further in (a tile of a
    # resumed run's initial bucket) is gathered into a buffer of its own, aligned like the
    # DDP bucket the state was built on: CPU BLAS rounds differently at another alignment.
    start: int | None

    @property
    def numel(self) -> int:
        """Elements of the canonical buffer."""
        return sum(self.numels)


@attrs.frozen
class Plan:
    """The canonical buckets of one real bucket, in the order the hook runs them."""

    groups: tuple[Group, ...]
    # The real buffer is the real-order gradients back to back, nothing else: the scatter of
    # a single copied group is one torch.cat(..., out=buffer).
    dense: bool


def _is_key(key: Any) -> bool:
    return isinstance(key, tuple) and all(isinstance(i, int) for i in key)


def known_keys(
    state: Any, state_buckets: Callable[[Any], Iterable[Any]] | None
) -> frozenset[BucketKey]:
    """The keys ``state_buckets(state)`` names (tuples of ints only)."""
    if state_buckets is None:
        return frozenset()
    return frozenset(key for key in state_buckets(state) if _is_key(key))


def saved_layout(state: Any) -> BucketLayout:
    """The state's :data:`BUCKET_LAYOUT`, as a tuple of keys (``()``: none, or not valid)."""
    layout = getattr(state, BUCKET_LAYOUT, None)
    if not isinstance(layout, (tuple, list)):
        return ()
    keys = tuple(tuple(key) if isinstance(key, list) else key for key in layout)
    return keys if all(_is_key(key) for key in keys) else ()


class LayoutRecorder:
    """Collects one step's canonical keys, bucket by bucket, and stores them in the state's
    :data:`BUCKET_LAYOUT` at the step's last bucket (DDP runs its buckets in index order).

    A layout this recorder did not store there (one a checkpoint restored) is what
    :meth:`loaded` returns, for the plans of the first step: the layout this hook records
    itself is the one of its own DDP's previous step, which DDP's rebuild after its first
    step makes stale (its keys would hold the parameters in the initial bucket's order).
    """

    __slots__ = ("_pending", "_recorded")

    def __init__(self) -> None:
        self._pending: dict[int, BucketLayout] = {}
        self._recorded: object = None

    def loaded(self, state: Any) -> BucketLayout:
        """The state's layout when it came from elsewhere (a checkpoint), else ``()``."""
        layout = getattr(state, BUCKET_LAYOUT, None)
        return () if layout is None or layout is self._recorded else saved_layout(state)

    def record(self, state: Any, bucket: GradBucket, plan: Plan) -> None:
        """Note ``plan``'s keys for ``bucket``; at the last bucket, store the step's layout."""
        if not hasattr(state, BUCKET_LAYOUT):
            return
        index = bucket.index()
        if index == 0:  # a new step
            self._pending.clear()
        self._pending[index] = tuple(group.key for group in plan.groups)
        if bucket.is_last():
            layout = tuple(key for i in sorted(self._pending) for key in self._pending[i])
            self._pending.clear()
            setattr(state, BUCKET_LAYOUT, layout)
            self._recorded = layout


def _tiles(
    members: frozenset[int], keys: Iterable[BucketKey], *, ordered: bool
) -> list[BucketKey] | None:
    # One key with exactly these parameters, or several that exactly tile them: in ``keys``'
    # order when ``ordered`` (a recorded layout), else by DDP's usual order.
    keys = list(keys)
    for key in keys:
        if len(key) == len(members) and frozenset(key) == members:
            return [key]
    inside = [key for key in keys if key and members.issuperset(key)]
    covered = [i for key in inside for i in key]
    if inside and len(covered) == len(members) and set(covered) == members:
        # DDP fills buckets in gradient-ready order, roughly the reverse of the parameters:
        # without a recorded order, process the tiles that way (last = the first parameters).
        return inside if ordered else sorted(inside, key=max, reverse=True)
    return None


def partition(
    indices: list[int],
    layout: BucketLayout,
    known: frozenset[BucketKey],
    *,
    layout_order: bool,
) -> list[BucketKey]:
    """The canonical keys of a real bucket holding the parameters ``indices`` (DDP's order).

    The keys of a restored ``layout`` (a resumed run's first step: DDP's initial single
    bucket, cut along the saving run's buckets, in their order), else those the state holds
    (``known``), each either one key with exactly these parameters (its order is the layout
    the state was built in) or several that exactly tile the bucket. Else a new key: this
    layout's order when the state will record it (``layout_order``), else the parameters'.
    """
    members = frozenset(indices)
    found = _tiles(members, layout, ordered=True) or _tiles(members, known, ordered=False)
    if found is not None:
        return found
    return [tuple(indices) if layout_order else tuple(sorted(indices))]


def make_plan(
    bucket: GradBucket,
    order: Mapping[int, int],
    layout: BucketLayout,
    known: frozenset[BucketKey],
    *,
    layout_order: bool,
) -> Plan:
    """The :class:`Plan` of ``bucket``, its parameters numbered by ``order`` (``id(p)`` to
    index in ``model.parameters()``); ``layout``, ``known`` and ``layout_order`` as for
    :func:`partition`."""
    buffer = bucket.buffer()
    base = buffer.storage_offset()
    params = bucket.parameters()
    grads = bucket.gradients()
    offsets = [int(grad.storage_offset()) - int(base) for grad in grads]
    numels = [grad.numel() for grad in grads]
    # A parameter missing from param_order (should not happen) goes after the known ones.
    canonical = [order.get(id(p), len(order) + pos) for pos, p in enumerate(params)]
    position_of = {index: pos for pos, index in enumerate(canonical)}
    groups = []
    for key in partition(canonical, layout, known, layout_order=layout_order):
        positions = tuple(position_of[index] for index in key)
        group_offsets = tuple(offsets[pos] for pos in positions)
        group_numels = tuple(numels[pos] for pos in positions)
        back_to_back = all(
            group_offsets[i + 1] == group_offsets[i] + group_numels[i]
            for i in range(len(positions) - 1)
        )
        groups.append(
            Group(
                key=key,
                positions=positions,
                offsets=group_offsets,
                numels=group_numels,
                shapes=tuple(grads[pos].shape for pos in positions),
                start=0 if back_to_back and group_offsets[0] == 0 else None,
            )
        )
    dense = sum(numels) == buffer.numel() and all(
        offsets[i] == sum(numels[:i]) for i in range(len(offsets))
    )
    return Plan(groups=tuple(groups), dense=dense)
