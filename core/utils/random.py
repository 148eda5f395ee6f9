"""``set_seed``: seed Python, NumPy, torch and every available device in one call."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from typing import Any

import torch

from kwplug._process.environment import ProcessInfo
from kwplug.validators import is_int

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]

#: NumPy's legacy ``np.random.seed`` accepts exactly this range; the other generators accept it.
_SEED_LIMIT = 2**32


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, NumPy's global generator, torch's CPU generator and every device's.

    The streams equal those after ``accelerate.utils.set_seed`` with the same arguments. The
    device generators seeded are CUDA's (``torch.cuda.manual_seed_all``, a deferred no-op
    without CUDA), and XPU's, MPS's and the current ``torch.accelerator``'s when available
    (Accelerate seeds only the first of these it finds).

    Args:
        seed: ``int`` in ``[0, 2**32)`` (NumPy's range), after adding the process index.
        device_specific: add this process's global rank (``RANK``, or the default process
            group's rank) to ``seed``, so that ranks draw different numbers.
        deterministic: also call ``torch.use_deterministic_algorithms(True)``; a
            non-deterministic operation then raises ``RuntimeError`` when it runs (CUDA also
            needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` for some of them).

    Raises:
        TypeError: ``seed`` is not an ``int`` (a ``bool`` is refused), or a flag is not a bool.
        ValueError: the seed is outside ``[0, 2**32)``.
    """
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {seed!r} of type {type(seed).__name__}")
    for name, flag in (("device_specific", device_specific), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if device_specific:
        seed += ProcessInfo.current().rank
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    if importlib.util.find_spec("numpy") is not None:  # imported only when seeding, not by kwplug
        import numpy as np

        np.random.seed(seed)
    torch.manual_seed(seed)
    _seed_devices(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _seed_devices(seed: int) -> None:
    # torch.manual_seed already reaches the built-in backends in recent torch; seeding each
    # explicitly keeps every visible device of every backend seeded on older versions too.
    torch.cuda.manual_seed_all(seed)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        device_type = accelerator.current_accelerator().type
        backend = getattr(torch, device_type, None)
        seed_all = getattr(backend, "manual_seed_all", None)
        if callable(seed_all):
            seed_all(seed)


def synchronize_rng_state(
    rng_type: str | None = None, generator: torch.Generator | None = None
) -> None:
    """Give every process the state of process 0's generator ``rng_type`` (Accelerate's
    function): the state is read with the generator's ``get_rng_state``/``get_state``, sent
    with ``torch.distributed.broadcast`` and set on the others. Nothing without a process
    group of several processes.

    Args:
        rng_type: a :class:`~kwplug.utils.RNGType` value: ``"torch"`` (the CPU generator),
            ``"cuda"``, ``"xpu"``, ``"npu"``, ``"mlu"``, ``"musa"``, ``"sdaa"``, ``"hpu"``,
            ``"neuron"`` (that device module's current generator), or ``"generator"``
            (``generator``). ``None`` does nothing (Accelerate's default).
        generator: the ``torch.Generator`` for ``"generator"``.

    Raises:
        ValueError: ``rng_type`` is not an RNGType value, ``"xla"`` (kwplug has no XLA
            support), or ``"generator"`` without ``generator``.
        RuntimeError: the device module of ``rng_type`` is not available here.
    """
    from kwplug.utils.dataclasses import RNGType
    from kwplug.utils.operations import _object_device, _world_size

    if rng_type is None:
        return
    try:
        kind = RNGType(rng_type)
    except ValueError:
        choices = ", ".join(repr(t.value) for t in RNGType)
        raise ValueError(f"rng_type must be one of {choices}, got {rng_type!r}") from None
    if kind is RNGType.XLA:
        raise ValueError("rng_type 'xla': kwplug has no XLA support")
    get: Callable[[], torch.Tensor]
    put: Callable[[torch.Tensor], Any]
    if kind is RNGType.GENERATOR:
        if not isinstance(generator, torch.Generator):
            raise ValueError("rng_type 'generator' needs generator=<torch.Generator>")
        get, put = generator.get_state, generator.set_state
    elif kind is RNGType.TORCH:
        get, put = torch.get_rng_state, torch.set_rng_state
    else:
        module = getattr(torch, kind.value, None)
        if module is None or not module.is_available():
            raise RuntimeError(f"rng_type {kind.value!r}: torch.{kind.value} is not available")
        get, put = module.get_rng_state, module.set_rng_state
    if _world_size() == 1:
        return
    import torch.distributed as dist

    # The state is a uint8 CPU tensor; the collective runs on the backend's device.
    state = get()
    device = _object_device(None)
    sent = state.to(device)
    dist.broadcast(sent, src=0)
    put(sent.cpu())


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``, in order.

    Raises:
        ValueError: see :func:`synchronize_rng_state`.
    """
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
