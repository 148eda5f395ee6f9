"""``kwplug env``'s text: what ``accelerate env`` prints, in its ``- Key: value`` layout, with
``kwplug`` in place of ``Accelerate`` in the keys, and the Accelerate API version kwplug
mirrors."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any

from kwplug._cli.launch_config import LaunchConfigError, default_config_file, load_mapping

__all__ = ["env_report", "format_report"]

#: ``accelerate env``'s names for ``torch.accelerator``'s device types.
_NAMES = {"cuda": "CUDA", "xpu": "XPU", "mlu": "MLU", "sdaa": "SDAA", "musa": "MUSA"}


def _version(name: str) -> str:
    import importlib_metadata

    try:
        return str(importlib_metadata.version(name))
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def _ram_gb() -> str:
    # psutil when installed (what accelerate env uses), else POSIX's page count.
    try:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        total = float(psutil.virtual_memory().total)
    except ModuleNotFoundError:
        try:
            total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            return "unknown"
    return f"{total / 1024**3:.2f} GB"


def _device_rows() -> dict[str, str]:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if accelerator is None or current is None or not accelerator.is_available():
        return {"PyTorch accelerator": "N/A"}
    kind = current.type
    name = _NAMES.get(kind, kind.upper())
    rows = {"PyTorch accelerator": name}
    module = getattr(torch, kind, None)
    get_name = getattr(module, "get_device_name", None)
    if callable(get_name):
        rows["GPU type" if kind == "cuda" else f"{name} type"] = str(get_name())
    return rows


def _config(config_file: str | None) -> tuple[str, dict[str, Any] | str]:
    # The file's own keys (accelerate env shows its ClusterConfig with defaults filled).
    heading = "`kwplug` default config" if config_file is None else "`kwplug` config passed"
    path = Path(config_file) if config_file is not None else default_config_file()
    if not path.is_file():
        return heading, "Not found" if config_file is None else f"{path} does not exist"
    try:
        return heading, load_mapping(path)
    except (LaunchConfigError, ValueError) as exc:
        return heading, f"unreadable: {exc}"


def env_report(config_file: str | None = None) -> dict[str, Any]:
    """``accelerate env``'s fields, kwplug's names: ``{key: value}`` in print order, the last
    one (``"`kwplug` default config"`` or ``"`kwplug` config passed"``) the config file's
    ``{key: value}`` or ``"Not found"``.

    Args:
        config_file: the config file to show; default: Accelerate's default one
            (``$HF_HOME/accelerate/default_config.yaml``) when it exists.
    """
    import torch
    import torch.distributed as dist

    from kwplug.accelerate import ACCELERATE_VERSION

    info: dict[str, Any] = {
        "`kwplug` version": _version("kwplug"),
        "`Accelerate` API version": ACCELERATE_VERSION,
        "Platform": platform.platform(),
        "`kwplug` bash location": shutil.which("kwplug") or "Not found",
        "Python version": platform.python_version(),
        "Numpy version": _version("numpy"),
        "PyTorch version": torch.__version__,
        **_device_rows(),
        "System RAM": _ram_gb(),
    }
    if dist.is_available():
        checks = ("gloo", "nccl", "mpi", "ucc", "xccl")
        found = {n: getattr(dist, f"is_{n}_available", lambda: False)() for n in checks}
        info["PyTorch distributed backends"] = ", ".join(
            f"{n}={'yes' if ok else 'no'}" for n, ok in found.items()
        )
    heading, config = _config(config_file)
    info[heading] = config
    return info


def format_report(info: dict[str, Any]) -> str:
    """``accelerate env``'s text for :func:`env_report`'s fields: a header line, ``- Key:
    value`` lines, the config's ``\\t- key: value`` lines under the last key."""
    *fields, (heading, config) = info.items()
    lines = ["", "Copy-and-paste the text below in your GitHub issue", ""]
    lines += [f"- {key}: {value}" for key, value in fields]
    lines.append(f"- {heading}:")
    if isinstance(config, dict):
        lines += [f"\t- {key}: {value}" for key, value in config.items()]
    else:
        lines.append(f"\t{config}")
    return "\n".join(lines)
