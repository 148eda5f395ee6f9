"""Every keyword Accelerate accepts is accepted: kwplug's callables have the signatures of the
installed Accelerate's, unless docs/migrating-from-accelerate.md says why not (issue 17).

For each public module a script imports from Accelerate, the gate takes the public callables
*defined* there (for ``accelerate`` and ``accelerate.utils``, which re-export, every public
name kwplug also exports) and, for each one kwplug's counterpart module has, compares
``inspect.signature``: the parameters' names, kinds, positional order and defaults. For a
class it compares the constructor and every public method and property Accelerate's own
classes define (``Accelerator``, ``AcceleratedOptimizer``, the handler dataclasses...). A
factory default (``field(default_factory=...)``) is compared by the value a default instance
holds.

A difference is allowed only when a row of the migration table names the callable in its first
cell with the status ``differs`` or ``not supported`` and names the parameter (or member) in
backticks: ``not supported`` on a bare name exempts the whole callable, otherwise (``differs``,
or a call such as ```DataLoaderConfiguration(dispatch_batches=True)```) the parameters named.
A ``not supported`` row naming something kwplug has fails (the row is stale).
An unqualified name in the ``Accelerator`` tables means an ``Accelerator`` member (or an
``accelerate`` top-level name); one under the ``accelerate.utils`` heading a module-level name; a
dotted name (``AcceleratedOptimizer.step``,
``accelerate.state.PartialState``) matches by its suffix, one starting with ``accelerate.``
only that object. A module kwplug does not have
(yet) needs a row naming the module (```accelerate.state```).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-accelerate.md"
HEADER = "| Accelerate name | kwplug | Notes |"
_SPAN = re.compile(r"`([^`]+)`")
_LEADING = re.compile(r"[A-Za-z_][\w.]*")
_WORD = re.compile(r"[A-Za-z_]\w*")

#: Accelerate module -> kwplug's counterparts, the first importable one is compared.
MODULES: dict[str, tuple[str, ...]] = {
    "accelerate": ("kwplug",),
    "accelerate.utils": ("kwplug.utils",),
    "accelerate.optimizer": ("kwplug.optimizer",),
    "accelerate.scheduler": ("kwplug.scheduler",),
    "accelerate.tracking": ("kwplug.tracking",),
    "accelerate.local_sgd": ("kwplug.local_sgd",),
    "accelerate.data_loader": ("kwplug.data_loader", "kwplug.data"),
    "accelerate.logging": ("kwplug.logging",),
    "accelerate.state": ("kwplug.state",),
    "accelerate.launchers": ("kwplug.launchers",),
    "accelerate.checkpointing": ("kwplug.checkpointing",),
}
#: Modules that re-export names defined elsewhere: every public name is theirs.
_NAMESPACES = ("accelerate", "accelerate.utils")


class Row(NamedTuple):
    """One row of a name table: where it is, what its first cell names, what it mentions."""

    section: str  # "Accelerator" or "utils"
    status: str
    names: tuple[str, ...]  # the dotted names the first cell's spans start with
    bare: frozenset[str]  # those written without a call (`name`, not `name(arg=...)`)
    words: frozenset[str]  # every identifier inside a backtick span of the row
    line: str


def _rows() -> Iterator[Row]:
    in_table = False
    section = "Accelerator"
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = "utils" if "accelerate.utils" in line else "Accelerator"
        if line.strip() == HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not in_table or set(cells[0]) <= {"-", " "} or len(cells) < 3:
            continue
        names, bare = [], set()
        for span in _SPAN.findall(cells[0]):
            match = _LEADING.match(span)
            if match:
                names.append(match.group(0).rstrip("."))
                if "(" not in span:
                    bare.add(names[-1])
        words = frozenset(w for span in _SPAN.findall(line) for w in _WORD.findall(span))
        yield Row(section, cells[1], tuple(names), frozenset(bare), words, line)


def _names_key(row: Row, name: str, key: str) -> bool:
    """Whether ``name``, a first-cell name of ``row``, names the Accelerate object ``key``
    (its dotted path, e.g. ``accelerate.Accelerator.save_state``)."""
    if name == key:
        return True
    if name.startswith("accelerate."):  # fully qualified: that object only
        return False
    if "." in name:  # `Class.member`: by suffix
        return key.endswith("." + name)
    parent, _, last = key.rpartition(".")
    if last != name:
        return False
    if row.section == "Accelerator":
        return parent in ("accelerate.Accelerator", "accelerate")
    return parent in MODULES  # utils heading: module-level names


def _exemptions(key: str) -> tuple[bool, set[str]]:
    """(whole callable exempt, exempt parameter/member names) for ``key``."""
    whole = False
    named: set[str] = set()
    for row in _rows():
        if row.status not in ("differs", "not supported"):
            continue
        matching = [name for name in row.names if _names_key(row, name, key)]
        if matching:
            # `name` not supported: all of it; `name(arg=...)` not supported: what it names.
            whole = whole or (row.status == "not supported" and bool(row.bare & set(matching)))
            named |= row.words
    return whole, named


class _Factory:
    """Stands for a default built by a factory; compared by a default instance's value."""

    def __repr__(self) -> str:
        return "<factory>"


