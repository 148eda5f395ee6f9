"""The plugin manager: one object that knows who is registered, in which order, and who answered.

:class:`KwplugPluginManager` is a ``pluggy.PluginManager`` for project ``kwplug`` with the hook
specs added. On top of pluggy it owns, per registered name, a human description (for messages)
and whether the plugin is a third-party default, and it calls hooks with provenance through
typed relays (``pm.first.<hook>(...)``, ``pm.each.<hook>(...)``,
:meth:`~KwplugPluginManager.first_with`, :meth:`~KwplugPluginManager.each_of`;
:mod:`kwplug._plugins._relays`) and its one caller
(:class:`~kwplug._plugins._calls.HookCalls`) through pluggy's own ``_hookexec``, so that
``enable_tracing()`` and ``add_hookcall_monitoring()`` see every call. With
``KWPLUG_TRACE_PLUGINS=1`` every hook call, who answered and with what is logged (level
``INFO``) on the ``kwplug.trace`` logger.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import pluggy
from pluggy._hooks import _SubsetHookCaller

from kwplug._contracts.environ import get as read_environ
from kwplug._plugins._calls import PER_CALL, Answer, HookCalls, is_watched, revalidate
from kwplug._plugins._conflicts import conflict_error, find_conflicts
from kwplug._plugins._defaults import select
from kwplug._plugins._identity import PluginSet, Registry
from kwplug._plugins._records import GROUP, PluginRecord, plugin_object
from kwplug._plugins._relays import EachRelay, FirstRelay
from kwplug._plugins._rules import require_handler_instance, validate_hookimpls
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import PROJECT_NAME, HandlerSpec

#: Set to ``1`` to log every hook call, who answered and with what, on :data:`trace_logger`.
TRACE_ENV = "KWPLUG_TRACE_PLUGINS"
trace_logger = logging.getLogger("kwplug.trace")
logger = logging.getLogger(__name__)

_NO_OPTS: Any = object()

# load_setuptools_entrypoints' work (kwplug._plugins._entrypoints.load_handlers), handed over
# by the package's face: discovery validates plugins with a manager of this module, so
# importing it here would close an import circle (tests/gates/test_layers.py).
_entry_point_loader: Callable[[KwplugPluginManager, str | None], int] | None = None


def use_entry_point_loader(loader: Callable[[KwplugPluginManager, str | None], int]) -> None:
    """Make ``loader`` what :meth:`KwplugPluginManager.load_setuptools_entrypoints` calls."""
    global _entry_point_loader
    _entry_point_loader = loader


class KwplugPluginManager(pluggy.PluginManager):
    """``pluggy.PluginManager`` of project ``kwplug``: registered names, their descriptions
    and third-party status, and hook calls that report who answered.

    Each :class:`~kwplug.Accelerator` builds one with :meth:`for_handlers`. pluggy calls the
    most recently registered implementation first, so plugins are registered in reverse
    precedence.

    Attributes:
        plan: which plugin answered each ``firstresult`` hook called through :attr:`first`
            (hook name -> :class:`Answer`); per-call handlers do not replace these answers.
        first: :class:`~kwplug._plugins._relays.FirstRelay`, the one-answer hooks by name.
        each: :class:`~kwplug._plugins._relays.EachRelay`, the collecting hooks by name.
    """

    # pluggy inspects every attribute of a plugin at each ``register``
    # (``inspect.getattr_static`` over the ~50 attributes of an attrs class); an Accelerator
    # registers a handler of each class, so the answer is cached per class. Attributes set on
    # an instance (not the class) are not cached.
    _opts_cache: dict[tuple[Any, str], Any] = {}  # noqa: RUF012 - shared on purpose

    def __init__(self, *, specs: bool = True) -> None:
        """An empty manager of project ``kwplug``.

        Args:
            specs: add the hook specs (default). ``False``: the caller copies them from a
                template (:mod:`kwplug._plugins._reuse`).
        """
        super().__init__(PROJECT_NAME)
        # Handlers compare by value and do not hash (as Accelerate's dataclasses): pluggy's
        # registry tells plugins apart by identity here (kwplug._plugins._identity).
        self._name2plugin = Registry()  # type: ignore[misc]
        if specs:
            self.add_hookspecs(HandlerSpec)
        self._descriptions: dict[str, str] = {}
        self._third_party: set[str] = set()
        self.plan: dict[str, Answer] = {}
        self._monitors = 0  # add_hookcall_monitoring calls not undone (enable_tracing's too)
        self._calls = HookCalls(self)
        # Hook name -> (its implementations when last checked, whether all are kwplug's own).
        self._own: dict[str, tuple[list[pluggy.HookImpl], bool]] = {}
        #: The one-answer hooks, by name: ``plugins.first.autocast(device_type=...)``.
        self.first = FirstRelay(self._calls.first)
        #: The collecting hooks, by name: ``plugins.each.comm_hooks()``.
        self.each = EachRelay(self._calls.each)
        if read_environ(TRACE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            self.add_hookcall_monitoring(self._trace_before, self._trace_after)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        """pluggy's answer, cached per (class, attribute) for instances and per (module,
        attribute) for modules."""
        key: tuple[Any, str]
        if isinstance(plugin, types.ModuleType):
            key = (plugin, name)  # a module plugin: its functions are fixed once imported
        elif isinstance(plugin, type) or name in getattr(plugin, "__dict__", ()):
            return super().parse_hookimpl_opts(plugin, name)
        else:
            key = (type(plugin), name)
        opts = self._opts_cache.get(key, _NO_OPTS)
        if opts is _NO_OPTS:
            opts = super().parse_hookimpl_opts(plugin, name)
            self._opts_cache[key] = opts
        return None if opts is None else cast(pluggy.HookimplOpts, dict(opts))

    @property
    def watched(self) -> bool:
        """Whether tracing or monitoring is on (``enable_tracing``,
        ``add_hookcall_monitoring``): hook calls then run through pluggy's ``_hookexec``."""
        return self._monitors > 0

    def add_hookcall_monitoring(
        self,
        before: Callable[[str, Sequence[pluggy.HookImpl], Mapping[str, Any]], None],
        after: Callable[
            [pluggy.Result[Any], str, Sequence[pluggy.HookImpl], Mapping[str, Any]], None
        ],
    ) -> Callable[[], None]:
        """pluggy's ``add_hookcall_monitoring`` (``enable_tracing`` calls it too), counted so
        that :attr:`watched` knows, without reading pluggy's private executor.

        Returns:
            The function that removes the monitoring (pluggy's ``undo``), once.
        """
        undo = super().add_hookcall_monitoring(before, after)
        self._monitors += 1
        done = False

        def counted_undo() -> None:
            nonlocal done
            undo()
            if not done:
                done = True
                self._monitors -= 1

        return counted_undo

    # -- registration ------------------------------------------------------------------------

    def get_plugins(self) -> PluginSet:  # type: ignore[override]
        """pluggy's ``get_plugins``: the registered plugin objects, as a read-only set whose
        membership is identity (:class:`~kwplug._plugins._identity.PluginSet`; handlers do
        not hash, so it is not a ``set``)."""
        return PluginSet(v for v in dict.values(self._name2plugin) if v is not None)

    def is_registered(self, plugin: object) -> bool:
        """pluggy's ``is_registered``, by identity: an equal copy of a registered handler
        is not registered."""
        return self.get_name(plugin) is not None

    def get_name(self, plugin: object) -> str | None:
        """pluggy's ``get_name``, by identity: the name this very object is registered
        under, else ``None``."""
        return cast(Registry, self._name2plugin).name_of(plugin)

    def subset_hook_caller(self, name: str, remove_plugins: Iterable[object]) -> pluggy.HookCaller:
        """pluggy's ``subset_hook_caller``: hook ``name`` without the implementations of
        ``remove_plugins`` (compared by identity; hashable or not)."""
        orig: pluggy.HookCaller = getattr(self.hook, name)
        implementing = PluginSet(impl.plugin for impl in orig.get_hookimpls())
        removed = PluginSet(p for p in remove_plugins if p in implementing)
        return orig if not removed else _SubsetHookCaller(orig, removed)

    def load_setuptools_entrypoints(self, group: str, name: str | None = None) -> int:
        """pluggy's ``load_setuptools_entrypoints`` through kwplug's discovery: register the
        ``kwplug.handlers`` plugins this manager lacks, as :meth:`for_handlers` registers them.

        What :func:`kwplug.discover` loaded (the loading controls, the API range, the import
        guard and a :class:`kwplug.testing.PluginSandbox` apply) is registered as a default: a
        handler class as a default instance, as ``"<distribution>:<entry point>"``, with its
        description and third-party standing. Left out: a handler class whose
        ``register_default`` is false or an instance of which (or of a subclass) is registered,
        an object registered already (identity), a name registered or ``set_blocked`` (the
        entry-point name or the registered one). A plugin that fails to load is skipped,
        reported once per process with a :class:`~kwplug.errors.PluginLoadWarning` naming it
        and its distribution. Precedence: pluggy asks the most recently registered
        implementation first, so what this registers answers before all registered earlier --
        on an Accelerator's manager, before its built-ins and the user's ``kwargs_handlers``
        (the hooks it answered at construction, and its conflict check, are not run again).

        Args:
            group: the entry-point group: ``"kwplug.handlers"`` only.
            name: only the entry point of this name (``"ddp"``) or registered name
                (``"kwplug:ddp"``); ``None`` (default): every one.

        Returns:
            The number of plugins this call registered, as pluggy's.

        Raises:
            ValueError: another ``group`` (named with the accepted one): its plugins would
                answer kwplug's hooks unseen by the loading controls, ``kwplug plugins`` and
                the API range check; ``register(plugin, name=...)`` adds one explicitly.
            kwplug.errors.PluginLoadError: a plugin failed to load and
                ``KWPLUG_STRICT_PLUGINS=1``, as at an Accelerator's construction.
        """
        if group != GROUP:  # refused, not imported: see Raises
            raise ValueError(
                f"load_setuptools_entrypoints({group!r}): kwplug's plugin manager loads the "
                f"{GROUP!r} entry points only; declare the plugin there, or register() it"
            )
        if _entry_point_loader is None:  # only while kwplug._plugins is being imported
            raise RuntimeError("load_setuptools_entrypoints: kwplug._plugins is not imported")
        return _entry_point_loader(self, name)

    @classmethod
    def for_handlers(
        cls, handlers: Sequence[KwargsHandler], records: Sequence[PluginRecord]
    ) -> KwplugPluginManager:
        """A manager with the user's ``handlers`` and the default plugins of ``records``.

        Order of answers: built-in defaults are registered first, then third-party defaults,
        then the user's handlers (last in the list first), so pluggy asks the user's handlers
        first. Which defaults, under which names: :func:`~kwplug._plugins._defaults.select`
        (a default handler class an instance of which the user passed is skipped). Each
        Accelerator has its own manager and registers objects under explicit names, so equal
        (by value) handlers in two Accelerators never collide.

        Args:
            handlers: the user's handler instances (already checked, see
                :func:`~kwplug._plugins._rules.require_handler_list`).
            records: discovered plugins, in precedence order (see :func:`kwplug.discover`).

        Raises:
            TypeError: a user handler's hookimpls fail pluggy's validation (names the class).
        """
        pm = cls()
        chosen = select(records, lambda kind: any(isinstance(h, kind) for h in handlers))
        objects = [plugin_object(d.record) for d in chosen]  # default instances, in order
        for d, obj in zip(reversed(chosen), reversed(objects), strict=True):
            pm.register_plugin(obj, d.name, d.description, third_party=d.third_party)
        for index in reversed(range(len(handlers))):
            pm.register_handler(index, handlers[index])
        return pm

    def register_plugin(
        self, plugin: Any, name: str, description: str, *, third_party: bool = False
    ) -> None:
        """Register a default ``plugin`` under ``name``, described as ``description``."""
        self._descriptions[name] = description
        if third_party:
            self._third_party.add(name)
        self.register(plugin, name=name)

    def register_handler(self, index: int, handler: KwargsHandler) -> str:
        """Register the user's ``kwargs_handlers[index]``; return its registered name,
        ``user[<index>]:<module>.<class>``.

        Raises:
            TypeError: its hookimpls fail pluggy's validation (names the class).
        """
        cls = type(handler)
        name = f"user[{index}]:{cls.__module__}.{cls.__qualname__}"
        self._descriptions[name] = f"kwargs_handlers[{index}] ({cls.__qualname__})"
        try:
            validate_hookimpls(self, handler, name)
        except pluggy.PluginValidationError as exc:
            raise TypeError(
                f"kwargs_handlers[{index}] ({cls.__qualname__}) has an invalid "
                f"hook implementation: {exc}"
            ) from exc
        return name

    def describe(self, name: str) -> str:
        """How messages name the plugin registered as ``name`` (``name`` itself if unknown)."""
        return self._descriptions.get(name, name)

    def descriptions(self) -> list[str]:
        """The descriptions of every plugin registered through this manager."""
        return list(self._descriptions.values())

    def is_third_party(self, name: str) -> bool:
        """Whether ``name`` is a third-party plugin registered by default."""
        return name in self._third_party

    def own_implementations(self, hook: str) -> list[pluggy.HookImpl] | None:
        """The implementations of ``hook`` (storage order: the last answers first) when calling
        them directly would be a hook call nobody can tell from pluggy's, else ``None``.

        That is: nothing watches the manager (no ``enable_tracing``, no
        ``add_hookcall_monitoring``, ``_hookexec`` not overridden), no implementation is a
        wrapper, and every one is kwplug's own code (its function defined in a ``kwplug``
        module) registered by kwplug or by the user -- not a third-party default plugin, not a
        user handler overriding the method. A registration after the check is seen at the next
        call (the implementations are compared each time).
        """
        impls: list[pluggy.HookImpl] = getattr(self.hook, hook).get_hookimpls()
        if is_watched(self):
            return None
        known = self._own.get(hook)
        if known is None or known[0] != impls:  # HookImpl compares by identity
            known = self._own[hook] = (impls, all(map(self._is_own, impls)))
        return impls if known[1] else None

    def _is_own(self, impl: pluggy.HookImpl) -> bool:
        function = getattr(impl.function, "__func__", impl.function)
        module = getattr(function, "__module__", None) or ""
        return (
            not (impl.wrapper or impl.hookwrapper)
            and (module == "kwplug" or module.startswith("kwplug."))
            and not self.is_third_party(impl.plugin_name)
        )

    def hook_impls(self, hook: str) -> list[pluggy.HookImpl]:
        """The implementations of ``hook`` in pluggy's storage order (the last answers first)."""
        return list(getattr(self.hook, hook).get_hookimpls())

    # -- hook calls --------------------------------------------------------------------------

    def first_with(self, handler: KwargsHandler | None) -> FirstRelay:
        """:attr:`first`, with ``handler``'s implementations answering before every
        registered one, without registering it (``accelerator.autocast(handler)``). With
        ``handler=None`` this is :attr:`first`; otherwise the answers are not recorded in
        :attr:`plan`.

        Raises (at the call):
            TypeError: ``handler`` is not a handler instance.
        """
        if handler is None:
            return self.first
        calls, methods_of = self._calls, self._methods_of

        def ask(hook: str, kwargs: dict[str, Any]) -> Any:
            require_handler_instance(handler, f"the {hook} handler")
            revalidate(handler)
            return calls.first_with(methods_of(handler, hook), hook, kwargs)

        return FirstRelay(ask)

    def each_of(self, name: str) -> EachRelay:
        """:attr:`each`, asking only the plugin registered as ``name``."""
        return EachRelay(functools.partial(self._calls.each, only=name.__eq__))

    def conflicts(self, device_type: str) -> dict[str, str]:
        """Hook name -> the third-party default plugins (described) that all claim it for
        ``device_type``, for each one-answer hook claimed twice or more (empty: none)."""
        if len(self._third_party) < 2:  # a conflict takes two third-party defaults
            return {}
        return find_conflicts(self, device_type)

    def check_conflicts(self, device_type: str) -> None:
        """Raise if :meth:`conflicts` finds any.

        Raises:
            kwplug.errors.PluginConflictError: naming every conflicting hook and plugin, and
                how to choose.
        """
        found = self.conflicts(device_type)
        if found:
            raise conflict_error(found, device_type)

    # -- internals ---------------------------------------------------------------------------

    def _methods_of(self, plugin: object, hook: str) -> list[Callable[..., Any]]:
        # Bound methods of ``plugin`` marked @kwplug.hookimpl for ``hook``.
        methods = []
        for attr in dir(plugin):
            opts = self.parse_hookimpl_opts(plugin, attr)
            if opts is not None and (opts.get("specname") or attr) == hook:
                methods.append(getattr(plugin, attr))
        return methods

    def _trace_before(
        self, hook: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]
    ) -> None:
        order = [self.describe(i.plugin_name) for i in reversed(impls)]
        trace_logger.info("hook %s(%s) asks %s", hook, ", ".join(sorted(kwargs)), order)

    def _trace_after(
        self,
        outcome: pluggy.Result[Any],
        hook: str,
        impls: Sequence[pluggy.HookImpl],
        kwargs: Mapping[str, Any],
    ) -> None:
        if outcome.exception is not None:
            trace_logger.info("hook %s raised %r", hook, outcome.exception)
            return
        running = self._calls.running[-1] if self._calls.running else None
        if running is None or running[0] is not impls:  # a plain pm.hook.<name>() call
            trace_logger.info("hook %s returned %r", hook, outcome.get_result())
            return
        for name, answer in running[1]:
            who = "the per-call handler" if name == PER_CALL else self.describe(name)
            trace_logger.info("hook %s answered by %s: %r", hook, who, answer)
