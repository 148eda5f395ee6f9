"""Prepared data loaders against Accelerate's: the shard samplers in one process (every rank
simulated), and whole prepared loaders in 1 and 2 processes (torchrun, gloo)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import kwplug
from kwplug.data import (
    BatchSamplerShard,
    DispatchedDataLoader,
    IterableDatasetShard,
    PreparedDataLoader,
)
from kwplug.testing import run_distributed
from kwplug.utils import DataLoaderConfiguration, set_seed

accelerate_data = pytest.importorskip("accelerate.data_loader")


class VaryingBatches:
    """A batch sampler without ``batch_size``: batches of 1, 2, 3, 1, 2, 3... indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in itertools.cycle((1, 2, 3)):
            if start >= self.n:
                return
            yield list(range(start, min(start + size, self.n)))
            start += size

    def __len__(self) -> int:
        return len(list(iter(self)))


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4, 8], [0, 1, 5, 7, 16, 17, 23]))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even", [False, True])
def test_batch_sampler_shard_matches_accelerate(drop_last: bool, split: bool, even: bool) -> None:
    for n, batch_size, length in GRID:
        if split and batch_size % n:
            continue
        base = BatchSampler(SequentialSampler(range(length)), batch_size, drop_last)
        for rank in range(n):
            ours = BatchSamplerShard(base, n, rank, split, even)
            theirs = accelerate_data.BatchSamplerShard(base, n, rank, split, even)
            case = (n, batch_size, length, rank)
            assert list(ours) == list(theirs), case
            assert len(ours) == len(theirs), case


@pytest.mark.parametrize("even", [False, True])
def test_batch_sampler_shard_varying_sizes_matches_accelerate(even: bool) -> None:
    for n, length in itertools.product([1, 2, 3], [0, 1, 4, 7, 12]):
        for rank in range(n):
            ours = BatchSamplerShard(VaryingBatches(length), n, rank, even_batches=even)
            theirs = accelerate_data.BatchSamplerShard(
                VaryingBatches(length), n, rank, even_batches=even
            )
            assert list(ours) == list(theirs), (n, length, rank)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_iterable_dataset_shard_matches_accelerate(drop_last: bool, split: bool) -> None:
    for n, batch_size, length in GRID:
        if split and batch_size > 1 and batch_size % n:
            continue
        for rank in range(n):
            args = (Stream(length), batch_size, drop_last, n, rank, split)
            ours, theirs = IterableDatasetShard(*args), accelerate_data.IterableDatasetShard(*args)
            theirs.epoch = 0  # Accelerate reads it in __iter__ before any set_epoch
            assert list(ours) == list(theirs), (n, batch_size, length, rank)
            assert len(ours) == len(theirs)


def test_split_batches_needs_a_divisible_batch_size() -> None:
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        BatchSamplerShard(base, 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="multiple"):
        IterableDatasetShard(Stream(10), 3, num_processes=2, split_batches=True)


# -- whole prepared loaders, kwplug's and Accelerate's, in the same processes ---------------

CASES: list[dict[str, Any]] = [
    {"length": 23, "batch_size": 4, "shuffle": True},
    {"length": 23, "batch_size": 4, "shuffle": False},
    {"length": 23, "batch_size": 4, "shuffle": True, "drop_last": True},
    {"length": 22, "batch_size": 4, "shuffle": True, "even_batches": False},
    {"length": 21, "batch_size": 4, "shuffle": True, "split_batches": True},
    {"length": 20, "batch_size": 5, "shuffle": True, "use_seedable_sampler": True},
    {"length": 13, "batch_size": None, "custom": "varying"},
    {"length": 23, "batch_size": 4, "iterable": True},
    {"length": 3, "batch_size": 4, "shuffle": True},
]


def _loader(case: dict[str, Any]) -> DataLoader[Any]:
    length = case["length"]
    if case.get("iterable"):
        return DataLoader(Stream(length), batch_size=case["batch_size"])
    if case.get("custom") == "varying":
        return DataLoader(list(range(length)), batch_sampler=VaryingBatches(length))
    return DataLoader(
        list(range(length)),
        batch_size=case["batch_size"],
        shuffle=case.get("shuffle", False),
        drop_last=case.get("drop_last", False),
    )


def _config(case: dict[str, Any], cls: Any) -> Any:
    keys = ("split_batches", "even_batches", "use_seedable_sampler")
    return cls(**{k: case[k] for k in keys if k in case})


def _epochs(loader: Any, count: int = 3) -> list[list[list[int]]]:
    out = []
    for epoch in range(count):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        out.append([batch.tolist() for batch in loader])
    return out


def both_loaders() -> list[dict[str, Any]]:
    """In each rank: every case's batches under Accelerate, then under kwplug, from one seed;
    and a weight drawn after preparing, to compare what each consumed of the global RNG."""
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.utils import DataLoaderConfiguration as AccelerateConfig

    results = []
    for case in CASES:
        set_seed(1234)
        theirs = AccelerateAccelerator(cpu=True, dataloader_config=_config(case, AccelerateConfig))
        loader = theirs.prepare(_loader(case))
        acc = {"epochs": _epochs(loader), "after": torch.rand(1).item(), "len": len(loader)}
        set_seed(1234)
        ours = kwplug.Accelerator(
            cpu=True, dataloader_config=_config(case, DataLoaderConfiguration)
        )
        loader = ours.prepare(_loader(case))
        kw = {"epochs": _epochs(loader), "after": torch.rand(1).item(), "len": len(loader)}
        results.append({"case": case, "accelerate": acc, "kwplug": kw})
    return results


