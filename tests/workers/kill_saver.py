"""Worker for tests/checkpoint/test_checkpoint_kills.py: SIGKILL savers at random instants
and at each named step of the commit protocol, in a row, and check after every kill that the newest
complete checkpoint loads and is at least as new as the last save that returned, and that the
folder its save hook wrote is reachable in the checkpoint directory (``DIR/unet``).

Usage: kill_saver.py DIR KILLS SEED. Prints one JSON line of figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _layout as layout


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def build() -> tuple[kwplug.Accelerator, torch.nn.Module, Counter]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        # diffusers' save_pretrained into <output_dir>/unet: linked as <DIR>/unet (issue 28)
        Path(output_dir, "unet").mkdir()
        Path(output_dir, "unet", "n.txt").write_text(str(counter.n))

    accelerator.register_save_state_pre_hook(save_hook)
    return accelerator, model, counter


def saver(directory: Path, ack: int, kill_at: str | None) -> None:
    """Resume, then save newer states forever, acknowledging each finished save."""
    accelerator, model, counter = build()
    if checkpoint.resolve_checkpoint(directory) is not None:
        accelerator.load_state(directory, exact_data_position=True)
    if kill_at is not None:

        def die(step: str) -> None:
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        commit.reached = die
    while True:
        counter.n += 1
        with torch.no_grad():
            model.weight.fill_(counter.n)
        accelerator.save_state(directory)
        os.write(ack, struct.pack("<q", counter.n))


def run_child(directory: Path, delay: float | None, kill_at: str | None) -> int | None:
    """Fork a saver, kill it, return the last acknowledged counter (or None)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            saver(directory, write, kill_at)
        finally:
            os._exit(3)
    os.close(write)
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    data = b""
    while chunk := os.read(read, 4096):
        data += chunk
    os.close(read)
    acked = [struct.unpack("<q", data[i : i + 8])[0] for i in range(0, len(data) - 7, 8)]
    return acked[-1] if acked else None


def main() -> None:
    directory, kills, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    torch.set_num_threads(1)
    checker, model, counter = build()
    figures = {"random_kills": 0, "step_kills": 0, "survived": 0, "interrupted_saves": 0}
    acked = 0

    def check() -> None:
        nonlocal acked
        leftovers = [
            p for p in commit.versions(directory).values() if not (p / layout.MARKER).exists()
        ]
        leftovers += [p for p in directory.iterdir() if layout.trash_number(p.name) is not None]
        figures["interrupted_saves"] += bool(leftovers)
        checker.load_state(directory)  # verifies every file first
        assert counter.n >= acked, (counter.n, acked)
        assert torch.all(model.weight == counter.n)
        # The hook's folder, linked into DIR, is the loaded version's (a kill between the
        # marker and the link is repaired by the load); no other link or temporary is left.
        assert (directory / "unet").is_symlink()
        assert int((directory / "unet" / "n.txt").read_text()) == counter.n
        links = [p.name for p in directory.iterdir() if p.is_symlink()]
        assert links == ["unet"], links
        acked = counter.n
        figures["survived"] += 1

    run_child(directory, None, "unlock")  # a first checkpoint, then killed at its end
    check()
    steps = list(commit.STEPS)
    for _ in range(2):  # each named step, the kills in a row, twice
        for step in steps:
            last = run_child(directory, None, step)
            acked = max(acked, last or 0)
            check()
            figures["step_kills"] += 1
        steps.reverse()
    # Random instants: from before the first save (start-up, resume) to a few saves in.
    for _ in range(kills):
        last = run_child(directory, rng.uniform(0.0, 0.25), None)
        acked = max(acked, last or 0)
        check()
        figures["random_kills"] += 1
    figures["last_counter"] = counter.n
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
