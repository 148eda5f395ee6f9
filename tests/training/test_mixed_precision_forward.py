"""Issue 17, divergence 1: ``prepare()`` applies mixed precision to the model's forward as
Accelerate's does (autocast around ``forward``, outputs converted to float32), so a forward
written outside ``accelerator.autocast()`` trains in bf16/fp16 -- compared with the installed
``accelerate``."""

from __future__ import annotations

import collections
import copy
import functools
import pickle
from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs
import pytest
import torch

import kwplug
from kwplug import AutocastKwargs
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.testing import run_distributed

accelerate = pytest.importorskip("accelerate")

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
Y = torch.randn(6, 2, generator=torch.Generator().manual_seed(4))


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide singletons reset around a test (mixed precision lives there)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _inner_dtypes(model: torch.nn.Module, inner: torch.nn.Module, x: torch.Tensor) -> list[Any]:
    """The output dtype of ``inner`` (a hook) and of ``model`` for one forward."""
    seen: list[Any] = []
    handle = inner.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    try:
        seen.append(model(x).dtype)
    finally:
        handle.remove()
    return seen


def _train(accelerator: Any) -> dict[str, Any]:
    """Three SGD steps, the forward NOT inside ``accelerator.autocast()`` (Accelerate style)."""
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    dtypes = _inner_dtypes(model, net[0], X)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(X), Y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"dtypes": dtypes, "weights": [p.detach().clone() for p in net.parameters()]}


