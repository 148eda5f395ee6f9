"""Issue 18 item 1: the entry-point cache proves itself or is ignored.

An attacker who can write the cache (a shared ``KWPLUG_CACHE_DIR``, a file left by another
user) appends one entry pointing at a module of their choosing, marked built-in so that it
passes every loading control. Each case runs real processes: one fills the cache, the attacker
edits it, the next builds an ``Accelerator()``; the attacker's module writes a marker file when
imported, and the marker must be absent.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from python import python

PAST = time.time() - 3600
NOBODY = 65534

PLUGIN = textwrap.dedent("""
    import os
    if "KWPLUG_POISON_MARKER" in os.environ:
        with open(os.environ["KWPLUG_POISON_MARKER"], "a") as marker:
            marker.write(__name__ + "\\n")
    import kwplug

    @kwplug.hookimpl
    def handler_state():
        return None
""")

PROBE = textwrap.dedent("""
    import json, os, sys, warnings
    if os.environ.get("PROBE_NO_SCAN"):
        import importlib_metadata
        def _no_scan(**kwargs):
            raise AssertionError("scanned the installed distributions")
        importlib_metadata.distributions = _no_scan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import kwplug
        kwplug.Accelerator(cpu=True)
        records = kwplug.discover()
    print(json.dumps({
        "status": {r.name: r.status for r in records},
        "builtin": {r.name: r.builtin for r in records},
        "cache_warnings": [
            str(w.message) for w in caught if type(w.message).__name__ == "PluginCacheWarning"
        ],
    }))
""")

CONTROLS = {
    "default": {},
    "autoload-disabled": {"KWPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"},
    "allow-none": {"KWPLUG_PLUGINS": ""},
    "allow-named": {"KWPLUG_PLUGINS": "poison,poisonreal"},
}
RESTRICTIVE = {k: v for k, v in CONTROLS.items() if k != "default"} | {
    "allow-other": {"KWPLUG_PLUGINS": "kwplug-fsdp"}
}


def _age(*roots: Path) -> None:
    for root in roots:
        for path in [root, *root.rglob("*")]:
            os.utime(path, (PAST, PAST))


class World:
    """A site folder (a real plugin and the attacker's module), a quiet working directory, and
    the clean cache file a first process wrote for them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / "site"
        self.cwd = root / "cwd"
        self.site.mkdir()
        self.cwd.mkdir()
        (self.site / "kwplug_poison_target.py").write_text(PLUGIN)  # no metadata: cache only
        (self.site / "kwplug_poison_real.py").write_text(PLUGIN)
        info = self.site / "kwplug_poisonreal-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kwplug-poisonreal\nVersion: 1.0\n"
        )
        (info / "entry_points.txt").write_text(
            "[kwplug.handlers]\npoisonreal = kwplug_poison_real\n"
        )
        _age(self.site, self.cwd)
        fill = root / "fill-cache"
        self.probe(fill)
        files = list(fill.glob("entry-points-*.json"))
        assert len(files) == 1, "the first process wrote no cache (a racily recent folder?)"
        self.clean = files[0]

    def probe(self, cache_dir: Path, marker: Path | None = None, **env: str) -> Any:
        full = {
            **os.environ,
            "PYTHONPATH": str(self.site),
            "PYTHONDONTWRITEBYTECODE": "1",  # a __pycache__ would change the site's mtime
            "KWPLUG_CACHE_DIR": str(cache_dir),
            "KWPLUG_POISON_MARKER": str(marker or self.root / "fill-marker"),
        }
        for name in ("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", "KWPLUG_PLUGINS", "KWPLUG_BLOCK_PLUGINS"):
            full.pop(name, None)
        full.update(env)
        out = python("-c", PROBE, cwd=self.cwd, env=full, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def cache_in(self, folder: Path, *, mode: int = 0o700) -> Path:
        """A copy of the clean cache file in ``folder`` (created with ``mode``)."""
        folder.mkdir()
        os.chmod(folder, mode)
        target = folder / self.clean.name
        shutil.copy(self.clean, target)
        os.chmod(target, 0o600)
        return target


def imported(marker: Path) -> list[str]:
    """The plugin modules imported by the probe (each writes its name to the marker)."""
    return marker.read_text().split() if marker.exists() else []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("poison"))


def append_forged_builtin(path: Path) -> None:
    """The attack: one more entry point, a copy of a built-in's with the attacker's module."""
    data = json.loads(path.read_text())
    for entry in data["entries"]:
        builtin = next(ep for ep in entry["entry_points"] if ep["dist"]["builtin"])
        forged = copy.deepcopy(builtin)
        forged["name"], forged["value"] = "poison", "kwplug_poison_target"
        entry["entry_points"].append(forged)
    path.write_text(json.dumps(data))


