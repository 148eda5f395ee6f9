"""Named DDP communication hooks: the record type and the process-wide registry.

A communication hook is PyTorch's ``hook(state, bucket: torch.distributed.GradBucket) ->
torch.futures.Future[torch.Tensor]`` (see ``DistributedDataParallel.register_comm_hook``). kwplug
names hooks so that ``DistributedDataParallelKwargs(comm_hook="name")`` can select them; names
come from :func:`register_comm_hook` and from plugins' ``comm_hooks`` hook.

A :class:`CommHook` also owns its state's life beyond one process: how the state is keyed by
bucket (``state_buckets``), saved and restored (``state_dict``/``load_state_dict``) and moved
to another number of processes (``resize``). The DDP handler and the checkpoint code only call
these; neither knows any hook.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kwplug._contracts.additive import merge

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import GradBucket

    HookFn = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
    StateFactory = Callable[[dist.ProcessGroup | None, Mapping[str, Any]], Any]
else:
    HookFn = Callable[..., Any]
    StateFactory = Callable[..., Any]

#: ``state_buckets(state) -> keys``: the bucket keys a layout-dependent hook's state holds.
StateBuckets = Callable[[Any], Iterable[Any]]
#: ``state_dict(state) -> saved``: what a checkpoint saves of a hook's state on this rank.
SaveState = Callable[[Any], Any]
#: ``load_state_dict(state, saved) -> None``: restore what ``state_dict`` returned.
LoadState = Callable[[Any, Any], None]
#: ``resize(saved, old_world_size, new_world_size) -> saved | None``: the saved rank 0's
#: state as this rank of a run with another number of processes loads it (``None``: afresh).
ResizeState = Callable[[Any, int, int], Any]

_OPTIONAL_CALLABLE = attrs.validators.optional(attrs.validators.is_callable())

# Hooks whose signature was checked already: handlers are re-validated on every ``no_sync``.
_TAKES_STATE_AND_BUCKET: weakref.WeakSet[Any] = weakref.WeakSet()


def check_hook_signature(field: str, hook: Any) -> None:
    """Raise ``TypeError`` now when ``hook`` cannot be called as ``hook(state, bucket)``.

    DDP calls a communication hook with two positional arguments only at the first
    ``backward``; a hook that takes another number would fail there, deep in the reducer.
    Callables whose signature Python cannot read (some builtins) are accepted as given.

    Args:
        field: the name the error gives for ``hook`` (e.g. ``"comm_hook"``).
        hook: the callable to check.

    Raises:
        TypeError: ``hook`` does not accept ``(state, bucket)`` positionally.
    """
    try:
        if hook in _TAKES_STATE_AND_BUCKET:
            return
    except TypeError:  # unhashable, or not weakly referable: check each time
        pass
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"'{field}' must accept two positional arguments, hook(state, bucket) -> "
            "torch.futures.Future[torch.Tensor] (DistributedDataParallel.register_comm_hook); "
            f"{getattr(hook, '__qualname__', type(hook).__name__)} has the signature "
            f"{str(signature)[:200]}"
        ) from None
    with contextlib.suppress(TypeError):  # not weakly referable: checked each time
        _TAKES_STATE_AND_BUCKET.add(hook)


def _check_hook(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_hook_signature(attribute.name, value)


@attrs.frozen
class CommHook:
    """A named DDP communication hook.

    Attributes:
        name: the name users pass as ``comm_hook=...``.
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, registered with
            ``DistributedDataParallel.register_comm_hook(state, hook)``.
        make_state: ``make_state(process_group, comm_state_option) -> state``, called after the
            process group exists; ``None`` means the state is the process group itself (the
            convention of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``).
        source: who provided it (a distribution or ``"kwplug.register_comm_hook"``), for errors.
        check_options: optional ``check_options(comm_state_option)`` that raises
            ``TypeError``/``ValueError`` for options ``make_state`` would refuse, without a
            process group (its return value is ignored). kwplug calls it when the Accelerator
            is built (``validate_setup``) and, in a single process where DDP is not used and
            ``make_state`` never runs, in ``prepare()``: a bad option fails early everywhere.
        state_buckets: ``state_buckets(state) -> keys``, for a hook whose state is keyed by
            ``bucket.index()`` and laid out like ``bucket.buffer()`` (a *layout-dependent*
            hook). When given, kwplug runs the hook behind
            :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` (buckets in the
            model's parameter order, keyed by a tuple of parameter indices, whatever DDP's
            layout) and calls it to learn the keys the state holds, so that a resumed run
            splits its first buckets as the saving run did. Return ``()`` when unknown.
        chains_collectives: the hook starts a collective from a future's callback (e.g. a
            second all-reduce after the first); on gloo kwplug then starts each bucket's hook
            after the previous bucket's future completed, without blocking backward
            (:func:`~kwplug.plugins.ddp_comm_hooks.ordered_hook`).
        state_dict: ``state_dict(state) -> saved``, what ``Accelerator.save_state`` saves of
            the state on each rank (tensors, numbers, strings, lists and dicts). ``None``: the
            state's own ``state_dict()`` method if it has one, else the checkpoint's generic
            rule (a custom ``__getstate__``); a process group is never saved.
        load_state_dict: ``load_state_dict(state, saved)``, restoring ``saved`` into the live
            state built by ``make_state``. ``None``: the state's own ``load_state_dict()``.
        resize: ``resize(saved, old_world_size, new_world_size) -> saved | None``, used when
            a checkpoint saved by ``old_world_size`` processes is loaded by
            ``new_world_size``: ``saved`` is what the saved rank 0 saved (every rank reads it)
            and the answer is loaded on this rank with ``load_state_dict``. ``None`` (the
            field, or the answer): the state starts afresh, and the warning kwplug emits names
            it.
        resize_note: what ``resize`` does not carry over, named in the one warning kwplug emits
            when a checkpoint is loaded by another number of processes; ``""``: the rule
            keeps everything and the warning does not name this hook.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    hook: HookFn = attrs.field(
        validator=attrs.validators.and_(attrs.validators.is_callable(), _check_hook)
    )
    make_state: StateFactory | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    source: str = "unknown"
    check_options: Callable[[Mapping[str, Any]], object] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    state_buckets: StateBuckets | None = attrs.field(
        default=None, kw_only=True, validator=_OPTIONAL_CALLABLE
    )
    chains_collectives: bool = attrs.field(
        default=False, kw_only=True, validator=attrs.validators.instance_of(bool)
    )
    state_dict: SaveState | None = attrs.field(
        default=None, kw_only=True, validator=_OPTIONAL_CALLABLE
    )
    load_state_dict: LoadState | None = attrs.field(
        default=None, kw_only=True, validator=_OPTIONAL_CALLABLE
    )
    resize: ResizeState | None = attrs.field(
        default=None, kw_only=True, validator=_OPTIONAL_CALLABLE
    )
    resize_note: str = attrs.field(
        default="", kw_only=True, validator=attrs.validators.instance_of(str)
    )

    @property
    def layout_dependent(self) -> bool:
        """Whether the hook's state depends on DDP's bucket layout (``state_buckets`` given)."""
        return self.state_buckets is not None

    def check(self, options: Mapping[str, Any]) -> None:
        """Validate ``options`` (``comm_state_option``) without building the state.

        Raises:
            ValueError: ``options`` is not empty but the hook takes no state options.
            TypeError, ValueError: from ``check_options``.
        """
        if self.make_state is None:
            if options:
                raise ValueError(
                    f"comm_state_option {dict(options)!r} given, but communication hook "
                    f"{self.name!r} (from {self.source}) takes no state options"
                )
        elif self.check_options is not None:
            self.check_options(options)

    def build_state(
        self, process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
    ) -> Any:
        """Return the hook's state for ``process_group`` (``None`` = the default group).

        Raises:
            ValueError: ``options`` is not empty but the hook takes no state options.
        """
        if self.make_state is None:
            self.check(options)
            return process_group
        return self.make_state(process_group, options)


_REGISTRY: dict[str, CommHook] = {}


def register_comm_hook(
    name: str,
    hook: HookFn,
    *,
    make_state: StateFactory | None = None,
    check_options: Callable[[Mapping[str, Any]], object] | None = None,
    replace: bool = False,
    **state_rules: Any,
) -> CommHook:
    """Register a DDP communication hook under ``name`` for this process.

    Args:
        name: non-empty name to use as ``DistributedDataParallelKwargs(comm_hook=name)``.
        hook: ``hook(state, bucket: torch.distributed.GradBucket) ->
            torch.futures.Future[torch.Tensor]``.
        make_state: optional ``make_state(process_group, comm_state_option) -> state``; without
            it the hook's state is the process group (``None`` = default group).
        check_options: optional ``check_options(comm_state_option) -> None`` validating the
            options without a process group (see :class:`CommHook`).
        replace: allow replacing a hook registered earlier under the same name.
        **state_rules: the :class:`CommHook` fields saying how the state is bucketed, saved,
            restored and resized (``state_buckets``, ``chains_collectives``, ``state_dict``,
            ``load_state_dict``, ``resize``, ``resize_note``).

    Returns:
        The :class:`CommHook` record.

    Raises:
        TypeError: ``hook`` or ``make_state`` is not callable, ``hook`` cannot be called as
            ``hook(state, bucket)``, ``name`` is not a ``str``, or a name in ``state_rules`` is
            not a :class:`CommHook` field.
        ValueError: ``name`` is empty or already registered (and ``replace`` is false).
    """
    if not isinstance(name, str) or not name:
        raise (ValueError if isinstance(name, str) else TypeError)(
            f"comm hook name must be a non-empty str, got {name!r}"
        )
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"communication hook {name!r} is already registered; pass replace=True to replace it"
        )
    record = CommHook(
        name,
        hook,
        make_state,
        source="kwplug.register_comm_hook",
        check_options=check_options,
        **state_rules,
    )
    _REGISTRY[name] = record
    return record


def unregister_comm_hook(name: str) -> None:
    """Remove the hook registered under ``name``; ``KeyError`` if there is none."""
    del _REGISTRY[name]


def registered_comm_hooks() -> Mapping[str, CommHook]:
    """Return a copy of the process-wide registry, by name."""
    return dict(_REGISTRY)


def merge_comm_hooks(
    contributions: list[tuple[str, Mapping[str, CommHook] | None]],
) -> dict[str, CommHook]:
    """Merge plugins' ``comm_hooks`` answers with the registry.

    Args:
        contributions: ``(plugin name, answer)`` pairs from the ``comm_hooks`` hook.

    Raises:
        TypeError: an answer is not a mapping of ``str`` to :class:`CommHook`.
        ValueError: two sources give the same name; the message names both.
    """
    global _last_merge
    # One snapshot of the registry for both the key and the merge: a hook registered by
    # another thread in between would otherwise be kept under a key without it.
    registry = dict(_REGISTRY)
    inputs = _merge_inputs(registry, contributions)
    last = _last_merge
    if inputs is not None and last is not None and _same_inputs(inputs, last[0]):
        return dict(last[1])  # each caller gets a dict of its own
    merged = merge(
        "comm_hooks",
        contributions,
        entry=_entry,
        label="communication hook",
        kind="kwplug.CommHook",
        remedy="block one of the plugins or rename the hook",
        start={name: (record, record.source) for name, record in registry.items()},
    )
    if inputs is not None:
        _last_merge = (inputs, dict(merged))
    return merged


def _entry(plugin_name: str, name: Any, record: Any) -> tuple[CommHook, str]:
    # One answered record as the merge keeps it (a module function: a closure made per
    # call cost every Accelerator a function object, kept merge or not).
    if not isinstance(record, CommHook):
        raise TypeError(
            f"plugin {plugin_name!r}: comm_hooks()[{name!r}] must be a kwplug.CommHook, "
            f"got {type(record).__name__}"
        )
    if record.source == "unknown":
        record = _sourced(record, plugin_name)
    return record, record.source


# The last merge and what it was merged from: every Accelerator merges the same plugins'
# answers (the same frozen records, as the plugins keep them) with the same registry, and the
# merge checks each record again. ``(names, objects)``: the names (compared by value) and the
# records and answers (compared by identity, and kept alive here so that no id is reused) in
# the registry's and the answers' order. A failed merge is not kept: it raises every time.
_MergeInputs = tuple[tuple[str | int, ...], tuple[Any, ...]]
_last_merge: tuple[_MergeInputs, dict[str, CommHook]] | None = None


def _merge_inputs(
    registry: dict[str, CommHook],
    contributions: list[tuple[str, Mapping[str, CommHook] | None]],
) -> _MergeInputs | None:
    # What merge_comm_hooks' result depends on, or None when it cannot be told from identities
    # (an answer that is a mapping of another kind may change in place, or compute its items).
    names: list[str | int] = [len(registry), *registry]
    objects: list[Any] = [*registry.values()]
    for plugin, answer in contributions:
        if answer is None:
            names.append(plugin)
            names.append(-1)
            continue
        if type(answer) is not dict:
            return None
        names.append(plugin)
        names.append(len(answer))
        names.extend(answer)
        objects.extend(answer.values())
    return tuple(names), tuple(objects)


def _same_inputs(new: _MergeInputs, old: _MergeInputs) -> bool:
    return (
        new[0] == old[0] and len(new[1]) == len(old[1]) and all(map(operator.is_, new[1], old[1]))
    )


# Records given a source by merge_comm_hooks, by (record, plugin name): a CommHook is frozen and
# compared by value, so every Accelerator of a process can share one instead of re-running the
# validators of attrs.evolve for each plugin's records at each construction.
_SOURCED: dict[tuple[CommHook, str], CommHook] = {}
_MAX_SOURCED = 64


def _sourced(record: CommHook, source: str) -> CommHook:
    try:
        key = (record, source)
        cached = _SOURCED.get(key)
    except TypeError:  # a field holds an unhashable callable: nothing to share
        return attrs.evolve(record, source=source)
    if cached is None:
        if len(_SOURCED) >= _MAX_SOURCED:
            _SOURCED.clear()
        cached = _SOURCED[key] = attrs.evolve(record, source=source)
    return cached
