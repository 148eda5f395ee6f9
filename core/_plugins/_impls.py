"""pluggy's ``HookImpl``, as kwplug's hook caller (:mod:`kwplug._plugins._calls`) handles it:
the arguments a plain call passes, an unregistered implementation for a per-call handler, and a
copy of an implementation with another plugin object and function (the recording twins).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pluggy


def arguments(
    impl: pluggy.HookImpl, kwargs: Mapping[str, Any]
) -> tuple[Sequence[Any], dict[str, Any] | None]:
    """What pluggy's ``_multicall`` passes ``impl`` from the call's ``kwargs``: its arguments
    by position, and the keyword ones given (``None``: none).

    Raises:
        pluggy.HookCallError: an argument ``impl`` takes is missing.
    """
    # An implementation taking none (``comm_hooks``, asked by every Accelerator) builds
    # neither: two comprehensions per implementation per call saved.
    if not impl.argnames and not impl.kwargnames:
        return (), None
    try:
        args = [kwargs[name] for name in impl.argnames]
        kw = {n: kwargs[n] for n in impl.kwargnames if n in kwargs} or None
    except KeyError as e:
        raise pluggy.HookCallError(f"hook call must provide argument {e.args[0]!r}") from e
    return args, kw


def per_call_impl(function: Callable[..., Any], name: str) -> pluggy.HookImpl:
    """A plain implementation, registered nowhere, of ``function`` (a per-call handler's bound
    method) under the plugin name ``name``."""
    return pluggy.HookImpl(None, name, function, _PLAIN_OPTS)


_PLAIN_OPTS: pluggy.HookimplOpts = {
    "wrapper": False,
    "hookwrapper": False,
    "optionalhook": False,
    "tryfirst": False,
    "trylast": False,
    "specname": None,
}


# HookImpl's attributes, copied one by one through their slot descriptors: several times faster
# than copy.copy (which goes through __reduce_ex__) or setattr by name; every Accelerator's
# manager copy re-binds each user or default handler's implementations this way.
_IMPL_SLOTS: tuple[str, ...] | None = getattr(pluggy.HookImpl, "__slots__", None)
# All slots read in one C call (a getter of two or more names returns a tuple).
_impl_values: Callable[[pluggy.HookImpl], tuple[Any, ...]] | None = None
_impl_setters: tuple[Callable[[pluggy.HookImpl, Any], None], ...] = ()
_SET_PLUGIN: Callable[[pluggy.HookImpl, Any], None] | None = None
_SET_FUNCTION: Callable[[pluggy.HookImpl, Any], None] | None = None
if _IMPL_SLOTS and len(_IMPL_SLOTS) > 1 and {"plugin", "function"} <= set(_IMPL_SLOTS):
    _impl_values = operator.attrgetter(*_IMPL_SLOTS)
    _impl_setters = tuple(vars(pluggy.HookImpl)[name].__set__ for name in _IMPL_SLOTS)
    _SET_PLUGIN = vars(pluggy.HookImpl)["plugin"].__set__
    _SET_FUNCTION = vars(pluggy.HookImpl)["function"].__set__


def copy_impl(impl: pluggy.HookImpl, plugin: Any, function: Callable[..., Any]) -> pluggy.HookImpl:
    """A copy of ``impl`` (same options and argument names) for ``plugin`` and ``function``."""
    if _impl_values is None or _SET_PLUGIN is None or _SET_FUNCTION is None:
        twin = copy.copy(impl)  # a pluggy without __slots__ on HookImpl
        # HookImpl's attributes are Final for type checkers; this copy is ours to change.
        object.__setattr__(twin, "plugin", plugin)
        object.__setattr__(twin, "function", function)
        return twin
    twin = object.__new__(pluggy.HookImpl)
    for setter, value in zip(_impl_setters, _impl_values(impl), strict=True):
        setter(twin, value)
    _SET_PLUGIN(twin, plugin)
    _SET_FUNCTION(twin, function)
    return twin
