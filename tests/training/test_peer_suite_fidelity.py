"""The last causes that failed Accelerate's own pytest files on kwplug (issue 28, item 3;
measured by tests/compat/peer_suite.py with Accelerate's 1.16.0 source archive), each as a
self-contained test compared with the installed Accelerate where it can be: no archive, no
network."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kwplug.hooks import ModelHook
from kwplug.utils.environment import clear_environment

_DYNAMO_ENVIRONMENTS = [
    {},
    {"ACCELERATE_DYNAMO_BACKEND": "aot_ts_nvfuser", "ACCELERATE_DYNAMO_MODE": "reduce-overhead"},
    {"ACCELERATE_DYNAMO_BACKEND": "EAGER", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true"},
    {"ACCELERATE_DYNAMO_USE_DYNAMIC": "1", "ACCELERATE_DYNAMO_MODE": "default"},
]


@pytest.mark.parametrize("environment", _DYNAMO_ENVIRONMENTS)
def test_dynamo_to_kwargs_counts_what_the_environment_set_as_accelerate(
    environment: dict[str, str],
) -> None:
    from accelerate.utils import TorchDynamoPlugin as Theirs

    from kwplug.utils import TorchDynamoPlugin

    # Accelerate's test_torch_dynamo_plugin: `accelerate launch --dynamo_backend` settings
    # are what to_kwargs() reports (its default instance is built under a cleared environment).
    with clear_environment():
        os.environ.update(environment)
        ours, theirs = TorchDynamoPlugin().to_kwargs(), Theirs().to_kwargs()
        given = TorchDynamoPlugin(backend="inductor", options={"trace.enabled": False})
        given_theirs = Theirs(backend="inductor", options={"trace.enabled": False})
        assert given.to_kwargs() == given_theirs.to_kwargs()
    assert ours == theirs
    if environment.get("ACCELERATE_DYNAMO_BACKEND") == "aot_ts_nvfuser":
        assert ours == {"backend": "aot_ts_nvfuser", "mode": "reduce-overhead"}


def test_dynamo_to_kwargs_defaults_are_a_plugin_built_without_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kwplug.utils import TorchDynamoPlugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    with clear_environment():
        default = TorchDynamoPlugin()
        assert default.to_kwargs() == {}
        fields = default.to_dict()
    fields.pop("use_regional_compilation")
    from kwplug.plugins.dynamo import _UNSET_ENVIRONMENT

    assert fields == _UNSET_ENVIRONMENT
    # The environment is read, not changed, by to_kwargs().
    assert TorchDynamoPlugin().to_kwargs() == {"backend": "eager"}
    assert os.environ["ACCELERATE_DYNAMO_BACKEND"] == "eager"


def test_a_prepared_loader_has_its_accelerators_gradient_state_and_frees_it() -> None:
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from kwplug import Accelerator
    from kwplug.data import prepare_dataloader

    accelerator = Accelerator(gradient_accumulation_steps=2)
    loader = accelerator.prepare_data_loader(DataLoader(list(range(16)), batch_size=4))
    assert loader.gradient_state is accelerator.gradient_state
    # What code written for Accelerate reads through the loader while iterating.
    seen = [(loader.gradient_state.end_of_dataloader, loader.gradient_state.active_dataloader)
            for _ in loader]  # fmt: skip
    assert seen == [(False, loader)] * 3 + [(True, loader)]
    assert loader.gradient_state.num_steps == 2
    other = Accelerator()
    assert other.prepare(DataLoader(range(4))).gradient_state is other.gradient_state
    unprepared = prepare_dataloader(DataLoader(range(4)), torch.device("cpu"), 1, 0)
    assert unprepared.gradient_state is None

    # Accelerate's test_ensure_dataloader_gets_cleaned_up: an object holding an Accelerator,
    # its loader and an iterator in mid-epoch, deleted: all freed by reference counting.
    class Holder:
        def __init__(self) -> None:
            self.accelerator = Accelerator()
            self.loader = self.accelerator.prepare_data_loader(DataLoader(list(range(16)), 4))
            self.iterator = iter(self.loader)

    gc.disable()
    try:
        holder = Holder()
        assert next(holder.iterator).tolist() == [0, 1, 2, 3]
        refs = [weakref.ref(holder.accelerator), weakref.ref(holder.loader)]
        refs.append(weakref.ref(holder.loader.gradient_state))
        del holder
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()


class _Quantized(torch.nn.Module):
    """What transformers' bitsandbytes loading leaves: flags, a device map, and a ``.to()``
    that raises (bitsandbytes' models cannot be moved)."""

    def __init__(self, device_map: dict[str, object], bits: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.hf_device_map = device_map
        setattr(self, f"is_loaded_in_{bits}bit", True)

    def to(self, *args: object, **kwargs: object) -> _Quantized:  # type: ignore[override]
        raise ValueError("`.to` is not supported for `8-bit` bitsandbytes models")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _outcome(prepare: object, model: torch.nn.Module) -> str:
    try:
        prepared = prepare(model)  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)
    return "kept" if prepared is model or getattr(prepared, "module", None) is model else "?"


@pytest.mark.parametrize(
    ("device_map", "bits"),
    [
        ({"": "cpu"}, 8),  # Accelerate's test_prepare_model_8bit_cpu_offload_raises_valueerror
        ({"": "cpu"}, 4),
        ({"linear": "disk", "x": 0}, 8),
        ({"": 0}, 8),  # the first device, as Accelerate: not the CPU device, yet no error
        ({"": "cuda:1"}, 4),  # another device than the training device
        ({"a": "cpu", "b": 0}, 8),
    ],
)
def test_a_quantized_device_mapped_model_is_checked_and_kept_as_accelerate(
    device_map: dict[str, object], bits: int
) -> None:
    from accelerate import Accelerator as Theirs

    from kwplug import Accelerator

    ours = _outcome(Accelerator(cpu=True).prepare_model, _Quantized(device_map, bits))
    theirs = _outcome(Theirs(cpu=True).prepare_model, _Quantized(device_map, bits))
    assert ours == theirs
    if {"cpu", "disk"} & set(device_map.values()):  # bitsandbytes without multi-backend
        assert "with CPU or disk offload" in ours


def test_a_quantized_model_offloaded_to_disk_alone_is_the_offload_error() -> None:
    from kwplug import Accelerator

    # Accelerate reads "disk" as a torch device first (a RuntimeError); kwplug says why.
    with pytest.raises(ValueError, match="with CPU or disk offload"):
        Accelerator(cpu=True).prepare_model(_Quantized({"": "disk"}))


def test_a_model_spread_over_devices_is_left_where_it_is_and_refused_in_several_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kwplug import Accelerator
    from kwplug.accelerator._device_map import stays_where_mapped

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.hf_device_map = {"0": "cpu", "1": "disk"}  # type: ignore[assignment]
    moved: list[object] = []
    model.to = lambda *a, **k: moved.append(a) or model  # type: ignore[method-assign]
    accelerator = Accelerator(cpu=True)
    assert accelerator.verify_device_map(model)
    assert accelerator.prepare_model(model) is model and moved == []
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"loaded with `device_map='auto'` in any distributed"):
        stays_where_mapped(model, cpu, world_size=2)
    monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", "true")
    assert stays_where_mapped(model, cpu, world_size=2)
    plain = torch.nn.Linear(2, 2)
    assert not stays_where_mapped(plain, cpu, world_size=2)


