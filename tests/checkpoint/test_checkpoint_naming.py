"""Automatic checkpoint naming (``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=N)``): Accelerate's folder names, pruning only kwplug's own complete checkpoints
after the commit, resuming the numbering, and the project folders as Accelerate keeps them."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _naming as naming
from kwplug.checkpoint import _runs as runs
from kwplug.errors import CheckpointError, KwplugWarning
from kwplug.utils import ProjectConfiguration


def _accelerator(project: Path, **config: Any) -> tuple[kwplug.Accelerator, torch.nn.Module]:
    accelerator = kwplug.Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, **config
        ),
    )
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    return accelerator, model


def _names(project: Path) -> list[str]:
    return sorted(os.listdir(project / "checkpoints"))


def test_same_folders_as_accelerate_after_saves_with_total_limit(tmp_path: Path) -> None:
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.utils import ProjectConfiguration as AccelerateConfig

    theirs = AccelerateAccelerator(
        cpu=True,
        project_config=AccelerateConfig(
            project_dir=str(tmp_path / "a"), automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    theirs.prepare(torch.nn.Linear(2, 1))
    ours, _ = _accelerator(tmp_path / "k", total_limit=2)
    for _ in range(5):
        theirs.save_state()
        saved = ours.save_state()
        assert _names(tmp_path / "k") == _names(tmp_path / "a")
        assert saved == tmp_path / "k" / "checkpoints" / f"checkpoint_{ours.save_iteration - 1}"
    assert _names(tmp_path / "k") == ["checkpoint_3", "checkpoint_4"]
    assert ours.save_iteration == theirs.save_iteration == 5
    folders = [tmp_path / "k" / "checkpoints" / name for name in _names(tmp_path / "k")]
    assert all(commit.is_complete(folder) for folder in folders)


def test_foreign_folders_are_neither_counted_nor_deleted(tmp_path: Path) -> None:
    accelerator, _ = _accelerator(tmp_path, total_limit=1)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "notes").mkdir(parents=True)
    (checkpoints / "notes" / "a.txt").write_text("mine")
    (checkpoints / "checkpoint_0").mkdir()  # the user's, under a kwplug name
    (checkpoints / "checkpoint_0" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"checkpoint_0 \(iteration 0\) already exists"):
        accelerator.save_state()
    accelerator.project_configuration.iteration = 1
    accelerator.save_state()
    accelerator.save_state()
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_2", "notes"]
    # A kwplug checkpoint folder holding a user's file is not kwplug's to delete either.
    (checkpoints / "checkpoint_2" / "README").write_text("keep")
    accelerator.save_state()
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_2", "checkpoint_3", "notes"]
    assert (checkpoints / "checkpoint_0" / "weights.bin").read_bytes() == b"x"


def test_pruning_happens_only_after_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, _ = _accelerator(tmp_path, total_limit=1)
    accelerator.save_state()

    def killed(step: str) -> None:
        if step == "mark":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit, "reached", killed)
    with pytest.raises(kwplug.checkpoint.CheckpointError):
        accelerator.save_state()
    monkeypatch.undo()
    # The failed save pruned nothing and did not count as an iteration.
    assert commit.is_complete(tmp_path / "checkpoints" / "checkpoint_0")
    assert accelerator.save_iteration == 1
    # A killed save's leftover (kwplug's files, no complete version) is saved into again.
    leftover = tmp_path / "checkpoints" / "checkpoint_1"
    (leftover / "kwplug-00000001").mkdir(parents=True)
    accelerator.save_state()
    assert _names(tmp_path) == ["checkpoint_1"]
    # Trash of a prune that was killed is finished off by the next prune.
    trash = tmp_path / "checkpoints" / ".kwplug-trash-checkpoint_0-1"
    (trash / "kwplug-00000001").mkdir(parents=True)
    (trash / "kwplug-00000001" / "MANIFEST.json").write_text("{}")
    accelerator.save_state()
    assert _names(tmp_path) == ["checkpoint_2"]


def test_a_failed_prune_warns_and_keeps_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, _ = _accelerator(tmp_path, total_limit=1)

    def refuse(directory: Path, total_limit: int, **_: Any) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(naming, "prune", refuse)
    with pytest.warns(KwplugWarning, match="could not delete an old checkpoint"):
        saved = accelerator.save_state()
    assert commit.is_complete(saved) and accelerator.save_iteration == 1


def test_resume_loads_the_newest_and_continues_numbering(tmp_path: Path) -> None:
    accelerator, model = _accelerator(tmp_path)
    saved = []
    for value in (1.0, 2.0, 3.0):
        with torch.no_grad():
            model.weight.fill_(value)
        saved.append(accelerator.save_state())
    # An incomplete newer folder (a killed save) is not loaded.
    (tmp_path / "checkpoints" / "checkpoint_7" / "kwplug-00000001").mkdir(parents=True)
    resumed, model = _accelerator(tmp_path)
    assert resumed.save_iteration == 0
    resumed.load_state()
    assert torch.equal(model.weight, torch.full((1, 2), 3.0))
    assert resumed.save_iteration == 3
    assert resumed.save_state() == tmp_path / "checkpoints" / "checkpoint_3"
    # An explicit checkpoint_<n> sets the iteration too.
    resumed.load_state(saved[0])
    assert torch.equal(model.weight, torch.full((1, 2), 1.0))
    assert resumed.save_iteration == 1


def test_without_a_folder_or_project(tmp_path: Path) -> None:
    plain = kwplug.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="needs output_dir"):
        plain.save_state()
    with pytest.raises(ValueError, match="needs input_dir"):
        plain.load_state()
    plain.save_state(tmp_path / "x")
    assert plain.save_iteration == 1  # as in Accelerate, every save counts
    nameless = kwplug.Accelerator(
        cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True)
    )
    with pytest.raises(ValueError, match="needs a project_dir"):
        nameless.save_state()
    empty, _ = _accelerator(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no complete kwplug checkpoint_<n>"):
        empty.load_state()


def test_an_explicit_output_dir_is_ignored_as_in_accelerate(tmp_path: Path) -> None:
    accelerator, _ = _accelerator(tmp_path / "p")
    with pytest.warns(KwplugWarning, match="ignores its output_dir"):
        saved = accelerator.save_state(tmp_path / "elsewhere")
    assert saved == tmp_path / "p" / "checkpoints" / "checkpoint_0"
    assert not (tmp_path / "elsewhere").exists()


def test_prune_skips_a_folder_another_process_is_saving_into(tmp_path: Path) -> None:
    accelerator, _ = _accelerator(tmp_path)
    accelerator.save_state()
    accelerator.save_state()
    checkpoints = tmp_path / "checkpoints"
    with kwplug.checkpoint._lock.locked(checkpoints / "checkpoint_0"):
        assert naming.prune(checkpoints, 1) == []
    assert naming.prune(checkpoints, 1) == [checkpoints / "checkpoint_0"]
    assert _names(tmp_path) == ["checkpoint_1"]


@pytest.mark.parametrize(
    ("project_dir", "config"),
    [
        ("p", None),
        (None, {"project_dir": "a", "logging_dir": "b"}),
        ("c", {"project_dir": "a"}),
        ("c", {"logging_dir": "b"}),
        (None, {}),
    ],
)
def test_project_folders_as_accelerate(project_dir: str | None, config: Any) -> None:
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.utils import ProjectConfiguration as AccelerateConfig

    seen = []
    for accelerator_class, config_class in (
        (AccelerateAccelerator, AccelerateConfig),
        (kwplug.Accelerator, ProjectConfiguration),
    ):
        project = None if config is None else config_class(**config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelerator = accelerator_class(
                cpu=True, project_dir=project_dir, project_config=project
            )
        if project is not None:
            assert accelerator.project_configuration is project
        seen.append((accelerator.project_dir, accelerator.logging_dir, accelerator.save_iteration))
    assert seen[0] == seen[1]


def two_process_naming(project: str) -> dict[str, Any]:
    """In each rank: saves with total_limit, a refused save, then a resume by load_state()."""
    accelerator, model = _accelerator(Path(project), total_limit=2)
    for value in (1.0, 2.0, 3.0):
        with torch.no_grad():
            model.module.weight.fill_(value)
        accelerator.save_state()
    accelerator.project_configuration.iteration = 1  # checkpoint_1 exists: every rank refuses
    try:
        accelerator.save_state()
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    with torch.no_grad():
        model.module.weight.zero_()
    accelerator.load_state()
    result = {
        "names": _names(Path(project)),
        "iteration": accelerator.save_iteration,
        "weight": model.module.weight.tolist(),
        "refused": "already exists" in refused,
    }
    accelerator.end_training()
    return result


@pytest.mark.timeout(200)
def test_two_processes_agree(tmp_path: Path) -> None:
    from kwplug.testing import run_distributed

    ranks = run_distributed(two_process_naming, str(tmp_path), nproc=2, timeout=180)
    assert ranks[0] == ranks[1]
    assert ranks[0] == {
        "names": ["checkpoint_1", "checkpoint_2"],
        "iteration": 3,
        "weight": [[3.0, 3.0]],
        "refused": True,
    }


def _filled(accelerator: kwplug.Accelerator, model: torch.nn.Module, value: float) -> Path:
    with torch.no_grad():
        model.weight.fill_(value)
    return accelerator.save_state()


def test_two_runs_in_one_project_keep_each_others_checkpoints(tmp_path: Path) -> None:
    # Issue 18: a second run in the same project_dir pruned the first's checkpoints (and the
    # first the second's), and load_state() then resumed the other run's. Accelerate deletes
    # the oldest whoever saved them; kwplug counts and deletes only this run's.
    first, first_model = _accelerator(tmp_path, total_limit=2, iteration=5)
    for value in (1.0, 2.0):
        _filled(first, first_model, value)
    second, second_model = _accelerator(tmp_path, total_limit=2)
    for value in (3.0, 4.0, 5.0):
        _filled(second, second_model, value)
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_2", "checkpoint_5", "checkpoint_6"]
    _filled(first, first_model, 6.0)
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_2", "checkpoint_6", "checkpoint_7"]
    for accelerator, model, folder, value in (
        (second, second_model, "checkpoint_2", 5.0),
        (first, first_model, "checkpoint_7", 6.0),
    ):
        with torch.no_grad():
            model.weight.zero_()
        assert accelerator.load_state().parent.name == folder  # this run's newest
        assert torch.equal(model.weight, torch.full((1, 2), value))
    # A new run finds two runs' checkpoints: which one to continue is the user's choice.
    third, third_model = _accelerator(tmp_path, total_limit=2)
    with pytest.raises(ValueError, match=r"checkpoints of 2 runs .*newest checkpoint_2.*") as info:
        third.load_state()
    assert "newest checkpoint_7" in str(info.value)
    third.load_state(tmp_path / "checkpoints" / "checkpoint_7")  # continues the first run
    assert torch.equal(third_model.weight, torch.full((1, 2), 6.0))
    _filled(third, third_model, 7.0)
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_2", "checkpoint_7", "checkpoint_8"]


def test_a_run_resumes_the_only_run_there_and_untagged_checkpoints_are_anyones(
    tmp_path: Path,
) -> None:
    first, model = _accelerator(tmp_path, total_limit=2)
    for value in (1.0, 2.0, 3.0):
        _filled(first, model, value)
    # A folder saved by kwplug before run tags.
    (tmp_path / "checkpoints" / "checkpoint_1" / ".kwplug-run").unlink()
    resumed, model = _accelerator(tmp_path, total_limit=2)
    resumed.load_state()  # the only run there: its newest, and that run is continued
    assert torch.equal(model.weight, torch.full((1, 2), 3.0))
    _filled(resumed, model, 4.0)
    assert _names(tmp_path) == ["checkpoint_2", "checkpoint_3"]
    # A second run saving at a number the first used is refused, naming the folder.
    other, _ = _accelerator(tmp_path, total_limit=2, iteration=3)
    with pytest.raises(ValueError, match=r"checkpoint_3 \(iteration 3\) already exists"):
        other.save_state()


def per_rank_directories(root: str) -> dict[str, Any]:
    """Run in each rank: save into a folder of its own and load from it (as a script using
    one tempfile.TemporaryDirectory per process does, Accelerate's test scripts among them);
    then load with process 0 passing an empty folder and process 1 the checkpoint's."""
    import warnings

    import kwplug
    from kwplug.errors import KwplugWarning

    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    mine = Path(root) / f"rank{accelerator.process_index}"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        accelerator.save_state(str(mine))
        with torch.no_grad():
            model.module.weight.fill_(5.0)
        accelerator.load_state(str(mine))
    result: dict[str, Any] = {
        "warnings": [str(w.message) for w in seen if w.category is KwplugWarning],
        "restored": not torch.equal(model.module.weight, torch.full((1, 2), 5.0)),
        "files": sorted(p.name for p in mine.iterdir()) if mine.exists() else None,
    }
    wrong = Path(root) / "empty" if accelerator.process_index == 0 else Path(root) / "rank0"
    wrong.mkdir(exist_ok=True)
    try:
        accelerator.load_state(str(wrong))
    except FileNotFoundError as exc:
        result["error"] = str(exc)
    finally:
        accelerator.end_training()
    return result


@pytest.mark.timeout(120)
def test_per_process_folders_share_process_zeros_checkpoint(tmp_path: Path) -> None:
    # The run saves one checkpoint, into process 0's folder (process 1 writes its files
    # there): a process whose folder holds none loads process 0's, and is warned each time.
    from kwplug.testing import run_distributed

    rank0, rank1 = run_distributed(per_rank_directories, str(tmp_path), nproc=2, timeout=60)
    assert rank0["restored"] and rank1["restored"]
    assert rank0["warnings"] == [] and rank0["files"] != []
    assert not rank1["files"] and len(rank1["warnings"]) == 2  # nothing written there
    assert all(f"process 0 passed {tmp_path / 'rank0'}" in w for w in rank1["warnings"])
    # Process 0's folder holds none: every rank raises, none waits in a collective for the
    # other (the job ends well before its timeout).
    assert rank0["error"].startswith(f"no complete kwplug checkpoint at '{tmp_path / 'empty'}'")
    assert rank1["error"].startswith("rank 0 found no complete kwplug checkpoint")
    assert "every process must load a checkpoint" in rank1["error"]


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it in the save runs."""


def test_a_save_killed_after_its_commit_is_resumed_by_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 18 re-verification (kill loop with automatic naming): a save killed between its
    # commit and its run tag left the newest checkpoint untagged; the restarted process loaded
    # it but kept a new run id, tagged its own saves with it, and the restart after that
    # refused load_state() ("the checkpoints of 2 runs") although one run was ever started.
    first, model = _accelerator(tmp_path, total_limit=2)
    for value in (1.0, 2.0):
        _filled(first, model, value)

    def killed(step: str) -> None:
        if step == "unlock":  # the version is committed; the process dies here
            raise _Killed

    monkeypatch.setattr(commit, "reached", killed)
    with pytest.raises(_Killed):
        _filled(first, model, 3.0)
    monkeypatch.undo()
    folders = tmp_path / "checkpoints"
    first_run = runs.owner(folders / "checkpoint_1")
    assert first_run is not None and runs.owner(folders / "checkpoint_2") == first_run
    for value in (4.0, 5.0):  # two restarts of the same training, each resuming
        resumed, model = _accelerator(tmp_path, total_limit=2)
        assert resumed.load_state().parent.name == f"checkpoint_{int(value) - 2}"
        assert torch.equal(model.weight, torch.full((1, 2), value - 1.0))
        _filled(resumed, model, value)
    # one run throughout: total_limit keeps its two newest
    assert _names(tmp_path) == ["checkpoint_3", "checkpoint_4"]


def test_an_untagged_newest_checkpoint_continues_the_only_run_there(tmp_path: Path) -> None:
    # The same from a folder without a tag (saved by kwplug before run tags): loading it
    # continues the one run whose tagged checkpoints are there.
    first, model = _accelerator(tmp_path, total_limit=2)
    for value in (1.0, 2.0, 3.0):
        _filled(first, model, value)
    (tmp_path / "checkpoints" / "checkpoint_2" / ".kwplug-run").unlink()
    resumed, model = _accelerator(tmp_path, total_limit=2)
    assert resumed.load_state().parent.name == "checkpoint_2"
    _filled(resumed, model, 4.0)
    again, model = _accelerator(tmp_path, total_limit=2)
    assert again.load_state().parent.name == "checkpoint_3"  # not "2 runs"
    assert torch.equal(model.weight, torch.full((1, 2), 4.0))
    assert _names(tmp_path) == ["checkpoint_2", "checkpoint_3"]


def test_a_save_refused_by_the_lock_leaves_the_savers_tag(tmp_path: Path) -> None:
    # The tag is written under the folder's lock: a second run reaching the folder another
    # process is saving into (its lock held, its tag written, no complete version yet) is
    # refused by the lock and does not re-tag the other process's checkpoint.
    first, _ = _accelerator(tmp_path)
    target = tmp_path / "checkpoints" / "checkpoint_0"
    target.mkdir(parents=True)
    runs.tag(target, "0" * 32)
    with kwplug.checkpoint._lock.locked(target), pytest.raises(CheckpointError):
        first.save_state()
    assert runs.owner(target) == "0" * 32
