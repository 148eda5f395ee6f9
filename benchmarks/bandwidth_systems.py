"""The trainings :mod:`benchmarks.bandwidth_worker` times: one per (system, hook) pair.

Systems:

- ``raw``: ``torch.nn.parallel.DistributedDataParallel`` with torch's own hooks registered by
  hand (``default_hooks.fp16_compress_hook``, ``powerSGD_hook.powerSGD_hook``, ...); int8 and
  top-k, which torch lacks, are kwplug-compress's hook functions registered the same way;
- ``accelerate``: Hugging Face Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)``
  (torch's hooks; no int8/top-k) and ``accelerate.local_sgd.LocalSGD``;
- ``kwplug``: ``kwplug.Accelerator`` with ``kwplug.DistributedDataParallelKwargs(comm_hook=...)``;
  ``kwplug_blocking`` (only when named in ``--configs``) is the same with the former blocking
  gloo ordering of PowerSGD's buckets, for a before/after in one launch.

``local_sgd`` is DDP whose gradients stay local (``no_sync``) and whose parameters are averaged
every :data:`LOCAL_SGD_PERIOD` steps (torch's
``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``; Accelerate's
own ``LocalSGD`` for Accelerate).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``step(batches)`` trains one step per batch.
Step = Callable[[Sequence[Batch]], None]

SYSTEMS: tuple[str, ...] = ("raw", "accelerate", "kwplug")
HOOKS: tuple[str, ...] = (
    "no",
    "fp16",
    "bf16",
    "power_sgd",
    "batched_power_sgd",
    "power_sgd_inplace",
    "int8",
    "topk",
    "local_sgd",
)
WIDTH = 1024
BATCH = 32
LR = 0.01
LOCAL_SGD_PERIOD = 4
#: ``cpu`` (gloo, default) or ``cuda`` (nccl, one GPU per rank), set by the launcher.
DEVICE_ENV = "KWPLUG_BENCH_DEVICE"
POWER_SGD: dict[str, Any] = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
TOPK: dict[str, Any] = {"ratio": 0.01}


def device() -> torch.device:
    """This rank's device: the CPU, or ``cuda:LOCAL_RANK`` under ``KWPLUG_BENCH_DEVICE=cuda``."""
    if os.environ.get(DEVICE_ENV, "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def make_model() -> torch.nn.Module:
    """The 3-layer, 1024-wide MLP (2,109,450 float32 parameters), the same on every call."""
    torch.manual_seed(0)
    return _mlp().to(device())


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )


def make_batches(rank: int, count: int = 8) -> list[Batch]:
    """``count`` fixed batches of :data:`BATCH` samples, different on every rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(BATCH, WIDTH, generator=gen).to(device()),
            torch.randint(0, 10, (BATCH,), generator=gen).to(device()),
        )
        for _ in range(count)
    ]


def options(hook: str) -> dict[str, Any]:
    """``comm_state_option`` of ``hook``."""
    if "power_sgd" in hook:
        return dict(POWER_SGD)
    return dict(TOPK) if hook == "topk" else {}


def supported(system: str, hook: str) -> bool:
    """Whether ``system`` offers ``hook`` (Accelerate has no int8/top-k/power_sgd_inplace)."""
    return not (system == "accelerate" and hook in ("int8", "topk", "power_sgd_inplace"))


def _loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    backward: Callable[[torch.Tensor], None],
    local_sgd: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    after_step: Callable[[], None] | None = None,
) -> Step:
    loss_fn = torch.nn.functional.cross_entropy

    def step(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            context = local_sgd() if local_sgd is not None else contextlib.nullcontext()
            with context:
                backward(loss_fn(model(x), y))
            opt.step()
            if after_step is not None:  # before zero_grad: the averager skips grad-less params
                after_step()
            opt.zero_grad()

    return step


def local_step() -> Step:
    """A single-process step of the same model: the compute floor (no communication)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return _loop(model, opt, torch.autograd.backward)


