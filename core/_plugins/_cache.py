"""A persistent cache of the ``kwplug.handlers`` entry points, read once per environment.

Scanning the installed distributions (``importlib_metadata.entry_points``) parses the metadata
of every distribution on ``sys.path``: tens of milliseconds in every new process, more than the
rest of an ``Accelerator``'s construction. What it finds changes only when a distribution is
installed, removed or edited, so kwplug stores the entry points of its group -- with each
distribution's name, version and the verdict of the API-range check
(:mod:`kwplug._plugins._api_range`) -- in a JSON file, and trusts it only while nothing it
depends on has changed:

- the interpreter (``sys.version``, ``sys.executable``), kwplug's cache format, the
  ``sys.path`` entries in order and the ``sys.meta_path`` finders' types;
- each ``sys.path`` entry's modification time (``st_mtime_ns``; ``None`` when missing) and the
  names of its ``*.dist-info``/``*.egg-info``/``*.egg-link``/``*.pth`` entries (a digest): pip
  creates or removes a ``*.dist-info`` folder in its site directory to install, upgrade or
  remove a distribution, which changes the directory's modification time -- and the names,
  which also change where a build normalises modification times (reproducible images,
  ``rsync -a``, some container layers);
- each plugin distribution's metadata folder (modification time, names) and its
  ``entry_points.txt`` / ``METADATA`` (``PKG-INFO``, ``requires.txt`` for ``*.egg-info``):
  modification time, size and sha256, so that an in-place edit of a plugin's metadata is seen
  too, whatever its time (kwplug's own distribution is one of them: a kwplug upgrade is seen).

A cache proves itself at each read, or is not used (:mod:`kwplug._plugins._cache_trust`): its
folder and file must be the user's and writable by nobody else, the file is opened without
following a symbolic link, and every entry point is checked against the ``entry_points.txt`` of
the metadata folder it names, the built-in verdict derived again from that distribution's
files. A cache that fails is one :class:`~kwplug.errors.PluginCacheWarning`, and is deleted and
rebuilt (a folder that fails is neither read nor written).

An entry is never written while one of these times is within :data:`RACY_SECONDS` of now (a
change in the same clock tick would go unseen, as git's "racily clean" files); a file that does
not parse, or has the wrong shape, is ignored and rewritten. Files are written atomically
(``os.replace``), one per interpreter, holding the :data:`MAX_KEYS` most recent keys (a key
differs per working directory when ``sys.path`` holds it).

Environment variables: ``KWPLUG_CACHE_DIR`` (folder; default ``$XDG_CACHE_HOME/kwplug`` or
``~/.cache/kwplug``), ``KWPLUG_NO_CACHE=1`` (neither read nor write).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from kwplug._plugins import _cache_trust as _trust
from kwplug.errors import PluginCacheWarning

CACHE_DIR_ENV = "KWPLUG_CACHE_DIR"
NO_CACHE_ENV = "KWPLUG_NO_CACHE"
#: Bumped whenever the file's layout or the meaning of a field changes.
# 2: distributions carry the built-in verdict; 3: and their metadata folder; 4: stamps hold
# folder listings and file hashes besides modification times
FORMAT = 4
#: Keys with a modification time this close to now (seconds) are not written.
RACY_SECONDS = 2.0
#: Keys kept per file (most recent first).
MAX_KEYS = 8

logger = logging.getLogger(__name__)

# An entry-point value: ``module``, ``module:attr.attr``, optionally ``[extras]`` (PyPA spec).
_VALUE = re.compile(r"^\s*(?P<module>[\w.]+)\s*(?::\s*(?P<attr>[\w.]+)\s*)?(?:\[[^\]]*\]\s*)?$")
_META_FILES = {
    ".dist-info": ("entry_points.txt", "METADATA"),
    ".egg-info": ("entry_points.txt", "PKG-INFO", "requires.txt"),
}


class DistributionLike(Protocol):
    """What discovery reads of a distribution (an ``importlib_metadata.Distribution`` or a
    :class:`CachedDistribution`)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...


