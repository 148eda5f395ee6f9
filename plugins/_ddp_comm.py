"""How ``DistributedDataParallelKwargs``' ``comm_*`` fields become a registered DDP hook.

The named hook's record is looked up (a misspelt name gets a suggestion and the list of known
names), its state built from ``comm_state_option``, and the callable composed with the
``comm_wrapper`` (:func:`kwplug.plugins.ddp_comm_hooks.compose`). Kept apart from the handler's
fields and hooks so that the handler module stays one concept: its options. Nothing here knows
:class:`~kwplug.plugins.ddp.DDPCommunicationHookType`: a member is a ``str`` equal to its
value, and whether ``comm_hook`` is a member is passed in as ``named_builtin``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kwplug import discover
from kwplug.comm_hooks import CommHook, HookFn
from kwplug.plugins import ddp_comm_hooks
from kwplug.validators import shown

#: The ``comm_hook`` and ``comm_wrapper`` value that means "no hook" / "no wrapper".
NO = "no"


def quoted(values: Iterable[str]) -> str:
    """``'a', 'b'``: the accepted values as messages list them."""
    return ", ".join(map(repr, values))


def _not_loaded() -> str:
    # A hook named by a plugin that is installed but blocked, disabled or broken is "unknown"
    # too; say which plugins were not loaded (they are not imported, so which hooks they
    # provide cannot be known).
    records = [r for r in discover() if not r.loaded and not r.builtin]
    if not records:
        return ""
    listed = ", ".join(f"{r.describe()}: {r.status}" for r in records)
    return f" (plugins installed but not loaded, one may provide it: {listed})"


def check_state_for_hook(hook: Any, options: Mapping[str, Any], *, named_builtin: bool) -> None:
    """Refuse ``comm_state_option`` ``options`` that the ``comm_hook`` ``hook`` cannot take.

    Args:
        hook: the ``comm_hook`` value (a member, another name, or a callable).
        options: the ``comm_state_option`` value.
        named_builtin: ``hook`` is a ``DDPCommunicationHookType`` member.

    Raises:
        TypeError, ValueError: from a built-in hook's option schema (PowerSGD: unknown keys,
            wrong types); ``ValueError`` for options given to a hook without state options
            (``"no"``, ``"fp16"``, ``"bf16"``, a callable).
    """
    if not options:
        return
    builtin = ddp_comm_hooks.BUILTIN_BY_NAME.get(str(hook)) if named_builtin else None
    if builtin is not None and builtin.options is not None:
        builtin.options.check(options)
    elif named_builtin or not isinstance(hook, str):
        described = f"{str(hook)!r}" if isinstance(hook, str) else f"the callable {hook!r}"
        raise ValueError(
            f"comm_state_option {dict(options)!r} is given, but comm_hook {described} takes no "
            "state options (a callable hook gets state=None); leave comm_state_option empty "
            "or register the hook with kwplug.register_comm_hook(name, hook, make_state=...)"
        )


def find_record(name: str, comm_hooks: Mapping[str, CommHook], *, named_builtin: bool) -> CommHook:
    """The named hook ``name`` selects among ``comm_hooks``.

    Args:
        name: the ``comm_hook`` name.
        comm_hooks: the named hooks known to the Accelerator.
        named_builtin: ``comm_hook`` is a ``DDPCommunicationHookType`` member: kwplug's own
            hook is used even where the ``ddp_comm_hooks`` plugin is not registered.

    Raises:
        ValueError: no hook has that name (the message lists the known names).
    """
    record = comm_hooks.get(name)
    if record is None and named_builtin:
        # The built-ins come from the ddp_comm_hooks plugin; should it be missing
        # (not installed as an entry point), the enum still means kwplug's hooks.
        record = ddp_comm_hooks.builtin_comm_hooks()[name]
    if record is None:
        known = sorted({NO, *comm_hooks, *ddp_comm_hooks.BUILTIN_HOOK_NAMES})
        by_lower = {k.lower(): k for k in known}
        # A name longer than any known one is no typo of it (and difflib on a 10 MB
        # string takes seconds).
        longest = max(map(len, known))
        close = (
            difflib.get_close_matches(name.lower(), list(by_lower), n=1)
            if len(name) <= 2 * longest
            else []
        )
        hint = f"did you mean {by_lower[close[0]]!r}? " if close else ""
        raise ValueError(
            f"unknown communication hook {shown(name)} in DistributedDataParallelKwargs."
            f"comm_hook; {hint}known hooks: {quoted(known)}{_not_loaded()}. "
            "Register one with "
            "kwplug.register_comm_hook(name, hook) or contribute it from a plugin's "
            "comm_hooks hook"
        )
    return record


def hook_and_state(
    hook: Any,
    wrapper: str,
    options: dict[str, Any],
    comm_hooks: Mapping[str, CommHook],
    parameters: Iterable[torch.Tensor],
    *,
    named_builtin: bool,
) -> tuple[HookFn | None, Any, CommHook | None]:
    """The hook to register, its state and its record; ``(None, None, None)`` for DDP's own
    all-reduce (``hook`` and ``wrapper`` both ``"no"``).

    Args:
        hook: the ``comm_hook`` value (a member, another name, or a callable).
        wrapper: the ``comm_wrapper`` value (``"no"``, ``"fp16"``, ``"bf16"``).
        options: the ``comm_state_option`` value, given to the record's ``make_state``.
        comm_hooks: the named hooks known to the Accelerator.
        parameters: the model's parameters, in order: the canonical order of a
            layout-dependent hook's buckets.
        named_builtin: ``hook`` is a ``DDPCommunicationHookType`` member.

    Returns:
        The callable from :func:`~kwplug.plugins.ddp_comm_hooks.compose` (the record's hook,
        gloo ordering, the wrapper, canonical buckets for a layout-dependent hook), the hook's
        state and its record.

    Raises:
        ValueError: unknown hook name; options the hook does not accept.
    """
    state: Any = None
    if named_builtin and hook == NO:
        if wrapper == NO:
            return None, None, None
        record = CommHook(NO, ddp_comm_hooks.mean_allreduce_hook, source="kwplug")
    elif isinstance(hook, str):
        record = find_record(str(hook), comm_hooks, named_builtin=named_builtin)
        state = record.build_state(None, options)
    else:
        record = ddp_comm_hooks.callable_record(hook)
    wrap = ddp_comm_hooks.COMPRESSION_WRAPPERS[wrapper] if wrapper != NO else None
    return ddp_comm_hooks.compose(record, state, parameters, wrapper=wrap), state, record
