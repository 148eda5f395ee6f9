"""The entry-point cache proves itself, or is not used: its folder, its file, each entry.

A cached entry point is imported, and a cached "built-in" verdict would let it past
``KWPLUG_DISABLE_PLUGIN_AUTOLOAD`` and ``KWPLUG_PLUGINS``; so whoever can write the cache can
run code in every later process. Three checks stand between the file and an import:

- **the folder** (``KWPLUG_CACHE_DIR``, ``$XDG_CACHE_HOME/kwplug``, ``~/.cache/kwplug``) is a
  directory owned by the effective user and not writable by its group or others (``fstat`` of
  the opened folder: a shared, world-writable or pre-created team folder is refused);
- **the file** is opened relative to that folder without following a symbolic link
  (``O_NOFOLLOW``), and ``fstat`` says it is a regular file, owned by the effective user, not
  writable by its group or others, and no larger than :data:`MAX_BYTES`;
- **each entry** is checked against the distribution metadata it claims to come from: the
  metadata folder is a ``*.dist-info``/``*.egg-info`` directly inside a ``sys.path`` entry, its
  ``entry_points.txt`` (parsed by ``importlib_metadata``) declares exactly the cached names and
  values, its name and version are the cached ones, and the built-in verdict is derived again
  from its installed files (:func:`kwplug._plugins._own.is_own_distribution`), never read from
  the cache.

A failed check raises :class:`UntrustedCache`; :mod:`kwplug._plugins._cache` then warns once
(:class:`~kwplug.errors.PluginCacheWarning`) and discovery scans the installed distributions.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from kwplug._plugins._own import is_own_distribution
from kwplug._plugins._records import GROUP


class _CachedDistribution(Protocol):
    """What :func:`prove` reads of a cached distribution (``_cache.CachedDistribution``)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def builtin(self) -> bool: ...

    @property
    def path(self) -> str | None: ...


