"""Timeout errors speak in seconds, never in ``str(timedelta)`` ("-1 day, 23:59:55")."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch.distributed

import kwplug

# str(timedelta) forms: "-1 day, 23:59:55", "0:00:00.500000", "999999999 days, ...".
_TIMEDELTA_TEXT = re.compile(r"\d+:\d\d:\d\d|\bdays?\b")


@pytest.mark.parametrize(
    ("timeout", "seconds"),
    [
        (timedelta(seconds=-5), "timeout=-5 s"),
        (-5, "timeout=-5 s"),
        (timedelta(milliseconds=500), "timeout=0.5 s"),
        (timedelta(0), "timeout=0 s"),
    ],
    ids=["negative-timedelta", "negative-seconds", "half-second", "zero"],
)
def test_too_small_timeout_is_reported_in_seconds(timeout: timedelta | int, seconds: str) -> None:
    with pytest.raises(ValueError) as info:
        kwplug.InitProcessGroupKwargs(timeout=timeout)
    message = str(info.value)
    assert seconds in message, message
    assert "at least 1 second" in message and "accepted: a datetime.timedelta" in message
    assert not _TIMEDELTA_TEXT.search(message), message


def test_out_of_range_timeout_names_its_limit_in_seconds() -> None:
    with pytest.raises(ValueError, match=r"up to 8\.64e\+13 s, got 1e\+20") as info:
        kwplug.InitProcessGroupKwargs(timeout=1e20)
    assert not _TIMEDELTA_TEXT.search(str(info.value)), str(info.value)


def test_failed_rendezvous_names_the_timeout_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kwargs: object) -> None:
        raise RuntimeError("connection refused\nC++ stack")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    handler = kwplug.InitProcessGroupKwargs(
        backend="gloo", init_method="tcp://127.0.0.1:1", timeout=5
    )
    with pytest.raises(RuntimeError, match=r"timeout 5 s\): RuntimeError: connection refused$"):
        handler.init_process_group(device_type="cpu", world_size=2, rank=0)
