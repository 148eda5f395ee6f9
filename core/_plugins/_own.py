"""Which distribution is kwplug's own: the one test that decides whether a plugin is built-in.

Built-ins skip the loading controls (``KWPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``KWPLUG_PLUGINS``) and
the API range, so the verdict is always derived from a distribution's installed files, never
from its name alone nor from anything stored (the entry-point cache re-derives it too).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from kwplug._plugins._records import OWN_DISTRIBUTION

# kwplug's own folder (this module's parent package's parent), and its ``__init__.py``.
CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_INIT = os.path.join(CORE, "__init__.py")


def normalise(name: str | None) -> str:
    """A distribution name normalised as PEP 503 says (by hand: ``packaging`` costs
    milliseconds at every start-up)."""
    return re.sub(r"[-_.]+", "-", name or "").lower()


def is_own_distribution(dist: Any) -> bool:
    """Whether ``dist`` (an ``importlib_metadata.Distribution``) is the distribution this very
    kwplug was installed from.

    The name alone proves nothing: any folder on ``sys.path`` may hold a ``kwplug-*.dist-info``
    (a stale copy, a malicious one), and built-ins skip the loading controls and the API range.
    ``dist`` is kwplug's own when it is named ``kwplug`` and either lists kwplug's imported
    ``__init__.py`` among its installed files, or is an editable install (``direct_url.json``)
    of the source folder kwplug was imported from.
    """
    if normalise(dist.name) != OWN_DISTRIBUTION:
        return False
    own = os.path.realpath(_OWN_INIT)
    for path in dist.files or ():
        if path.name == "__init__.py" and os.path.realpath(str(dist.locate_file(path))) == own:
            return True
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    url = direct.get("url", "") if isinstance(direct, dict) else ""
    if not (url.startswith("file://") and direct.get("dir_info", {}).get("editable")):
        return False
    source = os.path.realpath(url2pathname(urlparse(url).path))
    return own.startswith(source + os.sep)
