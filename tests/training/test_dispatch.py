"""Dispatched data loaders (``dispatch_batches``, Accelerate's default for an
``IterableDataset``) against Accelerate's, differentially: in each of 2 torchrun processes the
same loaders are prepared under Accelerate and under kwplug, and each rank's batches,
``end_of_dataloader``, ``remainder``, ``len`` and ``gather_for_metrics`` results compared."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import kwplug
from kwplug.testing import run_distributed
from kwplug.utils import DataLoaderConfiguration, set_seed

pytest.importorskip("accelerate")

#: Accelerate needs this to use the CPU under torchrun.
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}


class Stream(IterableDataset[int]):
    """``range(n)`` as a stream (with a length, as many real streams have)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for length in (7, 29, 203, 997):
        for split in (False, True):
            for even in (True, False):
                cases.append({"length": length, "split_batches": split, "even_batches": even})
    cases += [
        {"length": 29, "drop_last": True},
        {"length": 29, "drop_last": True, "split_batches": True},
        {"length": 32},
        {"length": 3},
        {"length": 29, "dispatch_batches": False},
        {"length": 203, "dispatch_batches": False},
        {"length": 29, "map": True, "dispatch_batches": True},
        {"length": 203, "map": True, "dispatch_batches": True, "shuffle": True},
        {"length": 29, "map": True, "dispatch_batches": True, "split_batches": True},
        {"length": 29, "map": True, "dispatch_batches": True, "drop_last": True},
    ]
    return cases


CASES = _cases()


def _loader(case: dict[str, Any]) -> DataLoader[Any]:
    drop_last = case.get("drop_last", False)
    if case.get("map"):
        data = list(range(case["length"]))
        return DataLoader(
            data, batch_size=4, shuffle=case.get("shuffle", False), drop_last=drop_last
        )
    return DataLoader(Stream(case["length"]), batch_size=4, drop_last=drop_last)


def _config(case: dict[str, Any], cls: Any) -> Any:
    keys = ("split_batches", "even_batches", "dispatch_batches")
    return cls(**{k: case[k] for k in keys if k in case})


def _epoch(accelerator: Any, loader: Any) -> dict[str, Any]:
    batches, ends, remainders, gathered = [], [], [], []
    for batch in loader:
        batches.append(batch.tolist())
        ends.append(loader.end_of_dataloader)
        remainders.append(loader.remainder)
        gathered.append(accelerator.gather_for_metrics(batch).tolist())
    return {
        "batches": batches,
        "ends": ends,
        "remainder_at_end": remainders[-1] if remainders else None,
        "gathered": gathered,
        "gathered_count": sum(len(g) for g in gathered),
        "len": len(loader),
    }


