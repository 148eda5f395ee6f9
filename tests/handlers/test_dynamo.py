"""``Accelerator(dynamo_backend=...)``/``TorchDynamoPlugin``: ``torch.compile`` in ``prepare``
through the ``compile_model`` hook (the built-in ``dynamo`` plugin), on CPU with the ``eager``
and ``aot_eager`` backends (no C compiler needed)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch._dynamo.eval_frame import OptimizedModule

import kwplug
from kwplug import Accelerator
from kwplug.errors import MissingFeatureError
from kwplug.testing import PluginSandbox
from kwplug.utils import DynamoBackend, TorchDynamoPlugin, extract_model_from_parallel


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(accelerator: Accelerator, steps: int = 5) -> tuple[list[float], torch.nn.Module]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=generator)
    y = torch.randn(16, 1, generator=generator)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(prepared(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, prepared


def test_hook_compile_model() -> None:
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = _model()
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, OptimizedModule)
    assert prepared._orig_mod is model
    # dynamo_backend= passes the handler on, as if given in kwargs_handlers.
    assert (
        accelerator.plan["compile_model"].plugin
        == "user[0]:kwplug.plugins.dynamo.TorchDynamoPlugin"
    )
    # Prepared twice: compiled once (Accelerate's `not is_compiled_module(model)`).
    assert accelerator.prepare(prepared) is prepared


def test_no_backend_compiles_nothing() -> None:
    for accelerator in (Accelerator(cpu=True), Accelerator(cpu=True, dynamo_backend="no")):
        model = _model()
        assert accelerator.prepare(model) is model
        assert accelerator.plan["compile_model"].plugin is None


def test_evaluation_mode_compiles_too() -> None:
    # Accelerate: evaluation_mode applies "mixed precision and torch.compile" only.
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = _model()
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    assert isinstance(prepared, OptimizedModule) and prepared._orig_mod is model


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_training_gives_the_losses_of_the_uncompiled_model(backend: str) -> None:
    plain, plain_model = _train(Accelerator(cpu=True))
    compiled, compiled_model = _train(Accelerator(cpu=True, dynamo_backend=backend))
    assert isinstance(compiled_model, OptimizedModule)
    # eager runs the very same kernels: bitwise. aot_eager runs the decomposed graph: the same
    # float32 sums in the same order here, so also equal; 1e-6 leaves room for torch versions.
    tolerance = 0.0 if backend == "eager" else 1e-6
    assert compiled == pytest.approx(plain, abs=tolerance, rel=0)
    assert compiled[-1] < compiled[0]  # it trained
    for a, b in zip(
        plain_model.state_dict().values(),
        compiled_model._orig_mod.state_dict().values(),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the inductor compiles C++: no compiler")
def test_inductor_the_one_test_of_accelerates_usual_backend() -> None:
    # The one inductor run of the suite (about 55 s cold on a loaded 2-core machine, cached
    # by torch in /tmp/torchinductor_<user> afterwards). Measured: the largest loss difference
    # from the uncompiled run is 6e-8 (fused float32 kernels); 1e-5 is the bound.
    plain, _ = _train(Accelerator(cpu=True))
    compiled, model = _train(Accelerator(cpu=True, dynamo_backend="INDUCTOR"))
    assert isinstance(model, OptimizedModule)
    assert compiled == pytest.approx(plain, abs=1e-5, rel=0)


def test_unwrap_model_keeps_or_removes_the_compiled_wrapper() -> None:
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = _model()
    prepared = accelerator.prepare(model)
    assert accelerator.unwrap_model(prepared) is prepared  # keep_torch_compile=True default
    assert accelerator.unwrap_model(prepared, keep_torch_compile=True) is prepared
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
    assert extract_model_from_parallel(prepared) is prepared
    assert extract_model_from_parallel(prepared, keep_torch_compile=False) is model


def test_saved_keys_are_the_modules_own(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    _, prepared = _train(accelerator, steps=2)
    own = sorted(prepared._orig_mod.state_dict())
    assert own == ["0.bias", "0.weight", "2.bias", "2.weight"]
    accelerator.save_model(prepared, tmp_path / "model")
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == own
    assert sorted(accelerator.get_state_dict(prepared)) == own
    accelerator.save_state(tmp_path / "state")
    (state_file,) = (tmp_path / "state").glob("*/model_0.safetensors")  # kwplug's layout
    with safe_open(str(state_file), "pt") as f:
        assert sorted(f.keys()) == own
        saved = {k: f.get_tensor(k) for k in own}
    # ... and load back into the compiled model.
    with torch.no_grad():
        for parameter in prepared.parameters():
            parameter.zero_()
    accelerator.load_state(tmp_path / "state")
    for key, value in prepared._orig_mod.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_what_reaches_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = torch.compile

    def spy(model: torch.nn.Module, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    plugin = TorchDynamoPlugin(backend="AOT_EAGER", fullgraph=True, dynamic=False)
    prepared = Accelerator(cpu=True, dynamo_plugin=plugin).prepare(_model())
    assert isinstance(prepared, OptimizedModule)
    assert calls == [
        {
            "backend": "aot_eager",
            "mode": None,
            "fullgraph": True,
            "dynamic": False,
            "options": None,
            "disable": False,
        }
    ]
    calls.clear()
    model = _model()
    disabled = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", disable=True))
    assert disabled.prepare(model) is model  # torch.compile(disable=True) is the model itself
    assert calls[0]["disable"] is True


def test_backend_names_in_any_case_as_accelerate() -> None:
    from accelerate.utils import DynamoBackend as AccelerateBackend
    from accelerate.utils import TorchDynamoPlugin as AcceleratePlugin

    assert [b.name for b in DynamoBackend] == [b.name for b in AccelerateBackend]
    assert [b.value for b in DynamoBackend] == [b.value for b in AccelerateBackend]
    for given in ("eager", "EAGER", "Eager", DynamoBackend.EAGER, "aot_eager", "no"):
        ours = TorchDynamoPlugin(backend=given)
        theirs = AcceleratePlugin(backend=given)
        assert ours.backend.value == theirs.backend.value
        assert ours.to_dict()["backend"] == theirs.to_dict()["backend"]
    assert TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR).backend is DynamoBackend.INDUCTOR


def test_environment_defaults_as_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import TorchDynamoPlugin as AcceleratePlugin

    def fields(plugin: Any) -> dict[str, Any]:
        names = ("mode", "fullgraph", "dynamic", "disable", "options")
        return {"backend": plugin.backend.value, **{n: getattr(plugin, n) for n in names}}

    assert fields(TorchDynamoPlugin()) == fields(AcceleratePlugin())
    assert TorchDynamoPlugin().backend is DynamoBackend.NO
    # What `accelerate launch --dynamo_backend eager --dynamo_mode ...` exports.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "True")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False")
    assert fields(TorchDynamoPlugin()) == fields(AcceleratePlugin())
    assert fields(TorchDynamoPlugin()) == {
        "backend": "EAGER",
        "mode": "max-autotune",
        "fullgraph": True,
        "dynamic": False,
        "disable": False,
        "options": None,
    }
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")
    # The default instance every Accelerator registers reads them: compiled without a keyword.
    model = _model()
    prepared = Accelerator(cpu=True).prepare(model)
    assert isinstance(prepared, OptimizedModule) and prepared._orig_mod is model


def test_bad_values_are_errors_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'backend' must be one of 'no', 'eager'.*'aot_eager'"):
        TorchDynamoPlugin(backend="eagre")
    with pytest.raises(ValueError, match="'backend' must be one of"):
        Accelerator(cpu=True, dynamo_backend="not-a-backend")
    with pytest.raises(TypeError, match="'backend' must be a str"):
        TorchDynamoPlugin(backend=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'mode' must be one of .*'reduce-overhead'"):
        TorchDynamoPlugin(backend="inductor", mode="fastest")
    with pytest.raises(TypeError, match="'fullgraph'"):
        TorchDynamoPlugin(fullgraph="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'options'"):
        TorchDynamoPlugin(options=["max_autotune"])
    with pytest.raises(ValueError, match="'use_regional_compilation' must be False"):
        TorchDynamoPlugin(use_regional_compilation=True)
    with pytest.raises(
        ValueError, match="cannot pass in both `dynamo_plugin` and `dynamo_backend`"
    ):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin())
    with pytest.raises(TypeError, match="dynamo_plugin must be a TorchDynamoPlugin"):
        Accelerator(cpu=True, dynamo_plugin={"backend": "eager"})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="both TorchDynamoPlugin; pass at most one handler of each class"
    ):
        Accelerator(
            cpu=True, kwargs_handlers=[TorchDynamoPlugin()], dynamo_plugin=TorchDynamoPlugin()
        )
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "turbo")
    with pytest.raises(ValueError, match="'backend' must be one of .*got 'turbo'"):
        Accelerator(cpu=True)
    assert TorchDynamoPlugin(backend="eager").backend is DynamoBackend.EAGER  # given wins


def test_a_plugin_answering_something_else_than_a_module_is_a_type_error() -> None:
    import attrs

    @attrs.define
    class Broken(kwplug.KwargsHandler):
        @kwplug.hookimpl
        def compile_model(self, model: torch.nn.Module) -> Any:
            return "compiled"

    accelerator = Accelerator(cpu=True, kwargs_handlers=[Broken()])
    with pytest.raises(TypeError, match="hook 'compile_model' .* returned str"):
        accelerator.prepare(_model())


def test_dynamo_backend_with_the_plugin_blocked_names_why(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "dynamo")
    with pytest.raises(
        MissingFeatureError, match=r"built-in 'dynamo' plugin, which is not loaded \(blocked"
    ):
        Accelerator(cpu=True, dynamo_backend="eager")
    # Without the keyword nothing asks for it: the model is prepared uncompiled.
    model = _model()
    assert Accelerator(cpu=True).prepare(model) is model


def test_from_config_table() -> None:
    accelerator = Accelerator.from_config(
        {"cpu": True, "handlers": {"dynamo": {"backend": "aot_eager", "fullgraph": True}}}
    )
    model = _model()
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, OptimizedModule) and prepared._orig_mod is model
    (handler,) = [h for h in accelerator.handlers if isinstance(h, TorchDynamoPlugin)]
    assert handler.compile_kwargs()["backend"] == "aot_eager" and handler.fullgraph is True


def test_hook_compile_model_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    import attrs

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")  # the default instance compiles

    @attrs.define
    class Own(kwplug.KwargsHandler):
        answer: bool = True

        @kwplug.hookimpl
        def compile_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
            return torch.nn.Sequential(model) if self.answer else None

    model = _model()
    # A user handler answers before the built-in default ...
    accelerator = Accelerator(cpu=True, kwargs_handlers=[Own()])
    mine = accelerator.prepare(model)
    assert isinstance(mine, torch.nn.Sequential) and mine[0] is model
    assert accelerator.plan["compile_model"].plugin.startswith("user[0]:")
    # ... and its None falls through to the default TorchDynamoPlugin.
    accelerator = Accelerator(cpu=True, kwargs_handlers=[Own(answer=False)])
    compiled = accelerator.prepare(model)
    assert isinstance(compiled, OptimizedModule) and compiled._orig_mod is model
    assert accelerator.plan["compile_model"].plugin == "kwplug:dynamo"
