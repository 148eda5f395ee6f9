"""The keywords and behaviours Accelerate scripts rely on (issue 17, items 2 and 3), each run
under kwplug and, where it can run here, under Accelerate in the same process.

The signature gate (tests/gates/test_signatures.py) proves that every keyword is *accepted*;
these tests check what each one does: ``save_state``/``load_state`` keywords, ``unwrap_model``
with ``torch.compile``, ``prepare(device_placement=...)``, picklable prepared objects,
``register_for_checkpointing``'s ``ValueError``, ``gradient_state.active_dataloader`` and
``set_epoch`` reaching a custom batch sampler.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import kwplug
from kwplug.errors import KwplugWarning

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def reset_accelerate() -> Iterator[None]:
    """Accelerate keeps process-wide singletons: reset them around each use."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _trained(library: Any, **kwargs: Any) -> tuple[Any, torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    accelerator = library.Accelerator(cpu=True, **kwargs)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(torch.ones(4, 3)).sum())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return accelerator, model, optimizer, scheduler


# -- save_state / load_state keywords -----------------------------------------------------------


def test_save_state_safe_serialization_false_warns_and_saves_safetensors(tmp_path: Path) -> None:
    accelerator, model, _, _ = _trained(kwplug)
    weight = model.weight.detach().clone()
    with pytest.warns(KwplugWarning, match="safe_serialization=False.*safetensors"):
        accelerator.save_state(tmp_path / "ckpt", safe_serialization=False)
    files = [p.name for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert not [f for f in files if f.endswith((".bin", ".pkl", ".pt"))], files
    assert any(f.endswith(".safetensors") for f in files)
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, weight)


def test_save_state_default_keywords_do_not_warn(tmp_path: Path) -> None:
    accelerator, _, _, _ = _trained(kwplug)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerator.save_state(tmp_path / "ckpt", safe_serialization=True)
        accelerator.load_state(tmp_path / "ckpt", load_kwargs=None, map_location="on_device")


def test_save_state_rejects_non_bool_safe_serialization(tmp_path: Path) -> None:
    accelerator, _, _, _ = _trained(kwplug)
    with pytest.raises(TypeError, match="safe_serialization.*must be a bool"):
        accelerator.save_state(tmp_path / "ckpt", safe_serialization="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


def test_save_model_func_kwargs_are_ignored_with_a_warning_naming_them(tmp_path: Path) -> None:
    accelerator, _, _, _ = _trained(kwplug)
    with pytest.warns(KwplugWarning, match=r"\['client_state', 'tag'\].*DeepSpeed"):
        accelerator.save_state(tmp_path / "ckpt", tag="x", client_state={})
    accelerator.load_state(tmp_path / "ckpt")


def test_accelerate_accepts_the_same_save_and_load_calls(
    tmp_path: Path, reset_accelerate: None
) -> None:
    """The calls kwplug accepts are calls Accelerate accepts (without DeepSpeed it ignores the
    model-function keywords of save_state and passes map_location/strict to its loader)."""
    accelerator, _, _, _ = _trained(accelerate)
    accelerator.save_state(str(tmp_path / "a"), safe_serialization=True, tag="x")
    accelerator.load_state(str(tmp_path / "a"), map_location="cpu", strict=True)
    with pytest.raises(TypeError):
        accelerator.load_state(str(tmp_path / "a"), not_a_keyword=1)


def test_load_state_keywords(tmp_path: Path) -> None:
    accelerator, model, _, _ = _trained(kwplug)
    accelerator.save_state(tmp_path / "ckpt")
    weight = model.weight.detach().clone()
    for location in ("cpu", "on_device", None):
        with torch.no_grad():
            model.weight.zero_()
        accelerator.load_state(tmp_path / "ckpt", map_location=location, strict=True)
        assert torch.equal(model.weight, weight) and model.weight.device.type == "cpu"
    with pytest.warns(KwplugWarning, match="load_kwargs.*weights_only"):
        accelerator.load_state(tmp_path / "ckpt", load_kwargs={"weights_only": True})
    with pytest.raises(ValueError, match="strict=False"):
        accelerator.load_state(tmp_path / "ckpt", strict=False)
    with pytest.raises(ValueError, match="map_location"):
        accelerator.load_state(tmp_path / "ckpt", map_location="cuda:7")
    with pytest.raises(TypeError, match="not_a_keyword"):
        accelerator.load_state(tmp_path / "ckpt", not_a_keyword=1)


# -- unwrap_model(keep_torch_compile=...) ---------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_unwrap_model_keep_torch_compile_as_accelerate(keep: bool, reset_accelerate: None) -> None:
    module = torch.nn.Linear(2, 2)
    compiled = torch.compile(module)  # nothing compiles until the first call
    theirs = accelerate.Accelerator(cpu=True).unwrap_model(compiled, keep_torch_compile=keep)
    ours = kwplug.Accelerator(cpu=True).unwrap_model(compiled, keep_torch_compile=keep)
    assert type(ours) is type(theirs)
    assert ours is (compiled if keep else module)
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_unwrap_model_rejects_non_bool_flags() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="keep_torch_compile must be a bool"):
        accelerator.unwrap_model(torch.nn.Linear(1, 1), keep_torch_compile=1)  # type: ignore[arg-type]


