"""A tracker that waits on its server never waits in silence, nor forever.

``init_trackers`` builds and starts each tracker and stores the configuration through it; a
tracker with a server (MLflow, W&B, Comet) connects there, and its client retries on its own
(MLflow: minutes of silent back-off for a refused port, no end for a server that accepts and
never replies). :func:`bounded` wraps each of those calls:

- after :data:`NOTICE_SECONDS` seconds, and then every :data:`REPEAT_SECONDS`, kwplug's logger
  says at ``WARNING`` which tracker it waits for, where (its ``endpoint``), for how long, and
  when it gives up;
- after ``KWPLUG_TRACKER_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT`; ``0`` waits for
  ever) it raises :class:`~kwplug.errors.TrackerTimeoutError` naming them. The deadline is a
  ``SIGALRM`` timer (``signal.setitimer``), whose handler raises in the waiting call. It is
  set on the main thread only (elsewhere the notices still come, without the deadline). A
  timer someone else armed (``pytest-timeout``, a job's own alarm) is kept: when it would
  fire first, kwplug sets none; otherwise kwplug's replaces it for the call, then it is
  re-armed with the time it had left and its handler restored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from kwplug.errors import TrackerTimeoutError

logger = logging.getLogger("kwplug.tracking")

#: The environment variable holding the deadline, in seconds (``0``: none).
TIMEOUT_ENV = "KWPLUG_TRACKER_TIMEOUT"
#: The deadline when ``KWPLUG_TRACKER_TIMEOUT`` is not set, in seconds.
DEFAULT_TIMEOUT = 120.0
#: Seconds before the first notice.
NOTICE_SECONDS = 5.0
#: Seconds between later notices.
REPEAT_SECONDS = 30.0


def timeout_seconds() -> float | None:
    """The deadline from ``KWPLUG_TRACKER_TIMEOUT`` (``None``: no deadline).

    Raises:
        ValueError: the variable is not a number of seconds ``>= 0``.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{TIMEOUT_ENV} must be a number of seconds >= 0 (0: wait for ever), got {raw[:40]!r}"
        )
    return value or None


def _describe(tracker: str, endpoint: str | None) -> str:
    return f"tracker {tracker!r}" + (f" at {endpoint}" if endpoint else "")


def _can_alarm(deadline: float | None) -> tuple[bool, float]:
    # (whether to set kwplug's timer, seconds another timer had left: 0.0 for none)
    if deadline is None or not hasattr(signal, "setitimer"):
        return False, 0.0
    if threading.current_thread() is not threading.main_thread():
        return False, 0.0
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    return (left == 0 or left > deadline), left


@contextlib.contextmanager
def bounded(tracker: str, endpoint: str | None, action: str) -> Iterator[None]:
    """Notices while the block runs long, and :class:`TrackerTimeoutError` past the deadline.

    Args:
        tracker: the tracker's name (``"mlflow"``).
        endpoint: where it connects (its ``endpoint``), or ``None``.
        action: what the block does (``"start"``, ``"store_init_configuration"``).

    Raises:
        TrackerTimeoutError: the block ran past ``KWPLUG_TRACKER_TIMEOUT`` seconds.
        ValueError: ``KWPLUG_TRACKER_TIMEOUT`` is not a number of seconds.
    """
    deadline = timeout_seconds()
    who = _describe(tracker, endpoint)
    began = time.monotonic()
    done = threading.Event()
    limit = f"gives up after {deadline:g} s" if deadline else "no deadline"

    def notices() -> None:
        delay = NOTICE_SECONDS
        while not done.wait(delay):
            logger.warning(
                "init_trackers: still waiting for %s (%s) after %.0f s; %s (%s)",
                who, action, time.monotonic() - began, limit, TIMEOUT_ENV,
            )  # fmt: skip
            delay = REPEAT_SECONDS

    fired: list[TrackerTimeoutError] = []

    def expired(signum: int, frame: FrameType | None) -> None:
        fired.append(
            TrackerTimeoutError(
                f"init_trackers: {who} did not answer within {deadline:g} s ({action}); check that "
                f"its server is reachable, or set {TIMEOUT_ENV} (seconds, 0: no deadline)",
                tracker=tracker,
                endpoint=endpoint,
                seconds=deadline,
            )
        )
        raise fired[0]

    watcher = threading.Thread(target=notices, name="kwplug-tracker-wait", daemon=True)
    watcher.start()
    alarm, other = _can_alarm(deadline)
    previous = signal.signal(signal.SIGALRM, expired) if alarm else None
    try:
        if alarm and deadline is not None:
            signal.setitimer(signal.ITIMER_REAL, deadline)
        yield
    except Exception as exc:
        # A client that wraps every exception (MLflow: MlflowException) must not hide ours.
        if fired and exc is not fired[0]:
            raise fired[0] from exc
        raise
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if other:  # the other timer goes on with the time it had left
                signal.setitimer(signal.ITIMER_REAL, max(other - (time.monotonic() - began), 1e-3))
        done.set()
