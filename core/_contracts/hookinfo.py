"""How a hook spec declares itself: its combination policy and :class:`HookInfo`, set by the
:func:`spec` decorator (:mod:`kwplug.hookspecs` declares every spec with it and re-exports these
names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import pluggy

PROJECT_NAME = "kwplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: How the answers of several plugins to one hook combine (checked when an ``Accelerator`` is
#: built). ``ONE_ANSWER``: the first non-``None`` answer wins, and two third-party defaults
#: claiming the hook for the same device are an error. ``ADDITIVE``: every
#: answer is merged; a name given twice is an error naming both sources. ``PER_PLUGIN``: each
#: plugin's answer is kept apart, under the plugin's registered name. ``EVERY``: every plugin is
#: called, and raising rejects.
ONE_ANSWER = "one answer per device"
ADDITIVE = "additive, unique names"
PER_PLUGIN = "per plugin"
EVERY = "every plugin (raising rejects)"

_F = TypeVar("_F", bound=Callable[..., Any])


@attrs.frozen
class HookInfo:
    """What kwplug knows about one hook spec, declared once by :func:`spec`.

    Attributes:
        name: the hook name, e.g. ``"autocast"``.
        policy: how several plugins' answers combine: :data:`ONE_ANSWER`, :data:`ADDITIVE`,
            :data:`PER_PLUGIN` or :data:`EVERY`.
        pure: calling the hook has no side effect, so ``kwplug plugins --explain`` calls it to
            show what would reach torch.
    """

    name: str
    policy: str
    pure: bool = False

    @property
    def firstresult(self) -> bool:
        """Whether pluggy stops at the first non-``None`` answer (one-answer hooks)."""
        return self.policy == ONE_ANSWER

    @property
    def setup(self) -> bool:
        """Whether the hook builds something an Accelerator uses (one answer, or additive),
        as opposed to validating or checkpointing; ``kwplug plugins --explain`` lists these."""
        return self.policy in (ONE_ANSWER, ADDITIVE)


def spec(policy: str, *, pure: bool = False) -> Callable[[_F], _F]:
    """Declare a method of :class:`HandlerSpec` a hook spec, with its combination policy.

    The one place a hook's metadata is written: pluggy's ``firstresult`` follows from
    ``policy`` (true for :data:`ONE_ANSWER`), and :data:`HOOKS`, :data:`HOOK_POLICY`, the
    conflict check and ``kwplug plugins --explain`` read it back.

    Args:
        policy: :data:`ONE_ANSWER`, :data:`ADDITIVE`, :data:`PER_PLUGIN` or :data:`EVERY`.
        pure: calling the hook has no side effect (see :attr:`HookInfo.pure`); default false.

    Raises:
        ValueError: ``policy`` is not one of the four.
    """
    if policy not in (ONE_ANSWER, ADDITIVE, PER_PLUGIN, EVERY):
        raise ValueError(f"unknown hook policy {policy!r}")

    def mark(function: _F) -> _F:
        info = HookInfo(function.__name__, policy, pure)
        setattr(function, INFO, info)
        marked: _F = hookspec(firstresult=info.firstresult)(function)
        return marked

    return mark


#: The attribute of a spec function holding its :class:`HookInfo`.
INFO = f"{PROJECT_NAME}_hook_info"
