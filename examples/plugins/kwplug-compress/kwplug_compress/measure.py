"""Measure what the hooks send: bytes handed to ``torch.distributed`` collectives per step.

:func:`count_collective_bytes` wraps the collective functions of the ``torch.distributed``
module and adds up the bytes each call's payload holds on this rank
(``tensor.numel() * tensor.element_size()``). :func:`train_and_measure` trains the
scikit-learn digits MLP (64-128-64-10) under ``torchrun`` with each configuration in turn and
counts only inside ``accelerator.backward()``, where DDP calls the communication hook.

DDP's own all-reduce (``comm_hook="no"``) runs in C++ and never calls the Python functions, so
it counts as 0; the reference is therefore a plain mean all-reduce hook,
:func:`allreduce_mean_hook` (what DDP does: ``numel * 4`` bytes per float32 bucket), which is
registered under ``"allreduce_mean"`` while the measurement runs.

``measure_bytes.py`` next to the package prints the table; the tests assert on the counts.
Needs scikit-learn (the ``test`` extra) for the data.
"""

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

import kwplug

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

__all__ = [
    "BASELINE",
    "COLLECTIVE_PAYLOAD",
    "ByteCounter",
    "allreduce_mean_hook",
    "count_collective_bytes",
    "digits_mlp",
    "train_and_measure",
]

#: Name under which :func:`train_and_measure` registers :func:`allreduce_mean_hook`.
BASELINE = "allreduce_mean"

#: ``torch.distributed`` function name -> (position, name) of the argument holding what this
#: rank contributes.
COLLECTIVE_PAYLOAD: Mapping[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
}


class ByteCounter:
    """Running totals kept by :func:`count_collective_bytes`.

    Attributes:
        active: count calls only while ``True`` (set it around the code to measure).
        bytes: payload bytes contributed by this rank while active.
        calls: collective calls while active, by function name.
    """

    def __init__(self) -> None:
        self.active = False
        self.bytes = 0
        self.calls: dict[str, int] = {}
        # Per thread: hooks may issue collectives from several gloo threads at once.
        self._inside = threading.local()
        self._lock = threading.Lock()

    @property
    def nested(self) -> bool:
        """Whether this thread is inside a counted call (a collective implemented by another)."""
        return bool(getattr(self._inside, "value", False))

    @nested.setter
    def nested(self, value: bool) -> None:
        self._inside.value = value

    def add(self, name: str, payload: Any) -> None:
        """Count one call of ``torch.distributed.<name>`` with ``payload`` (a tensor or a list
        of tensors) if :attr:`active`."""
        if not self.active:
            return
        tensors = payload if isinstance(payload, (list, tuple)) else [payload]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            self.bytes += nbytes
            self.calls[name] = self.calls.get(name, 0) + 1


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[ByteCounter]:
    """Count the bytes this rank hands to ``torch.distributed`` collectives.

    Replaces each function in :data:`COLLECTIVE_PAYLOAD` on the ``torch.distributed`` module
    with a wrapper that records the payload argument's bytes, then calls the original; the
    originals are put back on exit. Only code that calls collectives through the module
    attribute (``dist.all_reduce(...)``) is seen; DDP's built-in C++ all-reduce is not.

    Yields:
        A :class:`ByteCounter`, inactive: set ``counter.active = True`` around what to count.
    """
    counter = ByteCounter()
    originals: dict[str, Callable[..., Any]] = {}

    def wrap(
        name: str, argument: tuple[int, str], original: Callable[..., Any]
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def counting(*args: Any, **kwargs: Any) -> Any:
            if counter.nested:  # one collective implemented by another counts once
                return original(*args, **kwargs)
            position, keyword = argument
            payload = args[position] if len(args) > position else kwargs[keyword]
            counter.add(name, payload)
            counter.nested = True
            try:
                return original(*args, **kwargs)
            finally:
                counter.nested = False

        return counting

    for name, argument in COLLECTIVE_PAYLOAD.items():
        if not hasattr(dist, name):  # e.g. all_gather_single before torch 2.13
            continue
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, argument, originals[name]))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def allreduce_mean_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The reference: average the bucket with one ``torch.distributed.all_reduce`` in its own
    dtype, as DDP does without a hook (``numel * element_size`` bytes per rank)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    if work is None:
        raise RuntimeError("this process is not a member of the hook's process group")
    return cast("torch.futures.Future[Any]", work.get_future()).then(lambda _: buffer)


