"""Discovery's on-disk entry-point cache: used when nothing changed, never trusted blindly."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from python import python

from kwplug._plugins import _cache
from kwplug._plugins import _discovery as discovery
from kwplug.testing import PluginSandbox

PAST = time.time() - 3600  # an hour ago: outside the "racily recent" window


def age(*roots: Path) -> None:
    """Set every file and folder under ``roots`` to an old modification time."""
    for root in roots:
        for path in [root, *root.rglob("*")]:
            os.utime(path, (PAST, PAST))


def install(site: Path, dist: str, module: str, *, requires: str = "", value: str = "") -> Path:
    """A pip-like install of a module plugin into ``site``: the module and its dist-info."""
    (site / f"{module}.py").write_text(
        "import kwplug\n\n@kwplug.hookimpl\ndef handler_state():\n    return None\n"
    )
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n"
    (info / "METADATA").write_text(meta + (f"Requires-Dist: {requires}\n" if requires else ""))
    (info / "entry_points.txt").write_text(f"[kwplug.handlers]\n{module} = {value or module}\n")
    return info


def _touched_since(path: str, since: float) -> bool:
    try:
        return os.stat(path or ".").st_mtime > since
    except OSError:
        return False


def names() -> set[str]:
    return {r.name for r in discovery.discover(refresh=True)}


@pytest.fixture
def site(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Path]:
    """A private cache folder and an old, empty site folder first on ``sys.path``."""
    monkeypatch.setenv("KWPLUG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KWPLUG_NO_CACHE", raising=False)
    folder = tmp_path / "site"
    folder.mkdir()
    age(folder)
    # The working directory is on sys.path ('' under `python -m pytest`) and is part of the
    # cache key; the repository's changes all the time during a run (coverage data files), and
    # a key younger than 2 s is never cached: work from an old, quiet folder instead.
    quiet = tmp_path / "cwd"
    quiet.mkdir()
    age(quiet)
    monkeypatch.chdir(quiet)
    # Likewise any sys.path folder another test touched in the last seconds (a key younger
    # than the racy window is never written), and the repository's root and test folders:
    # another xdist worker writes there at any moment (coverage data, scratch files), which
    # would change the key between a test's write and its read. These tests import nothing new
    # from them. (A virtual environment inside the checkout, as CI's, stays: it holds kwplug's
    # own entry points.)
    recent = time.time() - 10
    root = request.config.rootpath
    busy = {str(root), *(str(p) for p in root.glob("tests/**") if p.is_dir())}
    saved = list(sys.path)
    kept = [
        p
        for p in sys.path
        if p and not _touched_since(p, recent) and os.path.abspath(p) not in busy
    ]
    monkeypatch.setattr(sys, "path", kept)
    sys.path.insert(0, str(folder))
    modules = set(sys.modules)
    yield folder
    sys.path[:] = saved  # before the refresh below: discovery must see every folder again
    for name in set(sys.modules) - modules:
        if name.startswith("cacheplug"):
            del sys.modules[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        discovery.discover(refresh=True)  # forget this test's plugins


def no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a live scan of the installed distributions fail: only the cache can answer."""

    def fail() -> Any:
        raise AssertionError("entry points scanned although the cache was valid")

    monkeypatch.setattr(discovery, "_scan", fail)