def _torch_hook(hook: str) -> tuple[Any, Any]:
    """(state, hook function) of torch's hook ``hook`` -- or kwplug-compress's int8/top-k."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook in ("fp16", "bf16"):
        return None, getattr(default_hooks, f"{hook}_compress_hook")
    if hook == "power_sgd":
        return powerSGD_hook.PowerSGDState(None, **POWER_SGD), powerSGD_hook.powerSGD_hook
    if hook == "batched_power_sgd":
        state = powerSGD_hook.PowerSGDState(None, **POWER_SGD)
        return state, powerSGD_hook.batched_powerSGD_hook
    if hook == "power_sgd_inplace":  # torch lacks it: kwplug's function and state, by hand
        from kwplug.plugins import ddp_comm_hooks

        state = ddp_comm_hooks.make_power_sgd_state(None, POWER_SGD)
        return state, ddp_comm_hooks.power_sgd_inplace_hook
    import kwplug_compress

    if hook == "int8":
        return kwplug_compress.make_int8_state(None, {}), kwplug_compress.int8_hook
    return kwplug_compress.make_topk_state(None, dict(TOPK)), kwplug_compress.topk_hook


def _averager() -> Callable[[torch.nn.Module], Callable[[], None]]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    def bind(model: torch.nn.Module) -> Callable[[], None]:
        averager = PeriodicModelAverager(period=LOCAL_SGD_PERIOD, warmup_steps=0)
        return lambda: averager.average_parameters(model.parameters())

    return bind


def build_raw(hook: str) -> Step:
    """Hand-written DDP, torch's hook registered directly."""
    ids = [device().index] if device().type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(make_model(), device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if hook == "local_sgd":
        return _loop(model, opt, torch.autograd.backward, model.no_sync, _averager()(model))
    if hook != "no":
        model.register_comm_hook(*_torch_hook(hook))
    return _loop(model, opt, torch.autograd.backward)


def build_kwplug(hook: str) -> Step:
    """``kwplug.Accelerator`` with ``DistributedDataParallelKwargs(comm_hook=hook)``."""
    import kwplug

    ddp_hook = "no" if hook == "local_sgd" else hook
    handler = kwplug.DistributedDataParallelKwargs(
        comm_hook=ddp_hook, comm_state_option=options(ddp_hook)
    )
    accelerator = kwplug.Accelerator(cpu=device().type == "cpu", kwargs_handlers=[handler])
    plain = make_model()
    model, opt = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    if hook == "local_sgd":  # kwplug has no LocalSGD helper: the prepared DDP + torch's averager
        return _loop(model, opt, accelerator.backward, model.no_sync, _averager()(model))
    return _loop(model, opt, accelerator.backward)


def build_kwplug_blocking(hook: str) -> Step:
    """:func:`build_kwplug` with kwplug's former gloo ordering of chained hooks: each bucket run
    to completion inside the hook (``serialized_hook``) instead of ``ordered_hook``'s chain.

    Not one of :data:`SYSTEMS`: ``--configs kwplug:power_sgd,kwplug_blocking:power_sgd``
    times the two side by side, in interleaved blocks of one launch.
    """
    from kwplug.plugins.ddp_comm_hooks import _compose, serialized_hook

    chained = _compose.ordered_hook
    _compose.ordered_hook = serialized_hook  # only while prepare() composes the hook
    try:
        return build_kwplug(hook)
    finally:
        _compose.ordered_hook = chained


def build_accelerate(hook: str) -> Step:
    """Accelerate with its ``DistributedDataParallelKwargs`` (or its ``LocalSGD``)."""
    import accelerate
    from accelerate.utils import DDPCommunicationHookType

    ddp_hook = "no" if hook == "local_sgd" else hook
    handler = accelerate.DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(ddp_hook), comm_state_option=options(ddp_hook)
    )
    accelerator = accelerate.Accelerator(cpu=device().type == "cpu", kwargs_handlers=[handler])
    torch.set_num_threads(1)
    plain = make_model()
    model, opt = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    if hook != "local_sgd":
        return _loop(model, opt, accelerator.backward)
    from accelerate.local_sgd import LocalSGD

    local = LocalSGD(accelerator, model, local_sgd_steps=LOCAL_SGD_PERIOD, enabled=True)
    local.__enter__()  # kept open for the life of the process: it only holds a counter
    loss_fn = torch.nn.functional.cross_entropy

    def step(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            with accelerator.no_sync(model):
                accelerator.backward(loss_fn(model(x), y))
            opt.step()
            local.step()
            opt.zero_grad()

    return step


BUILDERS: dict[str, Callable[[str], Step]] = {
    "raw": build_raw,
    "accelerate": build_accelerate,
    "kwplug": build_kwplug,
    "kwplug_blocking": build_kwplug_blocking,
}


def wire_bytes() -> int:
    """Bytes sent so far on this network namespace's loopback (``/proc/self/net/dev``)."""
    with open("/proc/self/net/dev", encoding="ascii") as handle:
        for line in handle:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])  # transmit bytes
    return 0


@contextlib.contextmanager
def payload_counter() -> Iterator[Any]:
    """kwplug-compress's collective byte counter (what the Python hooks hand to collectives)."""
    from kwplug_compress.measure import count_collective_bytes

    with count_collective_bytes() as counter:
        counter.active = True
        yield counter


def agree(ok: bool) -> bool:
    """True when ``ok`` on every rank."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