class _Double(ModelHook):
    """Doubles the positional inputs (module level: a hooked model pickles with its hook)."""

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(a * 2 for a in args), kwargs


class _PlusOne(ModelHook):
    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output + 1


def test_model_hooks_run_as_accelerates_and_survive_prepare_unwrap_and_pickle() -> None:
    import pickle

    from accelerate.hooks import ModelHook as TheirHook
    from accelerate.hooks import add_hook_to_module as their_add

    from kwplug import Accelerator
    from kwplug.hooks import SequentialHook, add_hook_to_module, remove_hook_from_module

    class TheirDouble(TheirHook):  # type: ignore[misc]
        def pre_forward(self, module, *args, **kwargs):  # type: ignore[no-untyped-def]
            return tuple(a * 2 for a in args), kwargs

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    plain = model(x)
    theirs = torch.nn.Linear(3, 2)
    theirs.load_state_dict(model.state_dict())
    their_add(theirs, TheirDouble())
    assert add_hook_to_module(model, _Double()) is model
    assert torch.equal(model(x), theirs(x)) and torch.equal(
        model(x), torch.nn.Linear.forward(model, 2 * x)
    )
    add_hook_to_module(model, _PlusOne(), append=True)
    assert isinstance(model._hf_hook, SequentialHook)
    assert torch.equal(model(x), theirs(x) + 1)
    # Accelerate's test_can_unwrap_hooked_model_bf16: prepare in bf16, unwrap, still callable.
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    prepared = accelerator.prepare(model)
    assert prepared(x).dtype == torch.float32
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert torch.equal(unwrapped(x), theirs(x) + 1)
    copy = pickle.loads(pickle.dumps(unwrapped))  # Accelerate's hooked forward does not pickle
    assert torch.equal(copy(x), theirs(x) + 1)
    remove_hook_from_module(unwrapped)
    assert torch.equal(unwrapped(x), plain) and not hasattr(unwrapped, "_hf_hook")
    assert unwrapped.forward.__func__ is torch.nn.Linear.forward


