"""``dynamo_backend=`` side by side with Accelerate 1.16: the same script with its imports
renamed, in one process (``aot_eager``) and under DDP in 2 processes (``eager``, gloo):
what ``prepare`` and ``unwrap_model`` return, the losses, the saved keys, ``no_sync``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from python import python

_SIDE_BY_SIDE = """
import glob, json, sys, tempfile, torch
from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin
from safetensors import safe_open

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
prepared, optimizer = accelerator.prepare(model, optimizer)
losses = []
generator = torch.Generator().manual_seed(1)
x = torch.randn(16, 4, generator=generator)
y = torch.randn(16, 1, generator=generator)
for _ in range(4):
    loss = torch.nn.functional.mse_loss(prepared(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
kept = accelerator.unwrap_model(prepared)
removed = accelerator.unwrap_model(prepared, keep_torch_compile=False)
folder = tempfile.mkdtemp()
accelerator.save_state(folder)
(model_file,) = glob.glob(folder + "/**/model*.safetensors", recursive=True)
with safe_open(model_file, "pt") as f:
    state_keys = sorted(f.keys())
accelerator.save_model(prepared, folder + "/export")
with safe_open(folder + "/export/model.safetensors", "pt") as f:
    model_keys = sorted(f.keys())
print(json.dumps({
    "prepared": type(prepared).__name__,
    "orig_mod_is_model": prepared._orig_mod is model,
    "kept": type(kept).__name__,
    "kept_is_prepared": kept is prepared,
    "removed": type(removed).__name__,
    "removed_is_model": removed is model,
    "backend": getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None),
    "losses": losses,
    "state_keys": state_keys,
    "model_keys": model_keys,
}))
"""


def test_side_by_side_with_accelerate() -> None:
    results = {}
    for library in ("accelerate", "kwplug"):
        source = _SIDE_BY_SIDE.replace("from accelerate", f"from {library}")
        done = python("-c", source, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        results[library] = json.loads(done.stdout.strip().splitlines()[-1])
    ours, theirs = results["kwplug"], results["accelerate"]
    assert theirs["backend"] == "AOT_EAGER" and ours["backend"] is None  # no state.dynamo_plugin
    # save_model: Accelerate 1.16 writes torch.compile's `_orig_mod.` prefix into the exported
    # file (its save_state does not); kwplug writes the module's own keys in both (documented).
    assert ours["model_keys"] == ours["state_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert theirs["model_keys"] == [f"_orig_mod.{key}" for key in ours["model_keys"]]
    for key in ("backend", "model_keys"):
        ours.pop(key), theirs.pop(key)
    assert ours == theirs
    assert ours["prepared"] == "OptimizedModule" and ours["removed"] == "Sequential"


def _ddp_run(library: str, backend: str, folder: Path) -> list[dict[str, Any]]:
    from torchrun import torchrun

    worker = Path(__file__).parents[1] / "workers" / "dynamo_ddp_worker.py"
    done = torchrun(worker, library, backend, str(folder), nproc=2, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KWPLUG_RESULT ")]
    assert len(lines) == 1, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result: list[dict[str, Any]] = json.loads(lines[0].split(" ", 1)[1])
    return result


def test_ddp_in_two_processes_compiled_as_accelerate(tmp_path: Path) -> None:
    plain = _ddp_run("kwplug", "no", tmp_path / "plain")
    ours = _ddp_run("kwplug", "eager", tmp_path / "ours")
    theirs = _ddp_run("accelerate", "eager", tmp_path / "theirs")
    for rank in range(2):
        # torch.compile around the DDP wrapper, in both libraries.
        assert ours[rank]["prepared"] == theirs[rank]["prepared"] == "OptimizedModule"
        assert ours[rank]["inside"] == theirs[rank]["inside"] == "DistributedDataParallel"
        assert plain[rank]["prepared"] == "DistributedDataParallel"
        assert ours[rank]["removed_is_model"] and theirs[rank]["removed_is_model"]
        # keep_torch_compile=True: an OptimizedModule around the module itself in both (kwplug's
        # is a new one; Accelerate's is the prepared one with DDP taken out of it).
        assert ours[rank]["kept"] == theirs[rank]["kept"] == "OptimizedModule"
        assert ours[rank]["kept_inside_is_model"] and theirs[rank]["kept_inside_is_model"]
        # The same losses and weights as the uncompiled DDP run and as Accelerate: exactly
        # (eager runs the same kernels; the gradients are averaged by the same all-reduce).
        assert ours[rank]["losses"] == plain[rank]["losses"] == theirs[rank]["losses"]
        assert ours[rank]["weights"] == plain[rank]["weights"] == theirs[rank]["weights"]
        assert ours[rank]["state_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert ours[0]["weights"] == ours[1]["weights"]  # synchronised
    # no_sync reaches DDP inside the compiled wrapper (local gradients differ per rank, as in
    # Accelerate), and trigger_sync_in_backward re-arms it (the same gradients on both ranks).
    # Accelerate 1.16's trigger_sync_in_backward sets DDP's flags on the compiled wrapper
    # instead, so its backward stays local (documented in the migration table).
    for run in (ours, theirs, plain):
        assert run[0]["no_sync_grads"] != run[1]["no_sync_grads"]
    assert ours[0]["triggered_grads"] == ours[1]["triggered_grads"]
    assert plain[0]["triggered_grads"] == plain[1]["triggered_grads"]
    assert ours[0]["triggered_grads"] == plain[0]["triggered_grads"]
    assert theirs[0]["triggered_grads"] != theirs[1]["triggered_grads"]
    assert ours[0]["no_sync_grads"] == plain[0]["no_sync_grads"] == theirs[0]["no_sync_grads"]