def both_libraries() -> list[dict[str, Any]]:
    """In each rank: every case under Accelerate, then under kwplug (two epochs of the
    29-sample cases: the second must start afresh)."""
    import warnings

    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.utils import DataLoaderConfiguration as AccelerateConfig

    results = []
    for case in CASES:
        set_seed(1234)
        theirs = AccelerateAccelerator(cpu=True, dataloader_config=_config(case, AccelerateConfig))
        loader = theirs.prepare(_loader(case))
        epochs = 2 if case["length"] == 29 else 1
        acc = [_epoch(theirs, loader) for _ in range(epochs)]
        set_seed(1234)
        ours = kwplug.Accelerator(
            cpu=True, dataloader_config=_config(case, DataLoaderConfiguration)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # even_batches=False under dispatch: warned
            loader = ours.prepare(_loader(case))
        kw = [_epoch(ours, loader) for _ in range(epochs)]
        results.append({"case": case, "accelerate": acc, "kwplug": kw})
    return results


@pytest.mark.multiprocess
def test_dispatched_loaders_match_accelerate_in_two_processes() -> None:
    per_rank = run_distributed(both_libraries, nproc=2, timeout=400, env=ACCELERATE_ENV)
    for rank, results in enumerate(per_rank):
        for row in results:
            ours, theirs = row["kwplug"], row["accelerate"]
            if row["case"].get("dispatch_batches") is False:
                # Each rank reads the stream (IterableDatasetShard): the same batches, but
                # Accelerate's remainder is 0 there, so its gather_for_metrics keeps the
                # samples repeated to complete the last round; kwplug's drops them
                # (docs/migrating-from-accelerate.md, "Data loaders").
                length = row["case"]["length"]
                assert ours[0]["gathered_count"] == length < theirs[0]["gathered_count"]
                keys = ("remainder_at_end", "gathered", "gathered_count")
                ours = [{k: v for k, v in e.items() if k not in keys} for e in ours]
                theirs = [{k: v for k, v in e.items() if k not in keys} for e in theirs]
            assert ours == theirs, (rank, row["case"])
    # The figures of issue 17: a 29-sample stream at batch 4 gives [4, 4, 4, 3] on each rank
    # and 29 gathered samples (kwplug used to give [4, 4, 4, 4] and 32).
    default_29 = CASES.index({"length": 29, "split_batches": False, "even_batches": True})
    for results in per_rank:
        epoch = results[default_29]["kwplug"][0]
        assert [len(b) for b in epoch["batches"]] == [4, 4, 4, 3]
        assert epoch["gathered_count"] == 29 and epoch["remainder_at_end"] == 5
        assert sorted(i for g in epoch["gathered"] for i in g) == list(range(29))
    for length in (7, 203, 997):
        index = CASES.index({"length": length, "split_batches": False, "even_batches": True})
        assert per_rank[0][index]["kwplug"][0]["gathered_count"] == length


def test_dispatch_in_one_process_keeps_the_loader_batches() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(Stream(10), batch_size=4))
    seen = [(batch.tolist(), loader.remainder) for batch in loader]
    assert seen == [([0, 1, 2, 3], -1), ([4, 5, 6, 7], -1), ([8, 9], 2)]
    assert len(loader) == 3


def test_dispatch_refuses_a_distributed_sampler_and_checks_split() -> None:
    from kwplug.data import prepare_dataloader

    config = DataLoaderConfiguration(dispatch_batches=True)
    sampler = torch.utils.data.DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="DistributedSampler"):
        prepare_dataloader(
            DataLoader(list(range(8)), sampler=sampler), torch.device("cpu"), 2, 0, config=config
        )
    split = DataLoaderConfiguration(dispatch_batches=True, split_batches=True)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        prepare_dataloader(
            DataLoader(Stream(8), batch_size=3), torch.device("cpu"), 2, 0, config=split
        )


def resume_mid_epoch() -> dict[str, Any]:
    """A dispatched stream stopped after 3 batches, its position saved and restored in a new
    loader: the rest of the epoch equals the uninterrupted run's."""
    config = DataLoaderConfiguration()
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=config)
    whole = [b.tolist() for b in accelerator.prepare(DataLoader(Stream(29), batch_size=4))]
    first = accelerator.prepare(DataLoader(Stream(29), batch_size=4))
    iterator = iter(first)
    head = [next(iterator).tolist() for _ in range(3)]
    state = first.state_dict()
    restored = accelerator.prepare(DataLoader(Stream(29), batch_size=4))
    restored.load_state_dict(state)
    tail = [(b.tolist(), restored.end_of_dataloader, restored.remainder) for b in restored]
    return {"whole": whole, "head": head, "tail": tail, "state": state}


@pytest.mark.multiprocess
def test_dispatched_loader_resumes_mid_epoch_in_two_processes() -> None:
    for result in run_distributed(resume_mid_epoch, nproc=2, timeout=120):
        assert result["state"]["batches_yielded"] == 3
        assert [len(b) for b in result["whole"]] == [4, 4, 4, 3]
        assert result["head"] + [b for b, _, _ in result["tail"]] == result["whole"]
        assert [(end, rem) for _, end, rem in result["tail"]] == [(True, 5)]