def test_no_grad_hook_and_recursive_removal() -> None:
    from kwplug.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class NoGrad(ModelHook):
        no_grad = True

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    add_hook_to_module(model[0], NoGrad())
    add_hook_to_module(model[1], ModelHook())
    out = model(torch.ones(1, 2))
    assert out.requires_grad and model[0](torch.ones(1, 2)).requires_grad is False
    remove_hook_from_module(model, recurse=True)
    assert all(
        not hasattr(m, "_hf_hook") and m.forward.__func__ is torch.nn.Linear.forward for m in model
    )


def test_model_has_dtensor_and_tp_size_as_accelerate() -> None:
    from types import SimpleNamespace

    from accelerate.utils import get_model_tp_size as their_tp_size

    from kwplug.utils import get_model_tp_size, model_has_dtensor

    model = torch.nn.Linear(4, 4)
    assert model_has_dtensor(model) is False
    for tp_size, config in [(None, None), (2, None), (None, SimpleNamespace(
            distributed_config=SimpleNamespace(tp_size=4))),
            (None, SimpleNamespace(distributed_config={"tp_size": 8}))]:  # fmt: skip
        probe = torch.nn.Linear(1, 1)
        probe.tp_size = tp_size  # type: ignore[assignment]
        if config is not None:
            probe.config = config  # type: ignore[assignment]
        assert get_model_tp_size(probe) == their_tp_size(probe)
    assert get_model_tp_size(model) is None


def test_model_has_dtensor_finds_a_sharded_parameter(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from kwplug.utils import model_has_dtensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(2, 2)
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Replicate()])
        )
        assert isinstance(model.weight, DTensor) and model_has_dtensor(model) is True
    finally:
        dist.destroy_process_group()


def test_fp8_recipe_names_import_and_refuse_at_construction() -> None:
    from kwplug.utils import AORecipeKwargs, TERecipeKwargs

    with pytest.raises(NotImplementedError, match="TERecipeKwargs.*no FP8 training"):
        TERecipeKwargs(fp8_format="HYBRID")
    with pytest.raises(NotImplementedError, match="AORecipeKwargs"):
        AORecipeKwargs()


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("cls_name", ["DataLoaderShard", "DataLoaderDispatcher"])
def test_loader_classes_take_accelerates_drop_last_and_non_blocking(
    cls_name: str, drop_last: bool
) -> None:
    import accelerate.data_loader as theirs

    import kwplug.data_loader as ours

    def run(module: Any) -> list[Any]:
        loader = getattr(module, cls_name)(
            list(range(10)), batch_size=4, _drop_last=drop_last, _non_blocking=True
        )
        loader = module.skip_first_batches(loader, num_batches=1)
        seen = [(b.tolist(), loader.remainder, loader.end_of_dataloader) for b in loader]
        return [loader._drop_last, loader._non_blocking, seen]

    # Accelerate's test_skip_first_batches_preserves_configuration, and what the flags do.
    assert run(ours) == run(theirs)
    assert run(ours)[:2] == [drop_last, True]