FACTORY = _Factory()


def _default(parameter: inspect.Parameter) -> Any:
    default = parameter.default
    if default is dataclasses._HAS_DEFAULT_FACTORY or isinstance(default, attrs.Factory):  # type: ignore[attr-defined]
        return FACTORY
    if repr(default) in ("<factory>", "NOTHING"):
        return FACTORY
    return default


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if inspect.isfunction(a) and inspect.isfunction(b):  # each library's own helper
        return bool(a.__name__ == b.__name__)
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return getattr(a, "value", a) == getattr(b, "value", b)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. tensors: no truth value
        return False


def _signature(obj: Callable[..., Any]) -> inspect.Signature | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    kinds = [p.kind for p in signature.parameters.values() if p.name != "self"]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        # A decorator without functools.wraps (Accelerate's `on_main_process` on
        # `init_trackers`): the decorated function is in the closure.
        for cell in getattr(obj, "__closure__", None) or ():
            inner = cell.cell_contents
            if inspect.isfunction(inner) and inner.__name__ == getattr(obj, "__name__", None):
                return _signature(inner)
        return None  # Accelerate's own (*args, **kwargs): nothing to compare
    return signature


def _instance_value(cls: type, name: str) -> Any:
    try:
        return getattr(cls(), name)
    except Exception as error:  # a class that cannot be built without arguments
        return f"<{type(error).__name__}>"


class Difference(NamedTuple):
    """One difference: the Accelerate object (dotted path), the parameter or member it is
    about, and what differs."""

    key: str
    word: str
    text: str

    def __str__(self) -> str:
        return f"{self.key}: {self.text}"


def _compare_signature(
    key: str, theirs: Callable[..., Any], ours: Callable[..., Any], classes: tuple[type, type]
) -> list[Difference]:
    """The differences between two callables' parameters."""
    a, b = _signature(theirs), _signature(ours)
    if a is None or b is None:
        return []
    found = []
    mine_all = dict(b.parameters)
    kinds = {p.kind for p in b.parameters.values()}
    for name, param in a.parameters.items():
        mine = mine_all.get(name)
        if mine is None:
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                if param.kind not in kinds:
                    star = "**" if param.kind is param.VAR_KEYWORD else "*"
                    found.append(Difference(key, name, f"no {star}{name}"))
            elif param.VAR_KEYWORD in kinds and param.kind is not param.POSITIONAL_ONLY:
                found.append(Difference(key, name, f"`{name}` only through **kwargs"))
            else:
                found.append(Difference(key, name, f"missing parameter `{name}`"))
            continue
        if mine.kind is not param.kind:
            text = f"`{name}` is {mine.kind.description}, Accelerate: {param.kind.description}"
            found.append(Difference(key, name, text))
        theirs_default, ours_default = _default(param), _default(mine)
        if theirs_default is FACTORY:
            theirs_default = _instance_value(classes[0], name)
        if ours_default is FACTORY:
            ours_default = _instance_value(classes[1], name)
        if not _same(theirs_default, ours_default):
            text = f"`{name}` defaults to {ours_default!r}, Accelerate: {theirs_default!r}"
            found.append(Difference(key, name, text))
    positional = [n for n, p in a.parameters.items() if p.kind <= p.POSITIONAL_OR_KEYWORD]
    ours_positional = [n for n, p in b.parameters.items() if p.kind <= p.POSITIONAL_OR_KEYWORD]
    common = [n for n in positional if n in ours_positional]
    if [n for n in ours_positional if n in common] != common:
        for n, m in zip(common, [n for n in ours_positional if n in common], strict=True):
            if n != m:
                text = f"positional order {ours_positional}, Accelerate: {positional}"
                found.append(Difference(key, n, text))
                break
    return found


