"""``DataLoaderConfiguration(use_stateful_dataloader=True)``: prepared loaders are torchdata's
``StatefulDataLoader``, as Accelerate's, and resume at the exact next batch from
``state_dict``/``load_state_dict`` and ``save_state``/``load_state`` (issue 17).

One-process tests of kwplug here; the differential test runs the same script under
Accelerate and kwplug in 2 processes and compares the batches after a resume."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import kwplug
from kwplug.errors import CheckpointError, KwplugWarning
from kwplug.testing import run_distributed
from kwplug.utils import DataLoaderConfiguration, set_seed

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader

STATEFUL = DataLoaderConfiguration(use_stateful_dataloader=True)


class Stream(IterableDataset[int]):
    """``range(n)``; counts the samples it produced."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.reads += 1
            yield i


class ResumableStream(Stream):
    """A stream with torch's ``Stateful`` protocol: it resumes from its own state, so a
    stateful loader never reads it again to find its place."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.start = self.position = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        for i in range(start, self.n):
            self.reads += 1
            self.position = i + 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]


def _values(batches: list[Any]) -> list[list[int]]:
    return [(b[0] if isinstance(b, list) else b).tolist() for b in batches]


def _interrupted(loader: Any, at: int) -> tuple[dict[str, Any], list[list[int]]]:
    """One epoch: the position after batch ``at`` and the batches after it."""
    state: dict[str, Any] = {}
    rest = []
    for step, batch in enumerate(loader):
        if step == at:
            state = loader.state_dict()
        if step > at:
            rest.append(batch)
    return state, _values(rest)


def _map_loader(n: int = 30, shuffle: bool = True) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=shuffle)


def test_the_flag_gives_torchdata_stateful_dataloaders() -> None:
    from kwplug.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader

    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    shard = accelerator.prepare(_map_loader())
    stream = accelerator.prepare(DataLoader(Stream(10), batch_size=4))
    for loader in (shard, stream):
        assert isinstance(loader, StatefulDataLoader) and isinstance(loader, DataLoaderShard)
        assert loader.use_stateful_dataloader and accelerator.use_stateful_dataloader
    assert isinstance(stream, DataLoaderDispatcher)  # an iterable data set is dispatched
    alone = prepare_data_loader(_map_loader(), use_stateful_dataloader=True)
    assert isinstance(alone, StatefulDataLoader)
    assert not isinstance(kwplug.Accelerator(cpu=True).prepare(_map_loader()), StatefulDataLoader)


def test_dataloader_config_is_settable_as_in_accelerate() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.dataloader_config = STATEFUL
    assert isinstance(accelerator.prepare(_map_loader()), StatefulDataLoader)
    with pytest.raises(TypeError, match="DataLoaderConfiguration"):
        accelerator.dataloader_config = {"use_stateful_dataloader": True}  # type: ignore[assignment]


@pytest.mark.parametrize("kind", ["shuffled", "stream", "workers"])
def test_load_state_dict_resumes_at_the_next_batch(kind: str) -> None:
    set_seed(7)
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)

    def make() -> Any:
        if kind == "stream":
            return accelerator.prepare(DataLoader(Stream(30), batch_size=4))
        data = TensorDataset(torch.arange(30))
        workers = 2 if kind == "workers" else 0  # workers draw the order as the loader is built
        return accelerator.prepare(
            DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)
        )

    loader = make()
    state, rest = _interrupted(loader, at=2)
    assert state["batches_yielded"] == 3 and "_iterator_finished" in state  # torchdata's too
    loader.load_state_dict(state)  # the same loader, after its epoch ended
    assert _values(list(loader)) == rest
    fresh = make()  # a new loader, as after a restart
    fresh.load_state_dict(state)
    assert _values(list(fresh)) == rest
    assert fresh.epoch == 1 and len(list(fresh)) == 8  # then whole epochs


def test_a_stateful_stream_resumes_from_its_own_state() -> None:
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(DataLoader(ResumableStream(30), batch_size=4))
    state, rest = _interrupted(loader, 2)
    # the position of the batch handed out (the loader has read one batch ahead: not counted)
    assert state["dataset_state"] == {"position": 12}
    stream = ResumableStream(30)
    resumed = accelerator.prepare(DataLoader(stream, batch_size=4))
    resumed.load_state_dict(state)
    assert _values(list(resumed)) == rest
    assert stream.reads == 30 - 12  # nothing before the resumed batch was read again


def test_a_position_at_the_last_batch_resumes_at_the_next_epoch() -> None:
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(_map_loader(shuffle=False))
    for _ in loader:
        state = loader.state_dict()
    assert state["_iterator_finished"] is True  # as torchdata's (and Accelerate's)
    loader.load_state_dict(state)
    assert loader.epoch == 1 and _values(list(loader)) == _values(list(loader))
    assert len(_values(list(loader))) == 8
    between = loader.state_dict()  # between epochs: kwplug's keys only, from the start
    assert between["batches_yielded"] == 0 and "_num_yielded" not in between


def test_skip_first_batches_keeps_the_loader_stateful_and_counts_in_the_position() -> None:
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(_map_loader(shuffle=False))
    assert accelerator.skip_first_batches(loader, 2) is loader
    state, rest = _interrupted(loader, at=1)  # batch 3 of the epoch
    assert state["skipped"] == 2 and state["batches_yielded"] == 4
    assert rest == [[16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29]]
    loader.load_state_dict(state)
    assert _values(list(loader)) == rest
    loader.set_epoch(0)  # set_epoch of the restored epoch keeps the position (Accelerate's)
    loader.load_state_dict(state)
    loader.set_epoch(0)
    assert _values(list(loader)) == rest
    loader.load_state_dict(state)
    loader.set_epoch(5)  # another epoch starts afresh
    assert len(list(loader)) == 8


def test_a_stateful_loader_pickles_with_its_position() -> None:
    import pickle

    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(_map_loader(shuffle=False))
    iterator = iter(loader)
    next(iterator)
    copy = pickle.loads(pickle.dumps(loader))
    assert isinstance(copy, StatefulDataLoader)
    assert copy.state_dict() == loader.state_dict()
    assert len(list(copy)) == 8


def test_save_state_round_trips_the_position(tmp_path: Path) -> None:
    set_seed(3)
    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(_map_loader())
    rest = []
    for step, batch in enumerate(loader):
        if step == 2:
            accelerator.save_state(tmp_path / "ckpt")
        if step > 2:
            rest.append(batch)
    accelerator.load_state(tmp_path / "ckpt")
    assert _values(list(loader)) == _values(rest)


def test_a_stateful_position_is_not_moved_to_another_number_of_processes() -> None:
    from kwplug.checkpoint._resize import convert_position, describe

    accelerator = kwplug.Accelerator(cpu=True, dataloader_config=STATEFUL)
    loader = accelerator.prepare(_map_loader())
    state, _ = _interrupted(loader, at=2)
    with pytest.raises(CheckpointError, match="use_stateful_dataloader"):
        convert_position(state, describe(loader), loader, 2, Path("ckpt"))


# -- Accelerate and kwplug, the same script, 2 processes ------------------------------------


def resume_under(library: str, folder: str) -> dict[str, Any]:
    """Accelerate's stateful checks (test_distributed_data_loop.py): a resume through
    ``state_dict``, through ``save_state`` into one folder, and into one folder per process
    (as that script does), for a pre-shuffled stream, a sequential map-style set, and a
    shuffling sampler. Also returns the warnings kwplug gave."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration as Config
    else:
        from kwplug import Accelerator
        from kwplug.utils import DataLoaderConfiguration as Config
    set_seed(11)
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    accelerator = Accelerator(cpu=True, dataloader_config=Config(use_stateful_dataloader=True))
    values = torch.randperm(64)
    out: dict[str, Any] = {}
    loaders = {
        "stream": lambda: DataLoader(_Values(values), batch_size=4),
        "map": lambda: DataLoader(TensorDataset(values), batch_size=4),
        "shuffled": lambda: DataLoader(TensorDataset(values), batch_size=4, shuffle=True),
    }
    if library == "kwplug":  # kwplug only: a padded last round, and workers
        loaders["stream29"] = lambda: DataLoader(_Values(values[:29]), batch_size=4)
        loaders["workers"] = lambda: DataLoader(
            TensorDataset(values), batch_size=4, shuffle=True, num_workers=2
        )
    for name, make in loaders.items():
        for via in VIAS if name in ("stream", "map", "shuffled") else VIAS[:1]:
            set_seed(11)  # each case from the same state (a resume leaves it as each library does)
            loader = accelerator.prepare(make())
            rest, target = [], f"{folder}/{name}-{via}"
            if via == "own_folder":
                target += f"-{accelerator.process_index}"
            for step, batch in enumerate(loader):
                if step == 2:
                    if via == "state_dict":
                        state = loader.state_dict()
                    elif library == "accelerate" and via == "save_state":
                        # Every process of Accelerate writes the same dl_state_dict.bin with
                        # torch.save, unlocked: a process could read it while another still
                        # writes (CI saw "Unsupported operand"). They take turns here, process
                        # 1 last, as the comparison below expects, and all finish before a load.
                        for turn in range(accelerator.num_processes):
                            if turn == accelerator.process_index:
                                accelerator.save_state(target)
                            accelerator.wait_for_everyone()
                    else:
                        accelerator.save_state(target)
                if step > 2:
                    rest.append(batch)
            if via == "state_dict":
                loader.load_state_dict(state)
            else:
                accelerator.load_state(target)
            out[f"{name}/{via}"] = {"rest": _values(rest), "resumed": _values(list(loader))}
    caught.__exit__(None, None, None)
    out["first"] = int(values[0])
    out["warnings"] = sorted({str(w.message) for w in seen if w.category is KwplugWarning})
    return out


