"""``Accelerator(log_with=...)``: which trackers, ``init_trackers``, ``log``, ``get_tracker``
and finishing them in ``end_training``. The trackers themselves come from plugins' ``trackers``
hook (:mod:`kwplug.tracking`); they exist on the main process only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kwplug._plugins import KwplugPluginManager
from kwplug.accelerator._tracker_wait import bounded
from kwplug.tracking import GeneralTracker, TrackerFactory, _registered, merge_trackers
from kwplug.validators import shown

#: What ``log_with`` accepts: ``None``, a tracker name, ``"all"``, a :class:`GeneralTracker`,
#: or a list of those.
LogWith = str | GeneralTracker | Sequence[str | GeneralTracker] | None


@attrs.define(eq=False)
class _Trackers:
    """The trackers of one Accelerator.

    Attributes:
        selected: tracker names (``str``) and ready tracker instances chosen by ``log_with``.
        factories: name -> factory, from every plugin's ``trackers`` answer.
        logging_dir: the project's logging folder (``None``: not set).
        main: whether this is the main process (the only one with trackers).
        started: the trackers ``init_trackers`` built and started.
    """

    selected: list[str | GeneralTracker]
    factories: dict[str, TrackerFactory]
    logging_dir: str | None
    main: bool
    started: list[GeneralTracker] = attrs.Factory(list)

    @classmethod
    def resolve(
        cls, plugins: KwplugPluginManager, log_with: Any, logging_dir: str | None, main: bool
    ) -> _Trackers:
        """Check ``log_with`` against the trackers plugins contribute.

        The ``trackers`` hook is called only when ``log_with`` names a tracker.

        Raises:
            TypeError: ``log_with`` holds something that is neither a name nor a
                ``GeneralTracker``.
            ValueError: an unknown tracker name (the message lists the available ones), or a
                tracker needing a logging directory while ``project_dir``/``logging_dir`` is
                unset.
        """
        if log_with is None or (type(log_with) is list and not log_with):
            # No trackers (every Accelerator() without log_with): nothing to check or ask.
            return cls([], {}, logging_dir, main)
        items = _as_list(log_with)
        for item in items:
            if not isinstance(item, (str, GeneralTracker)):
                raise TypeError(
                    "log_with must be a tracker name, 'all', a kwplug.tracking.GeneralTracker "
                    f"or a list of those, got {type(item).__name__}"
                )
        factories: dict[str, TrackerFactory] = {}
        if any(isinstance(item, str) for item in items):
            answers = plugins.each.trackers()
            factories = merge_trackers([(plugins.describe(n), a) for n, a in answers])
            factories.update(_registered())  # register_tracker_class's, as Accelerate's
        selected: list[str | GeneralTracker] = []
        for item in items:
            if isinstance(item, GeneralTracker):
                selected.append(item)
            elif str(item) == "all":
                selected += [
                    name
                    for name, factory in factories.items()
                    if getattr(factory, "is_available", lambda: True)()
                ]
            elif str(item) in factories:
                selected.append(str(item))
            else:
                raise ValueError(
                    f"log_with: unknown tracker {shown(str(item))}; available: "
                    f"{', '.join(map(repr, sorted(factories))) or 'none'} (or 'all')"
                )
        for name in selected:
            needs_dir = getattr(factories.get(str(name)), "requires_logging_directory", False)
            if isinstance(name, str) and needs_dir and logging_dir is None:
                raise ValueError(
                    # Accelerate's first words (code matches them), then kwplug's remedy.
                    f"Logging with `{name}` requires a `logging_dir`: log_with: tracker "
                    f"{name!r} writes files and needs a logging directory: pass project_dir= "
                    "or project_config=ProjectConfiguration(logging_dir=...)"
                )
        return cls(list(dict.fromkeys(selected)), factories, logging_dir, main)

    def init(
        self,
        project_name: str,
        config: Mapping[str, Any] | None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None,
    ) -> None:
        """Build and start every selected tracker (main process only), then store ``config``."""
        if not self.main:
            return
        init_kwargs = init_kwargs or {}
        for item in self.selected:
            if isinstance(item, GeneralTracker):
                tracker = item
            else:
                factory = self.factories[item]
                kwargs = dict(init_kwargs.get(item, {}))
                if getattr(factory, "requires_logging_directory", False):
                    tracker = factory(project_name, self.logging_dir, **kwargs)
                else:
                    tracker = factory(project_name, **kwargs)
            with bounded(_name(tracker), _endpoint(tracker), "start"):
                tracker.start()
            self.started.append(tracker)
        if config is not None:
            for tracker in self.started:
                with bounded(_name(tracker), _endpoint(tracker), "store_init_configuration"):
                    tracker.store_init_configuration(config)

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None,
    ) -> None:
        """Log ``values`` to every started tracker (none exist off the main process)."""
        log_kwargs = log_kwargs or {}
        for tracker in self.started:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool) -> Any:
        """The started tracker called ``name`` (its ``tracker`` object when ``unwrap``); off the
        main process, a do-nothing ``GeneralTracker``.

        Raises:
            ValueError: no started tracker has that name (lists the started ones).
        """
        if not self.main:
            return GeneralTracker(_blank=True)
        for tracker in self.started:
            if getattr(tracker, "name", None) == name:
                return tracker.tracker if unwrap else tracker  # type: ignore[attr-defined]
        names = [getattr(t, "name", "?") for t in self.started]
        raise ValueError(
            f"{name!r} is not a tracker of this Accelerator; started: {names or 'none'} "
            "(call init_trackers first)"
        )

    def finish(self) -> None:
        """``finish()`` every started tracker once, then forget them."""
        started, self.started = self.started, []
        for tracker in started:
            tracker.finish()


def _as_list(log_with: Any) -> list[Any]:
    if isinstance(log_with, (str, GeneralTracker)):
        return [log_with]
    if isinstance(log_with, Sequence):
        return list(log_with)
    return [log_with]


def _name(tracker: GeneralTracker) -> str:
    return str(getattr(tracker, "name", type(tracker).__name__))


def _endpoint(tracker: GeneralTracker) -> str | None:
    # A tracker written for Accelerate has no endpoint; a broken property must not stop a run.
    try:
        endpoint = getattr(tracker, "endpoint", None)
    except Exception:
        return None
    return endpoint if isinstance(endpoint, str) else None