def test_cache_is_written_then_used_and_sees_install_and_removal(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = install(site, "cacheplug-one", "cacheplug_one")
    age(site)
    assert "cacheplug_one" in names()
    stored = json.loads(Path(_cache.cache_file()).read_text())
    assert any(ep["name"] == "cacheplug_one" for e in stored["entries"] for ep in e["entry_points"])

    with monkeypatch.context() as patch:
        no_scan(patch)
        assert "cacheplug_one" in names()  # a fresh read, answered by the cache

    install(site, "cacheplug-two", "cacheplug_two")  # the site folder's time changes
    assert {"cacheplug_one", "cacheplug_two"} <= names()
    shutil.rmtree(info)  # pip uninstall
    assert "cacheplug_one" not in names() and "cacheplug_two" in names()


def test_in_place_metadata_edit_is_seen(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = install(site, "cacheplug-edit", "cacheplug_edit")
    age(site)
    names()  # writes the cache
    entry_points = info / "entry_points.txt"
    entry_points.write_text("[kwplug.handlers]\nrenamed = cacheplug_edit\n")
    os.utime(site, (PAST, PAST))  # the site folder itself looks unchanged
    found = names()
    assert "renamed" in found and "cacheplug_edit" not in found


def test_install_is_seen_where_modification_times_are_normalised(site: Path) -> None:
    # Reproducible image builds, rsync -a, some container layers: every time is the same.
    install(site, "cacheplug-first", "cacheplug_first")
    age(site)
    assert "cacheplug_first" in names()  # writes the cache
    install(site, "cacheplug-late", "cacheplug_late")
    age(site)  # the site folder and the new dist-info look as old as before
    assert {"cacheplug_first", "cacheplug_late"} <= names()


def test_metadata_edit_is_seen_where_modification_times_are_normalised(site: Path) -> None:
    info = install(site, "cacheplug-same", "cacheplug_same")
    age(site)
    names()  # writes the cache
    (info / "entry_points.txt").write_text("[kwplug.handlers]\nsametime = cacheplug_same\n")
    age(site)  # the edited file keeps its old time
    found = names()
    assert "sametime" in found and "cacheplug_same" not in found


def test_corrupt_or_foreign_cache_is_ignored_and_replaced(site: Path) -> None:
    install(site, "cacheplug-c", "cacheplug_c")
    age(site)
    path = Path(_cache.cache_file())
    path.parent.mkdir(parents=True)
    for junk in ("{not json", json.dumps({"entries": [{"key": _cache.environment_key()}]})):
        path.write_text(junk)
        assert "cacheplug_c" in names()
        assert json.loads(path.read_text())["format"] == _cache.FORMAT
    entry = json.loads(path.read_text())["entries"][0]
    entry["entry_points"][0]["dist"]["version"] = 3  # right key, wrong shape
    path.write_text(json.dumps({"format": _cache.FORMAT, "entries": [entry]}))
    assert _cache.read(_cache.environment_key()) is None


def test_recent_changes_are_not_cached(site: Path) -> None:
    install(site, "cacheplug-racy", "cacheplug_racy")  # modified just now
    assert "cacheplug_racy" in names()
    assert not os.path.exists(_cache.cache_file())


def test_no_cache_variable_disables_read_and_write(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(site, "cacheplug-off", "cacheplug_off")
    age(site)
    names()  # a valid cache exists now
    monkeypatch.setenv("KWPLUG_NO_CACHE", "1")
    with monkeypatch.context() as patch, pytest.raises(AssertionError, match="scanned"):
        no_scan(patch)
        names()  # not read
    os.remove(_cache.cache_file())
    assert "cacheplug_off" in names()
    assert not os.path.exists(_cache.cache_file())  # not written


def test_controls_and_api_range_apply_to_cached_entry_points(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(site, "cacheplug-old", "cacheplug_old", requires="kwplug<0.0.1")
    install(site, "cacheplug-ok", "cacheplug_ok", requires="kwplug>=0.0.1")
    age(site)
    with pytest.warns(Warning, match="cacheplug-old"):
        discovery.discover(refresh=True)
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "cacheplug-ok")
    with monkeypatch.context() as patch, pytest.warns(Warning, match="cacheplug-old"):
        no_scan(patch)
        records = {r.name: r for r in discovery.discover(refresh=True)}
    assert records["cacheplug_ok"].status == "blocked"
    assert records["cacheplug_old"].status == "incompatible"
    assert "kwplug<0.0.1" in (records["cacheplug_old"].error or "")


def test_a_cache_hit_scans_no_distribution_and_imports_no_packaging(
    site: Path, tmp_path: Path
) -> None:
    # A hit reads only the plugins' own metadata (to prove each entry, with importlib_metadata)
    # instead of every installed distribution's, and never imports packaging.
    install(site, "cacheplug-sub", "cacheplug_sub", requires="kwplug>=0.0.1")
    age(site)
    program = (
        "import sys, importlib_metadata, kwplug\n"
        "if sys.argv[1] == 'hit':\n"
        "    def boom(**kw): raise AssertionError('scanned')\n"
        "    importlib_metadata.distributions = boom\n"
        "records = {r.name: r.status for r in kwplug.discover()}\n"
        "print(records['cacheplug_sub'], 'packaging.requirements' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    runs = [
        python("-c", program, mode, cwd=site, env=env, timeout=300, check=True).stdout.split()
        for mode in ("miss", "hit")
    ]
    assert runs[0] == ["loaded", "True"]  # the miss scans and range-checks
    assert runs[1] == ["loaded", "False"]


def test_sandbox_plugins_are_seen_through_the_cache(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (site / "cacheplug_sandboxed.py").write_text("x = 1\n")
    age(site)
    with PluginSandbox() as sandbox:
        sandbox.add("cacheplug_sandboxed", distribution="cacheplug-sandboxed")
        roots = [Path(p) for p in sys.path if "kwplug-sandbox-" in p]
        age(*roots)
        assert "cacheplug_sandboxed" in {r.name for r in sandbox.records(refresh=True)}
        assert os.path.exists(_cache.cache_file())  # written, with the sandbox's root
        shutil.rmtree(next(roots[0].glob("*.dist-info")))  # uninstalled
        assert "cacheplug_sandboxed" not in {r.name for r in sandbox.records(refresh=True)}
    assert "cacheplug_sandboxed" not in names()
