"""Runs a function through kwplug's notebook_launcher and debug_launcher, 2 processes each,
and prints what they returned as JSON (tests/training/test_launchers.py)."""

import functools
import json
import sys

import torch

import kwplug
from kwplug.launchers import debug_launcher, notebook_launcher


def train(tag: str) -> list:
    # What a notebook's training function does: its own Accelerator, a collective.
    accelerator = kwplug.Accelerator()
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), "sum")
    state = kwplug.PartialState()
    result = [tag, accelerator.process_index, state.num_processes, str(accelerator.device)]
    result.append(accelerator.mixed_precision)  # notebook_launcher's reaches Accelerator()
    distributed = torch.distributed.is_initialized()
    result += [float(total), torch.distributed.get_backend() if distributed else None]
    accelerator.end_training()
    return result


if __name__ == "__main__":
    port = sys.argv[1]
    debug = debug_launcher(train, ("debug",))
    notebook = notebook_launcher(
        lambda: train("notebook"), num_processes=2, use_port=port, mixed_precision="bf16"
    )
    single = notebook_launcher(train, ("single",), num_processes=1)
    # Accelerate's own tests launch functools.partial objects (no __name__).
    partial = debug_launcher(functools.partial(train, "partial"), num_processes=1)
    result = {"debug": debug, "notebook": notebook, "single": single, "partial": partial}
    print(json.dumps(result), flush=True)
