"""``check_handler(cls)``: the conformance check a handler class passes in its own CI.

It checks what kwplug and its users rely on, using kwplug's real code paths: the class is an
attrs :class:`~kwplug.KwargsHandler` that can be default-constructed; its hook implementations
pass pluggy's validation against kwplug's hook specs; ``to_kwargs()`` of a default instance is
empty and holds a changed field otherwise; instances compare by value and survive
``pickle`` and ``copy.deepcopy``; and every field rejects a nonsense value with a
``TypeError``/``ValueError`` naming the field, at construction and on assignment.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import pluggy

from kwplug._plugins import (
    KwplugPluginManager,
    device_types_problem,
    spec_signatures,
    tryfirst_problem,
    validate_hookimpls,
)
from kwplug.handler import TO_KWARGS, KwargsHandler


class _Nonsense:
    """A value no handler field should accept."""

    def __repr__(self) -> str:
        return "<nonsense value>"


def conformance_problems(
    cls: Any, *, examples: Mapping[str, Any] | None = None, accepts_any: Iterable[str] = ()
) -> list[str]:
    """The ways ``cls`` breaks the handler contract, one sentence each (empty when none).

    See :func:`check_handler` for the arguments.
    """
    if not (isinstance(cls, type) and issubclass(cls, KwargsHandler)):
        return [f"{cls!r} is not a subclass of kwplug.KwargsHandler"]
    if not cls.is_attrs_class():
        return [f"{cls.__qualname__} is not decorated with @attrs.define"]
    fields = [f for f in attrs.fields(cls) if f.init]
    names = {f.name for f in fields}
    examples = dict(examples or {})
    skip = set(accepts_any)
    problems = [
        f"examples/accepts_any name unknown field {n!r} (fields: {sorted(names)})"
        for n in sorted((set(examples) | skip) - names)
    ]
    problems += [f"field {f.name!r} has no default" for f in fields if f.default is attrs.NOTHING]
    problems += [
        f"field {f.name!r} has a mutable default shared by every instance "
        f"({f.default!r}); use attrs.field(factory=...)"
        for f in fields
        if isinstance(f.default, (list, dict, set, bytearray))
    ]
    problems += _lost_annotations(cls)
    try:
        default = cls()
    except Exception as exc:
        return [*problems, f"{cls.__qualname__}() raised {type(exc).__name__}: {exc}"]
    problems += _hook_problems(default)
    device_problem = device_types_problem(cls)
    if device_problem:
        problems.append(device_problem)
    if default.to_kwargs() != {}:
        problems.append(f"{cls.__qualname__}().to_kwargs() is {default.to_kwargs()!r}, not {{}}")
    if set(default.to_dict()) != names:
        problems.append("to_dict() does not hold exactly the constructor fields")
    problems += _equality_problems(cls, default)
    instances = [default]
    for field in fields:
        if field.name in examples:
            problems += _example_problems(cls, field, examples[field.name], instances)
        if field.name not in skip:
            problems += _rejects_nonsense(cls, field.name)
    for instance in instances:
        problems += _copy_problems(instance)
    return problems


def check_handler(
    cls: type[KwargsHandler],
    *,
    examples: Mapping[str, Any] | None = None,
    accepts_any: Iterable[str] = (),
) -> None:
    """Assert that handler class ``cls`` honours kwplug's handler contract.

    Args:
        cls: the handler class (not an instance).
        examples: a valid, non-default value per field name; each is checked to construct,
            to appear in ``to_kwargs()`` (unless the field is marked
            ``metadata={TO_KWARGS: False}``), to compare equal after ``pickle`` and
            ``copy.deepcopy``. Fields without an example are checked only for rejecting
            nonsense.
        accepts_any: names of fields that legitimately accept any object (skipped by the
            nonsense-value check).

    Raises:
        AssertionError: listing every problem found (so one run shows them all).
    """
    problems = conformance_problems(cls, examples=examples, accepts_any=accepts_any)
    if problems:
        name = getattr(cls, "__qualname__", repr(cls))
        raise AssertionError(
            f"{name} does not conform to the kwplug handler contract:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _lost_annotations(cls: type[KwargsHandler]) -> list[str]:
    # attrs.define ignores annotated class attributes when any field is an unannotated
    # attrs.field(): the attribute then silently is not a constructor argument.
    fields = {f.name for f in attrs.fields(cls)}
    own = vars(cls).get("__annotations__", {})
    return [
        f"annotated attribute {name!r} is not an attrs field (annotate every attrs.field() "
        "too, or mark it ClassVar)"
        for name, annotation in own.items()
        if name not in fields and "ClassVar" not in str(annotation)
    ]


def _equality_problems(cls: type[KwargsHandler], default: KwargsHandler) -> list[str]:
    other = cls()
    if other == default:
        return []
    unequal = [
        f.name
        for f in attrs.fields(cls)
        if f.eq and getattr(other, f.name) != getattr(default, f.name)
    ]
    return [
        f"two {cls.__qualname__}() instances are not equal: field(s) {unequal} compare by "
        "identity (a default such as a lock or a fresh object); use a value, or "
        "attrs.field(eq=False) for state that is not configuration"
    ]


def _hook_problems(handler: KwargsHandler) -> list[str]:
    pm = KwplugPluginManager()
    try:
        validate_hookimpls(pm, handler, "handler")
    except pluggy.PluginValidationError as exc:
        message = " ".join(str(exc).split())  # pluggy's text spans lines
        return [f"invalid hook implementation: {message}{spec_signatures(handler)}"]
    if not pm.get_hookcallers(handler):
        return ["implements no kwplug hook (mark methods with @kwplug.hookimpl)"]
    problem = tryfirst_problem(pm, handler)
    return [problem] if problem else []


def _example_problems(
    cls: type[KwargsHandler], field: attrs.Attribute[Any], value: Any, instances: list[Any]
) -> list[str]:
    try:
        instance = cls(**{field.name: value})
    except Exception as exc:
        return [f"example {field.name}={value!r} raised {type(exc).__name__}: {exc}"]
    instances.append(instance)
    resolved = getattr(instance, field.name)
    if resolved == getattr(cls(), field.name):
        return [f"example {field.name}={value!r} equals the default; give a non-default value"]
    # Other fields may resolve differently too (a default that depends on this one), so
    # only this field's own entry is checked.
    kwargs = instance.to_kwargs()
    wanted = field.metadata.get(TO_KWARGS, True)
    if (field.name in kwargs) != wanted or (wanted and kwargs[field.name] != resolved):
        expected = f"{field.name}={resolved!r}" if wanted else f"no {field.name!r}"
        return [
            f"{cls.__qualname__}({field.name}={value!r}).to_kwargs() is {kwargs!r}, "
            f"expected {expected} in it"
        ]
    return []


def _rejects_nonsense(cls: type[KwargsHandler], name: str) -> list[str]:
    problems = []
    try:
        cls(**{name: _Nonsense()})
    except (TypeError, ValueError) as exc:
        if name not in str(exc):
            problems.append(
                f"{cls.__qualname__}({name}=<nonsense>) raised {type(exc).__name__} without "
                f"naming the field: {exc}"
            )
    except Exception as exc:
        problems.append(
            f"{cls.__qualname__}({name}=<nonsense>) raised {type(exc).__name__}, not "
            f"TypeError/ValueError: {exc}"
        )
    else:
        problems.append(f"{cls.__qualname__}({name}=<nonsense>) was accepted")
    instance = cls()
    try:
        setattr(instance, name, _Nonsense())
    except (TypeError, ValueError, attrs.exceptions.FrozenInstanceError):
        pass
    except Exception as exc:
        problems.append(
            f"assigning nonsense to {name} raised {type(exc).__name__}, not TypeError/ValueError"
        )
    else:
        problems.append(f"assigning nonsense to {name} was accepted (validators on setattr?)")
    return problems


def _copy_problems(instance: KwargsHandler) -> list[str]:
    problems = []
    try:
        if pickle.loads(pickle.dumps(instance)) != instance:
            problems.append(f"{instance!r} is not equal to itself after pickle")
    except Exception as exc:
        problems.append(f"{instance!r} cannot be pickled: {type(exc).__name__}: {exc}")
    try:
        if copy.deepcopy(instance) != instance:
            problems.append(f"{instance!r} is not equal to itself after copy.deepcopy")
    except Exception as exc:
        problems.append(f"{instance!r} cannot be deep-copied: {type(exc).__name__}: {exc}")
    return problems
