"""The causes that failed Accelerate's own pytest files on kwplug (issue 28, item 3; measured
by tests/compat/peer_suite.py), each as a self-contained test: no mirror, no network."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
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


def test_init_empty_weights_puts_parameters_on_meta_and_buffers_only_when_asked() -> None:
    from kwplug import init_empty_weights, init_on_device

    with init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.BatchNorm1d(1000))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    assert model[0].weight.shape == (1000, 1000) and model[0].weight.dtype == torch.float32
    assert model[1].running_mean.device.type == "cpu"  # buffers stay (Accelerate's default)
    with init_empty_weights(include_buffers=True):
        norm = torch.nn.BatchNorm1d(8)
    assert norm.running_mean.device.type == "meta" and norm.weight.device.type == "meta"
    with init_on_device(torch.device("meta")):
        frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert frozen.weight.device.type == "meta"
    # Outside the block torch is as before.
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert torch.empty(1).device.type == "cpu"


def test_init_empty_weights_reads_accelerates_buffers_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kwplug import init_empty_weights

    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        norm = torch.nn.BatchNorm1d(4)
    assert norm.running_var.device.type == "meta"


@pytest.mark.parametrize("safe", [True, False])
def test_load_checkpoint_in_model_reads_save_models_files_into_a_meta_model(
    tmp_path: Path, safe: bool
) -> None:
    from kwplug import Accelerator, init_empty_weights, load_checkpoint_in_model

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    accelerator = Accelerator(cpu=True)
    accelerator.save_model(source, tmp_path, max_shard_size="10KB", safe_serialization=safe)
    assert len(list(tmp_path.glob("*.index.json"))) == 1  # sharded
    with init_empty_weights():
        target = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    load_checkpoint_in_model(target, tmp_path, strict=True)
    for (name, mine), theirs in zip(
        target.state_dict().items(), source.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    half = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    load_checkpoint_in_model(half, tmp_path, dtype="float16")
    assert half[0].weight.dtype == torch.float16
    assert torch.equal(half[0].weight, source[0].weight.half())
    accelerator.end_training()


def test_big_model_inference_names_import_and_raise_naming_their_row(tmp_path: Path) -> None:
    from kwplug import infer_auto_device_map, load_checkpoint_and_dispatch, load_checkpoint_in_model
    from kwplug.utils.modeling import get_state_dict_from_offload

    model = torch.nn.Linear(2, 2)
    doc = (Path(__file__).parents[2] / "docs" / "migrating-from-accelerate.md").read_text()
    calls = {
        "infer_auto_device_map": lambda: infer_auto_device_map(model),
        "load_checkpoint_and_dispatch": lambda: load_checkpoint_and_dispatch(
            model, tmp_path, device_map="auto"
        ),
        "get_state_dict_from_offload": lambda: get_state_dict_from_offload(model, "", {}),
    }  # the hooks are Accelerate's (test_peer_suite_fidelity.py)
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=rf"`{name}` row of docs/migrating"):
            call()
        assert f"`{name}`" in doc
    with pytest.raises(NotImplementedError, match=r"device_map=\.\.\."):
        load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"})


def test_accelerates_loader_classes_construct_with_accelerates_arguments() -> None:
    from torch.utils.data import DataLoader

    from kwplug.data import DispatchedDataLoader, PreparedDataLoader
    from kwplug.data_loader import DataLoaderDispatcher, DataLoaderShard, DataLoaderStateMixin

    shard = DataLoaderShard(list(range(16)), batch_size=4)
    assert type(shard) is PreparedDataLoader and isinstance(shard, DataLoaderShard)
    assert isinstance(shard, DataLoader) and isinstance(shard, DataLoaderStateMixin)
    assert not isinstance(shard, DataLoaderDispatcher)
    for _ in range(2):  # Accelerate's test_end_of_dataloader: twice
        ends = [shard.end_of_dataloader for _ in shard]
        assert ends == [False, False, False, True]
    assert [b.tolist() for b in shard] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    dispatcher = DataLoaderDispatcher(range(16), batch_size=4)
    assert isinstance(dispatcher, DispatchedDataLoader) and isinstance(dispatcher, DataLoaderShard)
    assert [dispatcher.end_of_dataloader for _ in dispatcher] == [False, False, False, True]
    started = DataLoaderShard(list(range(8)), batch_size=4, iteration=3, skip_batches=1)
    assert started.epoch == 3
    assert [b.tolist() for b in started] == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="torch_device_mesh"):
        DataLoaderShard(list(range(8)), torch_device_mesh=object())
    with pytest.raises(ValueError, match="rng_types"):
        DataLoaderShard(list(range(8)), rng_types=["cuda"])


def test_accelerates_stateful_loader_classes_are_torchdatas() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from kwplug.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    shard = DataLoaderShard(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    assert isinstance(shard, stateful.StatefulDataLoader) and shard.use_stateful_dataloader
    assert [shard.end_of_dataloader for _ in shard] == [False, False, False, True]
    dispatcher = DataLoaderDispatcher(range(16), batch_size=4, use_stateful_dataloader=True)
    assert isinstance(dispatcher, stateful.StatefulDataLoader)
    skip = SkipDataLoader(
        list(range(16)), batch_size=4, skip_batches=2, use_stateful_dataloader=True
    )
    assert isinstance(skip, stateful.StatefulDataLoader)
    assert [t.tolist() for t in skip] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_skip_batch_sampler_and_skip_data_loader_skip_every_iteration() -> None:
    from torch.utils.data import BatchSampler

    from kwplug.data_loader import SkipBatchSampler, SkipDataLoader

    sampler = SkipBatchSampler(BatchSampler(range(16), batch_size=4, drop_last=False), 2)
    assert list(sampler) == [[8, 9, 10, 11], [12, 13, 14, 15]] == list(sampler)
    assert len(sampler) == 2 and sampler.total_length == 4
    loader = SkipDataLoader(list(range(16)), batch_size=4, skip_batches=2)
    for _ in range(2):
        assert [t.tolist() for t in loader] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="skip_batches"):
        SkipBatchSampler([[0]], -1)


def test_skip_first_batches_of_a_loader_kwplug_did_not_prepare() -> None:
    from torch.utils.data import DataLoader

    from kwplug.data_loader import skip_first_batches

    plain = DataLoader(list(range(16)), batch_size=4)
    skipped = skip_first_batches(plain, num_batches=2)
    assert skipped is not plain
    assert [t.tolist() for t in skipped] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert len([t for t in plain]) == 4  # the user's loader is untouched
    with pytest.raises(TypeError, match="DataLoader"):
        skip_first_batches([1, 2, 3], 1)


def test_split_batches_error_says_round_multiple_as_accelerate() -> None:
    from torch.utils.data import BatchSampler

    from kwplug.data import BatchSamplerShard

    with pytest.raises(ValueError, match="round multiple"):
        BatchSamplerShard(BatchSampler(range(20), batch_size=3, drop_last=False), 2, 0, True)


def test_pad_across_processes_names_a_nested_tensor_in_one_process() -> None:
    from kwplug.utils import CannotPadNestedTensorWarning, pad_across_processes

    nested = torch.nested.nested_tensor([[1.0, 2.0, 3.0], [1.0], [1.0, 2.0]])
    with pytest.warns(CannotPadNestedTensorWarning) as record:
        same = pad_across_processes(nested)
    assert same is nested
    assert record[0].filename == __file__  # points at the caller
    plain = torch.randn(4, 3, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pad_across_processes(plain, dim=-1) is plain


class _Selectable:
    """What Accelerate's split_between_processes calls on a datasets.Dataset."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, indices: list[int]) -> _Selectable:
        return _Selectable([self.rows[i] for i in indices])


