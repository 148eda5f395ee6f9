"""Every value Accelerate's handlers accept for an optional or enum field, kwplug accepts too.

The fields and values are derived from the installed Accelerate by inspection, not listed by
hand: for each handler dataclass, ``None`` for a field whose annotation allows it (or whose
default is ``None``), and for a field typed by an enum (its annotation, a ``Literal`` of
members, or its default) every member Accelerate allows, the member's value (its name for
torch's integer enums, the spelling Accelerate converts), and ``None`` (Accelerate looks enum
fields up with ``dict.get``: ``None`` means "none", e.g. no communication hook). Each value
Accelerate constructs with must construct in kwplug -- except a refusal that names FSDP1, the
documented FSDP2-only difference (docs/migrating-from-accelerate.md).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
import warnings
from typing import Any

import pytest

accelerate_utils = pytest.importorskip("accelerate.utils")
import torch.distributed.fsdp  # noqa: E402,F401  (Accelerate's FSDP annotations name it)

import kwplug.utils  # noqa: E402

HANDLERS = (
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "AutocastKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "FullyShardedDataParallelPlugin",
    "TorchDynamoPlugin",
    "ParallelismConfig",
    "ProjectConfiguration",
    "GradientAccumulationPlugin",
    "DataLoaderConfiguration",
)
#: Compared like for like: kwplug's FSDP plugin is FSDP2 only.
BASE: dict[str, dict[str, Any]] = {"FullyShardedDataParallelPlugin": {"fsdp_version": 2}}


def _enums(annotation: Any) -> list[type[enum.Enum]]:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [annotation]
    found: list[type[enum.Enum]] = []
    for arg in typing.get_args(annotation):
        found += [type(arg)] if isinstance(arg, enum.Enum) else _enums(arg)
    return found


def _allows_none(annotation: Any) -> bool:
    return annotation in (type(None), Any) or any(map(_allows_none, typing.get_args(annotation)))


def _cases() -> list[Any]:
    cases = []
    for name in HANDLERS:
        cls = getattr(accelerate_utils, name)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            annotation = hints[field.name]
            values: list[Any] = []
            if _allows_none(annotation) or field.default is None:
                values.append(None)
            default = [type(field.default)] if isinstance(field.default, enum.Enum) else []
            literal = typing.get_origin(annotation) is typing.Literal
            for kind in dict.fromkeys(_enums(annotation) + default):
                members = typing.get_args(annotation) if literal else tuple(kind)
                for member in members:
                    spelled = member.value if isinstance(member.value, str) else member.name
                    values += [member, spelled]
                values.append(None)
            for value in dict.fromkeys(values):
                case_id = f"{name}.{field.name}={value!r}"
                cases.append(pytest.param(name, field.name, value, id=case_id))
    return cases


def _builds(cls: Any, kwargs: dict[str, Any]) -> Exception | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes; only acceptance is compared
        try:
            cls(**kwargs)
        except Exception as exc:  # any refusal is the observation
            return exc
    return None


@pytest.mark.parametrize(("handler", "field", "value"), _cases())
def test_values_accelerate_accepts_are_accepted(handler: str, field: str, value: Any) -> None:
    kwargs = {**BASE.get(handler, {}), field: value}
    if _builds(getattr(accelerate_utils, handler), kwargs) is not None:
        pytest.skip("Accelerate refuses it too")
    refused = _builds(getattr(kwplug.utils, handler), kwargs)
    if refused is not None and "FSDP1" in str(refused):
        pytest.skip(f"documented FSDP2-only difference: {refused}")
    assert refused is None, f"kwplug refuses {handler}({field}={value!r}): {refused}"


def test_the_derivation_finds_the_ddp_comm_fields() -> None:
    # Guards the derivation itself: were Accelerate's annotations no longer read, the test
    # above would pass vacuously.
    ids = {case.id for case in _cases()}
    assert "DistributedDataParallelKwargs.comm_wrapper=None" in ids
    assert "DistributedDataParallelKwargs.comm_hook=<DDPCommunicationHookType.FP16: 'fp16'>" in ids
    assert "AutocastKwargs.cache_enabled=None" in ids


@pytest.mark.parametrize("field", ["comm_hook", "comm_wrapper"])
def test_accelerates_ddp_enum_means_the_same_hook(field: str) -> None:
    theirs = accelerate_utils.DDPCommunicationHookType
    handler = kwplug.utils.DistributedDataParallelKwargs(**{field: theirs.BF16})
    assert getattr(handler, field) is kwplug.utils.DDPCommunicationHookType.BF16
    for none in (None, theirs.NO):
        handler = kwplug.utils.DistributedDataParallelKwargs(**{field: none})
        assert getattr(handler, field) is kwplug.utils.DDPCommunicationHookType.NO
    # On assignment too (attrs runs the converter on setattr).
    setattr(handler, field, None)
    assert getattr(handler, field) is kwplug.utils.DDPCommunicationHookType.NO


def test_comm_state_option_none_is_no_options() -> None:
    handler = kwplug.utils.DistributedDataParallelKwargs(comm_state_option=None)
    assert handler.comm_state_option == {}


def test_a_foreign_enum_with_an_unknown_value_is_still_refused() -> None:
    class Other(enum.Enum):
        X = "not-a-wrapper"

    with pytest.raises(TypeError, match="comm_wrapper"):
        kwplug.utils.DistributedDataParallelKwargs(comm_wrapper=Other.X)