def strings_in_batches() -> str:
    accelerator = kwplug.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(_Words(), batch_size=2))
    try:
        list(loader)
    except (TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class _Words(IterableDataset[str]):
    def __iter__(self) -> Iterator[str]:
        return iter(["a", "b", "c"])


@pytest.mark.multiprocess
def test_dispatching_non_tensors_fails_on_every_rank_without_hanging() -> None:
    rank0, rank1 = run_distributed(strings_in_batches, nproc=2, timeout=120)
    assert rank0.startswith("TypeError: dispatch_batches sends tensors only")
    assert rank1.startswith("RuntimeError: dispatch_batches: process 0 failed") and "str" in rank1


# -- use_seedable_sampler with per-process seeds ---------------------------------------------


def seedable_epochs(library: str) -> dict[str, Any]:
    """``set_seed(42, device_specific=True)`` (ranks seeded 42 and 43), a seedable shuffled
    loader of 24 samples at batch 4: three epochs, then ``set_epoch(0)`` and three more, then
    ``set_epoch(1)`` and one."""
    import warnings

    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration as Config
        from accelerate.utils import set_seed as seed_everything
    else:
        from kwplug import Accelerator  # type: ignore[assignment]
        from kwplug.utils import DataLoaderConfiguration as Config  # type: ignore[assignment]
        from kwplug.utils import set_seed as seed_everything

    accelerator = Accelerator(cpu=True, dataloader_config=Config(use_seedable_sampler=True))
    seed_everything(42, device_specific=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = accelerator.prepare(DataLoader(list(range(24)), batch_size=4, shuffle=True))

    def epoch() -> list[int]:
        return [i for batch in loader for i in batch.tolist()]

    first = [epoch() for _ in range(3)]
    loader.set_epoch(0)
    replay = [epoch() for _ in range(3)]
    loader.set_epoch(1)
    second = epoch()
    return {
        "first": first,
        "replay": replay,
        "second": second,
        "warnings": [str(w.message) for w in caught if "use_seedable_sampler" in str(w.message)],
    }


@pytest.mark.multiprocess
def test_seedable_shards_partition_the_data_with_device_specific_seeds() -> None:
    ranks = run_distributed(seedable_epochs, "kwplug", nproc=2, timeout=120)
    for e in range(3):
        seen = sorted(ranks[0]["first"][e] + ranks[1]["first"][e])
        assert seen == list(range(24)), f"epoch {e}: not every sample exactly once"
    assert ranks[0]["first"][0] != ranks[0]["first"][1]  # each epoch has its own order
    for result in ranks:
        assert result["replay"] == result["first"]  # set_epoch(0) replays the epochs
        assert result["second"] == result["first"][1]
    # Rank 1 was seeded 43: it is told that it shuffles with rank 0's seed.
    assert ranks[0]["warnings"] == [] and "differs from process 0's (42)" in ranks[1]["warnings"][0]
    # Accelerate shuffles each rank with its own seed: an epoch repeats and misses samples
    # (the documented difference).
    theirs = run_distributed(
        seedable_epochs, "accelerate", nproc=2, timeout=120, env=ACCELERATE_ENV
    )
    assert sorted(theirs[0]["first"][0] + theirs[1]["first"][0]) != list(range(24))


class EpochBatches:
    """A user's batch sampler with ``set_epoch``: batches of 2 in order, epochs recorded."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, list[int]()
        self.batch_size, self.drop_last = 2, False

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(range(i, min(i + 2, self.n))) for i in range(0, self.n, 2)])

    def __len__(self) -> int:
        return (self.n + 1) // 2


def test_set_epoch_reaches_a_custom_batch_sampler_under_the_shard() -> None:
    from kwplug.data import prepare_dataloader

    batches = EpochBatches(8)
    loader = prepare_dataloader(
        DataLoader(list(range(8)), batch_sampler=batches), torch.device("cpu"), 2, 0
    )
    for _ in range(2):
        assert [b.tolist() for b in loader] == [[0, 1], [4, 5]]
    loader.set_epoch(5)
    list(loader)
    assert batches.epochs == [0, 1, 5]