@pytest.mark.parametrize(
    ("rank", "padding", "expected"),
    [(0, False, [0, 1, 2]), (1, False, [3, 4]), (1, True, [3, 4, 4])],
)
def test_split_between_processes_selects_a_datasets_dataset(
    rank: int, padding: bool, expected: list[int]
) -> None:
    from kwplug._runtime import split_between_processes

    part = split_between_processes(_Selectable(list(range(5))), 2, rank, padding)
    assert isinstance(part, _Selectable) and part.rows == expected


def test_split_between_processes_a_real_datasets_dataset() -> None:
    datasets = pytest.importorskip("datasets")
    from kwplug._runtime import split_between_processes

    data = datasets.Dataset.from_dict({"x": list(range(5))})
    assert split_between_processes(data, 2, 1, True)["x"] == [3, 4, 4]


def test_prepared_objects_are_listed_and_flagged_as_accelerate_does() -> None:
    # Accelerate's tests/test_accelerator.py reads ``accelerator._models`` (and the other
    # lists) and the ``_is_accelerate_prepared`` flag; preparing a prepared model again
    # returns it without a second entry.
    accelerator = kwplug.Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    prepared = accelerator.prepare(model, optimizer, scheduler, loader, [1, 2])
    lists = (
        accelerator._models,
        accelerator._optimizers,
        accelerator._schedulers,
        accelerator._dataloaders,
    )
    for obj, listed in zip(prepared, lists, strict=False):
        assert any(obj is item for item in listed)
        assert getattr(obj, "_is_accelerate_prepared", False) is True
    assert getattr(prepared[4], "_is_accelerate_prepared", False) is False
    assert accelerator.prepare_model(prepared[0]) is prepared[0]
    assert len(accelerator._models) == 1
    accelerator.free_memory()
    assert [len(listed) for listed in lists] == [0, 0, 0, 0]


