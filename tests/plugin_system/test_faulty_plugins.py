"""A matrix of faulty third-party plugins, each pip-installed for real: each is reported by
name, distribution and version with its cause, and the rest keep working."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from plugin_site import pip_install, run_json

HEADER = "import attrs, torch, kwplug\n"
FAULTY = {
    # entry point: (module source, entry-point attribute)
    "badsig": (
        HEADER
        + textwrap.dedent("""
        @attrs.define
        class BadSig(kwplug.KwargsHandler):
            @kwplug.hookimpl
            def autocast(self, device_type, no_such_argument):
                return None
        """),
        ":BadSig",
    ),
    "raiser": (
        HEADER
        + textwrap.dedent("""
        @attrs.define
        class Raiser(kwplug.KwargsHandler):
            @kwplug.hookimpl
            def make_scaler(self, mixed_precision):
                if mixed_precision == "fp16":
                    raise RuntimeError("scaler exploded")
        """),
        ":Raiser",
    ),
    "wrongtype": (
        HEADER
        + textwrap.dedent("""
        @attrs.define
        class WrongType(kwplug.KwargsHandler):
            @kwplug.hookimpl
            def wrap_model(self, model):
                return "a string, not a module"
        """),
        ":WrongType",
    ),
    "duphook": (
        HEADER
        + textwrap.dedent("""
        @kwplug.hookimpl
        def comm_hooks():
            return {"bf16": kwplug.CommHook("bf16", lambda state, bucket: None)}
        """),
        "",
    ),
    "slow": (
        HEADER
        + "import time\ntime.sleep(1.5)\n"
        + textwrap.dedent("""
        @attrs.define
        class Slow(kwplug.KwargsHandler):
            pass
        """),
        ":Slow",
    ),
    "nothandler": (HEADER + "class NotAHandler:\n    pass\n", ":NotAHandler"),
}

PYPROJECT = """
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"
[project]
name = "kwplug-{ep}"
version = "0.0.{n}"
[project.entry-points."kwplug.handlers"]
{ep} = "kwplug_{ep}{attr}"
[tool.setuptools]
py-modules = ["kwplug_{ep}"]
"""

PROBE = textwrap.dedent("""
    import json, sys, warnings
    import torch, kwplug
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = kwplug.discover()
    out["status"] = {r.name: r.status for r in records}
    out["errors"] = {r.name: r.error for r in records if r.error}
    out["warnings"] = [str(w.message) for w in caught]
    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    attempt("bf16", lambda: kwplug.Accelerator(mixed_precision="bf16", cpu=True))
    attempt("fp16", lambda: kwplug.Accelerator(mixed_precision="fp16", cpu=True))
    attempt("prepare", lambda: kwplug.Accelerator(cpu=True).prepare(torch.nn.Linear(2, 2)))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faulty")
    sources = []
    for n, (ep, (source, attr)) in enumerate(FAULTY.items()):
        src = root / ep
        src.mkdir()
        (src / "pyproject.toml").write_text(PYPROJECT.format(ep=ep, n=n, attr=attr))
        (src / f"kwplug_{ep}.py").write_text(source)
        sources.append(str(src))
    pip_install([Path(x) for x in sources], root / "site")
    return root / "site"


def probe(site: Path, allow: str) -> dict:
    return run_json(PROBE, site, KWPLUG_PLUGINS=allow)  # type: ignore[no-any-return]


def test_load_time_failures_are_skipped_and_reported(site: Path) -> None:
    result = probe(site, "badsig,slow,nothandler")
    assert result["status"]["badsig"] == "failed"
    assert "PluginValidationError" in result["errors"]["badsig"]
    assert "no_such_argument" in result["errors"]["badsig"]
    assert result["status"]["nothandler"] == "failed"
    assert "not a kwplug.KwargsHandler subclass" in result["errors"]["nothandler"]
    assert result["status"]["slow"] == "loaded"
    warnings = "\n".join(result["warnings"])
    assert "'badsig' (kwplug-badsig 0.0.0) failed to load" in warnings
    assert "'nothandler' (kwplug-nothandler 0.0.5) failed to load" in warnings
    assert "'slow' (kwplug-slow 0.0.4) took" in warnings and "s to import" in warnings
    # The rest keep working: built-ins answer, training set-up succeeds.
    assert result["bf16"] == result["fp16"] == result["prepare"] == "ok"


def test_hook_that_raises_names_the_plugin(site: Path) -> None:
    result = probe(site, "raiser")
    assert result["bf16"] == "ok"  # declines quietly outside fp16
    assert result["fp16"].startswith(
        "PluginHookError: hook 'make_scaler' of default plugin "
        "'raiser' (kwplug-raiser 0.0.1) raised RuntimeError: "
        "scaler exploded"
    )


def test_wrong_return_type_names_the_plugin(site: Path) -> None:
    result = probe(site, "wrongtype")
    assert result["prepare"] == (
        "TypeError: hook 'wrap_model' of default plugin 'wrongtype' (kwplug-wrongtype 0.0.2) "
        "returned str, not a torch.nn.Module"
    )


def test_duplicate_comm_hook_name_names_both_sources(site: Path) -> None:
    result = probe(site, "duphook")
    assert result["bf16"].startswith("ValueError: communication hook 'bf16' is provided twice")
    assert "'duphook' (kwplug-duphook 0.0.3)" in result["bf16"]
    assert "kwplug" in result["bf16"]
