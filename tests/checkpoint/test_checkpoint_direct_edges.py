"""Adversarial loads read straight into the live tensors (``kwplug.checkpoint._direct``):
every load gives back, bitwise, what was saved (as the private copy did), whatever the
parameters' layout, dtypes and optimizer; a file changed or unreadable during the direct read
is a ``CheckpointError`` naming it, and no thread writes after ``load_state`` returns."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _api as api
from kwplug.checkpoint import _direct as direct

pytestmark = pytest.mark.timeout(120)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x.long().abs() % 16).mean(1))


class Flat(torch.nn.Module):
    """Parameters that are views into one flat buffer (``overlap``: partly the same bytes)."""

    def __init__(self, overlap: bool) -> None:
        super().__init__()
        flat = torch.randn(64)
        second = 8 if overlap else 32
        self.a = torch.nn.Parameter(flat[0:32].view(4, 8))
        self.b = torch.nn.Parameter(flat[second : second + 32].view(4, 8))
        self.c = torch.nn.Parameter(flat[40:48])  # one more view, after both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, :4] @ self.a + x[:, 4:] @ self.b).sum(1) * self.c.sum()


class NonContiguous(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8).t())  # (8, 4), transposed
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Buffers(torch.nn.Module):
    """BatchNorm (num_batches_tracked), buffers of every small dtype, 0-dim, empty and
    non-persistent ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("bf16", torch.randn(5).to(torch.bfloat16))
        self.register_buffer("fp16", torch.randn(3, 2).to(torch.float16))
        self.register_buffer("int8", torch.randint(-100, 100, (7,), dtype=torch.int8))
        self.register_buffer("flags", torch.rand(9) > 0.5)
        self.register_buffer("scalar", torch.tensor(3.25))
        self.register_buffer("count", torch.tensor(11, dtype=torch.int64))
        self.register_buffer("empty", torch.empty(0, 3))
        self.register_buffer("scratch", torch.randn(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)).sum(1)


class Clones(torch.nn.Linear):
    """A module whose ``state_dict`` returns clones (its load is torch's own)."""

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return {k: v.clone() for k, v in super().state_dict(*args, **kwargs).items()}


def _step(model: torch.nn.Module, optimizer: Any, steps: int = 2) -> None:
    for _ in range(steps):
        x = torch.randn(6, 8)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return value