def test_loaders_answer_accelerates_iteration_and_base_dataloader() -> None:
    from kwplug.data_loader import DataLoaderShard, skip_first_batches

    loader = DataLoaderShard(list(range(16)), batch_size=4)
    assert loader.base_dataloader is loader
    with pytest.raises(AttributeError):
        _ = DataLoaderShard.base_dataloader  # an attribute of loaders, as Accelerate's
    assert isinstance(loader.base_dataloader, torch.utils.data.DataLoader)
    loader.set_epoch(1)
    assert loader.iteration == 1
    assert skip_first_batches(loader, num_batches=2).iteration == 1
    assert [b.tolist() for b in loader] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert loader.iteration == 2  # advanced by the completed iteration, as Accelerate's


def test_partial_state_shared_state_is_empty_until_an_accelerator_is_built() -> None:
    # Accelerate's test_tracking.py: building a tracker must not set the state up; building
    # the Accelerator does (``PartialState._shared_state`` read before and after).
    from kwplug.plugins.trackers import JSONLinesTracker
    from kwplug.state import PartialState

    PartialState._reset_state()
    assert PartialState._shared_state == {}
    tracker = JSONLinesTracker("run", ".")
    assert PartialState._shared_state == {}
    accelerator = kwplug.Accelerator(log_with=tracker)
    shared = PartialState._shared_state
    assert shared["device"] == accelerator.device
    assert shared["num_processes"] == 1 and shared["_cpu"] is True
    PartialState._reset_state()
    assert PartialState._shared_state == {}


def test_accelerate_torch_device_names_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accelerate's test_accelerator.py::test_env_var_device: ACCELERATE_TORCH_DEVICE is used
    # as it is; a malformed value is a ValueError naming the variable.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:64")
    accelerator = kwplug.Accelerator()
    assert str(accelerator.device) == str(accelerator.state.device) == "cpu:64"
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "not-a-device")
    with pytest.raises(ValueError, match="ACCELERATE_TORCH_DEVICE"):
        kwplug.Accelerator()
