"""The plugin API range: the kwplug versions a plugin's distribution requires.

A plugin declares the kwplug API range it supports the standard way, as a dependency in its
``pyproject.toml`` (``dependencies = ["kwplug>=0.1,<0.2"]``, stored as ``Requires-Dist`` in
its metadata). pip enforces it at install time, but an environment can still end up outside it
(``pip install --no-deps``, a later ``pip install -U kwplug``, a ``--target`` folder on
``PYTHONPATH``). kwplug reads the requirement before importing the plugin; a plugin whose range
excludes the running kwplug is listed as ``incompatible`` and never imported, so it cannot be
half-loaded. Requirements are parsed with ``packaging`` (PEP 508 / PEP 440).
"""

from __future__ import annotations

import functools
from typing import Any

import importlib_metadata


@functools.cache
def kwplug_version() -> str:
    """The installed kwplug version (from its metadata)."""
    return importlib_metadata.version("kwplug")


def api_problem(distribution: Any) -> str | None:
    """Why ``distribution`` cannot run with this kwplug, or ``None`` when it can.

    Args:
        distribution: an ``importlib_metadata`` distribution (``EntryPoint.dist``), or ``None``.

    Only unconditional requirements on ``kwplug`` count (a requirement behind an extra, or a
    marker false on this interpreter, does not); an unparsable requirement is ignored, as
    pip would have refused to install it.
    """
    if distribution is None:
        return None
    # Imported here: only third-party plugins are checked, and packaging costs ~8 ms to import.
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    version = kwplug_version()
    for line in getattr(distribution, "requires", None) or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != "kwplug":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            return f"requires {requirement}, but kwplug {version} is installed"
    return None
