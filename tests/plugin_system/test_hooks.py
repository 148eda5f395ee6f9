"""One test per hook spec (test_hook_<name>): a plugin implementing it drives what torch gets.

tests/gates/test_api_docs.py fails when a spec has no test here (or no section in the docs).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import KwargsHandler, checkpoint, hookimpl
from kwplug.checkpoint import _manifest as manifest
from kwplug.checkpoint import _reader as reader


def test_hook_autocast() -> None:
    @attrs.define
    class Half(KwargsHandler):
        @hookimpl
        def autocast(self, device_type: str, mixed_precision: str) -> Any:
            return functools.partial(torch.autocast, device_type, dtype=torch.float16)

    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[Half()])
    with accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def test_hook_wrap_model() -> None:
    seen: dict[str, Any] = {}

    @attrs.define
    class Wrap(KwargsHandler):
        @hookimpl
        def wrap_model(
            self,
            model: torch.nn.Module,
            device: torch.device,
            world_size: int,
            comm_hooks: Any,
        ) -> torch.nn.Module:
            seen.update(device=device, world_size=world_size, hooks=set(comm_hooks))
            return torch.nn.Sequential(model, torch.nn.Identity())

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Wrap()])
    model = accelerator.prepare(torch.nn.Linear(3, 3))
    assert isinstance(model, torch.nn.Sequential) and isinstance(model[1], torch.nn.Identity)
    assert seen["device"] == torch.device("cpu") and seen["world_size"] == 1
    assert {"fp16", "bf16", "power_sgd", "batched_power_sgd"} <= seen["hooks"]


def test_hook_make_scaler() -> None:
    @attrs.define
    class Scaler(KwargsHandler):
        @hookimpl
        def make_scaler(self, device_type: str, mixed_precision: str) -> Any:
            return torch.amp.GradScaler(device_type, init_scale=3.0)

    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[Scaler()])
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 3.0
    loss = torch.nn.Parameter(torch.tensor(2.0)) * 1.0
    accelerator.backward(loss)  # goes through the plugin's scaler


def test_hook_init_process_group(monkeypatch: Any) -> None:
    calls: list[tuple[str, int, int]] = []

    @attrs.define
    class Group(KwargsHandler):
        @hookimpl
        def init_process_group(self, device_type: str, world_size: int, rank: int) -> bool:
            calls.append((device_type, world_size, rank))
            torch.distributed.init_process_group(
                "gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0
            )
            return True

    # torchrun's variables claim two processes; the plugin answers with its own group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    try:
        accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Group()])
        assert calls == [("cpu", 2, 0)]
        assert accelerator.plan["init_process_group"].plugin.startswith("user[0]")
        assert accelerator.num_processes == 1  # the group the plugin made
    finally:
        accelerator.end_training()
    assert not torch.distributed.is_initialized()


def test_hook_make_profiler() -> None:
    built: list[int] = []

    @attrs.define
    class Profiler(KwargsHandler):
        @hookimpl
        def make_profiler(self, rank: int) -> torch.profiler.profile:
            built.append(rank)
            return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Profiler()])
    with accelerator.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert built == [0]
    assert any(e.key == "aten::mm" for e in prof.key_averages())


def test_hook_comm_hooks() -> None:
    def noop(state: Any, bucket: Any) -> Any:
        raise AssertionError("only registered here")

    @attrs.define
    class Hooks(KwargsHandler):
        @hookimpl
        def comm_hooks(self) -> Any:
            return {"noop": kwplug.CommHook("noop", noop)}

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Hooks()])
    assert accelerator.comm_hooks["noop"].hook is noop
    assert "kwargs_handlers[0]" in accelerator.comm_hooks["noop"].source


@attrs.define
class Counting(KwargsHandler):
    """A handler with state of its own, saved in checkpoints."""

    seen: int = 0

    @hookimpl
    def handler_state(self) -> Any:
        return {"seen": self.seen}

    @hookimpl
    def load_handler_state(self, state: Any) -> None:
        self.seen = state["seen"]


def test_hook_handler_state(tmp_path: Any) -> None:
    handler = Counting(seen=7)
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    records = manifest.read(version)
    saved, _ = reader.read_state(version / "rank_0.safetensors", records["rank_0.safetensors"])
    assert saved["handlers"] == {"user[0]:test_hooks.Counting": {"seen": 7}}


def test_hook_load_handler_state(tmp_path: Any) -> None:
    kwplug.Accelerator(cpu=True, kwargs_handlers=[Counting(seen=3)]).save_state(tmp_path / "c")
    fresh = Counting()
    kwplug.Accelerator(cpu=True, kwargs_handlers=[fresh]).load_state(tmp_path / "c")
    assert fresh.seen == 3


def test_hook_validate_setup(monkeypatch: Any) -> None:
    seen: list[tuple[str, int, str, bool]] = []

    @attrs.define
    class Strict(KwargsHandler):
        @hookimpl
        def validate_setup(
            self, device_type: str, world_size: int, mixed_precision: str, comm_hooks: Any
        ) -> None:
            seen.append((device_type, world_size, mixed_precision, "bf16" in comm_hooks))
            if mixed_precision == "fp16":
                raise ValueError("Strict: fp16 is not supported; use bf16")

    kwplug.Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[Strict()])
    assert seen == [("cpu", 1, "bf16", True)]
    with pytest.raises(ValueError, match="fp16 is not supported"):
        kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[Strict()])
    # Before the process group: a rejected setting under torchrun costs no rendezvous.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: reaching it would fail differently
    with pytest.raises(ValueError, match="fp16 is not supported"):
        kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[Strict()])
    assert not torch.distributed.is_initialized()
    # The built-in DDP handler rejects an unknown hook name here, not in prepare().
    with pytest.raises(ValueError, match="unknown communication hook 'bf17'.*did you mean 'bf16'"):
        kwplug.Accelerator(
            cpu=True, kwargs_handlers=[kwplug.DistributedDataParallelKwargs(comm_hook="bf17")]
        )
