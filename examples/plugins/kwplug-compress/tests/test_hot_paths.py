"""The ``"topk"`` hook's block selection in large buckets, and the int8 hook's cached buffers.

Small buckets (under ``TOPK_BLOCKED_MIN``) send the exact top k; test_compress.py checks that
with two processes. Here: the selection rule of large buckets, and that error feedback stays
exact whatever is selected.
"""

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from kwplug_compress import make_int8_state, make_topk_state
from kwplug_compress.hooks import TOPK_BLOCK, TOPK_BLOCKED_MIN, int8_hook, topk_hook, topk_select

NUMEL = TOPK_BLOCKED_MIN + 3 * TOPK_BLOCK + 517  # a short last block


class FakeBucket:
    """Stands in for torch.distributed.GradBucket (Python cannot construct one)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor

    def index(self) -> int:
        return 0

    def parameters(self) -> list[torch.Tensor]:
        return [torch.empty(self._tensor.numel())]


@pytest.fixture
def one_process() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def reference_selection(values: torch.Tensor, k: int) -> set[int]:
    # The documented rule, written out: each block proposes its ceil(k / blocks) largest
    # magnitudes, and the k largest proposals are sent.
    blocks = list(values.abs().split(TOPK_BLOCK))
    per_block = -(-k // len(blocks))
    proposals: list[tuple[float, int]] = []
    for number, block in enumerate(blocks):
        top = block.topk(min(per_block, block.numel()))
        proposals += [
            (float(v), number * TOPK_BLOCK + int(i))
            for v, i in zip(top.values, top.indices, strict=True)
        ]
    proposals.sort(reverse=True)
    return {index for _, index in proposals[:k]}


def test_large_bucket_sends_the_k_largest_block_proposals() -> None:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    # One block holds many large entries: more than it may propose.
    values[TOPK_BLOCK : 2 * TOPK_BLOCK] *= 50
    k = 700
    chosen = topk_select(values, k)
    assert chosen.numel() == k
    assert set(chosen.tolist()) == reference_selection(values, k)
    # Here the rule differs from the exact top k: the crowded block sent only its quota.
    assert set(chosen.tolist()) != set(values.abs().topk(k).indices.tolist())


def test_large_bucket_with_spread_entries_sends_the_exact_top_k() -> None:
    values = torch.rand(NUMEL, generator=torch.Generator().manual_seed(1))
    k = 300
    spread = torch.arange(0, NUMEL, NUMEL // k)[:k]
    values[spread] += 10  # the k largest, at most one per block
    assert set(topk_select(values, k).tolist()) == set(spread.tolist())


def test_non_finite_entries_are_always_sent() -> None:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    values[TOPK_BLOCK * 3 + 5] = float("nan")
    values[NUMEL - 1] = float("inf")
    chosen = set(topk_select(values, 100).tolist())
    assert {TOPK_BLOCK * 3 + 5, NUMEL - 1} <= chosen


@pytest.mark.usefixtures("one_process")
def test_large_bucket_error_feedback_is_exact() -> None:
    # World size 1: the hook returns what was sent; sent + residual is the corrected gradient,
    # bitwise, whatever the selection.
    state = make_topk_state(None, {"ratio": 0.01})
    generator = torch.Generator().manual_seed(3)
    residual = torch.zeros(NUMEL)
    for _ in range(3):
        grad = torch.randn(NUMEL, generator=generator)
        corrected = residual + grad
        sent = topk_hook(state, FakeBucket(grad.clone())).wait()
        residual = state.memory.residual(0, ((NUMEL,),), grad).clone()
        assert int((sent != 0).sum()) == -(-NUMEL // 100)
        assert torch.equal(sent + residual, corrected)
        assert torch.equal(residual[sent != 0], torch.zeros(int((sent != 0).sum())))


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize(
    ("hook", "make_state", "options"),
    [(int8_hook, make_int8_state, {"chunk_size": 512}), (topk_hook, make_topk_state, {})],
)
def test_cached_buffers_give_the_same_result_every_step(
    hook: Any, make_state: Any, options: Any
) -> None:
    # Reusing the payload and work tensors must not leak one step into the next.
    grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(4))
    reused, fresh = make_state(None, {**options, "error_feedback": False}), None
    first = hook(reused, FakeBucket(grad.clone())).wait().clone()
    hook(reused, FakeBucket(torch.randn(NUMEL))).wait()
    again = hook(reused, FakeBucket(grad.clone())).wait()
    fresh = hook(make_state(None, {**options, "error_feedback": False}), FakeBucket(grad.clone()))
    assert torch.equal(again, first)
    assert torch.equal(fresh.wait(), first)
