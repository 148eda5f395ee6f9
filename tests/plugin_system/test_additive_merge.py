"""``comm_hooks`` and ``trackers`` answers merge through one ``ADDITIVE`` merge: ``None``
skipped, a non-mapping or a bad entry refused naming the plugin, a name given twice refused
naming both sources (the registry counts as a source)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import kwplug
from kwplug.comm_hooks import CommHook, merge_comm_hooks
from kwplug.tracking import merge_trackers


def _hook(state: Any, bucket: Any) -> Any:
    return bucket.buffer()


@pytest.fixture
def registered() -> Iterator[str]:
    kwplug.register_comm_hook("merge_test_hook", _hook)
    yield "merge_test_hook"
    kwplug.unregister_comm_hook("merge_test_hook")


def test_comm_hooks_merge_with_the_registry_and_name_sources(registered: str) -> None:
    merged = merge_comm_hooks([("plugin a", None), ("plugin a", {"mine": CommHook("mine", _hook)})])
    assert merged["mine"].source == "plugin a"  # an unknown source becomes the plugin
    assert merged[registered].source == "kwplug.register_comm_hook"
    with pytest.raises(
        ValueError,
        match=r"communication hook 'merge_test_hook' is provided twice: by "
        r"kwplug.register_comm_hook and by plugin b; block one",
    ):
        merge_comm_hooks([("plugin b", {registered: CommHook(registered, _hook)})])


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            ["x"],
            r"plugin 'p': comm_hooks must return a mapping of name to kwplug.CommHook, got list",
        ),
        (
            {"x": _hook},
            r"plugin 'p': comm_hooks\(\)\['x'\] must be a kwplug.CommHook, got function",
        ),
    ],
)
def test_comm_hooks_bad_answers_name_the_plugin(answer: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        merge_comm_hooks([("p", answer)])


def test_trackers_merge_and_refuse_a_name_twice() -> None:
    assert merge_trackers([("a", None), ("a", {"t": dict})]) == {"t": dict}
    with pytest.raises(
        ValueError, match=r"tracker name 't' is provided twice: by a and by b; block one of them"
    ):
        merge_trackers([("a", {"t": dict}), ("b", {"t": list})])


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (3, r"plugin 'p': trackers must return a mapping of name to tracker factory, got int"),
        ({"t": 3}, r"plugin 'p': trackers\(\)\['t'\] must map a str to a callable"),
        ({1: dict}, r"plugin 'p': trackers\(\)\[1\] must map a str"),
    ],
)
def test_trackers_bad_answers_name_the_plugin(answer: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        merge_trackers([("p", answer)])
