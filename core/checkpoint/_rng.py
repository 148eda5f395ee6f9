"""Random number generator states of one process: Python, NumPy, torch CPU and device."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """RNG states of Python, NumPy (if installed), torch CPU and ``device``'s generator."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "get_rng_state"):
            state["device"] = module.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "device" in state:
        getattr(torch, device.type).set_rng_state(state["device"], device)