def test_drop_last_of_a_loader_class_must_be_a_bool() -> None:
    from kwplug.data_loader import DataLoaderShard

    with pytest.raises(TypeError, match="_drop_last must be a bool"):
        DataLoaderShard(list(range(4)), batch_size=2, _drop_last="yes")


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_remap_optimizer_parameters_after_a_placement_that_replaced_them(
    library: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    Accelerator = importlib.import_module(library).Accelerator
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old_parameter = model.weight
    old = accelerator._get_named_parameters(model)
    assert old == {"weight": old_parameter}
    ids = accelerator._get_named_parameters(model, torch.nn.Linear(1, 1), drop_refs=True)
    assert ids["0.weight"] == old_parameter.data_ptr() and set(ids) == {
        "0.weight", "1.weight", "1.bias"}  # fmt: skip
    # Accelerate's test_remap_optimizer_parameters: placement that replaces parameters.
    flag = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model = accelerator.prepare_model(model)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(flag)
    optimizer = accelerator.prepare_optimizer(optimizer)
    accelerator._remap_optimizer_parameters(old, model, optimizer)
    assert model.weight is not old_parameter
    assert optimizer.param_groups[0]["params"][0] is model.weight
    before = model.weight.detach().clone()
    accelerator.backward(model(torch.ones(2, 2)).sum())
    optimizer.step()
    torch.testing.assert_close(model.weight, before - 0.2)


def test_remap_optimizer_parameters_points_an_unprepared_optimizer_at_the_new_ones() -> None:
    from kwplug import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old = accelerator._get_named_parameters(model)
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # a replacement
    accelerator._remap_optimizer_parameters(old, model, optimizer)
    assert optimizer.param_groups[0]["params"][0] is model.weight
    assert optimizer.param_groups[0]["params"][1] is model.bias


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
@pytest.mark.parametrize("split_batches", [False, True])
def test_a_scheduler_does_not_step_after_an_optimizer_step_marked_overflowed(
    library: str, split_batches: bool
) -> None:
    import importlib

    # Accelerate's lambda_test (tests/test_scheduler.py): code written for Accelerate marks a
    # skipped step with the prepared optimizer's `_is_overflow`, without a loss scaler.
    accelerator = importlib.import_module(library).Accelerator(
        cpu=True, split_batches=split_batches
    )
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer._is_overflow = False
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9
    optimizer._is_overflow = True
    assert optimizer.step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9  # not stepped
    optimizer._is_overflow = False
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.8


def test_set_verbosity_filters_a_ported_scripts_accelerate_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    import kwplug.logging as kl

    # Accelerate's test_verbosity_filters_logs, after the rename.
    logger = kl.get_logger("accelerate.test_verbosity")
    levels = {name: logging.getLogger(name).level for name in ("kwplug", "accelerate", "")}
    try:
        with caplog.at_level(logging.WARNING, logger="accelerate"):
            kl.set_verbosity_error()
            logger.warning("hidden warning")
            assert not caplog.records
            kl.set_verbosity_warning()
            logger.warning("visible warning")
            assert [r.name for r in caplog.records] == ["accelerate.test_verbosity"]
        assert logging.getLogger().level == levels[""]
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _three_layers() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    ).eval()


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_offloading_hooks_keep_weights_on_meta_between_forwards(library: str) -> None:
    import importlib

    hooks = importlib.import_module(f"{library}.hooks")
    from kwplug.utils import has_offloaded_params

    model, x = _three_layers(), torch.randn(5, 3)
    expected = model(x)
    hooks.attach_align_device_hook(model, execution_device=torch.device("cpu"), offload=True)
    assert [p.device.type for p in model.parameters()] == ["meta"] * 6
    assert model[1].running_mean.device.type == "cpu"  # buffers not offloaded by default
    assert has_offloaded_params(model[0]) and not has_offloaded_params(model)
    assert torch.equal(model(x), expected)  # each layer's weights brought in for its forward
    assert [p.device.type for p in model.parameters()] == ["meta"] * 6
    hooks.remove_hook_from_module(model, recurse=True)
    assert [p.device.type for p in model.parameters()] == ["cpu"] * 6
    assert torch.equal(model(x), expected) and not has_offloaded_params(model[0])