class _CachedEntryPoint(Protocol):
    """What :func:`prove` reads of a cached entry point (``_cache.CachedEntryPoint``; the
    cache calls this module, so this module does not import it)."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> str: ...

    @property
    def dist(self) -> _CachedDistribution: ...


_EP = TypeVar("_EP", bound=_CachedEntryPoint)

#: A larger cache file is refused unread (the real one holds a few kilobytes per key).
MAX_BYTES = 4 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted as the file must not block open()
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_META_SUFFIXES = (".dist-info", ".egg-info")


class UntrustedCache(Exception):
    """The cache folder, file or an entry failed a check; the message says which and why.

    Attributes:
        remove: the file itself is at fault (not its folder), so it may be deleted and rebuilt.
    """

    def __init__(self, message: str, *, remove: bool = True) -> None:
        super().__init__(message)
        self.remove = remove


def supported() -> bool:
    """Whether this platform can run the ownership and no-follow checks (POSIX); elsewhere the
    cache is not used at all."""
    return hasattr(os, "geteuid") and bool(_NOFOLLOW)


def _check_owner_and_mode(what: str, path: str, st: os.stat_result, *, remove: bool) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UntrustedCache(
            f"{what} {path} is owned by uid {st.st_uid}, not by the current user (uid {uid})",
            remove=remove,
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCache(
            f"{what} {path} is writable by its group or by others "
            f"(mode {stat.filemode(st.st_mode)}); use chmod go-w, or a private folder",
            remove=remove,
        )


def open_folder(folder: str, *, create: bool) -> int | None:
    """A descriptor of the cache ``folder`` once it passed the folder check, or ``None`` when
    it does not exist (and ``create`` is false). The caller closes it.

    Raises:
        UntrustedCache: the folder is not a directory, not the user's, or writable by others.
        OSError: it cannot be created or opened.
    """
    if create:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        fd = os.open(folder, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise UntrustedCache(
            f"the cache folder {folder} is not a directory", remove=False
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedCache(f"the cache folder {folder} is not a directory", remove=False)
        _check_owner_and_mode("the cache folder", folder, st, remove=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(folder_fd: int, name: str, path: str) -> str | None:
    """The text of file ``name`` in the checked folder ``folder_fd`` (``path`` for messages),
    or ``None`` when it does not exist.

    Raises:
        UntrustedCache: it is a symbolic link, not a regular file, not the user's, writable by
            others, or too large.
        OSError: it cannot be read.
    """
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK, dir_fd=folder_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise UntrustedCache(f"the cache file {path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedCache(f"the cache file {path} is not a regular file")
        _check_owner_and_mode("the cache file", path, st, remove=True)
        if st.st_size > MAX_BYTES:
            raise UntrustedCache(
                f"the cache file {path} has {st.st_size} bytes (at most {MAX_BYTES})"
            )
        return handle.read(MAX_BYTES + 1).decode("utf-8")


def remove_file(folder_fd: int, name: str) -> None:
    """Delete ``name`` from the checked folder (best effort: a rebuild replaces it anyway)."""
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=folder_fd)


def _on_path(folder: str, path_entries: Iterable[str]) -> bool:
    parent = os.path.normpath(os.path.abspath(os.path.dirname(folder) or os.curdir))
    return any(
        parent == os.path.normpath(os.path.abspath(entry or os.curdir)) for entry in path_entries
    )


def distribution_at(
    folder: str | None, group: str, path_entries: Iterable[str]
) -> tuple[str, str, bool, frozenset[tuple[str, str]]]:
    """What the metadata ``folder`` really declares: ``(name, version, built-in, {(entry-point
    name, value)})`` of ``group``, read with ``importlib_metadata``.

    Raises:
        UntrustedCache: ``folder`` is not a metadata folder directly inside one of
            ``path_entries`` (``sys.path``), or its metadata cannot be read.
    """
    if (
        not isinstance(folder, str)
        or not folder.endswith(_META_SUFFIXES)
        or not _on_path(folder, path_entries)
        or not os.path.isdir(folder)
    ):
        raise UntrustedCache(f"a cached entry names {folder!r}, not a metadata folder on sys.path")
    import pathlib

    import importlib_metadata  # the same parser a scan uses

    dist: Any = importlib_metadata.PathDistribution(pathlib.Path(folder))
    try:
        name, version = dist.name, dist.version
        declared = frozenset(
            (str(ep.name), str(ep.value)) for ep in dist.entry_points.select(group=group)
        )
        builtin = is_own_distribution(dist)
    except Exception as exc:  # unreadable or malformed metadata: the entry is not proven
        raise UntrustedCache(f"cannot read the metadata in {folder}: {exc!r}") from None
    if not isinstance(name, str) or not isinstance(version, str):
        raise UntrustedCache(f"the metadata in {folder} has no name or version")
    return name, version, builtin, declared


def prove(entry_points: tuple[_EP, ...], path_entries: Sequence[str]) -> tuple[_EP, ...]:
    """``entry_points`` (cached), once each is proven against the metadata folder it names:
    the names, values, distribution name and version are what that folder declares, and the
    built-in verdict is what its files say (:func:`distribution_at`).

    Raises:
        UntrustedCache: on the first difference.
    """
    by_folder: dict[str | None, list[_EP]] = {}
    for ep in entry_points:
        by_folder.setdefault(ep.dist.path, []).append(ep)
    for folder, eps in by_folder.items():
        name, version, builtin, declared = distribution_at(folder, GROUP, path_entries)
        claimed = frozenset((ep.name, ep.value) for ep in eps)
        if claimed != declared:
            extra = sorted(f"{n} = {v}" for n, v in claimed - declared)
            missing = sorted(f"{n} = {v}" for n, v in declared - claimed)
            raise UntrustedCache(
                f"the cache lists entry points {extra} that the entry_points.txt of {folder} "
                "does not declare"
                if extra
                else f"the cache misses entry points {missing} of {folder}"
            )
        for ep in eps:
            if (ep.dist.name, ep.dist.version) != (name, version):
                raise UntrustedCache(
                    f"the cache names distribution {ep.dist.name} {ep.dist.version} for "
                    f"{folder}, which holds {name} {version}"
                )
            if ep.dist.builtin != builtin:
                raise UntrustedCache(
                    f"the cache marks entry point {ep.name!r} of {folder} as "
                    f"{'built-in' if ep.dist.builtin else 'third-party'}, but it is "
                    f"{'kwplug' if builtin else 'not kwplug'}'s own distribution"
                )
    return entry_points
