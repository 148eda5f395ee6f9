"""ordered_hook: each bucket's hook starts after the previous bucket's future completed, the
autograd thread is not held up (except on the step's last bucket), errors reach the future."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kwplug.plugins.ddp_comm_hooks import ordered_hook
from kwplug.plugins.ddp_comm_hooks._adapters import ORDERS_COLLECTIVES


class _Bucket:
    def __init__(self, index: int, last: bool) -> None:
        self._index = index
        self._last = last
        self._buffer = torch.full((4,), float(index))

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer


class _Recorder:
    """A hook whose futures the test completes by hand; records the order of the calls."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.started: list[int] = []
        self.states: list[Any] = []
        self.pending: dict[int, torch.futures.Future[torch.Tensor]] = {}
        self.fail = fail

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        self.started.append(bucket.index())
        self.states.append(state)
        if bucket.index() in self.fail:
            raise ValueError(f"bucket {bucket.index()} failed")
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.pending[bucket.index()] = future
        return future

    def finish(self, index: int) -> None:
        self.pending.pop(index).set_result(torch.full((4,), 10.0 + index))


def test_buckets_start_in_order_without_blocking() -> None:
    inner = _Recorder()
    hook = ordered_hook(inner)
    f0 = hook(None, _Bucket(0, last=False))
    f1 = hook(None, _Bucket(1, last=False))  # returns although bucket 0 is not done
    assert inner.started == [0]  # bucket 1 waits for bucket 0's future
    assert not f0.done() and not f1.done()
    inner.finish(0)
    assert f0.wait().tolist() == [10.0] * 4
    assert inner.started == [0, 1]
    assert not f1.done()
    inner.finish(1)
    assert f1.wait().tolist() == [11.0] * 4


def test_last_bucket_waits_for_the_chain_and_resets_it() -> None:
    inner = _Recorder()
    hook = ordered_hook(inner)
    hook(None, _Bucket(0, last=False))
    # The step's last bucket returns only once every bucket of the chain is done: finish
    # them from another thread, as gloo's worker threads would.
    finisher = threading.Timer(0.05, lambda: (inner.finish(0), inner.finish(1)))
    finisher.start()
    last = hook(None, _Bucket(1, last=True))
    finisher.join()
    assert last.done() and last.wait().tolist() == [11.0] * 4
    # Next step: the first bucket starts at once.
    hook(None, _Bucket(0, last=False))
    assert inner.started == [0, 1, 0]


def test_an_error_fails_its_bucket_and_the_chain_goes_on() -> None:
    inner = _Recorder(fail=frozenset({1}))
    hook = ordered_hook(inner)
    f0 = hook(None, _Bucket(0, last=False))
    f1 = hook(None, _Bucket(1, last=False))
    f2 = hook(None, _Bucket(2, last=False))
    inner.finish(0)
    assert inner.started == [0, 1, 2]  # bucket 2 still issues its collectives
    with pytest.raises(ValueError, match="bucket 1 failed"):
        f1.wait()
    inner.pending.pop(2).set_exception(RuntimeError("gloo: connection closed"))
    with pytest.raises(RuntimeError, match="connection closed"):
        f2.wait()
    assert f0.wait().tolist() == [10.0] * 4
    # A failed last bucket returns its failed future instead of raising in backward's thread.
    inner.fail = frozenset({3})
    f3 = hook(None, _Bucket(3, last=True))
    assert f3.done()
    with pytest.raises(ValueError, match="bucket 3 failed"):
        f3.wait()


def test_hooks_that_order_themselves_are_returned_unchanged() -> None:
    def own(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        raise AssertionError("not called")

    setattr(own, ORDERS_COLLECTIVES, True)
    assert ordered_hook(own) is own
    assert ordered_hook(_Recorder()).__qualname__ == "_Recorder"


class _TwoLanes:
    def __init__(self) -> None:
        self.views = ("lane 0", "lane 1")

    def kwplug_lanes(self) -> tuple[str, ...]:
        return self.views


def test_lanes_overlap_consecutive_buckets_and_keep_each_lane_in_order() -> None:
    inner = _Recorder()
    hook = ordered_hook(inner)
    state = _TwoLanes()
    f0 = hook(state, _Bucket(0, last=False))
    f1 = hook(state, _Bucket(1, last=False))
    f2 = hook(state, _Bucket(2, last=False))
    assert inner.started == [0, 1]  # bucket 1 on the other lane overlaps bucket 0
    inner.finish(1)
    assert inner.started == [0, 1]  # bucket 2 waits for bucket 0, its lane's previous
    inner.finish(0)
    assert inner.started == [0, 1, 2]
    assert inner.states == ["lane 0", "lane 1", "lane 0"]  # the hook gets its lane's view
    finisher = threading.Timer(0.05, lambda: (inner.finish(2), inner.finish(3)))
    finisher.start()
    last = hook(state, _Bucket(3, last=True))  # waits for both lanes
    finisher.join()
    assert inner.states[-1] == "lane 1"
    assert [f.wait()[0].item() for f in (f0, f1, f2, last)] == [10.0, 11.0, 12.0, 13.0]
    hook(state, _Bucket(0, last=False))  # next step: lane 0 again, at once
    assert inner.states[-1] == "lane 0" and inner.started[-1] == 0


def test_power_sgd_state_lanes_share_the_state_and_need_warm_start() -> None:
    from kwplug.plugins.ddp_comm_hooks import make_power_sgd_state

    state: Any = make_power_sgd_state(None, {"start_powerSGD_iter": 2})
    assert state.kwplug_lanes() == (state,)  # no process group: no second group
    group = object()
    state.q_process_group = group
    first, second = state.kwplug_lanes()
    assert first is state and second.process_group is group
    second.total_numel_before_compression += 5  # torch's hook updates its counters like this
    second.error_dict["key"] = "error"
    assert state.total_numel_before_compression == 5 and state.error_dict == {"key": "error"}
    assert second.iter == state.iter and second.process_group is not state.process_group
    cold: Any = make_power_sgd_state(None, {"warm_start": False, "use_error_feedback": False})
    cold.q_process_group = group
    assert cold.kwplug_lanes() == (cold,)  # torch's hook clears every bucket's P/Q memories