def digits_mlp() -> torch.nn.Module:
    """The digits MLP: 64 -> 128 -> 64 -> 10 with ReLUs, 17,226 float32 parameters."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # optional: only the measurement needs it

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.long)


def train_and_measure(
    configs: Sequence[tuple[str, Mapping[str, Any]]], steps: int = 60, batch_size: int = 32
) -> dict[str, dict[str, Any]]:
    """Train the digits MLP once per configuration and count each step's collective bytes.

    Run in every process of a ``torchrun`` group (gloo on CPU). Every configuration starts from
    the same weights (seed 0) and trains ``steps`` steps of SGD (lr 0.1, momentum 0.9) on this
    rank's shard of the digits (every ``world_size``-th sample), ``batch_size`` per rank, via
    ``kwplug.Accelerator`` and ``DistributedDataParallelKwargs(comm_hook=name,
    comm_state_option=options)``. The group is destroyed at the end.

    Args:
        configs: ``(comm_hook name, comm_state_option)`` pairs; ``"allreduce_mean"`` is the
            reference (:data:`BASELINE`).
        steps: training steps per configuration.
        batch_size: samples per rank and step.

    Returns:
        Per configuration label (``name`` or ``name:key=value,...``): ``numel`` (parameters),
        ``bytes_per_step`` (this rank's collective payload bytes, total / steps),
        ``calls_per_step``, ``loss_start`` and ``loss_end`` (cross-entropy of the whole data
        set, the same on every rank), and ``params`` (the final flat parameters as a list of
        floats, to compare ranks).

    Raises:
        ValueError: a configuration kwplug or the hook rejects.
    """
    kwplug.register_comm_hook(BASELINE, allreduce_mean_hook, replace=True)
    x, y = _digits()
    loss_fn = torch.nn.CrossEntropyLoss()
    results: dict[str, dict[str, Any]] = {}
    accelerator: kwplug.Accelerator | None = None
    with count_collective_bytes() as counter:
        for name, options in configs:
            handler = kwplug.DistributedDataParallelKwargs(
                comm_hook=name, comm_state_option=dict(options)
            )
            accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
            rank, world = accelerator.process_index, accelerator.num_processes
            torch.manual_seed(0)
            model = digits_mlp()
            numel = sum(p.numel() for p in model.parameters())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model, optimizer = accelerator.prepare(model, optimizer)
            plain = accelerator.unwrap_model(model)
            with torch.no_grad():
                loss_start = loss_fn(plain(x), y).item()
            shard_x, shard_y = x[rank::world], y[rank::world]
            per_epoch = math.ceil(len(shard_y) / batch_size)
            counter.bytes, counter.calls = 0, {}
            for step in range(steps):
                start = (step % per_epoch) * batch_size
                loss = loss_fn(
                    model(shard_x[start : start + batch_size]), shard_y[start : start + batch_size]
                )
                counter.active = True  # DDP runs the hook inside backward
                accelerator.backward(loss)
                counter.active = False
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                loss_end = loss_fn(plain(x), y).item()
            label = name + (
                ":" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) if options else ""
            )
            results[label] = {
                "numel": numel,
                "bytes_per_step": counter.bytes / steps,
                "calls_per_step": {k: v / steps for k, v in counter.calls.items()},
                "loss_start": loss_start,
                "loss_end": loss_end,
                "params": torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).tolist(),
            }
    if accelerator is not None:
        accelerator.end_training()
    kwplug.unregister_comm_hook(BASELINE)
    return results