class _Values(IterableDataset[torch.Tensor]):
    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self.values


VIAS = ("state_dict", "save_state", "own_folder")


def both_libraries(folder: str) -> dict[str, Any]:
    theirs = resume_under("accelerate", f"{folder}/accelerate")
    return {"accelerate": theirs, "kwplug": resume_under("kwplug", f"{folder}/kwplug")}


@pytest.mark.multiprocess
def test_resumed_batches_match_accelerate_in_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    per_rank = run_distributed(
        both_libraries, str(tmp_path), nproc=2, timeout=240, env={"ACCELERATE_USE_CPU": "1"}
    )
    for rank, result in enumerate(per_rank):
        ours, theirs = result["kwplug"], result["accelerate"]
        notes = ours.pop("warnings")
        theirs.pop("warnings")
        result["first"] = ours.pop("first")
        theirs.pop("first")
        # one folder per process: process 0's holds the run's checkpoint, and kwplug says so
        assert (rank == 0) == (notes == []), notes
        assert all("process 0's folder" in note for note in notes)
        inexact = []
        for case, run in ours.items():
            assert run["resumed"] == run["rest"], (rank, case)
            if case not in theirs:
                continue
            assert len(run["rest"]) == 5, (rank, case)
            assert run["rest"] == theirs[case]["rest"], (rank, case)  # the same batches
            if theirs[case]["resumed"] == theirs[case]["rest"]:
                assert run == theirs[case], (rank, case)  # the same batches after the resume
            else:
                inexact.append(case)
        # Accelerate resumes elsewhere there: a shuffling sampler draws a new order, and in one
        # folder every process writes dl_state_dict.bin, process 1's (which reads nothing
        # of a dispatched stream) last (docs/migrating-from-accelerate.md)
        assert set(inexact) <= {"stream/save_state", *(f"shuffled/{via}" for via in VIAS)}
    assert per_rank[0]["kwplug"]["map/state_dict"] != per_rank[1]["kwplug"]["map/state_dict"]
    # A dispatched 29-sample stream resumed in its last round (batches 24-26 and 27, 28 and the
    # epoch's first sample, which the resumed epoch did not read: its position keeps it).
    last = [result["kwplug"]["stream29/state_dict"]["resumed"] for result in per_rank]
    assert [len(batch) for batch in last[0] + last[1]] == [3, 3]
    assert last[1][0][-1] == per_rank[1]["first"]