def _equal(now: Any, saved: Any, where: str = "") -> None:
    if isinstance(saved, torch.Tensor):
        assert isinstance(now, torch.Tensor), where
        assert now.dtype == saved.dtype and now.shape == saved.shape, where
        assert torch.equal(now, saved), where
    elif isinstance(saved, dict):
        assert now.keys() == saved.keys(), where
        for key in saved:
            _equal(now[key], saved[key], f"{where}.{key}")
    elif isinstance(saved, list | tuple):
        assert len(now) == len(saved), where
        for i, (a, b) in enumerate(zip(now, saved, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    else:
        assert now == saved, where


def _scramble(model: torch.nn.Module, optimizer: Any) -> None:
    with torch.no_grad():
        tensors = list(model.state_dict().values())
        for state in optimizer.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for value in tensors:
            if value.dtype == torch.bool:
                value.logical_not_()
            else:
                value.add_(1)


def _watch(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    read: list[str] = []
    real = direct.read_into

    def spy(path: Path, expected: Any, live: Any) -> Any:
        read.append(path.name)
        return real(path, expected, live)

    monkeypatch.setattr(direct, "read_into", spy)
    return read


def _roundtrip(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: torch.nn.Module,
    make: Callable[[Any], torch.optim.Optimizer],
    *,
    direct_files: int = 2,
    after_prepare: Callable[[torch.nn.Module], Any] | None = None,
    loads: int = 1,
) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    optimizer = make(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    if after_prepare is not None:
        after_prepare(model)
    _step(model, optimizer)
    accelerator.save_state(tmp_path / "ckpt")
    saved = (_clone(model.state_dict()), _clone(optimizer.state_dict()))
    _step(model, optimizer)  # the state tensors change after the save
    _scramble(model, optimizer)
    read = _watch(monkeypatch)
    for _ in range(loads):
        accelerator.load_state(tmp_path / "ckpt")
        _equal(model.state_dict(), saved[0], "model")
        _equal(optimizer.state_dict(), saved[1], "optimizer")
    assert len(read) == direct_files * loads, read
    return model, optimizer


def _adam(model: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _sgd(model: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_tied_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _roundtrip(tmp_path, monkeypatch, Tied(), _adam)
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("overlap", [False, True])
def test_views_into_one_flat_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    model, _ = _roundtrip(tmp_path, monkeypatch, Flat(overlap), _adam)
    base = model.a.untyped_storage().data_ptr()
    assert model.b.untyped_storage().data_ptr() == base  # still one buffer
    assert model.c.untyped_storage().data_ptr() == base


class Separate(torch.nn.Module):
    """``a`` and ``b`` (8 values each) in memory of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.arange(8.0))
        self.b = torch.nn.Parameter(torch.arange(8.0) + 100)


class Crossed(torch.nn.Module):
    """``a`` and ``b`` views of one buffer, the later (``b``) lower in memory: partly shared."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.zeros(16)
        self.a = torch.nn.Parameter(flat[4:12])
        self.b = torch.nn.Parameter(flat[0:8])


class Same(torch.nn.Module):
    """``a`` and ``b`` the same bytes (tied), declared in the order ``names``."""

    def __init__(self, names: tuple[str, str]) -> None:
        super().__init__()
        shared = torch.nn.Parameter(torch.zeros(8))
        for name in names:
            setattr(self, name, shared)


class Reversed(torch.nn.Module):
    """``a`` a transposed (non-contiguous) view, ``b`` a dense view of the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.zeros(8)
        self.a = torch.nn.Parameter(flat.view(2, 4).t())  # (4, 2)
        self.b = torch.nn.Parameter(flat.view(4, 2))


@pytest.mark.parametrize(
    ("saved", "live"),
    [
        (Separate, Crossed),
        (Separate, lambda: Same(("a", "b"))),
        (Separate, lambda: Same(("b", "a"))),
        (lambda: Reversed().requires_grad_(False).apply(_fill), Reversed),
    ],
    ids=["partly-shared", "tied", "tied-reversed", "non-contiguous-first"],
)
def test_shared_bytes_end_as_torchs_load_leaves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: Any, live: Any
) -> None:
    # A checkpoint whose tensors disagree on bytes the live ones share (saved by a model that
    # kept them apart): torch's load_state_dict copies them in order, the later winning; a
    # tensor read into ahead of those copies must not change that.
    source = saved()
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(source)
    accelerator.save_state(tmp_path / "ckpt")
    reference = live()
    reference.load_state_dict(source.state_dict())
    target = live()
    loader = kwplug.Accelerator(cpu=True)
    loader.register_for_checkpointing(target)
    read = _watch(monkeypatch)
    loader.load_state(tmp_path / "ckpt")
    assert read  # read directly
    for name, value in reference.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def _fill(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for i, param in enumerate(module.parameters(recurse=False)):
            param.copy_(torch.arange(param.numel()).view(param.shape) + 10.0 * i)
    for name in ("a", "b"):  # apart, so the file holds two different values
        if name in module._parameters:
            module._parameters[name] = torch.nn.Parameter(module._parameters[name].clone())


def test_non_contiguous_parameter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _roundtrip(tmp_path, monkeypatch, NonContiguous(), _sgd)
    assert not model.weight.is_contiguous()


def test_compiled_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = torch.compile(Tied(), backend="eager")
    _roundtrip(tmp_path, monkeypatch, compiled, _adam)  # type: ignore[arg-type]


def test_buffers_of_every_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _roundtrip(tmp_path, monkeypatch, Buffers(), _adam)
    assert "scratch" not in model.state_dict()


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    ],
    ids=["adam", "adamw", "amsgrad", "sgd-momentum"],
)
def test_optimizers_with_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[Any], Any]
) -> None:
    _roundtrip(tmp_path, monkeypatch, Buffers(), make)


def test_sgd_without_momentum_has_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No state to read into: only the model's file is read directly.
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    _roundtrip(tmp_path, monkeypatch, Buffers(), make, direct_files=1)


def test_two_groups_some_parameters_without_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Partial(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(8, 4)
            self.unused = torch.nn.Linear(8, 4)  # no gradient: no Adam state
            self.other = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.other(self.used(x))

    def make(m: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            [
                {"params": [*m.unused.parameters(), *m.used.parameters()]},
                {"params": m.other.parameters(), "lr": 0.1},
            ],
            lr=0.01,
        )

    _, optimizer = _roundtrip(tmp_path, monkeypatch, Partial(), make)
    assert len(optimizer.optimizer.state) == 4


def test_bf16_after_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _roundtrip(
        tmp_path, monkeypatch, Tied(), _sgd, after_prepare=lambda m: m.to(torch.bfloat16)
    )
    assert model.embed.weight.dtype == torch.bfloat16


def test_loaded_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _roundtrip(tmp_path, monkeypatch, Buffers(), _adam, loads=2)


@pytest.mark.parametrize("hook", ["pre", "post"])
def test_state_dict_hooks_go_through_the_private_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    model = Buffers()
    if hook == "pre":
        model.norm.register_state_dict_pre_hook(lambda *_: None)
    else:
        model.norm._register_state_dict_hook(lambda *_: None)
    _roundtrip(tmp_path, monkeypatch, model, _adam, direct_files=1)


def test_state_dict_returning_clones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = Clones(8, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(model, optimizer)
    accelerator.save_state(tmp_path / "ckpt")
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    _step(model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)


def _saved(tmp_path: Path) -> tuple[kwplug.Accelerator, Path, Path]:
    # A checkpoint of a model and an Adam optimizer with state: both files read directly.
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = Buffers()
    model, optimizer = accelerator.prepare(model, _adam(model))
    _step(model, optimizer)
    directory = accelerator.save_state(tmp_path / "ckpt")
    assert direct.live_state(model) is not None and direct.live_state(optimizer) is not None
    files = sorted(p for p in Path(directory).rglob("*.safetensors"))
    model_file = next(p for p in files if "model" in p.name)
    return accelerator, directory, model_file


def _no_reader_left() -> None:
    assert not [t for t in threading.enumerate() if t.name.startswith("kwplug-load")]


@pytest.mark.parametrize("change", ["truncated", "byte-flipped", "replaced-by-folder"])
def test_a_file_changed_after_verification_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    accelerator, _, model_file = _saved(tmp_path)
    real = direct.read_into

    def changed(path: Path, expected: Any, live: Any) -> Any:
        if path == model_file:  # after the first pass verified it
            if change == "truncated":
                os.truncate(path, path.stat().st_size // 2)
            elif change == "byte-flipped":
                with open(path, "r+b") as f:
                    f.seek(-3, os.SEEK_END)
                    byte = f.read(1)
                    f.seek(-3, os.SEEK_END)
                    f.write(bytes([byte[0] ^ 0xFF]))
            else:
                path.unlink()
                path.mkdir()
        return real(path, expected, live)

    monkeypatch.setattr(direct, "read_into", changed)
    with pytest.raises(CheckpointError) as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(model_file) and str(model_file) in str(caught.value)
    _no_reader_left()


@pytest.mark.parametrize("call", ["open", "pread", "preadv", "preadv-ends"])
def test_a_read_error_in_the_direct_read_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    # EIO (or a file ending early) where the reading threads open or read: a CheckpointError
    # naming the file, as from the first pass, never a bare OSError.
    accelerator, _, _ = _saved(tmp_path)
    name = call.split("-")[0]
    real = getattr(os, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("kwplug-load"):
            if call == "preadv-ends":
                return 0
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)
    with pytest.raises(CheckpointError) as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file is not None and caught.value.file.endswith(".safetensors")
    assert caught.value.file in str(caught.value)
    _no_reader_left()


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_no_thread_writes_after_an_interrupted_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: type[BaseException]
) -> None:
    accelerator, _, _ = _saved(tmp_path)
    real = direct.read_into
    finished: list[float] = []

    def slow(path: Path, expected: Any, live: Any) -> Any:
        time.sleep(0.5)  # still reading when the main thread is interrupted
        try:
            return real(path, expected, live)
        finally:
            finished.append(time.monotonic())

    def interrupted(*args: Any) -> Any:
        raise raised()

    monkeypatch.setattr(direct, "read_into", slow)
    monkeypatch.setattr(api, "_decoded", interrupted)
    with pytest.raises(raised):
        accelerator.load_state(tmp_path / "ckpt")
    returned = time.monotonic()
    _no_reader_left()
    assert finished and max(finished) <= returned


def test_a_load_state_dict_set_on_the_instance_goes_through_the_private_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A patched load_state_dict (here: the weight stored transposed) reads the state's
    # tensors: read into the parameter itself, its transpose would be copied onto itself.
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    torch_load = model.load_state_dict

    def transposed(state: Any, *args: Any, **kwargs: Any) -> Any:
        return torch_load({**state, "weight": state["weight"].t()}, *args, **kwargs)

    model.load_state_dict = transposed  # type: ignore[method-assign]
    accelerator.save_state(tmp_path / "ckpt")
    weight = model.weight.detach().t().clone()
    assert direct.live_state(model) is None
    read = _watch(monkeypatch)
    accelerator.load_state(tmp_path / "ckpt")
    assert not read and torch.equal(model.weight, weight)


def test_an_optimizer_load_state_dict_set_on_the_instance_goes_through_the_private_copy(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = Buffers()
    model, optimizer = accelerator.prepare(model, _adam(model))
    _step(model, optimizer)
    seen: list[int] = []
    inner = optimizer.optimizer
    torch_load = inner.load_state_dict

    def counted(state: Any) -> None:
        seen.append(1)
        torch_load(state)

    inner.load_state_dict = counted
    assert direct.live_state(optimizer) is None
    accelerator.save_state(tmp_path / "ckpt")
    saved = _clone(optimizer.state_dict())
    _step(model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    _equal(optimizer.state_dict(), saved, "optimizer")
    assert seen == [1]


def test_an_optimizer_state_on_an_accelerator_goes_through_the_private_copy() -> None:
    # Adam's ``step`` counts stay on the CPU beside moments on the accelerator (``meta``
    # stands for it here): reading its file directly would make new CPU memory for nearly
    # all of it.
    param = torch.nn.Parameter(torch.empty(1024, device="meta"))
    optimizer = torch.optim.Adam([param])
    moments = {k: torch.empty(1024, device="meta") for k in ("exp_avg", "exp_avg_sq")}
    optimizer.state[param] = {"step": torch.tensor(3.0), **moments}
    assert direct.live_state(optimizer) is None
    optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(1024)}
    assert direct.live_state(optimizer) is not None  # on the CPU: read directly
