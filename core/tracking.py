"""Experiment trackers: the :class:`GeneralTracker` base and how plugins contribute trackers.

A tracker records a run's configuration and metrics (TensorBoard, a JSON-lines file, an
experiment service). Trackers are plugins like every other torch-facing part of kwplug: a
plugin answers the ``trackers`` hook (:meth:`kwplug.hookspecs.HandlerSpec.trackers`) with a
mapping of tracker name to a :data:`TrackerFactory` -- usually the tracker class itself -- and
``Accelerator(log_with="name")`` selects it. kwplug's built-ins (``"tensorboard"``,
``"jsonl"``) come from :mod:`kwplug.plugins.trackers` exactly that way.

The API is Accelerate's (``accelerate.tracking.GeneralTracker``), so a tracker written for
Accelerate ports by changing its import. A factory is called as
``factory(run_name, logging_dir, **init_kwargs)`` when its ``requires_logging_directory`` is
true, else as ``factory(run_name, **init_kwargs)``; then the Accelerator calls ``start()``.
Trackers exist on the main process only (``init_trackers`` builds none elsewhere).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kwplug._contracts.additive import merge
from kwplug._contracts.lazy import exporter
from kwplug.errors import TrackerConfigWarning, user_stacklevel

__all__ = [
    "GeneralTracker",
    "TrackerFactory",
    "flatten_config",
    "import_tracker_package",
    "merge_trackers",
    "package_installed",
    "plain_value",
    "register_tracker_class",
]

#: What a flat configuration value may be (TensorBoard's ``add_hparams`` accepts these).
ConfigValue = bool | int | float | str | None


class GeneralTracker:
    """Base class of a tracker (Accelerate's ``GeneralTracker`` API).

    A subclass sets the class attributes ``name`` (``str``, the name ``log_with`` and
    ``get_tracker`` use) and ``requires_logging_directory`` (``bool``), defines the
    ``tracker`` property (the underlying object, e.g. a ``SummaryWriter``), and overrides what
    it needs of :meth:`start`, :meth:`store_init_configuration`, :meth:`log` and
    :meth:`finish` (each does nothing here). It may override :meth:`is_available` when it needs
    an optional dependency, so that ``log_with="all"`` skips it when that is missing.

    Args:
        _blank: build a do-nothing placeholder without checking the subclass (what
            ``get_tracker`` returns on processes other than the main one).

    Raises:
        NotImplementedError: a subclass lacks ``name``, ``requires_logging_directory`` or
            ``tracker`` (the message lists the missing ones).
    """

    #: Accelerate's flag; kwplug runs every tracker on the main process only.
    main_process_only: ClassVar[bool] = True
    #: What to ``pip install`` for the optional package :meth:`is_available` checks (e.g.
    #: ``"kwplug[wandb]"``), shown by ``kwplug plugins --trackers`` when it is missing;
    #: ``None``: the tracker needs nothing beyond kwplug.
    requirement: ClassVar[str | None] = None
    # Declared, not defined: a subclass must define them (checked in __init__).
    name: ClassVar[str]
    requires_logging_directory: ClassVar[bool]

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        required = ("name", "requires_logging_directory", "tracker")
        missing = [f"`{attr}`" for attr in required if attr not in dir(self)]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} is missing the required tracker attribute(s) "
                f"{', '.join(missing)}; define them in the class (see "
                "kwplug.tracking.GeneralTracker)"
            )

    @property
    def endpoint(self) -> str | None:
        """Where the tracker connects (a server's URI), named when ``init_trackers`` waits on
        it (see ``KWPLUG_TRACKER_TIMEOUT``); default ``None`` (a local tracker)."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Whether this tracker's dependencies are installed (default ``True``); trackers
        that are not available are left out of ``log_with="all"``."""
        return True

    def start(self) -> None:
        """Open the run (create writers, connect); called once by ``init_trackers`` right
        after the tracker is built, on the main process."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters.

        Args:
            values: name -> ``bool``, ``str``, ``int``, ``float`` or ``None``.
        """

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` for the run.

        Args:
            values: metric name -> value (``int``, ``float``, ``str``, 0-d tensors).
            step: the training step these values belong to, or ``None``.
            kwargs: tracker-specific options (``log_kwargs[name]`` of ``Accelerator.log``).
        """

    def finish(self) -> None:
        """Close the run and flush what is buffered; called by ``Accelerator.end_training``."""


def package_installed(module: str) -> bool:
    """Whether the top-level package ``module`` can be imported, without importing it (what a
    tracker's :meth:`GeneralTracker.is_available` usually answers).

    Args:
        module: an importable name, e.g. ``"wandb"``.
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken half-installed package, a bad sys.modules
        return False


def import_tracker_package(module: str, tracker: str, install: str) -> types.ModuleType:
    """Import the package a tracker needs, or fail with the command that installs it.

    Args:
        module: the package to import, e.g. ``"wandb"``.
        tracker: the tracker's name (``log_with``), for the message.
        install: what to ``pip install`` to get it, e.g. ``"kwplug[wandb]"``.

    Returns:
        The imported module.

    Raises:
        ModuleNotFoundError: ``module`` (or a package it imports) is not installed; the message
            names the tracker and ``pip install '<install>'``.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"log_with={tracker!r} needs the {exc.name or module} package: pip install '{install}'",
            name=exc.name,
        ) from exc


#: What a plugin's ``trackers`` hook maps each name to: a callable building the tracker
#: (usually the :class:`GeneralTracker` subclass). Its ``requires_logging_directory``
#: attribute decides whether it receives the logging directory.
TrackerFactory = Callable[..., GeneralTracker]


def flatten_config(
    values: Mapping[str, Any], tracker: str, separator: str = "/"
) -> dict[str, ConfigValue]:
    """``values`` with only ``bool``/``int``/``float``/``str``/``None`` values, for a tracker
    that stores nothing else (TensorBoard's hparams; torch's ``add_hparams`` raises
    ``ValueError`` on a list or a dict).

    A nested mapping becomes one key per leaf, joined with ``separator``
    (``{"optim": {"lr": 0.1}}`` -> ``{"optim/lr": 0.1}``); a one-element tensor or a NumPy
    scalar becomes its Python number; a list, a tuple or any other object becomes its
    ``str()`` (``"[1, 2]"``). Key order is kept.

    Args:
        values: the configuration given to ``init_trackers``.
        tracker: the tracker's name, for the warning.
        separator: ``str`` between a nested key and its parent's, default ``"/"``.

    Returns:
        The flat configuration (a new ``dict``; ``values`` is not modified).

    Warns:
        kwplug.errors.TrackerConfigWarning: once per call when a value was flattened or
            stringified; the message and its ``keys`` attribute name the top-level keys.
    """
    flat: dict[str, ConfigValue] = {}
    changed: list[str] = []

    def add(key: str, value: Any, top: str) -> None:
        if isinstance(value, Mapping):
            if top not in changed:
                changed.append(top)
            for inner, item in value.items():
                add(f"{key}{separator}{inner}", item, top)
            return
        plain = _scalar(value)
        if plain is _NOT_SCALAR:
            if top not in changed:
                changed.append(top)
            plain = str(value)
        flat[key] = plain

    for key, value in values.items():
        add(str(key), value, str(key))
    if changed:
        names = ", ".join(map(repr, changed))
        warnings.warn(
            TrackerConfigWarning(
                f"{tracker}: configuration key(s) {names} hold values this tracker cannot "
                f"store as given (lists, tuples, nested dicts or other objects): nested dicts "
                f"were flattened to '<key>{separator}<inner key>' keys and other values stored "
                "as strings",
                tracker=tracker,
                keys=tuple(changed),
            ),
            stacklevel=user_stacklevel(),
        )
    return flat


_NOT_SCALAR = object()


def plain_value(value: Any) -> Any:
    """``value`` as a Python number when it is a one-element tensor or a NumPy scalar (or
    one-element array); any other value unchanged. Trackers whose clients want plain numbers
    pass ``log`` values through it (``accelerator.log({"loss": loss})`` with a 0-d tensor).

    Args:
        value: a logged value.
    """
    plain = _scalar(value)
    return value if plain is _NOT_SCALAR else plain


def _scalar(value: Any) -> Any:
    # bool/int/float/str/None as they are; a one-element tensor or NumPy array/scalar (it has
    # .item() and one element: numel() for torch, size for NumPy) as its Python value.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else getattr(value, "size", None)
    if callable(item) and count == 1:
        result = item()
        if isinstance(result, (bool, int, float, str)):
            return result
    return _NOT_SCALAR


def merge_trackers(
    contributions: list[tuple[str, Mapping[str, TrackerFactory] | None]],
) -> dict[str, TrackerFactory]:
    """Merge the plugins' ``trackers`` answers into one mapping of name to factory.

    Args:
        contributions: ``(plugin description, answer)`` pairs from the ``trackers`` hook.

    Raises:
        TypeError: an answer is not a mapping of ``str`` to a callable.
        ValueError: two plugins give the same tracker name; the message names both.
    """

    def entry(plugin: str, name: Any, factory: Any) -> tuple[TrackerFactory, str]:
        if not isinstance(name, str) or not callable(factory):
            raise TypeError(
                f"plugin {plugin!r}: trackers()[{name!r}] must map a str to a callable "
                f"tracker factory, got {type(factory).__name__}"
            )
        return factory, plugin

    return merge(
        "trackers",
        contributions,
        entry=entry,
        label="tracker name",
        kind="tracker factory",
        remedy="block one of them (KWPLUG_BLOCK_PLUGINS)",
    )


#: Accelerate's tracker class names -> kwplug's module defining the class: the built-in
#: tracker plugins', or a placeholder raising ``NotImplementedError`` for those kwplug lacks.
#: Imported on first use (PEP 562), so importing this module imports no plugin.
_TRACKER_CLASSES: dict[str, str] = {
    "AimTracker": "kwplug.plugins.aim_tracker",
    "CometMLTracker": "kwplug.plugins.comet_ml_tracker",
    "MLflowTracker": "kwplug.plugins.mlflow_tracker",
    "TensorBoardTracker": "kwplug.plugins.trackers",
    "WandBTracker": "kwplug.plugins.wandb_tracker",
    "ClearMLTracker": "kwplug._accelerate.tracker_placeholders",
    "DVCLiveTracker": "kwplug._accelerate.tracker_placeholders",
    "SwanLabTracker": "kwplug._accelerate.tracker_placeholders",
    "TrackioTracker": "kwplug._accelerate.tracker_placeholders",
}
#: The ``LOGGER_TYPE_TO_CLASS`` entries of Accelerate's built-ins kwplug has as plugins.
_BUILTIN_LOGGERS = {
    "aim": "AimTracker",
    "comet_ml": "CometMLTracker",
    "mlflow": "MLflowTracker",
    "tensorboard": "TensorBoardTracker",
    "wandb": "WandBTracker",
}
_class_getattr, _ = exporter(globals(), _TRACKER_CLASSES)
_BUILTIN_CLASSES: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """Accelerate's tracker class names and ``LOGGER_TYPE_TO_CLASS``, built on first use."""
    if name == "LOGGER_TYPE_TO_CLASS":
        return _registry()
    return _class_getattr(name)


def _registry() -> dict[str, type[GeneralTracker]]:
    """``LOGGER_TYPE_TO_CLASS`` (Accelerate's name): tracker name -> class, the built-in
    trackers' and those :func:`register_tracker_class` added; created on first use."""
    registry: dict[str, type[GeneralTracker]] | None = globals().get("LOGGER_TYPE_TO_CLASS")
    if registry is None:
        registry = {name: _class_getattr(cls) for name, cls in _BUILTIN_LOGGERS.items()}
        _BUILTIN_CLASSES.update(registry)
        globals()["LOGGER_TYPE_TO_CLASS"] = registry
    return registry


def _registered() -> dict[str, type[GeneralTracker]]:
    """The ``LOGGER_TYPE_TO_CLASS`` entries that are not the built-in plugins' own classes
    (those come through the ``trackers`` hook, where a blocked plugin stays out): what
    ``Accelerator(log_with=name)`` adds to, and prefers over, the plugins' trackers."""
    registry = globals().get("LOGGER_TYPE_TO_CLASS")
    if registry is None:
        return {}
    return {n: c for n, c in registry.items() if _BUILTIN_CLASSES.get(n) is not c}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``Accelerator(log_with=tracker_class.name)`` build ``tracker_class`` (Accelerate's):
    it is added to ``LOGGER_TYPE_TO_CLASS`` and, for later Accelerators, wins over a plugin's
    tracker of the same name. It is called as ``tracker_class(project_name, **init_kwargs)``,
    with the logging directory second when ``requires_logging_directory`` is true. A tracker
    shipped as a package is better a plugin (the ``trackers`` hook).

    Args:
        tracker_class: a :class:`GeneralTracker` subclass with a non-empty ``name`` and a
            ``requires_logging_directory`` class attribute.

    Raises:
        ValueError: ``tracker_class`` is not such a class (as Accelerate's).

    Warns:
        UserWarning: a tracker of that name is already registered (it is replaced).
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}."
        )
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            "The tracker class to register must define a `requires_logging_directory` class "
            "attribute: `True` if the tracker needs a logging directory, `False` otherwise."
        )
    registry = _registry()
    if tracker_class.name in registry:
        warnings.warn(
            f"A tracker with the name '{tracker_class.name}' is already registered and will be "
            f"overwritten by {tracker_class}.",
            UserWarning,
            stacklevel=2,
        )
    registry[tracker_class.name] = tracker_class