def _own_members(cls: type) -> dict[str, Any]:
    """Public members defined by the Accelerate classes of ``cls``'s MRO (not torch's)."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("accelerate"):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                members[name] = value
    return members


def _is_property(value: Any) -> bool:
    return isinstance(value, (property, types.GetSetDescriptorType, types.MemberDescriptorType))


def _compare_class(key: str, theirs: type, ours: type, instance: Any = None) -> list[Difference]:
    found = _compare_signature(key, theirs, ours, (theirs, ours))
    if dataclasses.is_dataclass(theirs) or issubclass(theirs, enum.Enum):
        return found  # fields are the constructor's parameters, compared above
    for name, value in _own_members(theirs).items():
        member_key = f"{key}.{name}"
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if not (callable(value) or _is_property(value)):
            continue  # class constants
        mine = inspect.getattr_static(ours, name, None)
        if mine is None and instance is not None and name in vars(instance):
            if _exemptions(member_key)[0]:
                found.append(Difference(member_key, "", _STALE))
            elif not _is_property(value):
                found.append(Difference(member_key, name, "an attribute, Accelerate: a method"))
            continue
        if mine is None:
            found.append(Difference(member_key, name, "missing"))
            continue
        if isinstance(mine, (staticmethod, classmethod)):
            mine = mine.__func__
        if _exemptions(member_key)[0]:
            found.append(Difference(member_key, "", _STALE))
            continue
        if _is_property(value) != (_is_property(mine) or not callable(mine)):
            what = "a property" if _is_property(value) else "a method"
            found.append(Difference(member_key, name, f"not {what} as in Accelerate"))
        elif not _is_property(value):
            found.extend(_compare_signature(member_key, value, mine, (theirs, ours)))
    return found


_STALE = (
    "the migration table calls it `not supported`, but kwplug has it: make the row "
    "`differs` (naming what differs) or `supported`"
)


def _exempt(difference: Difference, owner: str) -> bool:
    """Whether the migration table names ``difference`` (on ``owner``, the module-level
    callable it belongs to), with a reason."""
    if difference.text == _STALE:
        return False
    whole, named = _exemptions(difference.key)
    if whole or difference.word in named:
        return True
    if difference.key != owner:  # a member: the class's own rows may name it
        whole, named = _exemptions(owner)
        member = difference.key[len(owner) + 1 :].split(".", 1)[0]
        return whole or member in named
    return False


def _public_callables(module_name: str, kwplug_module: Any) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    names = {}
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType) or not callable(value):
            continue
        if module_name in _NAMESPACES:
            if not hasattr(kwplug_module, name):
                continue  # the migration table gate covers names kwplug lacks
        elif getattr(value, "__module__", None) != module_name:
            continue  # imported from elsewhere: compared where it is defined
        names[name] = value
    return names


def _kwplug_module(module_name: str) -> Any:
    for candidate in MODULES[module_name]:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as error:
            if error.name != candidate:
                raise
    return None


def _differences(module_name: str) -> list[Difference]:
    pytest.importorskip("accelerate")
    ours_module = _kwplug_module(module_name)
    if ours_module is None:
        if any(module_name in row.names for row in _rows() if row.status != "supported"):
            return []
        text = f"kwplug has no counterpart module {' or '.join(MODULES[module_name])}"
        return [Difference(module_name, module_name, text)]
    problems = []
    for name, theirs in _public_callables(module_name, ours_module).items():
        key = f"{module_name}.{name}"
        ours = getattr(ours_module, name, None)
        if ours is None:
            found = [Difference(key, name, f"missing in {ours_module.__name__}")]
        elif _exemptions(key)[0]:
            found = [Difference(key, "", _STALE)]
        elif isinstance(theirs, type) and isinstance(ours, type):
            instance = _kwplug_accelerator() if key == "accelerate.Accelerator" else None
            found = _compare_class(key, theirs, ours, instance)
        else:
            found = _compare_signature(key, theirs, ours, (theirs, ours))
        problems.extend(d for d in found if not _exempt(d, key))
    return problems


_ACCELERATOR: list[Any] = []


def _kwplug_accelerator() -> Any:
    if not _ACCELERATOR:
        import kwplug

        _ACCELERATOR.append(kwplug.Accelerator(cpu=True))
    return _ACCELERATOR[0]


@pytest.mark.parametrize("module_name", list(MODULES))
def test_signatures_match_accelerate(module_name: str) -> None:
    problems = [str(difference) for difference in _differences(module_name)]
    assert problems == [], (
        f"{len(problems)} difference(s) from {module_name} not named in "
        f"docs/migrating-from-accelerate.md:\n  " + "\n  ".join(problems)
    )