# -- prepare(device_placement=...), prepare_model(evaluation_mode=...) ----------------------------


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_prepare_device_placement_per_object(library: str, reset_accelerate: None) -> None:
    """A model on the meta device cannot be copied to the CPU: ``device_placement=[False]``
    leaves it there, ``[True]`` tries to move it -- in both libraries."""
    lib = kwplug if library == "kwplug" else accelerate
    accelerator = lib.Accelerator(cpu=True)
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    loader = DataLoader(list(range(4)), batch_size=2)
    prepared, _ = accelerator.prepare(model, loader, device_placement=[False, None])
    assert prepared.weight.device.type == "meta"
    with torch.device("meta"):
        other = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError):
        accelerator.prepare(other, device_placement=[True])
    with pytest.raises(ValueError, match="device_placement"):
        accelerator.prepare(torch.nn.Linear(1, 1), loader, device_placement=[True])


def test_accelerator_device_placement_false_is_the_default_of_prepare() -> None:
    accelerator = kwplug.Accelerator(cpu=True, device_placement=False)
    assert accelerator.device_placement is False
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert accelerator.prepare(model).weight.device.type == "meta"
    assert accelerator.prepare_model(model, device_placement=False).weight.is_meta
    with pytest.raises(TypeError, match="device_placement"):
        kwplug.Accelerator(cpu=True, device_placement="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device_placement"):
        accelerator.prepare(model, device_placement=["no"])  # type: ignore[list-item]


def test_prepare_data_loader_keywords() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    loader = DataLoader(list(range(4)), batch_size=2)
    prepared = accelerator.prepare_data_loader(loader, device_placement=False)
    assert prepared.device_placement is False and [b.tolist() for b in prepared] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="slice_fn_for_dispatch"):
        accelerator.prepare_data_loader(loader, slice_fn_for_dispatch=lambda *a: a)


def test_prepare_model_evaluation_mode_does_not_wrap() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    assert accelerator.prepare_model(model, evaluation_mode=True) is model
    assert accelerator._prepared.models == [model]
    assert accelerator.plan.get("wrap_model") is None  # the hook was not asked


# -- picklable prepared objects -----------------------------------------------------------------


@pytest.mark.parametrize("copier", [pickle.loads, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_prepared_optimizer_and_scheduler_pickle(copier: Any) -> None:
    _, _, optimizer, scheduler = _trained(kwplug)
    blob = (optimizer, scheduler)
    twin, twin_scheduler = copier(pickle.dumps(blob)) if copier is pickle.loads else copier(blob)
    assert isinstance(twin, kwplug.optimizer.AcceleratedOptimizer)
    assert twin.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert twin_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert twin_scheduler.optimizers[0] is twin  # one object graph
    # the copy still steps its own parameters
    params = [p for group in twin.param_groups for p in group["params"]]
    before = params[0].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    twin.step()
    assert not torch.equal(params[0], before)


def test_pickled_fp16_optimizer_still_detects_skipped_steps() -> None:
    """The scaler's skipped-step detection is a hook on the wrapped optimizer, which torch does
    not pickle: the copy registers it again."""
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(2, 1)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    twin = pickle.loads(pickle.dumps(optimizer))
    assert twin.scaler is not None
    params = [p for group in twin.param_groups for p in group["params"]]
    for value, skipped in ((1.0, False), (float("inf"), True), (1.0, False)):
        twin.zero_grad()
        twin.scaler.scale(sum(p.sum() for p in params) * value).backward()
        twin.step()
        assert twin.step_was_skipped is skipped


def test_prepared_data_loader_pickles() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    torch.manual_seed(0)
    loader = accelerator.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=False))
    twin = pickle.loads(pickle.dumps(loader))
    assert [b.tolist() for b in twin] == [b.tolist() for b in loader]


