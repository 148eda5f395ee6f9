"""Loading a folder in Accelerate's ``save_state`` layout runs no code (issue 28, item 4).

Accelerate loads its ``.bin``/``.pkl`` files with ``weights_only=False``; kwplug reads them
with ``torch.load(weights_only=True)`` and allows NumPy's RNG array in
``random_states_<rank>.pkl`` only. A pickle naming another global is refused by name before
anything is built (a ``__reduce__`` calling ``os.system`` never runs) and before any object is
loaded. The resume itself, against Accelerate's, is tests/parity/test_accelerate_resume.py.
"""

from __future__ import annotations

import fractions
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import kwplug
from kwplug.checkpoint import CheckpointError


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


class Shell:
    """Unpickled, this runs ``touch <marker>`` (what a malicious optimizer.bin would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _accelerate_folder(folder: Path, model: torch.nn.Module, **overrides: Any) -> Path:
    # The files Accelerate 1.x's save_state writes for one model, one AdamW, one registered
    # object, one process (accelerate/checkpointing.py), each replaceable.
    folder.mkdir()
    optimizer = torch.optim.AdamW(model.parameters())
    files: dict[str, Any] = {
        "optimizer.bin": optimizer.state_dict(),
        "custom_checkpoint_0.pkl": {"n": 5},
        "random_states_0.pkl": {
            "step": 3,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
    }
    files.update(overrides)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    for name, value in files.items():
        torch.save(value, folder / name)
    return folder


def _prepared() -> tuple[kwplug.Accelerator, torch.nn.Module, Counter]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, counter


def test_loads_accelerate_layout_with_numpy_rng(tmp_path: Path) -> None:
    accelerator, model, counter = _prepared()
    saved = torch.nn.Linear(3, 2)
    np.random.seed(11)
    expected = np.random.get_state()[1].copy()
    folder = _accelerate_folder(tmp_path / "ckpt", saved)
    np.random.seed(12)
    assert accelerator.load_state(folder) == folder
    assert torch.equal(model.weight, saved.weight)
    assert counter.n == 5
    assert np.array_equal(np.random.get_state()[1], expected)
    assert accelerator.gradient_state.step == 3  # Accelerate's `step`


def test_reduce_calling_os_system_is_refused_and_never_runs(tmp_path: Path) -> None:
    accelerator, model, counter = _prepared()
    before = model.weight.detach().clone()
    marker = tmp_path / "marker"
    folder = _accelerate_folder(
        tmp_path / "ckpt", torch.nn.Linear(3, 2), **{"optimizer.bin": Shell(marker)}
    )
    with pytest.raises(CheckpointError, match=r"optimizer\.bin is refused.*(posix|os)\.system"):
        accelerator.load_state(folder)
    assert not marker.exists()
    assert torch.equal(model.weight, before)  # nothing loaded: the model file came first
    assert counter.n == 0


@pytest.mark.parametrize(
    ("file", "value", "named"),
    [
        # NumPy is allowed for the RNG states only: the allow-list is per file.
        ("custom_checkpoint_0.pkl", {"n": np.zeros(3)}, "numpy"),
        ("random_states_0.pkl", {"random_state": fractions.Fraction(1, 3)}, "fractions.Fraction"),
    ],
    ids=["numpy-outside-random-states", "class-in-random-states"],
)
def test_globals_outside_the_allow_list_are_refused(
    tmp_path: Path, file: str, value: Any, named: str
) -> None:
    accelerator, _, counter = _prepared()
    folder = _accelerate_folder(tmp_path / "ckpt", torch.nn.Linear(3, 2), **{file: value})
    with pytest.raises(CheckpointError, match=rf"{file} is refused.*{named}"):
        accelerator.load_state(folder)
    assert counter.n == 0


def test_other_objects_than_prepared_are_refused(tmp_path: Path) -> None:
    accelerator, _, counter = _prepared()
    folder = _accelerate_folder(tmp_path / "ckpt", torch.nn.Linear(3, 4))
    with pytest.raises(CheckpointError, match=r"weight has shape \(4, 3\).*\(2, 3\)"):
        accelerator.load_state(folder)
    os.remove(folder / "custom_checkpoint_0.pkl")
    save_file(
        {k: v.clone() for k, v in torch.nn.Linear(3, 2).state_dict().items()},
        folder / "model.safetensors",
    )
    with pytest.raises(CheckpointError, match="found 0 checkpoints, 1 registered objects"):
        accelerator.load_state(folder)
    torch.save({"n": 1}, folder / "custom_checkpoint_0.pkl")
    save_file({"w": torch.zeros(1)}, folder / "model_1.safetensors")
    with pytest.raises(CheckpointError, match=r"model_1\.safetensors: this run prepared 1 model"):
        accelerator.load_state(folder)
    assert counter.n == 0


def test_a_folder_without_either_layout_says_so(tmp_path: Path) -> None:
    accelerator, _, _ = _prepared()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete kwplug checkpoint"):
        accelerator.load_state(tmp_path / "empty")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied, as a language model's


def test_tied_weights_saved_once_load_into_both_names(tmp_path: Path) -> None:
    # Accelerate's safetensors save keeps one name of tied tensors (the first).
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(Tied())
    saved = Tied()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"embed.weight": saved.embed.weight.detach().clone()}, folder / "model.safetensors")
    torch.save({"random_state": random.getstate()}, folder / "random_states_1.pkl")
    with pytest.warns(kwplug.errors.KwplugWarning, match="no random_states_0.pkl"):
        accelerator.load_state(folder)
    assert torch.equal(model.head.weight, saved.embed.weight)
    assert model.head.weight is model.embed.weight


def test_loader_state_files_are_not_read_and_say_so(tmp_path: Path) -> None:
    accelerator, _, counter = _prepared()
    folder = _accelerate_folder(tmp_path / "ckpt", torch.nn.Linear(3, 2))
    torch.save({"anything": 1}, folder / "dl_state_dict.bin")
    with pytest.warns(kwplug.errors.KwplugWarning, match=r"dl_state_dict\.bin\) is not read"):
        accelerator.load_state(folder)
    assert counter.n == 5