class EntryPointLike(Protocol):
    """What discovery reads of an entry point (an ``importlib_metadata.EntryPoint`` or a
    :class:`CachedEntryPoint`)."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> str: ...

    @property
    def dist(self) -> DistributionLike | None: ...

    def load(self) -> Any: ...

    def __hash__(self) -> int: ...  # discovery caches per entry point


@attrs.frozen
class CachedDistribution:
    """A distribution as the cache stores it.

    Attributes:
        name: the distribution name (as its metadata spells it).
        version: its version.
        api_problem: why its requirement on kwplug excludes the kwplug that wrote the entry
            (``None``: compatible, or kwplug's own distribution).
        builtin: it is the distribution this kwplug was installed from (derived from its
            files when the cache is filled and again each time it is read, never by name).
        path: its metadata folder (``*.dist-info``), which every read checks the entry against.
    """

    name: str
    version: str
    api_problem: str | None = None
    builtin: bool = False
    path: str | None = None


@attrs.frozen
class CachedEntryPoint:
    """One entry point of the ``kwplug.handlers`` group, as the cache stores it.

    Attributes:
        name: the entry-point name.
        value: its target, ``module:attr`` (extras ignored, as ``importlib_metadata`` does).
        dist: the distribution that declares it.
    """

    name: str
    value: str
    dist: CachedDistribution

    def load(self) -> Any:
        """Import the module and return the attribute the entry point names.

        Raises:
            ValueError: the value is not ``module[:attr[.attr...]]``.
            ImportError, AttributeError: as importing or looking up the target raises.
        """
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"malformed entry point value {self.value!r}")
        obj: Any = importlib.import_module(match["module"])
        for attr in filter(None, (match["attr"] or "").split(".")):
            obj = getattr(obj, attr)
        return obj


def enabled() -> bool:
    """Whether the cache is used: ``KWPLUG_NO_CACHE`` is not set to a true value, and the
    platform can check the file's owner without following links (POSIX)."""
    if not _trust.supported():
        return False
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """The cache folder: ``KWPLUG_CACHE_DIR``, else ``$XDG_CACHE_HOME/kwplug``, else
    ``~/.cache/kwplug``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kwplug")


def cache_file() -> str:
    """This interpreter's cache file (one per ``sys.executable`` and ``sys.prefix``)."""
    ident = f"{sys.executable}\0{sys.prefix}\0{sys.version}".encode()
    return os.path.join(cache_dir(), f"entry-points-{hashlib.sha256(ident).hexdigest()[:16]}.json")


#: Names in a ``sys.path`` folder whose set says which distributions it holds.
_LISTED = (".dist-info", ".egg-info", ".egg-link", ".pth")
#: Metadata files up to this size (bytes) are hashed whole; larger ones by size only.
_HASHED_BYTES = 1 << 20


def _stamp(path: str, listed: tuple[str, ...] | None = None) -> list[Any] | None:
    # [mtime, what the content says]: a folder's names (those ending in ``listed``, or all),
    # a file's size and sha256. Modification times alone are blind where a build normalises
    # them (reproducible images, rsync -a, some container layers): a plugin installed there
    # adds a *.dist-info name, and an edited entry_points.txt changes its bytes.
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            names = sorted(n for n in os.listdir(path) if listed is None or n.endswith(listed))
            return [info.st_mtime_ns, hashlib.sha256("\0".join(names).encode()).hexdigest()]
        if info.st_size > _HASHED_BYTES:
            return [info.st_mtime_ns, info.st_size]
        with open(path, "rb") as handle:
            return [info.st_mtime_ns, info.st_size, hashlib.sha256(handle.read()).hexdigest()]
    except (OSError, ValueError):  # missing, unreadable, or a path with a NUL byte
        return None


def environment_key() -> dict[str, Any]:
    """What the entry points found depend on, read now (a few ``stat`` calls)."""
    return {
        "format": FORMAT,
        "python": sys.version,
        "executable": sys.executable,
        "meta_path": [
            name
            for name in (_qualname(f if isinstance(f, type) else type(f)) for f in sys.meta_path)
            if name not in _SAME_AS_PATH_FINDER
        ],
        "path": [[entry, _stamp(entry or os.curdir, _LISTED)] for entry in sys.path],
        # relative entries (``""`` is the working directory) resolve against it
        "cwd": os.getcwd() if any(not os.path.isabs(e) for e in sys.path) else None,
    }


# importlib_metadata adds this finder to sys.meta_path when first imported (a cache read
# imports it to prove the entries): it finds the distributions the stdlib's PathFinder finds, so
# it must not make the process's next key differ.
_SAME_AS_PATH_FINDER = frozenset({"importlib_metadata.MetadataPathFinder"})


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _watched(folders: Iterable[str]) -> list[list[Any]] | None:
    # [path, mtime] for each metadata folder and its files; None when one is not a folder on
    # disk (a zip, a custom finder): such an environment is not cached.
    watched: list[list[Any]] = []
    for folder in sorted(set(folders)):
        suffix = next((s for s in _META_FILES if folder.endswith(s)), None)
        if suffix is None or not os.path.isdir(folder):
            return None
        paths = [folder, *(os.path.join(folder, name) for name in _META_FILES[suffix])]
        watched.extend([path, _stamp(path)] for path in paths)
    return watched


def _fresh(watched: Sequence[Sequence[Any]]) -> bool:
    return all(_stamp(path) == stamp for path, stamp in watched)


def read(key: dict[str, Any]) -> tuple[CachedEntryPoint, ...] | None:
    """The cached entry points for ``key``, each proven against its metadata, or ``None``
    (disabled, absent, stale, corrupt, or untrusted).

    An untrusted cache (see :mod:`kwplug._plugins._cache_trust`) is one
    :class:`~kwplug.errors.PluginCacheWarning`; the file is deleted when its folder is sound, so
    that the scan that follows rebuilds it.
    """
    if not enabled():
        return None
    path = cache_file()
    try:
        folder = _trust.open_folder(os.path.dirname(path), create=False)
    except _trust.UntrustedCache as exc:
        _distrust(path, exc)
        return None
    except OSError as exc:
        logger.debug("kwplug: cannot open the entry-point cache folder of %s: %r", path, exc)
        return None
    if folder is None:
        return None
    try:
        return _read_in(folder, path, key)
    except _trust.UntrustedCache as exc:
        if exc.remove:
            _trust.remove_file(folder, os.path.basename(path))
        _distrust(path, exc)
    finally:
        os.close(folder)
    return None


def _read_in(folder: int, path: str, key: dict[str, Any]) -> tuple[CachedEntryPoint, ...] | None:
    # Raises UntrustedCache; anything else wrong with the file is a silent miss.
    try:
        text = _trust.read_file(folder, os.path.basename(path), path)
        if text is None:
            return None
        data = json.loads(text)
        found = None
        for entry in data["entries"]:
            if entry["key"] == key and _fresh(entry["watched"]):
                found = tuple(_entry_point(item) for item in entry["entry_points"])
                break
    except _trust.UntrustedCache:
        raise
    except Exception as exc:  # a corrupt or foreign file is a miss, never an error
        logger.debug("kwplug: ignoring the entry-point cache %s: %r", path, exc)
        return None
    return None if found is None else _trust.prove(found, [entry for entry, _ in key["path"]])


def _distrust(path: str, exc: _trust.UntrustedCache) -> None:
    message = (
        f"kwplug: the entry-point cache is not used: {exc}. The installed plugins were read "
        "from their metadata instead"
        + (" and the cache rebuilt" if exc.remove else "; set KWPLUG_CACHE_DIR to a private folder")
    )
    warnings.warn(PluginCacheWarning(message, path=path, reason=str(exc)), stacklevel=2)
    logger.debug(message)


def _entry_point(item: dict[str, Any]) -> CachedEntryPoint:
    dist = item["dist"]
    problem = dist["api_problem"]
    if not all(isinstance(v, str) for v in (item["name"], item["value"], dist["name"])):
        raise TypeError(f"malformed cache entry {item!r}")
    if not isinstance(dist["version"], str) or not isinstance(problem, (str, type(None))):
        raise TypeError(f"malformed cache entry {item!r}")
    if not isinstance(dist["builtin"], bool):  # a cache without the verdict is a miss
        raise TypeError(f"malformed cache entry {item!r}")
    if not isinstance(dist["path"], str):
        raise TypeError(f"malformed cache entry {item!r}")
    return CachedEntryPoint(
        item["name"],
        item["value"],
        CachedDistribution(dist["name"], dist["version"], problem, dist["builtin"], dist["path"]),
    )


def write(
    key: dict[str, Any], entry_points: Sequence[CachedEntryPoint], folders: Iterable[str]
) -> bool:
    """Store ``entry_points`` for ``key``, watching the metadata ``folders`` they came from.

    Nothing is written (``False``) when the cache is disabled, a folder cannot be watched, a
    watched time is racily recent, or the folder is not writable; errors are logged at
    ``DEBUG`` only.
    """
    if not enabled():
        return False
    watched = _watched(folders)
    if watched is None:
        return False
    racy = time.time_ns() - int(RACY_SECONDS * 1e9)
    times = [m[0] for _, m in key["path"] if m] + [m[0] for _, m in watched if m]
    if any(m >= racy for m in times):
        return False
    entry = {
        "key": key,
        "watched": watched,
        "entry_points": [attrs.asdict(ep) for ep in entry_points],
    }
    path = cache_file()
    try:
        folder = _trust.open_folder(os.path.dirname(path), create=True)
        if folder is None:  # removed between makedirs and open
            return False
        try:
            old = _old_entries(folder, path, key)
            # mkstemp creates the file with mode 0600 in the checked folder
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".entry-points-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump({"format": FORMAT, "entries": [entry, *old][:MAX_KEYS]}, handle)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        finally:
            os.close(folder)
    except (OSError, _trust.UntrustedCache) as exc:  # an untrusted folder was reported on read
        logger.debug("kwplug: cannot write the entry-point cache %s: %r", path, exc)
        return False
    return True


def _old_entries(folder: int, path: str, key: dict[str, Any]) -> list[Any]:
    # The other keys' entries of a file that passes the file checks (they are proven when
    # read); an untrusted, absent or corrupt file: start afresh.
    try:
        text = _trust.read_file(folder, os.path.basename(path), path)
        data = json.loads(text or "{}")
        return [e for e in data["entries"] if isinstance(e, dict) and e.get("key") != key]
    except Exception:
        return []