def _compare(results: list[dict[str, Any]]) -> None:
    for row in results:
        assert row["kwplug"] == row["accelerate"], row["case"]


def test_prepared_loaders_match_accelerate_in_one_process() -> None:
    _compare(both_loaders())


@pytest.mark.multiprocess
def test_prepared_loaders_match_accelerate_in_two_processes() -> None:
    per_rank = run_distributed(both_loaders, nproc=2, timeout=240)
    for results in per_rank:
        _compare(results)
    # The ranks' batches cover the data set (shuffled case, 1st epoch): no rank sees it all.
    first = [r[0]["kwplug"]["epochs"][0] for r in per_rank]
    seen = [i for batches in first for batch in batches for i in batch]
    assert sorted(set(seen)) == list(range(23)) and len(first[0]) == 3


# -- kwplug's own guarantees -------------------------------------------------------------


def test_shuffle_follows_the_seed() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    orders = []
    for seed in (1, 1, 2):
        set_seed(seed)
        loader = accelerator.prepare(DataLoader(list(range(50)), batch_size=50, shuffle=True))
        orders.append(next(iter(loader)).tolist())
    assert orders[0] == orders[1] != orders[2]


def test_loader_attributes_and_end_of_dataloader() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=4))
    assert isinstance(loader, PreparedDataLoader)
    assert (len(loader), loader.batch_size, loader.total_batch_size, loader.remainder) == (
        3,
        4,
        4,
        2,
    )
    assert loader.dataset == list(range(10))
    ends, tracked, finished = [], [], []
    loader.on_end.append(lambda dl: finished.append(dl.epoch))
    for _ in loader:
        ends.append(loader.end_of_dataloader)
        tracked.append(accelerator._prepared.active_loaders.end_of_dataloader)
    assert ends == tracked == [False, False, True]
    assert finished == [1]
    assert accelerator._prepared.active_loaders.active is None


def test_skip_first_batches_does_not_skip_twice_after_a_restore() -> None:
    accelerator = kwplug.Accelerator(cpu=True)

    def loader() -> Any:
        return accelerator.prepare(DataLoader(list(range(20)), batch_size=2, shuffle=True))

    original = loader()
    iterator = iter(original)
    seen = [next(iterator).tolist() for _ in range(3)]
    state = original.state_dict()
    rest = [b.tolist() for b in iterator]
    assert len(seen + rest) == 10
    # load_state's position alone: the rest of the same epoch, in the same order.
    restored = loader()
    restored.load_state_dict(state)
    assert [b.tolist() for b in restored] == rest
    # Accelerate's idiom after it: skipped once (7 batches left), order drawn anew.
    skipped = loader()
    skipped.load_state_dict(state)
    assert accelerator.skip_first_batches(skipped, 3) is skipped
    assert len([b.tolist() for b in skipped]) == 7
    assert skipped.epoch == state["epoch"] + 1
    # A loader kwplug did not prepare: a new one-process loader skips (as Accelerate's).
    plain = DataLoader([1, 2, 3])
    assert [b.tolist() for b in accelerator.skip_first_batches(plain, 1)] == [[2], [3]]
    with pytest.raises(TypeError, match="DataLoader"):
        accelerator.skip_first_batches([1], 1)


def test_state_dict_keys_are_stable() -> None:
    loader = kwplug.Accelerator(cpu=True).prepare(DataLoader(list(range(4)), batch_size=2))
    assert set(loader.state_dict()) == {
        "epoch",
        "batches_yielded",
        "generator",
        "global_rng",
        "offset",
    }


def test_distributed_sampler_for_another_world_size_is_refused() -> None:
    sampler = torch.utils.data.DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="DistributedSampler shards for 2"):
        kwplug.Accelerator(cpu=True).prepare(DataLoader(list(range(8)), sampler=sampler))


def test_dataloader_config_type_is_checked() -> None:
    with pytest.raises(TypeError, match="DataLoaderConfiguration"):
        kwplug.Accelerator(cpu=True, dataloader_config={"split_batches": True})  # type: ignore[arg-type]


def test_unbatched_iterable_dataset_is_refused_in_several_processes() -> None:
    from kwplug.data import prepare_dataloader

    loader = DataLoader(Stream(4), batch_size=None)
    own_shards = DataLoaderConfiguration(dispatch_batches=False)
    with pytest.raises(ValueError, match="whole data set"):
        prepare_dataloader(loader, torch.device("cpu"), world_size=2, rank=0, config=own_shards)
    # Dispatched (the default for a stream): process 0 reads the batches the data set yields.
    dispatched = prepare_dataloader(loader, torch.device("cpu"), world_size=2, rank=0)
    assert isinstance(dispatched, DispatchedDataLoader)
    assert [int(x) for x in prepare_dataloader(loader, torch.device("cpu"), 1, 0)] == [0, 1, 2, 3]