def test_accelerates_has_offloaded_params_sequence_on_kwplugs_hooks() -> None:
    from accelerate.test_utils import RegressionModel

    from kwplug.big_modeling import cpu_offload_with_hook
    from kwplug.hooks import attach_align_device_hook, remove_hook_from_module
    from kwplug.utils import has_offloaded_params

    # Accelerate's test_has_offloaded_params, after the rename.
    model = RegressionModel()
    assert not has_offloaded_params(model)
    attach_align_device_hook(model, offload=False)
    assert not has_offloaded_params(model)
    remove_hook_from_module(model)
    model, _ = cpu_offload_with_hook(model)
    assert not has_offloaded_params(model)
    remove_hook_from_module(model)
    attach_align_device_hook(model, offload=True)
    assert has_offloaded_params(model)
    assert model.a.device.type == "meta"
    assert model(torch.tensor([2.0])).item() == pytest.approx(0.0)  # a = b = 0: brought in


class _Recording(torch.nn.Linear):
    """A layer that records where ``.to()`` sends it."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.moves: list[str] = []

    def to(self, *args: Any, **kwargs: Any) -> _Recording:  # type: ignore[override]
        self.moves.append(str(args[0]))
        return super().to(*args, **kwargs)  # type: ignore[return-value]


def test_cpu_offload_with_hook_moves_for_the_forward_and_offloads_the_previous_model() -> None:
    from kwplug.big_modeling import cpu_offload_with_hook
    from kwplug.hooks import CpuOffload, UserCpuOffloadHook

    first, second = _Recording(), _Recording()
    x = torch.randn(3, 2)
    expected = second(first(x))
    first, hook_1 = cpu_offload_with_hook(first, execution_device="cpu")
    second, hook_2 = cpu_offload_with_hook(second, "cpu", prev_module_hook=hook_1)
    assert isinstance(hook_2, UserCpuOffloadHook) and isinstance(hook_2.hook, CpuOffload)
    assert first.moves == ["cpu"] and second.moves == ["cpu"]  # on the CPU from the start
    assert torch.equal(second(first(x)), expected)
    hook_1.offload()
    assert first.moves == ["cpu", "cpu"]
    hook_2.remove()
    assert not hasattr(second, "_hf_hook") and torch.equal(second(first(x)), expected)


class _ForOffload(torch.nn.Module):
    """Accelerate's ModelForTest (tests/test_accelerator.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_load_checkpoint_and_dispatch_offloads_to_disk_and_save_model_keeps_the_weights(
    library: str, safe: bool, tmp_path: Path
) -> None:
    import importlib

    lib = importlib.import_module(library)
    accelerator = lib.Accelerator(cpu=True)
    torch.manual_seed(5)
    model, inputs = _ForOffload().eval(), torch.randn(3, 3)
    expected = model(inputs)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    device_map = {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"}
    # Accelerate's test_save_model_offload, and what it relies on.
    accelerator.save_model(model, tmp_path, safe_serialization=safe)
    lib.load_checkpoint_and_dispatch(
        model, tmp_path, device_map=device_map, offload_folder=tmp_path
    )
    assert model.hf_device_map == device_map
    assert (
        model.batchnorm.weight.device.type == "meta" and model.linear1.weight.device.type == "cpu"
    )
    assert torch.allclose(model(inputs), expected, atol=1e-6)
    assert model.batchnorm.weight.device.type == "meta"  # back on meta after the forward
    saved = tmp_path / "again"
    accelerator.save_model(model, saved, safe_serialization=safe)
    name = "model.safetensors" if safe else "pytorch_model.bin"
    if safe:
        from safetensors.torch import load_file

        reread = load_file(saved / name)
    else:
        reread = torch.load(saved / name, weights_only=True)
    assert set(reread) == set(weights)
    assert all(torch.equal(reread[k], weights[k]) for k in weights)  # offloaded ones too
    lib.load_checkpoint_and_dispatch(model, saved)
    assert torch.allclose(model(inputs), expected, atol=1e-6)


def test_load_checkpoint_and_dispatch_needs_a_folder_for_disk_and_a_map_it_can_read(
    tmp_path: Path,
) -> None:
    from kwplug import Accelerator, load_checkpoint_and_dispatch

    model = _ForOffload()
    Accelerator(cpu=True).save_model(model, tmp_path)
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(model, tmp_path, device_map={"batchnorm": "disk"})
    with pytest.raises(NotImplementedError, match="device_map='...'"):
        load_checkpoint_and_dispatch(model, tmp_path, device_map="auto")
