"""kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook, in one process, with stand-in buckets.

The end-to-end property (a resumed 2-process PowerSGD run is bitwise equal to an uninterrupted
one) is tests/checkpoint/test_checkpoint.py::test_ddp_power_sgd_resume_is_bitwise_exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from kwplug import DistributedDataParallelKwargs
from kwplug.plugins import ddp_comm_hooks as hooks


class RealBucket:
    """Duck-typed ``GradBucket`` with DDP's layout: gradients are views into one buffer, in
    the order given (optionally with a gap between them)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        *,
        index: int = 0,
        last: bool = True,
        gap: int = 0,
    ) -> None:
        self._params = list(params)
        pieces = []
        for grad in grads:
            pieces += [grad.reshape(-1), torch.full((gap,), float("nan"))]
        self._buffer = torch.cat(pieces)
        self._offsets = []
        offset = 0
        for grad in grads:
            self._offsets.append(offset)
            offset += grad.numel() + gap
        self._shapes = [grad.shape for grad in grads]
        self._index = index
        self._last = last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        # As GradBucket.set_buffer: gradients() become views into the new buffer.
        self._buffer = tensor

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return [
            self._buffer.narrow(0, offset, shape.numel()).view(shape)
            for offset, shape in zip(self._offsets, self._shapes, strict=True)
        ]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def params_and_grads() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    shapes = [(16, 8), (8,), (8, 16), (3,)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    grads = [torch.randn(shape) for shape in shapes]
    return params, grads


def done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class Recorder:
    """Inner hook: records what it sees, returns ``10 * buffer`` as a new tensor."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.seen.append(
            {
                "buffer": buffer.clone(),
                "data_ptr": buffer.data_ptr(),
                "grads": bucket.gradients(),
                "params": bucket.parameters(),
                "index": bucket.index(),
                "last": bucket.is_last(),
            }
        )
        return done(buffer * 10)


def canonical(grads: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    return torch.cat([grads[i].reshape(-1) for i in order])


@pytest.mark.parametrize("gap", [0, 2], ids=["dense", "gaps"])
def test_reordered_bucket_is_presented_in_canonical_order(gap: int) -> None:
    params, grads = params_and_grads()
    real_order = [3, 1, 2, 0]  # e.g. DDP's rebuilt, gradient-ready order
    bucket = RealBucket([params[i] for i in real_order], [grads[i] for i in real_order], gap=gap)
    real = bucket.buffer()
    recorder = Recorder()
    hook = hooks.canonical_bucket_hook(recorder, params)
    out = hook(None, bucket).wait()  # type: ignore[arg-type]
    (seen,) = recorder.seen
    assert torch.equal(seen["buffer"], canonical(grads, [0, 1, 2, 3]))
    assert seen["index"] == (0, 1, 2, 3)
    assert seen["last"] is True
    assert [p is q for p, q in zip(seen["params"], params, strict=True)] == [True] * 4
    # gradients(): views into the canonical buffer, in canonical order, with their shapes.
    for view, grad in zip(seen["grads"], grads, strict=True):
        assert view.shape == grad.shape and torch.equal(view, grad)
        assert seen["data_ptr"] <= view.data_ptr() < seen["data_ptr"] + 4 * seen["buffer"].numel()
    # The result lands in DDP's own layout, and the real buffer is returned.
    assert out is real
    for view, i in zip(bucket.gradients(), real_order, strict=True):
        assert torch.equal(view, grads[i] * 10)


def test_canonical_layout_is_used_in_place() -> None:
    params, grads = params_and_grads()
    bucket = RealBucket(params, grads)  # DDP's initial layout: parameters() order
    recorder = Recorder()
    out = hooks.canonical_bucket_hook(recorder, params)(None, bucket).wait()  # type: ignore[arg-type]
    assert recorder.seen[0]["data_ptr"] == bucket.buffer().data_ptr()  # no gather copy
    assert out is bucket.buffer()
    assert torch.equal(out, canonical(grads, [0, 1, 2, 3]) * 10)


def test_same_parameters_get_the_same_index_in_any_layout() -> None:
    params, grads = params_and_grads()
    recorder = Recorder()
    hook = hooks.canonical_bucket_hook(recorder, params)
    hook(None, RealBucket([params[2], params[0]], [grads[2], grads[0]], index=1))  # type: ignore[arg-type]
    hook(None, RealBucket([params[0], params[2]], [grads[0], grads[2]], index=0))  # type: ignore[arg-type]
    assert [seen["index"] for seen in recorder.seen] == [(0, 2), (0, 2)]
    assert torch.equal(recorder.seen[0]["buffer"], recorder.seen[1]["buffer"])


class KeyedState:
    def __init__(self, *keys: Any) -> None:
        self.error_dict = dict.fromkeys(keys)


def test_bucket_tiled_by_state_keys_runs_the_hook_per_tile() -> None:
    # A resumed run's first step: DDP still has one bucket, the saved state was built on two.
    params, grads = params_and_grads()
    bucket = RealBucket(params, grads, last=True)
    recorder = Recorder()
    hook = hooks.canonical_bucket_hook(
        recorder, params, state_buckets=hooks.power_sgd_state_buckets
    )
    out = hook(KeyedState((2, 3), (0, 1), 7), bucket).wait()  # type: ignore[arg-type]
    # Tiles in gradient-ready order (later parameters first); only the last one is "last".
    assert [(s["index"], s["last"]) for s in recorder.seen] == [((2, 3), False), ((0, 1), True)]
    assert torch.equal(recorder.seen[0]["buffer"], canonical(grads, [2, 3]))
    assert torch.equal(out, canonical(grads, [0, 1, 2, 3]) * 10)
    # Keys that do not tile the bucket exactly: the bucket runs whole, under its own key.
    for state in (KeyedState((2, 3)), KeyedState((1, 2, 3), (0, 1)), KeyedState(0, 1)):
        recorder.seen.clear()
        hook(state, RealBucket(params, grads))  # type: ignore[arg-type]
        assert [s["index"] for s in recorder.seen] == [(0, 1, 2, 3)]


class LayoutState(KeyedState):
    """A state that opts into a recorded bucket layout (as kwplug's PowerSGD state does)."""

    def __init__(self, *keys: Any, layout: Any = None) -> None:
        super().__init__(*keys)
        self.kwplug_bucket_layout = layout


def test_the_recorded_layout_cuts_a_resumed_first_bucket_in_its_order() -> None:
    params, grads = params_and_grads()
    recorder = Recorder()
    hook = hooks.canonical_bucket_hook(
        recorder, params, state_buckets=hooks.power_sgd_state_buckets
    )
    # A step on two buckets, with no key in the state (before compression starts): the
    # state records the step's keys, in DDP's order and each bucket's own parameter order.
    state = LayoutState()
    first = [params[1], params[0]], [grads[1], grads[0]]
    hook(state, RealBucket(*first, index=0, last=False))  # type: ignore[arg-type]
    assert state.kwplug_bucket_layout is None  # recorded at the step's last bucket
    hook(state, RealBucket([params[3], params[2]], [grads[3], grads[2]], index=1))  # type: ignore[arg-type]
    assert state.kwplug_bucket_layout == ((1, 0), (3, 2))
    # Its own record does not cut the next step's buckets (DDP may have rebuilt them): a
    # bucket runs under its own order, as torch's hook would see it.
    recorder.seen.clear()
    order = [2, 0, 3, 1]
    hook(state, RealBucket([params[i] for i in order], [grads[i] for i in order]))  # type: ignore[arg-type]
    assert [s["index"] for s in recorder.seen] == [tuple(order)]
    assert state.kwplug_bucket_layout == (tuple(order),)
    # A resumed run's first step (one bucket, DDP's initial layout): cut along the saved
    # layout, in its order (not the usual later-parameters-first), even over a stale key.
    recorder.seen.clear()
    resumed = LayoutState((0, 1, 2, 3), layout=((1, 0), (3, 2)))
    out = hook(resumed, RealBucket(params, grads)).wait()  # type: ignore[arg-type]
    assert [(s["index"], s["last"]) for s in recorder.seen] == [((1, 0), False), ((3, 2), True)]
    assert torch.equal(recorder.seen[1]["buffer"], canonical(grads, [3, 2]))
    assert torch.equal(out, canonical(grads, [0, 1, 2, 3]) * 10)
    assert resumed.kwplug_bucket_layout == ((1, 0), (3, 2))
    # No layout (a checkpoint from before kwplug saved it), or one that does not fit: the
    # state's keys decide, as before.
    for layout in (None, ((0, 1),), "not a layout"):
        recorder.seen.clear()
        hook(LayoutState((2, 3), (0, 1), layout=layout), RealBucket(params, grads))  # type: ignore[arg-type]
        assert [s["index"] for s in recorder.seen] == [(2, 3), (0, 1)]


@pytest.mark.usefixtures("one_process_group")
def test_power_sgd_state_saves_and_restores_its_bucket_layout() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    options = {"start_powerSGD_iter": 2}
    state = hooks.make_power_sgd_state(None, options)
    assert "kwplug_bucket_layout" not in hooks.power_sgd_state_dict(state)  # no step yet
    state.kwplug_bucket_layout = ((1, 0), (3, 2))  # type: ignore[attr-defined]
    saved = hooks.power_sgd_state_dict(state)
    assert saved["kwplug_bucket_layout"] == ((1, 0), (3, 2))
    fresh = hooks.make_power_sgd_state(None, options)
    hooks.load_power_sgd_state(fresh, saved)
    assert fresh.kwplug_bucket_layout == ((1, 0), (3, 2))  # type: ignore[attr-defined]
    # Kept across sizes (the same on every process); an older checkpoint has none.
    resized = hooks.resize_power_sgd_state(saved, 2, 3)
    assert resized["kwplug_bucket_layout"] == ((1, 0), (3, 2)) and "error_dict" not in resized
    old = {k: v for k, v in saved.items() if k != "kwplug_bucket_layout"}
    hooks.load_power_sgd_state(fresh, old)
    assert fresh.kwplug_bucket_layout is None  # type: ignore[attr-defined]
    plain = PowerSGDState(process_group=None, start_powerSGD_iter=2)
    hooks.load_power_sgd_state(plain, saved)  # no slot for it: ignored
    assert plain.iter == state.iter


POWER_SGD_HOOKS = [
    torch_psgd.powerSGD_hook,
    hooks.batched_power_sgd_hook,
    hooks.fp16_compress_wrapper(torch_psgd.powerSGD_hook),
]
POWER_SGD_IDS = ["power_sgd", "batched_power_sgd", "fp16_wrapper_power_sgd"]


def _psgd_step(
    hook: Any, state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], layout: list[int]
) -> torch.Tensor:
    # One bucket in ``layout``'s order; the averaged gradients DDP receives (the future's
    # tensor, laid out like the bucket), back in parameter order.
    bucket = RealBucket([params[i] for i in layout], [grads[i] for i in layout])
    out = hook(state, bucket).wait()
    pieces = out.split([grads[i].numel() for i in layout])
    by_param = dict(zip(layout, pieces, strict=True))
    return torch.cat([by_param[i] for i in range(len(params))])


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("inner", POWER_SGD_HOOKS, ids=POWER_SGD_IDS)
def test_power_sgd_state_follows_its_layout_into_another(inner: Any) -> None:
    # A resumed run: the state is built on one layout (DDP's rebuilt buckets, compression from
    # the third step on), then its process goes on in another (a fresh DDP's first step). Both
    # continuations give bitwise the same averaged gradients and state, step after step.
    params, _ = params_and_grads()
    options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    states = [hooks.make_power_sgd_state(None, options) for _ in range(2)]
    hook = hooks.canonical_bucket_hook(inner, params, state_buckets=hooks.power_sgd_state_buckets)
    built_in = [3, 1, 2, 0]
    for step in range(7):
        grads = [torch.randn(p.shape) for p in params]
        later = built_in if step < 4 else [0, 1, 2, 3]
        results = [
            _psgd_step(hook, states[0], params, grads, built_in),
            _psgd_step(hook, states[1], params, grads, later),
        ]
        assert torch.equal(results[0], results[1]), step
    assert states[0].iter == states[1].iter == 7
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        first, second = getattr(states[0], name), getattr(states[1], name)
        # The key records the layout the state was built in.
        assert list(first) == list(second) == [tuple(built_in)], name
        assert torch.equal(first[tuple(built_in)], second[tuple(built_in)]), name


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("inner", POWER_SGD_HOOKS, ids=POWER_SGD_IDS)
def test_power_sgd_on_ddp_layout_is_torch_bitwise(inner: Any) -> None:
    # On the layout its state was built in, the wrapped hook computes what the hook computes
    # on DDP's bucket directly (same random draws, same matrices): weights equal Accelerate's.
    params, _ = params_and_grads()
    options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    wrapped_state, raw_state = (hooks.make_power_sgd_state(None, options) for _ in range(2))
    wrapped = hooks.canonical_bucket_hook(
        inner, params, state_buckets=hooks.power_sgd_state_buckets
    )
    layout = [3, 1, 2, 0]
    for step in range(6):
        grads = [torch.randn(p.shape) for p in params]
        ours = _psgd_step(wrapped, wrapped_state, params, grads, layout)
        theirs = _psgd_step(inner, raw_state, params, grads, layout)
        assert torch.equal(ours, theirs), step
    assert [key for key in wrapped_state.p_memory_dict] == [tuple(layout)]
    assert torch.equal(wrapped_state.p_memory_dict[tuple(layout)], raw_state.p_memory_dict[0])
    assert wrapped_state.rng.get_state()[2] == raw_state.rng.get_state()[2]


def test_hook_keeps_its_name_and_is_accepted_by_ddp() -> None:
    params, _ = params_and_grads()
    hook = hooks.canonical_bucket_hook(torch_psgd.powerSGD_hook, params)
    assert hook.__name__ == hook.__qualname__ == "powerSGD_hook"  # what DDP logs
    assert hooks.ddp_compatible_hook(hook) is hook
    wrapped = hooks.canonical_bucket_hook(hooks.bf16_compress_wrapper(noop), params)
    assert wrapped.__qualname__ == "kwplug_bf16_compress_wrapper_hook[noop]"
    with pytest.raises(TypeError, match="callable"):
        hooks.canonical_bucket_hook("not a hook", params)  # type: ignore[arg-type]


def noop(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    return done(bucket.buffer())


def test_set_buffer_checks_the_size() -> None:
    bucket = hooks.CanonicalBucket(torch.zeros(6), (0,), True, [], [torch.Size([2, 3])])
    bucket.set_buffer(torch.ones(6, dtype=torch.float16))
    assert bucket.gradients()[0].dtype == torch.float16
    with pytest.raises(ValueError, match="6 elements"):
        bucket.set_buffer(torch.zeros(5))
    assert "numel=6" in repr(bucket)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("comm_hook", "comm_wrapper", "canonical_view"),
    [
        ("power_sgd", "no", True),
        ("batched_power_sgd", "bf16", True),
        ("fp16", "no", False),
        ("no", "fp16", False),
    ],
)
def test_wrap_model_uses_the_canonical_view_for_power_sgd(
    comm_hook: str, comm_wrapper: str, canonical_view: bool
) -> None:
    handler = DistributedDataParallelKwargs(
        comm_hook=comm_hook,
        comm_wrapper=comm_wrapper,
        comm_state_option={"start_powerSGD_iter": 2} if "power_sgd" in comm_hook else {},
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 1))
    ddp = handler.wrap_model(
        model=model, device=torch.device("cpu"), world_size=2, comm_hooks=hooks.comm_hooks()
    )
    assert ddp is not None
    ((registered, _),) = ddp._comm_hooks
    assert (registered.__code__.co_name == "canonical_hook") is canonical_view
    for _ in range(4):  # DDP rebuilds its buckets after the first step
        ddp(torch.randn(8, 6)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    del ddp
