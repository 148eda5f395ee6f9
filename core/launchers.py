"""``notebook_launcher`` and ``debug_launcher``: run a training function in several local
processes from Python (a notebook, a test), with Accelerate's signatures.

Both hand the function to torch's own elastic agent
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs): it starts the
processes with torchrun's variables (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so an ``Accelerator`` or ``PartialState`` built inside the
function joins the run exactly as under ``torchrun``. Processes are forked (as Accelerate's
launchers do), so the function may be defined in the notebook or be a closure.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from kwplug.utils.environment import patch_environment
from kwplug.validators import is_int

__all__ = ["debug_launcher", "notebook_launcher"]


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> dict[int, Any] | None:
    """Run ``function(*args)`` in ``num_processes`` processes on this machine (per node).

    Args:
        function: the training function; it builds its ``Accelerator`` itself.
        args: positional arguments for ``function``.
        num_processes: processes per node (``int >= 1``); required, as in Accelerate off
            Colab/Kaggle. With 1, ``function`` runs in this process.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` (any case): with several
            processes, set as ``ACCELERATE_MIXED_PRECISION`` for them, which an
            ``Accelerator()`` built inside ``function`` reads (as Accelerate's launcher). With
            one process Accelerate ignores it; kwplug refuses anything but ``"no"`` there.
        use_port: the rendezvous port (``MASTER_PORT``), default ``"29500"``.
        master_addr: the rendezvous host (``MASTER_ADDR``), default ``"127.0.0.1"``.
        node_rank: this node's rank, ``0 <= node_rank < num_nodes``.
        num_nodes: the number of nodes, each running ``num_processes`` processes.
        rdzv_backend: torch's rendezvous backend (``"static"``, as ``torchrun
            --master-port``, or ``"c10d"``).
        rdzv_endpoint: ``host:port`` of the rendezvous; default ``master_addr:use_port``
            for ``"static"``.
        rdzv_conf: extra rendezvous options (``LaunchConfig.rdzv_configs``).
        rdzv_id: the run id (``LaunchConfig.run_id``).
        max_restarts: restarts of the worker group on failure (torch elastic).
        monitor_interval: seconds between the agent's checks of its workers.
        log_line_prefix_template: torch elastic's template for the workers' output lines.

    Returns:
        With several processes, ``{local rank: what function returned}`` for this node
        (Accelerate returns ``None``); with one, ``None``.

    Raises:
        ValueError: ``num_processes`` missing or below 1, ``node_rank >= num_nodes``,
            ``mixed_precision`` unknown (or not ``"no"`` in one process), or this process
            already has a
            ``torch.distributed`` process group (build the ``Accelerator`` inside
            ``function``).
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a process
            failed; the message holds its traceback.
    """
    if num_processes is None:
        raise ValueError(
            "notebook_launcher: give the number of processes to start (num_processes=...)"
        )
    if not is_int(num_processes) or num_processes < 1:
        raise ValueError(
            f"notebook_launcher: num_processes must be an int >= 1, got {num_processes!r}"
        )
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"notebook_launcher: node_rank must be in [0, num_nodes), got node_rank={node_rank}, "
            f"num_nodes={num_nodes}"
        )
    precision = mixed_precision.lower() if isinstance(mixed_precision, str) else mixed_precision
    if precision not in ("no", "fp16", "bf16"):
        raise ValueError(
            f"notebook_launcher: mixed_precision must be 'no', 'fp16' or 'bf16', got "
            f"{mixed_precision!r}"
        )
    if num_processes == 1 and num_nodes == 1:
        if precision != "no":
            # Accelerate runs the function without it here, silently: refused instead.
            raise ValueError(
                f"notebook_launcher(mixed_precision={mixed_precision!r}, num_processes=1): "
                "one process gets no launcher settings; build Accelerator(mixed_precision=...) "
                "inside the launched function"
            )
        function(*args)
        return None
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "notebook_launcher: this process already has a torch.distributed process group; "
            "create the Accelerator (or PartialState) only inside the launched function"
        )
    configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        configs["rank"] = node_rank
        rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    with patch_environment(ACCELERATE_MIXED_PRECISION=precision):  # inherited by the forks
        return _launch(
            function,
            args,
            min_nodes=num_nodes,
            max_nodes=num_nodes,
            nproc_per_node=num_processes,
            run_id=rdzv_id,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_backend=rdzv_backend,
            rdzv_configs=configs,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            log_line_prefix_template=log_line_prefix_template,
        )


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> dict[int, Any]:
    """Run ``function(*args)`` in ``num_processes`` CPU processes (gloo), to test
    distributed code on any machine.

    The processes get ``ACCELERATE_USE_CPU=1`` (so ``Accelerator()`` and ``PartialState()``
    pick the CPU, and the process group is gloo) and a free local port.

    Args:
        function: the function to run; it builds its ``Accelerator`` itself.
        args: positional arguments for ``function``.
        num_processes: ``int >= 1``, default 2.

    Returns:
        ``{rank: what function returned}`` (Accelerate returns ``None``).

    Raises:
        ValueError: ``num_processes`` below 1, or this process already has a process group.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a process failed.
    """
    if not is_int(num_processes) or num_processes < 1:
        raise ValueError(
            f"debug_launcher: num_processes must be an int >= 1, got {num_processes!r}"
        )
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "debug_launcher: this process already has a torch.distributed process group; "
            "create the Accelerator (or PartialState) only inside the launched function"
        )
    with patch_environment(ACCELERATE_USE_CPU="1"):  # inherited by the forked workers
        return _launch(
            function,
            args,
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=num_processes,
            run_id="debug",
            rdzv_endpoint=f"127.0.0.1:{_free_port()}",
            rdzv_backend="static",
            rdzv_configs={"rank": 0},
            max_restarts=0,
            monitor_interval=0.1,
            log_line_prefix_template=None,
        )


def _launch(function: Callable[..., Any], args: tuple[Any, ...], **config: Any) -> dict[int, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # fork: the function need not be importable by a fresh interpreter (notebooks, closures).
    launch = LaunchConfig(start_method="fork", **config)
    results: dict[int, Any] = elastic_launch(config=launch, entrypoint=_named(function))(*args)
    return results


def _named(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a ``__name__`` and ``__qualname__``: torch's ``elastic_launch`` names
    its run and its error records after them, which a ``functools.partial`` or a callable
    object lacks (Accelerate's ``start_processes`` does not ask; its tests launch partials).
    A new partial carries the names; the user's object is left as it is."""
    if hasattr(function, "__name__") and hasattr(function, "__qualname__"):
        return function
    inner: Any = function
    while isinstance(inner, functools.partial):
        inner = inner.func
    named = functools.partial(function)
    name = getattr(inner, "__name__", type(inner).__name__)
    named.__name__ = name  # type: ignore[attr-defined]
    named.__qualname__ = getattr(inner, "__qualname__", name)  # type: ignore[attr-defined]
    return named


def _free_port() -> int:
    # A port the OS reports free now (the agent binds it right after, in this process).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
