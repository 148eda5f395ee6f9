"""The GPU suite: collected only when CUDA is available (``scripts/gpu-check`` runs it).

Without CUDA every test here is skipped at collection, with one reason. Multi-process tests use
``min(2, torch.cuda.device_count())`` ranks: NCCL refuses two ranks of one communicator on the
same GPU ("Duplicate GPU detected"), so on a one-GPU machine the nccl tests run one rank (a real
nccl process group, DDP and its hooks included) and the two-rank ones are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU suite is skipped", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
