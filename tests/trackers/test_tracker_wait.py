"""A tracker server that never answers is named within seconds and given up on after a
bounded, configurable time (issue 30, item 5): ``init_trackers`` with ``MLFLOW_TRACKING_URI``
at a server that accepts and never replies was silent for minutes."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kwplug
from kwplug.accelerator import _tracker_wait
from kwplug.errors import TrackerTimeoutError
from kwplug.tracking import GeneralTracker


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP server on loopback that accepts connections and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_mlflow_at_a_silent_server_is_named_then_given_up(
    silent_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service import utils as mlflow_uri

    # An earlier test's mlflow.set_tracking_uri is process-wide and outranks the variable;
    # monkeypatch puts it back afterwards, so that no later test talks to this server.
    monkeypatch.setattr(mlflow_uri, "_tracking_uri", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", silent_server)
    monkeypatch.setenv("KWPLUG_TRACKER_TIMEOUT", "4")
    monkeypatch.setattr(_tracker_wait, "NOTICE_SECONDS", 1.0)
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow", project_dir=tmp_path)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, "kwplug"), pytest.raises(TrackerTimeoutError) as info:
        accelerator.init_trackers("run", config={"lr": 0.1})
    took = time.monotonic() - began
    assert 3.5 < took < 30, took
    assert info.value.tracker == "mlflow" and info.value.endpoint == silent_server
    assert "'mlflow'" in str(info.value) and silent_server in str(info.value)
    notices = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert notices and silent_server in notices[0] and "gives up after 4 s" in notices[0]


class _Slow(GeneralTracker):
    name = "slow"
    requires_logging_directory = False

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.started = False

    @property
    def tracker(self) -> None:
        return None

    def start(self) -> None:
        time.sleep(self.seconds)
        self.started = True


def test_a_slow_start_within_the_deadline_is_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KWPLUG_TRACKER_TIMEOUT", "10")
    monkeypatch.setattr(_tracker_wait, "NOTICE_SECONDS", 0.2)
    tracker = _Slow(0.6)
    accelerator = kwplug.Accelerator(cpu=True, log_with=tracker)
    with caplog.at_level(logging.WARNING, "kwplug"):
        accelerator.init_trackers("run")
    assert tracker.started and accelerator.trackers == [tracker]
    assert any("still waiting for tracker 'slow'" in r.getMessage() for r in caplog.records)
    import signal

    left = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's own timer, if any, goes on
    assert left == 0 or left > 60
    accelerator.end_training()


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_timeout_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KWPLUG_TRACKER_TIMEOUT", value)
    accelerator = kwplug.Accelerator(cpu=True, log_with=_Slow(0))
    with pytest.raises(ValueError, match="KWPLUG_TRACKER_TIMEOUT must be a number of seconds"):
        accelerator.init_trackers("run")


def test_zero_means_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KWPLUG_TRACKER_TIMEOUT", "0")
    assert _tracker_wait.timeout_seconds() is None
    monkeypatch.delenv("KWPLUG_TRACKER_TIMEOUT")
    assert _tracker_wait.timeout_seconds() == _tracker_wait.DEFAULT_TIMEOUT
