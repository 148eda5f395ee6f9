"""Every exception and warning kwplug raises, in one place.

Each error subclasses :class:`KwplugError` *and* the builtin it has always been (so
``except RuntimeError`` / ``except ValueError`` / ``pytest.raises(AssertionError)`` in existing
code keep working), and carries what its message names as attributes, for programs that handle
it. Warnings subclass :class:`KwplugWarning` (a ``UserWarning``). The messages are unchanged; the
attributes default to ``None`` when a raise site does not know them. Every error pickles with its
attributes (``BaseException`` keeps an instance's ``__dict__`` across ``pickle``).
:func:`user_stacklevel` points a warning at the user's line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# kwplug's core folder (kwplug/, core/ in a checkout): the frames user_stacklevel skips.
_CORE = os.path.dirname(os.path.abspath(__file__))


class KwplugError(Exception):
    """Base class of every error kwplug raises on purpose."""


class KwplugWarning(UserWarning):
    """Base class of every warning kwplug issues."""


class PluginLoadWarning(KwplugWarning):
    """A handler plugin could not be loaded, a loading control names no plugin, or several
    distributions declare one entry-point name (a name clash; neither plugin is dropped).

    Attributes:
        plugin: the entry-point name, or ``None`` (a loading control naming no plugin).
        distribution: the distribution declaring the entry point, or ``None``.
    """

    def __init__(
        self, message: str, *, plugin: str | None = None, distribution: str | None = None
    ) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution


class PluginCacheWarning(KwplugWarning):
    """The on-disk entry-point cache failed a check and was not used (discovery scanned the
    installed distributions instead, and rebuilt the cache where its folder allows).

    Attributes:
        path: the cache file or folder concerned.
        reason: what failed (owner, mode, a symbolic link, an entry its metadata does not
            declare, ...).
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class MissingFeatureError(KwplugError, RuntimeError):
    """A feature the ``Accelerator`` was asked for (mixed precision, its gradient scaler, DDP
    wrapping) has no plugin to provide it: kwplug refuses to train without it.

    Attributes:
        feature: what was asked, e.g. ``"mixed_precision='bf16'"``.
        hook: the hook no plugin answered, e.g. ``"autocast"``.
        providers: ``(plugin, why it did not provide it)`` for each plugin that could have.
    """

    def __init__(
        self,
        message: str,
        *,
        feature: str | None = None,
        hook: str | None = None,
        providers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.feature = feature
        self.hook = hook
        self.providers = providers


class TrackerConfigWarning(KwplugWarning):
    """A tracker could not store some configuration values as given (lists, tuples, nested
    dicts, other objects) and stored them flattened or as strings.

    Attributes:
        tracker: the tracker's name (``"tensorboard"``).
        keys: the configuration keys whose values were changed, in order.
    """

    def __init__(self, message: str, *, tracker: str, keys: tuple[str, ...]) -> None:
        super().__init__(message)
        self.tracker = tracker
        self.keys = keys


class FrozenModelWarning(KwplugWarning):
    """``prepare`` left a model without trainable parameters unwrapped (no DDP) in a
    multi-process run.

    Attributes:
        model: the model's class name.
    """

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class TrackerTimeoutError(KwplugError, RuntimeError):
    """A tracker did not finish starting (or storing the configuration) within
    ``KWPLUG_TRACKER_TIMEOUT`` seconds, e.g. a tracking server that accepts and never replies.
    Not a ``TimeoutError``: HTTP clients retry those, and this one must end the wait.

    Attributes:
        tracker: the tracker's name (``"mlflow"``).
        endpoint: where it connects, or ``None`` when the tracker does not say.
        seconds: the deadline that passed.
    """

    def __init__(
        self,
        message: str,
        *,
        tracker: str | None = None,
        endpoint: str | None = None,
        seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.tracker = tracker
        self.endpoint = endpoint
        self.seconds = seconds


class PluginLoadError(KwplugError, RuntimeError):
    """A handler plugin failed to load while ``KWPLUG_STRICT_PLUGINS=1``.

    Attributes:
        plugins: ``(entry-point name, distribution)`` of every plugin that failed.
    """

    def __init__(self, message: str, *, plugins: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.plugins = plugins


class PluginHookError(KwplugError, RuntimeError):
    """A third-party plugin's hook implementation raised; the message names the plugin.

    The plugin's own exception is the ``__cause__``.

    Attributes:
        plugin: the plugin's registered name (``distribution:entry-point``).
        hook: the hook name, e.g. ``"make_scaler"``.
    """

    def __init__(self, message: str, *, plugin: str | None = None, hook: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


class PluginConflictError(KwplugError, RuntimeError):
    """Two third-party default plugins claim the same one-answer hook for the same device.

    Attributes:
        conflicts: hook name -> the claiming plugins, described, joined by ``" and "``.
        device_type: the device type the plugins claim, e.g. ``"cpu"``.
    """

    def __init__(
        self,
        message: str,
        *,
        conflicts: Mapping[str, str] | None = None,
        device_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.conflicts = dict(conflicts or {})
        self.device_type = device_type


class ConfigError(KwplugError, ValueError):
    """A configuration file or mapping is invalid; the message names the file, table and key.

    Attributes:
        file: the file path, or ``"<mapping>"`` for a mapping.
        key: the key at fault (``"handlers.<name>"`` or ``"handlers.<name>.<option>"`` inside
            a handler table), or ``None`` when the whole source is at fault.
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.key = key


class CheckpointError(KwplugError, ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong.

    Attributes:
        file: the file or directory concerned (``str``), or ``None``.
    """

    def __init__(self, message: str, file: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.file = None if file is None else os.fspath(file)


class NotCheckpointableError(KwplugError, ValueError, TypeError):
    """``register_for_checkpointing`` got objects without ``state_dict()`` and
    ``load_state_dict()``: a ``ValueError``, as Accelerate raises, and a ``TypeError``, as
    kwplug raised before.

    Attributes:
        indices: the positions of the invalid objects among the arguments.
    """

    def __init__(self, message: str, *, indices: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.indices = indices


class RankMismatchError(KwplugError, RuntimeError):
    """The ranks of one job constructed ``Accelerator()`` with different settings (raised on
    every rank, with the same message and attributes).

    The message names each differing field and each rank's value; values are canonical JSON
    text (``"'bf16'"`` is ``'"bf16"'``), ``"<absent>"`` for a field a rank does not have (a
    handler or plugin it lacks).

    Attributes:
        field: the first differing field, e.g. ``"mixed_precision"``,
            ``"DistributedDataParallelKwargs.bucket_cap_mb"``, ``"plugin 'compress'"``,
            ``"torch version"``.
        values: that field's value on each rank, in rank order.
        mismatches: every differing field -> its values per rank, in rank order.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        values: tuple[str, ...] = (),
        mismatches: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.values = tuple(values)
        self.mismatches = dict(mismatches or {})


class RankTimeoutError(KwplugError, RuntimeError):
    """A kwplug collective (``wait_for_everyone``, ``prepare``, ``save_state``,
    ``load_state``, the first ``backward``) gave up waiting for other ranks after
    ``KWPLUG_RANK_WAIT`` seconds (default: the process group's timeout). A ``RuntimeError``,
    as torch's own collective timeouts.

    Attributes:
        missing: the ranks that did not arrive (empty when the store could not be reached).
        waited_for: where this rank waited (``"wait_for_everyone"``, ``"save_state"``...).
        seconds: the wait that passed.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: tuple[int, ...] = (),
        waited_for: str | None = None,
        seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.waited_for = waited_for
        self.seconds = seconds


class DistributedRunError(KwplugError, AssertionError):
    """A ``kwplug.testing`` distributed run failed: the message holds the failing rank's
    traceback and the tail of the job's output (an ``AssertionError``, so pytest reports it as
    a failed test rather than an error).

    Attributes:
        returncode: the job's exit status (``None`` when it timed out).
    """

    def __init__(self, message: str, *, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DistributedRunError",
    "FrozenModelWarning",
    "KwplugError",
    "KwplugWarning",
    "MissingFeatureError",
    "PluginCacheWarning",
    "PluginConflictError",
    "PluginHookError",
    "PluginLoadError",
    "PluginLoadWarning",
    "RankMismatchError",
    "RankTimeoutError",
    "TrackerConfigWarning",
    "user_stacklevel",
]


def user_stacklevel(*also: str) -> int:
    """The ``stacklevel`` that makes a warning issued by the calling function name the first
    frame outside kwplug: ``warnings.warn(warning, stacklevel=user_stacklevel())``.

    Frames in kwplug's core folder, in its built-in plugins' folder (once imported) and in the
    ``also`` folders are skipped, so the warning names the user's line (``Accelerator()``,
    ``prepare``, ``init_trackers``...) whatever depth kwplug reached it from, where
    ``stacklevel=2`` would name the calling function's caller only.

    Args:
        also: further folders whose frames are skipped (e.g. pluggy's, for a warning issued
            inside a hook call).

    Returns:
        ``int``, 2 or more (2: the calling function's caller).
    """
    folders = [_CORE, *also]
    plugins = sys.modules.get("kwplug.plugins")  # not imported: none of its frames can exist
    if plugins is not None and plugins.__file__:
        folders.append(os.path.dirname(os.path.abspath(plugins.__file__)))
    skipped = tuple(os.path.join(folder, "") for folder in folders)
    frame, level = sys._getframe(2), 2  # the calling function's caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        skipped
    ):
        frame, level = frame.f_back, level + 1
    return level
