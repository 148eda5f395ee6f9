"""``kwplug.state`` (``PartialState``, ``AcceleratorState``) and ``kwplug.logging``
(``get_logger``): a script written for Accelerate runs with only its imports renamed and
prints the same lines on the same ranks (2 torchrun processes); single-process checks."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torchrun import torchrun

import kwplug
from kwplug.logging import get_logger
from kwplug.state import AcceleratorState, PartialState

SCRIPT = Path(__file__).resolve().parents[1] / "workers" / "accelerate_state_script.py"
_IMPORT = re.compile(r"^(from|import) accelerate\b", re.MULTILINE)


def _lines(stdout: str) -> list[str]:
    # The script's own lines: its logger's records and its prints (not library chatter).
    prefixes = ("INFO [RANK", "WARNING [RANK", "DEBUG", "rank ", "state.print")
    return [line for line in stdout.splitlines() if line.startswith(prefixes)]


def _per_rank(script: Path, logs: Path, env: dict[str, str] | None = None) -> list[list[str]]:
    """Each rank's lines, in order, from torchrun's per-rank stdout files (``--redirects``)."""
    torchrun(
        script, env=env, timeout=240, torchrun_args=["--log-dir", str(logs), "--redirects", "1"]
    )
    files = {int(p.parent.name): p for p in logs.glob("**/stdout.log")}
    assert sorted(files) == [0, 1], files
    return [_lines(files[rank].read_text()) for rank in (0, 1)]


def test_renamed_script_prints_what_accelerate_prints(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    renamed = tmp_path / "script.py"
    renamed.write_text(_IMPORT.sub(r"\1 kwplug", SCRIPT.read_text()))
    assert "accelerate" not in "".join(
        line for line in renamed.read_text().splitlines() if line.startswith(("from", "import"))
    )
    theirs = _per_rank(SCRIPT, tmp_path / "a", env={"ACCELERATE_USE_CPU": "1"})
    ours = _per_rank(renamed, tmp_path / "k")
    assert ours == theirs
    zero, one = ours
    assert "INFO [RANK 0] main only" in zero and "INFO [RANK 1] main only" not in one
    assert "INFO [RANK 1] every rank" in one and "WARNING [RANK 1] in order 1" in one
    assert "state.print from 0" in zero and "state.print from 1" not in one
    assert "rank 1: part [3, 3]" in one  # apply_padding repeats the last item
    for rank, lines in enumerate(ours):
        assert lines[0] == f"INFO [RANK {rank}] {'main only' if rank == 0 else 'every rank'}"
        state = f"rank {rank}: AcceleratorState num_processes=2 process_index={rank} "
        state += f"mixed_precision=bf16 type=DistributedType.MULTI_CPU main={rank == 0}"
        assert state in lines


def test_state_before_and_after_an_accelerator() -> None:
    before = PartialState()
    assert (before.num_processes, before.process_index, before.local_process_index) == (1, 0, 0)
    assert before.is_main_process and before.is_last_process and not before.use_distributed
    assert before.distributed_type is kwplug.DistributedType.NO
    assert AcceleratorState().mixed_precision == "no"
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    state = AcceleratorState()
    assert state.mixed_precision == "bf16" and state.device == accelerator.device
    assert state.distributed_type is accelerator.distributed_type
    with pytest.raises(ValueError, match="the live Accelerator uses 'bf16'"):
        AcceleratorState(mixed_precision="fp16")
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    assert state.on_main_process(lambda: 7)() == 7
    del accelerator, state
    import gc

    gc.collect()  # the live Accelerator is referenced weakly
    assert AcceleratorState().mixed_precision == "no"


def test_state_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(TypeError, match="InitProcessGroupKwargs"):
        PartialState(backend="gloo")
    with pytest.raises(TypeError, match="cpu must be a bool"):
        PartialState(cpu=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'deepspeed_plugin'"):
        AcceleratorState(deepspeed_plugin=object())
    AcceleratorState(fsdp_plugin=None, _from_accelerator=True)  # Accelerate's defaults pass


def test_use_cpu_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "yes")
    assert PartialState().device == torch.device("cpu")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")
    with pytest.raises(ValueError, match="maybe"):
        PartialState()


def test_logger_filters_by_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    logger = get_logger("kwplug.test_logging", log_level="INFO")
    logger.info("zero %d", 0)
    monkeypatch.setenv("RANK", "1")  # what torchrun sets on the second process
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger.info("dropped on rank 1")
    logger.info("kept %s", "everywhere", main_process_only=False)
    logger.warning_once("once")
    logger.warning_once("once")
    with pytest.raises(TypeError, match="main_process_only must be a bool"):
        logger.info("x", main_process_only="no")
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.endswith("logging")]
    assert records == [
        (logging.INFO, "[RANK 0] zero 0"),
        (logging.INFO, "[RANK 1] kept everywhere"),
    ]
    assert caplog.records[0].funcName == "test_logger_filters_by_rank"  # stacklevel
    with pytest.raises(ValueError, match="log_level"):
        get_logger("x", log_level="LOUD")
