"""Documentation gates: every public name has a docstring; every hook spec has a docs section
and a test_hook_<name> test."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import kwplug
import kwplug.plugins
from kwplug.hookspecs import HOOKS, HandlerSpec

ROOT = Path(__file__).parents[2]
SPECS = sorted(HOOKS)  # every spec, as declared with kwplug.hookspecs.spec


def public_modules() -> list[str]:
    names = ["kwplug"]
    for package in (kwplug, kwplug.plugins):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not info.name.rsplit(".", 1)[-1].startswith("_"):
                names.append(info.name)
    return names


def test_every_public_name_has_a_docstring() -> None:
    missing = []
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            missing.append(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    func = member.fget if isinstance(member, property) else member
                    func = getattr(func, "__func__", func)
                    if inspect.isfunction(func) and not (func.__doc__ or "").strip():
                        missing.append(f"{module_name}.{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"


def test_every_hook_spec_has_a_docs_section_and_a_test() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for spec in SPECS:
        assert re.search(rf"^### `{spec}`", architecture, re.M), f"no docs section for {spec}"
        assert f"def test_hook_{spec}(" in tests, f"no test_hook_{spec}"
        doc = getattr(HandlerSpec, spec).__doc__
        assert "Called by" in doc and "firstresult" in doc, spec