def test_bf16_forward_outside_autocast_matches_accelerate(fresh_accelerate: None) -> None:
    theirs = _train(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    ours = _train(kwplug.Accelerator(cpu=True, mixed_precision="bf16"))
    fp32 = _train(kwplug.Accelerator(cpu=True))
    # The inner Linear computes in bfloat16; the model's output comes back in float32.
    assert ours["dtypes"] == theirs["dtypes"] == [torch.bfloat16, torch.float32]
    assert fp32["dtypes"] == [torch.float32, torch.float32]
    for a, b in zip(ours["weights"], theirs["weights"], strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(ours["weights"], fp32["weights"], strict=True))


def test_fp16_on_cpu_forward_runs_in_float16() -> None:
    # Accelerate has no fp16 on the CPU (it trains in float32, a documented difference);
    # kwplug autocasts to float16 with a GradScaler("cpu"), now in the prepared forward too.
    ours = _train(kwplug.Accelerator(cpu=True, mixed_precision="fp16"))
    fp32 = _train(kwplug.Accelerator(cpu=True))
    assert ours["dtypes"] == [torch.float16, torch.float32]
    assert any(not torch.equal(a, b) for a, b in zip(ours["weights"], fp32["weights"], strict=True))


def test_no_mixed_precision_leaves_forward_alone() -> None:
    net = _net()
    kwplug.Accelerator(cpu=True).prepare(net)
    assert "forward" not in net.__dict__ and not hasattr(net, "_original_forward")


class Pair(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


class Output(collections.OrderedDict):  # type: ignore[type-arg]
    """What transformers' ModelOutput is to this conversion: an OrderedDict subclass."""


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.linear(x)
        return {
            "pair": Pair(y, torch.arange(3)),
            "list": [y, (y * 2, "text")],
            "output": Output(loss=y.sum(), hidden=y),
            "none": None,
            "computed_in": str(y.dtype),
        }


def _structure(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.dtype
    if isinstance(data, (tuple, list)):
        return (type(data).__name__, [_structure(d) for d in data])
    if isinstance(data, dict):
        return (type(data).__name__, {k: _structure(v) for k, v in data.items()})
    return data


def test_nested_outputs_are_converted_as_accelerate(fresh_accelerate: None) -> None:
    torch.manual_seed(0)
    theirs = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(Nested())(X)
    ours = kwplug.Accelerator(cpu=True, mixed_precision="bf16").prepare(Nested())(X)
    assert _structure(ours) == _structure(theirs)
    assert _structure(ours)[1]["pair"] == ("Pair", [torch.float32, torch.int64])
    assert type(ours["output"]) is Output and ours["list"][1][1] == "text"
    assert ours["computed_in"] == "torch.bfloat16"


def _unwrap_story(accelerator: Any) -> dict[str, Any]:
    net = _net()
    model = accelerator.prepare(net)
    kept = accelerator.unwrap_model(model)
    story: dict[str, Any] = {"kept": _inner_dtypes(kept, net[0], X)}
    bare = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    story["bare_is_net"] = bare is net
    story["bare"] = _inner_dtypes(bare, net[0], X)
    with accelerator.autocast():
        story["bare_in_autocast"] = _inner_dtypes(bare, net[0], X)
    story["original_forward_left"] = hasattr(bare, "_original_forward")
    return story


def test_unwrap_model_keep_fp32_wrapper_as_accelerate(fresh_accelerate: None) -> None:
    theirs = _unwrap_story(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    ours = _unwrap_story(kwplug.Accelerator(cpu=True, mixed_precision="bf16"))
    assert ours == theirs
    assert ours["kept"] == [torch.bfloat16, torch.float32]
    assert ours["bare"] == [torch.float32, torch.float32]
    assert ours["bare_in_autocast"] == [torch.bfloat16, torch.bfloat16]


def test_unwrap_model_false_restores_the_class_forward() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    net = _net()
    accelerator.prepare(net)
    assert "forward" in net.__dict__
    accelerator.unwrap_model(net, keep_fp32_wrapper=False)
    assert "forward" not in net.__dict__
    assert net.forward.__func__ is torch.nn.Sequential.forward  # type: ignore[attr-defined]


def test_signature_matches_accelerate() -> None:
    import inspect

    def parameters(function: Any) -> list[tuple[str, Any, Any]]:
        signature = inspect.signature(function)
        return [(p.name, p.kind, p.default) for p in signature.parameters.values()]

    theirs = parameters(accelerate.Accelerator.unwrap_model)
    assert parameters(kwplug.Accelerator.unwrap_model) == theirs
    # The patched forward keeps the original's signature (what the Trainer inspects).
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(Nested())
    assert str(inspect.signature(model.forward)) == str(inspect.signature(Nested().forward))


def _autocast_story(accelerator: Any) -> list[Any]:
    net = _net()
    model = accelerator.prepare(net)
    with accelerator.autocast():
        dtypes = _inner_dtypes(model, net[0], X)
        dtypes.append((model(X) @ torch.ones(2, 2)).dtype)  # after the forward, in the region
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        dtypes += _inner_dtypes(model, net[0], X)  # the forward's own autocast wins
    return dtypes


def test_accelerator_autocast_still_works_around_the_forward(fresh_accelerate: None) -> None:
    theirs = _autocast_story(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    ours = _autocast_story(kwplug.Accelerator(cpu=True, mixed_precision="bf16"))
    assert ours == theirs
    assert ours[:3] == [torch.bfloat16, torch.float32, torch.bfloat16]


@attrs.define
class Float16Autocast(KwargsHandler):
    """A plugin deciding the forward's precision (float16 for a bf16 Accelerator)."""

    @hookimpl
    def autocast(self, device_type: str) -> Any:
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


def test_the_autocast_hook_decides_the_forward_precision(fresh_accelerate: None) -> None:
    accelerator = kwplug.Accelerator(
        cpu=True, mixed_precision="bf16", kwargs_handlers=[Float16Autocast()]
    )
    net = _net()
    assert _inner_dtypes(accelerator.prepare(net), net[0], X) == [torch.float16, torch.float32]
    # AutocastKwargs(enabled=False) as a kwargs handler: float32 inside, as Accelerate.
    handlers = [AutocastKwargs(enabled=False)]
    ours_net, theirs_net = _net(), _net()
    ours = kwplug.Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=handlers)
    theirs = accelerate.Accelerator(
        cpu=True, mixed_precision="bf16", kwargs_handlers=[accelerate.utils.AutocastKwargs(False)]
    )
    got = _inner_dtypes(ours.prepare(ours_net), ours_net[0], X)
    assert got == _inner_dtypes(theirs.prepare(theirs_net), theirs_net[0], X)
    assert got == [torch.float32, torch.float32]


def test_hook_calls_per_forward_are_zero() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(_net())
    calls: list[str] = []
    undo = accelerator.plugin_manager.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append(name), lambda *args: None
    )
    try:
        for _ in range(3):
            model(X)
    finally:
        undo()
    assert calls == []


def test_prepared_again_is_patched_once() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    net = _net()
    accelerator.prepare(net)
    patched = net.forward
    accelerator.prepare(net)
    assert net.forward is patched
    accelerator.unwrap_model(net, keep_fp32_wrapper=False)
    assert "forward" not in net.__dict__


def test_pickle_and_deepcopy_keep_mixed_precision() -> None:
    # Accelerate's patched model unpickles with the class's forward: float32 inside, silently.
    # kwplug's keeps the mixed-precision forward through pickle, torch.save and deepcopy.
    net = kwplug.Accelerator(cpu=True, mixed_precision="bf16").prepare(_net())
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        assert _inner_dtypes(copied, copied[0], X) == [torch.bfloat16, torch.float32]
        assert copied.forward.__wrapped__.__self__ is copied
        assert torch.equal(copied(X), net(X))


def _ddp_worker() -> dict[str, Any]:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    net = _net()
    model = accelerator.prepare(net)
    result = {
        "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
        "dtypes": _inner_dtypes(model, net[0], X),
    }
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    rank = accelerator.process_index
    accelerator.backward(torch.nn.functional.mse_loss(model(X[rank::2]), Y[rank::2]))
    optimizer.step()
    result["weights"] = [p.detach().clone() for p in net.parameters()]
    result["unwrapped_is_net"] = accelerator.unwrap_model(model, keep_fp32_wrapper=False) is net
    result["bare"] = _inner_dtypes(net, net[0], X)
    return result


def test_ddp_calls_the_patched_forward_of_the_module() -> None:
    ranks = run_distributed(_ddp_worker, nproc=2, timeout=180)
    for rank in ranks:
        assert rank["ddp"] and rank["unwrapped_is_net"]
        assert rank["dtypes"] == [torch.bfloat16, torch.float32]
        assert rank["bare"] == [torch.float32, torch.float32]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert torch.equal(a, b)


def test_unwrap_model_keeps_torch_compile_as_accelerate(fresh_accelerate: None) -> None:
    theirs = accelerate.Accelerator(cpu=True)
    ours = kwplug.Accelerator(cpu=True)
    net = _net()
    compiled = torch.compile(net)
    for accelerator in (theirs, ours):  # an outermost compiled module around the model
        assert accelerator.unwrap_model(compiled) is compiled
        assert accelerator.unwrap_model(compiled, keep_torch_compile=False) is net
        inside = torch.nn.DataParallel(compiled)  # a compiled module inside a wrapper
        assert accelerator.unwrap_model(inside) is compiled
    # Around a wrapper: a compiled module around the user's module, the prepared one intact
    # (Accelerate reassigns its `_orig_mod`, taking the wrapper out of the trained model).
    parallel = torch.nn.DataParallel(net)
    outer = torch.compile(parallel)
    unwrapped = ours.unwrap_model(outer)
    assert type(unwrapped) is type(outer) and unwrapped._orig_mod is net
    assert outer._orig_mod is parallel
    assert ours.unwrap_model(outer, keep_torch_compile=False) is net
