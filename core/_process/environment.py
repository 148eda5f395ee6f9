"""Where this process runs: world size, ranks and device, read from torchrun or torch."""

from __future__ import annotations

import os

import attrs
import torch
import torch.distributed as dist


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


@attrs.frozen
class ProcessInfo:
    """Ranks of this process.

    Attributes:
        world_size: number of processes (``WORLD_SIZE`` from torchrun, or the default process
            group's size when one exists); 1 when not distributed.
        rank: global rank ``RANK`` (0 when not distributed).
        local_rank: rank on this node, ``LOCAL_RANK`` (0 when not distributed).
    """

    world_size: int
    rank: int
    local_rank: int

    @classmethod
    def current(cls) -> ProcessInfo:
        """Read the default process group if initialised, else torchrun's variables.

        Raises:
            ValueError: a torchrun variable is not an integer or out of range.
        """
        local_rank = _env_int("LOCAL_RANK", 0)
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank(), local_rank)
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"invalid torchrun environment: WORLD_SIZE={world_size}, RANK={rank} "
                "(need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE)"
            )
        return cls(world_size, rank, local_rank)


def select_device(cpu: bool, local_rank: int) -> torch.device:
    """The device this process trains on.

    ``cpu=True`` forces the CPU. Otherwise the current accelerator reported by
    ``torch.accelerator`` (CUDA, XPU, MPS, or an out-of-tree backend) is used, with index
    ``local_rank`` modulo the device count, and made current; the CPU when there is none.
    ``ACCELERATE_USE_CPU`` set to a true value (``1``, ``yes``...) forces the CPU too, as in
    Accelerate (what ``kwplug.launchers.debug_launcher`` sets).

    Raises:
        ValueError: ``ACCELERATE_USE_CPU`` is neither a true nor a false value.
    """
    from kwplug.utils.environment import parse_flag_from_env

    if cpu or parse_flag_from_env("ACCELERATE_USE_CPU"):
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        if not accelerator.is_available():
            return torch.device("cpu")
        device_type = accelerator.current_accelerator().type
        index = local_rank % max(accelerator.device_count(), 1)
        accelerator.set_device_index(index)
        return torch.device(device_type, index)
    if torch.cuda.is_available():  # torch < 2.6 has no torch.accelerator
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def end_process_group() -> None:
    """Destroy the default process group if there is one, collecting garbage first.

    A DDP reducer collected after its process group is destroyed can abort the process, and
    gloo's worker threads release a collective's tensors just after it returns; so, when a
    group exists, garbage is collected first and a 50 ms pause without the GIL precedes
    ``torch.distributed.destroy_process_group()`` (an exit in that instant can abort with
    "terminate called without an active exception"). Without a group there is nothing whose
    order of destruction matters, and nothing is collected (a full ``gc.collect()`` costs
    100-300 ms). Safe to call more than once.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    import gc
    import time

    gc.collect()
    time.sleep(0.05)
    dist.destroy_process_group()
