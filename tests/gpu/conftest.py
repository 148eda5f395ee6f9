"""The GPU suite: run only when CUDA is available (``scripts/gpu-check`` runs it).

Without CUDA every test collected under this folder is marked skipped, with one reason, so that
``pytest tests/gpu`` reports them as skipped and exits 0. Test modules must therefore not touch
the device at import time.
Multi-process tests use ``min(2, torch.cuda.device_count())`` ranks: NCCL refuses two ranks of
one communicator on the same GPU ("Duplicate GPU detected"), so on a one-GPU machine the nccl
tests run one rank (a real nccl process group, DDP and its hooks included) and the two-rank
ones are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "no CUDA device: the GPU suite is skipped"
sys.path.insert(0, str(HERE))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test of this folder when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
