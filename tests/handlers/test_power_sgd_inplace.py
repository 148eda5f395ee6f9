"""kwplug's ``"power_sgd_inplace"`` hook: torch's per-tensor PowerSGD to rounding, two
collectives per bucket, error feedback kept in place, DDP's buffer updated without copies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import kwplug
from kwplug.attached_state import attached_states
from kwplug.plugins import ddp_comm_hooks as hooks
from kwplug.testing import run_distributed

OPTIONS = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Matrices compressed (64x48, 128x64), one kept raw (4x128 at rank 2 saves too little),
    # biases raw; with 20 kB buckets, one bucket per layer after DDP's rebuild.
    return torch.nn.Sequential(
        torch.nn.Linear(48, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 4),
    )


def train(hook: str, wrapper: str = "no", unused: bool = False) -> dict[str, Any]:
    """Runs on every rank: 40 steps of kwplug DDP with ``hook``, several buckets."""
    collectives: list[tuple[str, int]] = []
    handler = kwplug.DistributedDataParallelKwargs(
        comm_hook=hook,
        comm_wrapper=wrapper,
        bucket_cap_mb=0.02,  # ~20 kB: a bucket per layer
        find_unused_parameters=unused,
        comm_state_option=dict(OPTIONS),
    )
    accelerator = kwplug.Accelerator(kwargs_handlers=[handler])
    plain = _model()
    model, optimizer = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    state = model._get_ddp_logging_data()
    all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        collectives.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    generator = torch.Generator().manual_seed(100 + accelerator.process_index)
    target = torch.randn(48, 4, generator=torch.Generator().manual_seed(7))
    batches = [torch.randn(32, 48, generator=generator) for _ in range(4)]
    losses, error_ptrs = [], []
    (attached,) = attached_states(model)
    hook_state = attached.state  # the live PowerSGDState the hook was registered with
    for step in range(40):
        x = batches[step % len(batches)]
        loss = (model(x) - x @ target * 0.2).square().mean()
        if step == 10:
            dist.all_reduce = counting  # type: ignore[assignment]
        accelerator.backward(loss)
        dist.all_reduce = all_reduce
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step >= 3:
            error_ptrs.append(
                sorted((str(k), v.data_ptr(), v.numel()) for k, v in hook_state.error_dict.items())
            )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buckets = len(model.reducer._get_zeros_like_grad_buckets())
    return {
        "params": flat.tolist(),
        "losses": losses,
        "comm_hook": state["comm_hook"],
        "collectives": collectives,
        "buckets": buckets,
        "error_ptrs": error_ptrs,
    }


def _trains(losses: list[float]) -> bool:
    # The loss over the last pass through the 4 batches is under 3/4 of the first pass's.
    return sum(losses[-4:]) < 0.75 * sum(losses[:4])


def _runs(*configs: tuple[Any, ...]) -> list[dict[str, Any]]:
    return [run_distributed(train, *config, nproc=2, timeout=180) for config in configs]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    names = ["power_sgd", "power_sgd_inplace", "power_sgd_inplace-fp16", "power_sgd_inplace-unused"]
    configs = [("power_sgd",), ("power_sgd_inplace",), ("power_sgd_inplace", "fp16")]
    configs.append(("power_sgd_inplace", "no", True))
    return dict(zip(names, _runs(*configs), strict=True))


def test_matches_torchs_power_sgd_to_rounding(results: dict[str, list[dict[str, Any]]]) -> None:
    torchs, ours = results["power_sgd"], results["power_sgd_inplace"]
    for reference, rank in zip(torchs, ours, strict=True):
        assert rank["buckets"] > 1
        assert rank["comm_hook"] == "power_sgd_inplace_hook"  # what reached DDP
        expected = torch.tensor(reference["params"])
        got = torch.tensor(rank["params"])
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)
        assert _trains(rank["losses"])
    assert ours[0]["params"] == ours[1]["params"]  # ranks identical


def test_two_collectives_per_bucket(results: dict[str, list[dict[str, Any]]]) -> None:
    # torch's hook all-reduces the raw tensors, then P, then Q: three per bucket. Here the
    # raw tensors travel with P: two per bucket, sized [raw + P] and Q.
    ours = results["power_sgd_inplace"][0]
    torchs = results["power_sgd"][0]
    buckets = ours["buckets"]
    assert len(ours["collectives"]) == 2 * buckets
    assert len(torchs["collectives"]) > len(ours["collectives"])
    sent = sum(numel for _, numel in ours["collectives"])
    assert sent == sum(numel for _, numel in torchs["collectives"])  # same bytes


def test_error_feedback_stays_in_place(results: dict[str, list[dict[str, Any]]]) -> None:
    ptrs = results["power_sgd_inplace"][0]["error_ptrs"]
    assert ptrs and all(step == ptrs[0] for step in ptrs)  # never reallocated
    # One error tensor per bucket, sized to its compressed matrices only (none for the bucket
    # of the 4x128 layer and the biases).
    sizes = sorted(numel for _, _, numel in ptrs[0] if numel)
    assert sizes == sorted([64 * 48, 128 * 64])


def test_with_a_wrapper_and_unused_parameter_map(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    for name in ("power_sgd_inplace-fp16", "power_sgd_inplace-unused"):
        rank0, rank1 = results[name]
        assert rank0["params"] == rank1["params"], name
        assert _trains(rank0["losses"]), name


class _Bucket:
    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int) -> None:
        self._buffer, self._shapes, self._index = buffer, shapes, index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == 0

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in self._shapes:
            numel = int(torch.Size(shape).numel())
            views.append(self._buffer.narrow(0, offset, numel).view(shape))
            offset += numel
        return views


@pytest.mark.usefixtures("one_process_group")
def test_one_process_is_the_rank_two_approximation_plus_error() -> None:
    state = hooks.make_power_sgd_state(None, {**OPTIONS, "start_powerSGD_iter": 2})
    state.iter = 2
    grad = torch.randn(40 * 30 + 30, generator=torch.Generator().manual_seed(0))
    buffer = grad.clone()
    out = hooks.power_sgd_inplace_hook(state, _Bucket(buffer, [(40, 30), (30,)], 0)).wait()
    assert out is buffer
    error = state.error_dict[0]
    assert error.shape == (40 * 30,)
    # The bias is averaged as is; the matrix is its rank-2 approximation, error the residual.
    torch.testing.assert_close(out[1200:], grad[1200:])
    torch.testing.assert_close(out[:1200] + error, grad[:1200])
    assert torch.linalg.matrix_rank(out[:1200].view(40, 30)).item() == 2
    assert state.iter == 3


@pytest.mark.usefixtures("one_process_group")
def test_gradients_outside_the_buffer_are_refused() -> None:
    state = hooks.make_power_sgd_state(None, dict(OPTIONS))
    state.iter = 5

    class Detached(_Bucket):
        def gradients(self) -> list[torch.Tensor]:
            return [g.clone() for g in super().gradients()]

    with pytest.raises(RuntimeError, match="views into its buffer"):
        hooks.power_sgd_inplace_hook(state, Detached(torch.randn(64), [(8, 8)], 0))