def test_accelerate_optimizer_and_scheduler_pickle_too(reset_accelerate: None) -> None:
    _, _, optimizer, scheduler = _trained(accelerate)
    pickle.loads(pickle.dumps((optimizer, scheduler)))


# -- register_for_checkpointing, gradient_state.active_dataloader, set_epoch ---------------------


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_register_for_checkpointing_unsupported_object_is_a_value_error(
    library: str, reset_accelerate: None
) -> None:
    lib = kwplug if library == "kwplug" else accelerate
    accelerator = lib.Accelerator(cpu=True)
    good = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1), 1)
    # Accelerate numbers the invalid objects among themselves, kwplug by argument position
    with pytest.raises(ValueError, match=r"Item at index \d, `object`") as raised:
        accelerator.register_for_checkpointing(good, object())
    registered = (
        accelerator._prepared.custom_objects if library == "kwplug" else accelerator._custom_objects
    )
    assert registered == []  # nothing registered
    if library == "kwplug":
        assert isinstance(raised.value, TypeError)  # what kwplug raised before
        assert raised.value.indices == (1,) and "index 1, `object`" in str(raised.value)


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_gradient_state_active_dataloader(library: str, reset_accelerate: None) -> None:
    lib = kwplug if library == "kwplug" else accelerate
    accelerator = lib.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(list(range(4)), batch_size=2))
    assert accelerator.gradient_state.active_dataloader is None
    seen = [accelerator.gradient_state.active_dataloader for _ in loader]
    assert seen == [loader, loader]
    assert accelerator.gradient_state.active_dataloader is None


class _EpochBatchSampler(BatchSampler):
    """A custom batch sampler that records the epoch it was given."""

    def __init__(self) -> None:
        super().__init__(SequentialSampler(range(8)), batch_size=2, drop_last=False)
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.mark.parametrize("library", ["kwplug", "accelerate"])
def test_set_epoch_reaches_a_custom_batch_sampler(library: str, reset_accelerate: None) -> None:
    lib = kwplug if library == "kwplug" else accelerate
    accelerator = lib.Accelerator(cpu=True)
    sampler = _EpochBatchSampler()
    loader = accelerator.prepare(DataLoader(list(range(8)), batch_sampler=sampler))
    loader.set_epoch(3)
    assert sampler.epoch == 3  # at once, before any iteration


# -- smaller signature items -------------------------------------------------------------------


def test_unscale_gradients_takes_an_optimizer() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(2, 1)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(1, 2)).sum())  # weight.grad: 65536 * [1, 1]
    accelerator.unscale_gradients(optimizer=optimizer.optimizer)  # the wrapped one works too
    assert torch.equal(model.weight.grad, torch.ones_like(model.weight))
    with pytest.raises(ValueError, match="not prepared"):
        accelerator.unscale_gradients(optimizer=torch.optim.SGD([torch.zeros(1)], lr=1))


def test_on_main_process_without_a_function() -> None:
    # Accelerate's instance method raises AttributeError here (it reads self.__qualname__)
    with pytest.raises(ValueError, match="on_main_process"):
        kwplug.Accelerator(cpu=True).on_main_process()
    with pytest.raises(ValueError, match="on_local_main_process"):
        kwplug.Accelerator(cpu=True).on_local_main_process()


def test_str_to_bool_to_bool_as_accelerate() -> None:
    from accelerate.utils import str_to_bool as theirs

    from kwplug.utils import str_to_bool as ours

    for value in ("yes", "0", "ON", "false"):
        for to_bool in (False, True):
            assert ours(value, to_bool=to_bool) == theirs(value, to_bool=to_bool)
            assert type(ours(value, to_bool=to_bool)) is type(theirs(value, to_bool=to_bool))