def mark_builtin(path: Path, name: str) -> None:
    """The attack on a real third-party plugin: its cached entry claims to be built-in."""
    data = json.loads(path.read_text())
    for entry in data["entries"]:
        for ep in entry["entry_points"]:
            if ep["name"] == name:
                ep["dist"]["builtin"] = True
    path.write_text(json.dumps(data))


def attack(world: World, tmp_path: Path, where: str) -> tuple[Path, Path]:
    """Plant a poisoned cache as ``where`` says; return the cache folder and the file."""
    if where == "private-folder":
        path = world.cache_in(tmp_path / "cache")
    elif where == "world-writable-folder":
        path = world.cache_in(tmp_path / "shared", mode=0o1777)  # a shared tmp, sticky bit
    elif where == "group-writable-folder":
        path = world.cache_in(tmp_path / "team", mode=0o770)
    elif where == "foreign-owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        path = world.cache_in(tmp_path / "cache")
    else:
        raise AssertionError(where)
    append_forged_builtin(path)
    if where == "foreign-owner":
        os.chown(path, NOBODY, NOBODY)
    return path.parent, path


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize(
    "where", ["private-folder", "world-writable-folder", "group-writable-folder", "foreign-owner"]
)
def test_poisoned_cache_imports_nothing(
    world: World, tmp_path: Path, where: str, control: str
) -> None:
    folder, path = attack(world, tmp_path, where)
    planted = path.read_bytes()
    marker = tmp_path / "marker"
    result = world.probe(folder, marker, **CONTROLS[control])
    assert "kwplug_poison_target" not in imported(marker), "the attacker's module was imported"
    assert "poison" not in result["status"]
    assert result["status"]["autocast"] == "loaded" and result["builtin"]["autocast"]
    [warning] = result["cache_warnings"]  # exactly one
    if where == "private-folder":
        assert "'poison = kwplug_poison_target'" in warning and "does not declare" in warning
    elif where == "foreign-owner":
        assert f"is owned by uid {NOBODY}, not by the current user" in warning
    else:
        assert f"the cache folder {folder} is writable by its group or by others" in warning
    if where.endswith("-folder") and where != "private-folder":
        assert path.read_bytes() == planted  # a folder others can write is never written to
    else:  # removed, and rebuilt (the user's own file, private, without the forged entry)
        # unless autoload is disabled: such a process never fills the cache (see _discovery)
        assert path.exists() == (control != "autoload-disabled")
        if path.exists():
            st = path.stat()
            assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
            assert b"kwplug_poison_target" not in path.read_bytes()


def test_rebuilt_cache_is_used_again_without_a_warning(world: World, tmp_path: Path) -> None:
    folder, _ = attack(world, tmp_path, "private-folder")
    first = world.probe(folder, tmp_path / "marker")
    assert len(first["cache_warnings"]) == 1
    again = world.probe(folder, tmp_path / "marker", PROBE_NO_SCAN="1")  # answered by the cache
    assert again["cache_warnings"] == [] and again["status"]["autocast"] == "loaded"
    assert "kwplug_poison_target" not in imported(tmp_path / "marker")


@pytest.mark.parametrize("control", RESTRICTIVE)
def test_forged_builtin_verdict_cannot_pass_the_controls(
    world: World, tmp_path: Path, control: str
) -> None:
    # poisonreal is a real installed plugin: its entry point matches its metadata, but the
    # cache says built-in. The verdict is derived from the distribution, so the controls apply.
    path = world.cache_in(tmp_path / "cache")
    mark_builtin(path, "poisonreal")
    marker = tmp_path / "marker"
    env = CONTROLS.get(control) or RESTRICTIVE[control]
    result = world.probe(path.parent, marker, **env)
    expected = "loaded" if control == "allow-named" else "disabled"
    assert result["status"]["poisonreal"] == expected and not result["builtin"]["poisonreal"]
    assert ("kwplug_poison_real" in imported(marker)) == (expected == "loaded")
    [warning] = result["cache_warnings"]
    assert "marks entry point 'poisonreal'" in warning and "not kwplug's own" in warning


def test_cache_file_that_is_a_symlink_or_writable_by_others_is_refused(
    world: World, tmp_path: Path
) -> None:
    path = world.cache_in(tmp_path / "cache")
    decoy = tmp_path / "decoy.json"
    shutil.copy(path, decoy)
    append_forged_builtin(decoy)
    path.unlink()
    path.symlink_to(decoy)
    result = world.probe(path.parent, tmp_path / "marker")
    assert "is a symbolic link" in result["cache_warnings"][0]
    assert (
        not path.is_symlink() and b"kwplug_poison_target" not in path.read_bytes()
    )  # rebuilt in its place
    append_forged_builtin(path)
    os.chmod(path, 0o666)
    result = world.probe(path.parent, tmp_path / "marker")
    assert "writable by its group or by others" in result["cache_warnings"][0]
    assert "kwplug_poison_target" not in imported(tmp_path / "marker")
