"""The process torchrun starts for :func:`kwplug.testing.run_distributed` (one per rank)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

from kwplug._process.environment import end_process_group


def main(folder: Path) -> int:
    rank = int(os.environ["RANK"])
    target, args = pickle.loads((folder / "call.pkl").read_bytes())
    module_name, _, qualname = target.partition(":")
    try:
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        result = fn(*args)
        try:
            payload = pickle.dumps(result)
        except Exception as exc:
            raise TypeError(
                f"the return value of {target} ({type(result).__name__}) cannot be pickled: {exc}"
            ) from exc
        (folder / f"rank_{rank}.pkl").write_bytes(payload)
    except BaseException as exc:
        # The summary line first (the headline of DistributedRunError), then the traceback.
        (folder / f"rank_{rank}.exc").write_text(f"{type(exc).__name__}: {exc}".strip())
        (folder / f"rank_{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        end_process_group()  # a DDP reducer must go before its process group
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
