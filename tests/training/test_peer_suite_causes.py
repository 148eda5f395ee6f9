"""The causes that failed Accelerate's own pytest files on kwplug (issue 28, item 3; measured
by tests/compat/peer_suite.py), each as a self-contained test: no mirror, no network."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kwplug
from kwplug.handler import TO_KWARGS


def test_a_dataclass_subclass_of_kwargs_handler_gives_its_changed_fields() -> None:
    from kwplug.utils import KwargsHandler  # Accelerate's import path

    assert KwargsHandler is kwplug.KwargsHandler

    @dataclasses.dataclass
    class MockClass(KwargsHandler):
        a: int = 0
        b: bool = False
        c: float = 3.0
        internal: str = dataclasses.field(default="x", metadata={TO_KWARGS: False})

    # Accelerate's test_kwargs_handler, word for word.
    assert MockClass().to_kwargs() == {}
    assert MockClass(a=2).to_kwargs() == {"a": 2}
    assert MockClass(a=2, b=True).to_kwargs() == {"a": 2, "b": True}
    assert MockClass(a=2, c=2.25).to_kwargs() == {"a": 2, "c": 2.25}
    assert MockClass(internal="y").to_kwargs() == {}
    assert MockClass(a=1).to_dict() == {"a": 1, "b": False, "c": 3.0, "internal": "x"}


def test_clear_environment_empties_and_restores() -> None:
    from kwplug.utils import clear_environment

    os.environ["KWPLUG_PEER_TEST"] = "kept"
    try:
        with pytest.raises(RuntimeError), clear_environment():
            assert dict(os.environ) == {}
            os.environ["KWPLUG_PEER_ADDED"] = "1"
            raise RuntimeError
        assert os.environ["KWPLUG_PEER_TEST"] == "kept"
        assert "KWPLUG_PEER_ADDED" not in os.environ
    finally:
        os.environ.pop("KWPLUG_PEER_TEST", None)


def test_utils_save_safetensors_drops_tied_tensors_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kwplug.utils import save

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied
    path = tmp_path / "model.safetensors"
    with caplog.at_level(logging.WARNING):
        save(model.state_dict(), path, safe_serialization=True)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "Removed shared tensor" in caplog.records[0].getMessage()
    loaded = load_file(path)
    assert sorted(loaded) == ["0.bias", "0.weight", "1.bias"]
    assert torch.equal(loaded["0.weight"], model[0].weight.detach())


def test_utils_save_torch_writes_what_weights_only_loads(tmp_path: Path) -> None:
    from kwplug.utils import save

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7, "names": ["a", "b"]}
    save(state, tmp_path / "state.bin")
    loaded = torch.load(tmp_path / "state.bin", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert loaded["names"] == ["a", "b"]


class _Arbitrary:
    pass


def test_utils_save_refuses_what_only_an_unsafe_unpickling_reads(tmp_path: Path) -> None:
    from kwplug.utils import save

    with pytest.raises(TypeError, match=r"weights_only.*_Arbitrary"):
        save({"obj": _Arbitrary()}, tmp_path / "bad.bin")
    assert not (tmp_path / "bad.bin").exists()  # refused before writing


def test_utils_save_writes_on_the_main_process_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kwplug.utils import save

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    save({"w": torch.ones(1)}, tmp_path / "rank1.bin")
    assert not (tmp_path / "rank1.bin").exists()
    save({"w": torch.ones(1)}, tmp_path / "node.bin", save_on_each_node=True)
    assert (tmp_path / "node.bin").exists()  # local main of its node
