"""Print, as one JSON line per rank, what a rank sees of its process (tests/plugin_system/
test_fast_launch.py compares the torchrun command line's ranks with the forked ones)."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader


def main() -> int:
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    atexit.register(lambda: (out / f"atexit_{rank}").write_text("ran"))
    seen = {
        "argv": sys.argv[1:],
        "env": dict(os.environ),
        "path0": sys.path[0],
        "path": sys.path[1:],
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "kwplug_imported": "kwplug" in sys.modules,
        "start_method": multiprocessing.get_start_method(),
        "process": multiprocessing.current_process().name,
        "parent": multiprocessing.parent_process() is None,
        "loader": [b.tolist() for b in DataLoader(list(range(4)), batch_size=2, num_workers=2)],
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(seen))
    print(f"stdout of rank {rank}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    if len(sys.argv) > 2 and sys.argv[2] == rank:
        raise SystemExit(7)
    return 0


if __name__ == "__main__":
    sys.exit(main())
