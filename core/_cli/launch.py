"""``kwplug launch``: ``accelerate launch``'s common flags, run by torch's own
``torch.distributed.run`` (what ``torchrun`` is).

The settings reach the script's ``Accelerator`` through the environment variables Accelerate's
launcher sets and its ``Accelerator`` reads: ``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_USE_CPU``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``,
``ACCELERATE_DYNAMO_BACKEND``, and for ``--use_fsdp``/``--use_parallelism_config`` (or a
config file's ``distributed_type: FSDP``/``parallelism_config``) ``ACCELERATE_USE_FSDP`` with
the ``FSDP_*`` variables and ``ACCELERATE_USE_PARALLELISM_CONFIG`` with the
``PARALLELISM_CONFIG_*`` ones (:mod:`kwplug._cli.launch_sharding`); so a script launched by
either launcher, or by ``torchrun`` with those variables, behaves the same. Values come from
the command line, else from the config file (``--config_file``, else Accelerate's default
one when it exists), else Accelerate's defaults. An ``accelerate launch`` option kwplug does
not carry out is an error naming it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kwplug._cli import launch_sharding as _launch_sharding
from kwplug._cli.launch_config import LaunchConfigError, default_config_file, read_config
from kwplug.utils.environment import patch_environment

__all__ = ["add_launch_parser", "launch_command", "torchrun_arguments"]

#: Accelerate's flag families kwplug refuses, by prefix, with what to do instead.
_REFUSED_PREFIXES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("use_deepspeed", "deepspeed", "zero", "zero3", "offload", "gradient_clipping"),
        "kwplug has no DeepSpeed integration",
    ),
    (("use_megatron_lm", "megatron_lm"), "kwplug has no Megatron-LM integration"),
    (
        ("tpu", "no_tpu", "vm", "env", "main_training_function", "downcast_bf16"),
        "kwplug has no TPU/XLA support",
    ),
    (("fp8",), "kwplug has no fp8 training"),
    (
        ("dynamo_mode", "dynamo_use"),
        "pass Accelerator(dynamo_plugin=TorchDynamoPlugin(...)) in the script",
    ),
    (("aws",), "kwplug has no SageMaker launcher"),
    (("mpirun",), "kwplug launch runs torch.distributed.run, not mpirun"),
    (("gpu_ids",), "set CUDA_VISIBLE_DEVICES (or your device's variable) instead"),
    (("debug",), "kwplug has no debug mode (ACCELERATE_DEBUG_MODE)"),
    (("enable_cpu_affinity",), "kwplug launch sets no CPU affinity"),
    (
        ("t", "tee", "log_dir", "role"),
        "kwplug launch passes no torchrun logging options; run `python -m "
        "torch.distributed.run` directly for them",
    ),
)

_TORCHRUN_HINT = "for torchrun's own options run `python -m torch.distributed.run` directly"


def add_launch_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``launch`` to the ``kwplug`` sub-command parsers ``sub``; returns it."""
    p: argparse.ArgumentParser = sub.add_parser(
        "launch",
        help="run a training script in several processes (accelerate launch's flags, "
        "torch.distributed.run underneath)",
        description="Run TRAINING_SCRIPT with torch.distributed.run, with accelerate launch's "
        "common flags; the settings reach the script's Accelerator as ACCELERATE_* variables.",
        allow_abbrev=False,
    )

    def flag(name: str, **kwargs: Any) -> None:
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", **kwargs)

    flag("config_file", default=None, help="Accelerate's YAML/JSON config file")
    p.add_argument("--quiet", "-q", action="store_true", help="on failure, only the summary")
    p.add_argument("--cpu", action="store_true", help="force the CPU (ACCELERATE_USE_CPU)")
    flag("multi_gpu", action="store_true", help="accepted: torch.distributed.run always")
    flag("mixed_precision", choices=("no", "fp16", "bf16"), type=str.lower, default=None)
    flag("num_processes", type=int, default=None, help="processes in all (all machines)")
    flag("num_machines", type=int, default=None)
    flag("machine_rank", type=int, default=None)
    flag("main_process_ip", default=None)
    flag("main_process_port", type=int, default=None, help="0: a free port")
    flag("same_network", action="store_true", help="accepted (a static rendezvous)")
    flag("rdzv_backend", default=None, help="torch's rendezvous backend (default static)")
    flag("rdzv_conf", default=None)
    flag("max_restarts", type=int, default=0)
    flag("monitor_interval", type=float, default=0.1)
    flag("num_cpu_threads_per_process", type=int, default=None, help="sets OMP_NUM_THREADS")
    flag("gradient_accumulation_steps", type=int, default=None)
    flag("dynamo_backend", default=None, help="torch.compile backend (ACCELERATE_DYNAMO_BACKEND)")
    _launch_sharding.add_flags(p)  # --use_fsdp, --fsdp_*, --parallelism_config_*
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module")
    flag("no_python", action="store_true", help="run the script without python")
    p.add_argument("training_script", help="the script (or module, or program) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=launch_command)
    return p


def _refusal(option: str) -> str | None:
    name = option.lstrip("-").split("=", 1)[0].replace("-", "_")
    for prefixes, why in _REFUSED_PREFIXES:
        if any(name == prefix or name.startswith(prefix + "_") for prefix in prefixes):
            return f"accelerate launch's {option} is not supported by kwplug launch: {why}"
    return None


def check_unknown(unknown: Sequence[str]) -> None:
    """Raise for the options before the script that kwplug launch does not take.

    Raises:
        ValueError: names each one and, for Accelerate's, what to do instead.
    """
    options = [u for u in unknown if u.startswith("-")]
    if not options:
        return
    lines = [
        _refusal(o) or f"{o} is not a kwplug launch option ({_TORCHRUN_HINT})" for o in options
    ]
    raise ValueError("; ".join(lines))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    # The command line wins; the config file fills what it left unset (as Accelerate).
    path = args.config_file
    if path is None and not args.cpu and default_config_file().is_file():
        path = str(default_config_file())
        print(f"kwplug launch: using the settings of {path}", file=sys.stderr)
    config = read_config(path) if path is not None else {}
    given = {
        k: v for k, v in vars(args).items() if v is not None and k not in ("func", "config_file")
    }
    settings = {**config, **given}
    # Where each value came from, for error messages (launch_sharding.origin).
    settings[_launch_sharding.GIVEN] = frozenset(given)
    settings[_launch_sharding.FILE] = path
    _launch_sharding.resolve(settings, args)
    settings["cpu"] = bool(args.cpu or config.get("use_cpu", False))
    if settings.get("mixed_precision") is not None:
        settings["mixed_precision"] = str(settings["mixed_precision"]).lower()
    return settings


def _default_processes(cpu: bool) -> int:
    # Accelerate: one process per accelerator device, else one.
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if cpu or accelerator is None or not accelerator.is_available():
        return 1
    return max(int(accelerator.device_count()), 1)


_COUNTS = (
    "num_processes", "num_machines", "machine_rank", "gradient_accumulation_steps",
    "num_cpu_threads_per_process",
)  # fmt: skip


def torchrun_arguments(settings: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The ``torch.distributed.run`` command line and the variables to add to the
    environment, for launch ``settings`` (the command line merged over the config file).

    Raises:
        ValueError: a count below 1, ``num_processes`` not a multiple of ``num_machines``,
            parallelism sizes whose product is not ``num_processes`` (all 1 excepted),
            several machines without ``main_process_ip``/``main_process_port`` (as
            Accelerate), or ``--module`` with ``--no_python``.
    """
    for name in _COUNTS:  # a config file's "two" is named, not int()'s message
        value = settings.get(name)
        if value is not None and (isinstance(value, bool) or not str(value).lstrip("-").isdigit()):
            raise ValueError(f"--{name} (config file: {name}) = {value!r}: not an integer")
    machines = int(settings.get("num_machines") or 1)
    total = settings.get("num_processes")
    kind = settings.get("distributed_type")
    if total is None or int(total) == -1:
        # Accelerate: a config file's NO means 1; another type must say how many (its -1).
        if kind not in (None, "NO"):
            raise ValueError("pass --num_processes: the config file does not set it")
        total = 1 if kind == "NO" else _default_processes(bool(settings.get("cpu")))
    total, rank = int(total), int(settings.get("machine_rank") or 0)
    if total < 1 or machines < 1 or total % machines:
        raise ValueError(
            f"--num_processes ({total}) must be a multiple >= 1 of --num_machines ({machines})"
        )
    if not 0 <= rank < machines:
        raise ValueError(f"--machine_rank must be in [0, {machines}), got {rank}")
    ip, port = settings.get("main_process_ip"), settings.get("main_process_port")
    if machines > 1 and (ip is None or port is None):
        raise ValueError("several machines need --main_process_ip and --main_process_port")
    if settings.get("module") and settings.get("no_python"):
        raise ValueError("--module and --no_python cannot be used together")
    backend = str(settings.get("rdzv_backend") or "static")
    argv = [f"--nnodes={machines}", f"--nproc-per-node={total // machines}"]
    argv += [f"--max-restarts={settings.get('max_restarts', 0)}"]
    argv += [f"--monitor-interval={settings.get('monitor_interval', 0.1)}"]
    if machines == 1 and not port:
        argv.append("--standalone")  # a free port on this machine (Accelerate's port 0)
    elif backend == "static":
        argv += [f"--node-rank={rank}", f"--master-addr={ip or '127.0.0.1'}"]
        argv += [f"--master-port={port}"]
    else:
        argv += [f"--node-rank={rank}", f"--rdzv-backend={backend}"]
        argv += [f"--rdzv-endpoint={ip or '127.0.0.1'}:{port}"]
    if settings.get("rdzv_conf"):
        argv.append(f"--rdzv-conf={settings['rdzv_conf']}")
    if settings.get("module"):
        argv.append("--module")
    if settings.get("no_python"):
        argv.append("--no-python")
    argv += [str(settings["training_script"]), *settings.get("training_script_args", [])]
    env = _environment(settings)
    _check_sizes(settings, total)  # in the launcher, not in every rank
    return argv, env


_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def _check_sizes(settings: Mapping[str, Any], processes: int) -> None:
    """Refuse a ``ParallelismConfig`` whose sizes' product is not the number of processes,
    before any process starts (the plugin's ``validate_setup`` would refuse it in every rank).
    All sizes 1 is accepted: the script's ``ParallelismConfig`` then replicates over every
    process (``dp_replicate_size`` = the number of processes, as Accelerate).

    Args:
        settings: the launch settings (types already checked by
            :func:`kwplug._cli.launch_sharding.environment`).
        processes: the number of processes in all, as the launcher computed it.

    Raises:
        ValueError: the product differs; the message names each size's flag or config key
            with its value, the product, and where the number of processes came from.
    """
    if not settings.get("use_parallelism_config"):
        return
    sizes = {
        name: int(str(_launch_sharding.value_of(settings, f"parallelism_config_{name}")))
        for name in _SIZES
    }
    product = math.prod(sizes.values())
    if product in (1, processes):
        return
    named = "; ".join(
        _launch_sharding.origin(
            settings, f"parallelism_config_{name}", "parallelism_config"
        ).removesuffix(": ")
        for name, size in sizes.items()
        if size != 1
    )
    counted = (
        _launch_sharding.origin(settings, "num_processes").removesuffix(": ")
        if settings.get("num_processes") is not None
        else "the default number of processes"
    )
    raise ValueError(
        f"the parallelism sizes multiply to {product} ({' x '.join(map(str, sizes.values()))} "
        f"= {' x '.join(_SIZES)}) but {processes} process(es) would start ({counted}); "
        f"they must be equal (or every size 1). Sizes: {named}"
    )


def _environment(settings: Mapping[str, Any]) -> dict[str, str]:
    env = {"ACCELERATE_MIXED_PRECISION": str(settings.get("mixed_precision") or "no")}
    if settings.get("cpu"):
        env["ACCELERATE_USE_CPU"] = "True"
    steps = settings.get("gradient_accumulation_steps")
    if steps is not None:
        if int(steps) < 1:
            raise ValueError(f"--gradient_accumulation_steps must be >= 1, got {steps}")
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(int(steps))
    if settings.get("dynamo_backend") is not None:
        env["ACCELERATE_DYNAMO_BACKEND"] = str(settings["dynamo_backend"]).upper()
    if settings.get("num_cpu_threads_per_process") is not None:
        env["OMP_NUM_THREADS"] = str(int(settings["num_cpu_threads_per_process"]))
    env.update(_launch_sharding.environment(settings))  # checked by kwplug's plugins
    return env


def launch_command(args: argparse.Namespace, unknown: Sequence[str] = ()) -> int:
    """Run ``kwplug launch``; returns the exit status (1 when a worker failed, 2 for bad
    flags or config)."""
    try:
        check_unknown(unknown)
        if args.cpu and args.multi_gpu:
            raise ValueError("You can only use one of `--cpu` and `--multi_gpu` (as Accelerate)")
        _launch_sharding.check_flags(args)
        settings = _settings(args)
        argv, env = torchrun_arguments(settings)
    except (ValueError, FileNotFoundError) as exc:
        kind = "" if isinstance(exc, LaunchConfigError) else "error: "
        print(f"kwplug launch: {kind}{exc}", file=sys.stderr)
        return 2
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in env:
        # A difference said at the call: accelerate launch passes the flag to DeepSpeed only.
        print(
            "kwplug launch: --gradient_accumulation_steps reaches the script's Accelerator as "
            f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={env['ACCELERATE_GRADIENT_ACCUMULATION_STEPS']}"
            " (accelerate launch passes it only with --use_deepspeed)",
            file=sys.stderr,
        )
    return _run(argv, env, quiet=bool(args.quiet))


def _run(argv: list[str], env: Mapping[str, str], quiet: bool) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    with patch_environment(**env):  # the workers inherit os.environ; restored after
        try:
            run(get_args_parser().parse_args(argv))  # type: ignore[no-untyped-call]
        except ChildFailedError as error:
            print(error if quiet else f"kwplug launch: {error}", file=sys.stderr)
            return 1
    return 0
