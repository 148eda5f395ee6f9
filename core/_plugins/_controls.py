"""Loading controls: which discovered plugins are loaded, read from environment variables.

One grammar for every variable: a comma-separated list of names, each an entry-point name
(``ddp``), a distribution name (``kwplug-fsdp``) or ``distribution:entry-point``. These are the
names ``kwplug plugins`` shows.

- ``KWPLUG_DISABLE_PLUGIN_AUTOLOAD=1``: load only kwplug's own built-ins. Any non-empty value
  disables -- whitespace too -- except ``0``/``false`` (any case, surrounding spaces ignored);
  unset or empty does not (fail closed, as pytest's ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does).
- ``KWPLUG_PLUGINS=a,b``: allow-list of third-party plugins (set but empty: none).
- ``KWPLUG_BLOCK_PLUGINS=c``: deny-list (built-ins can be blocked too).
- ``KWPLUG_STRICT_PLUGINS=1``: a plugin that fails to load raises :class:`PluginLoadError`
  instead of being skipped with a warning (for plugin authors' CI). A value that is neither
  true nor false is itself a :class:`PluginLoadError`.

``distribution:entry-point`` names exactly one entry point; a bare name may match several.

An unknown name is a :class:`~kwplug.errors.PluginLoadWarning` listing the known names.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping

import attrs

from kwplug._contracts.environ import get as read_environ
from kwplug.errors import PluginLoadError, PluginLoadWarning, user_stacklevel

DISABLE_AUTOLOAD_ENV = "KWPLUG_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "KWPLUG_PLUGINS"
BLOCK_ENV = "KWPLUG_BLOCK_PLUGINS"
STRICT_ENV = "KWPLUG_STRICT_PLUGINS"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _disabled(environ: Mapping[str, str]) -> bool:
    # Fail closed, as pytest reads PYTEST_DISABLE_PLUGIN_AUTOLOAD (``bool(os.environ.get(...))``:
    # any non-empty value disables). Any non-empty value disables here too -- whitespace
    # included ("TRUE ", "y", " ") -- except an explicit 0/false (kwplug's documented
    # opt-out, which pytest does not have). Unset or empty: plugins load.
    value = environ.get(DISABLE_AUTOLOAD_ENV, "")
    return value != "" and value.strip().lower() not in ("0", "false")


def _strict(environ: Mapping[str, str]) -> bool:
    value = environ.get(STRICT_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    # A typo must not silently turn strict loading off.
    raise PluginLoadError(
        f"{STRICT_ENV}={environ[STRICT_ENV]!r} is not understood; set it to one of "
        f"{', '.join(sorted(_TRUE))} (strict) or {', '.join(sorted(_FALSE - {''}))} "
        "(warn and skip), or unset it"
    )


_CONTROL_ENVS = (DISABLE_AUTOLOAD_ENV, ALLOW_ENV, BLOCK_ENV, STRICT_ENV)


@functools.lru_cache(maxsize=32)
def _parse_controls(raw: tuple[str | None, ...]) -> LoadControls:
    # Only successful parses are cached: lru_cache does not store a call that raised.
    env = {name: value for name, value in zip(_CONTROL_ENVS, raw, strict=True) if value is not None}
    return LoadControls(
        builtins_only=_disabled(env),
        allow=_names(env.get(ALLOW_ENV)),
        block=_names(env.get(BLOCK_ENV)) or frozenset(),
        strict=_strict(env),
    )


def control_name(name: str) -> str:
    """A name as the controls compare it: the distribution part normalised the way pip does
    (PEP 503, ``packaging.utils.canonicalize_name``); an entry-point name after ``:`` is kept.
    """
    # Imported here: packaging costs milliseconds at start-up, and only set controls need it.
    from packaging.utils import canonicalize_name

    dist, sep, entry_point = name.partition(":")
    return f"{canonicalize_name(dist)}{sep}{entry_point}" if sep else canonicalize_name(dist)


def _names(raw: str | None) -> frozenset[str] | None:
    if raw is None:
        return None
    return frozenset(control_name(part.strip()) for part in raw.split(",") if part.strip())


def plugin_names(name: str, distribution: str) -> frozenset[str]:
    """Every name a control may use for a plugin (normalised with :func:`control_name`).

    An entry-point name that contains ``:`` is reachable only as ``distribution:name``: alone
    it would read as another distribution's ``distribution:entry-point`` name.
    """
    bare = () if ":" in name else (name,)
    return frozenset(control_name(n) for n in (*bare, distribution, f"{distribution}:{name}"))


# cache_hash: every Accelerator looks its controls up in discovery's cache (the same parsed
# object each time), and attrs' generated __hash__ hashed the four fields again per call.
@attrs.frozen(cache_hash=True)
class LoadControls:
    """The loading controls in force (see the module docstring).

    Attributes:
        builtins_only: ``KWPLUG_DISABLE_PLUGIN_AUTOLOAD`` is true.
        allow: ``KWPLUG_PLUGINS`` names, or ``None`` when unset (all third-party plugins).
        block: ``KWPLUG_BLOCK_PLUGINS`` names.
        strict: ``KWPLUG_STRICT_PLUGINS`` is true.
    """

    builtins_only: bool = False
    allow: frozenset[str] | None = None
    block: frozenset[str] = frozenset()
    strict: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LoadControls:
        """Read the controls from ``environ`` (default ``os.environ``).

        Raises:
            PluginLoadError: ``KWPLUG_STRICT_PLUGINS`` has a value that is neither true
                (``1``, ``true``, ``yes``, ``on``) nor false (``0``, ``false``, ``no``,
                ``off``, empty).
        """
        # Read the four raw values every time (a script or test may change them between
        # Accelerators); parsing them is memoised on those exact strings, so the answer is
        # the same as parsing afresh, and an invalid value raises on every call.
        get = read_environ if environ is None else environ.get  # (unset names, cheaply)
        raw = tuple(map(get, _CONTROL_ENVS))
        controls = _parse_controls(raw)
        return controls if cls is LoadControls else cls(**attrs.asdict(controls, recurse=False))

    def status(self, name: str, distribution: str, builtin: bool) -> str | None:
        """``"blocked"``, ``"disabled"``, or ``None`` when the plugin is to be loaded."""
        if not self.block:  # decided without normalising names (packaging is not imported)
            if builtin:
                return None
            if self.builtins_only:
                return "disabled"
            if self.allow is None:
                return None
        names = plugin_names(name, distribution)
        if names & self.block:
            return "blocked"
        if builtin:
            return None
        if self.builtins_only or (self.allow is not None and not names & self.allow):
            return "disabled"
        return None

    def warn_unknown(self, known: Iterable[tuple[str, str]]) -> None:
        """Warn about control names that match no discovered plugin, listing the known ones."""
        pairs = list(known)
        valid = frozenset().union(*(plugin_names(n, d) for n, d in pairs)) if pairs else set()
        for env_name, names in ((ALLOW_ENV, self.allow), (BLOCK_ENV, self.block)):
            unknown = sorted((names or frozenset()) - valid)
            if unknown:
                listing = ", ".join(sorted(f"{n} ({d})" for n, d in pairs)) or "none"
                warnings.warn(
                    f"{env_name} names unknown plugin(s) {', '.join(unknown)}; known plugins "
                    f"(entry point (distribution)): {listing}",
                    PluginLoadWarning,
                    stacklevel=user_stacklevel(),  # the user's line, at any depth
                )
