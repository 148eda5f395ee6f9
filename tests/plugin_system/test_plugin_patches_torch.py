"""A plugin whose import patches what training relies on outside kwplug is undone and named
(issue 30, item 1): ``torch.autocast`` replaced made fp16 train in fp32, ``Tensor.backward``
replaced left every ``.grad`` ``None``, a wrapped ``safetensors.torch.save_file`` saw every
checkpoint tensor, and one plugin could patch another's tracker -- each listed ``loaded``.
Also the process's streams and signal handlers (item 4). Each plugin is pip-installed for
real and the training runs in a fresh process."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from plugin_site import install_module_plugins, run_json

PATCHES = {
    "autocastpatch": """
        import contextlib, torch
        fake = lambda *args, **kwargs: contextlib.nullcontext()
        torch.autocast = fake
        torch.amp.autocast = fake
        torch.amp.autocast_mode.autocast = fake
    """,
    "backwardpatch": """
        import torch
        torch.Tensor.backward = lambda self, *args, **kwargs: None
        torch.autograd.backward = lambda *args, **kwargs: None
    """,
    "safetensorsspy": """
        import safetensors.torch
        SEEN = []
        real = safetensors.torch.save_file
        def save_file(tensors, *args, **kwargs):
            SEEN.extend(tensors)
            return real(tensors, *args, **kwargs)
        safetensors.torch.save_file = save_file
    """,
    "streams": """
        import io, signal, sys
        sys.stdout = io.StringIO()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """,
    # Loaded first (names sort), a tracker plugin; the next one patches its tracker.
    "atracker": """
        import kwplug
        from kwplug.tracking import GeneralTracker
        class MineTracker(GeneralTracker):
            name = "mine"
            requires_logging_directory = False
            tracker = None
            def log(self, values, step=None, **kwargs):
                LOGGED.append(dict(values))
        LOGGED = []
        @kwplug.hookimpl
        def trackers():
            return {"mine": MineTracker}
    """,
    "btrackerthief": """
        import kwplug_atracker
        kwplug_atracker.MineTracker.log = lambda self, values, step=None, **kwargs: None
    """,
}

TRAIN = textwrap.dedent("""
    import json, signal, sys, tempfile
    import torch
    import kwplug
    import safetensors.torch
    accelerator = kwplug.Accelerator(mixed_precision="fp16", cpu=True, log_with="mine")
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    with accelerator.autocast():
        inner = torch.nn.functional.linear(torch.randn(8, 4), model.weight, model.bias)
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    accelerator.backward(loss)
    grad = model.weight.grad
    accelerator.log({"loss": 1.0})
    with tempfile.TemporaryDirectory() as folder:
        accelerator.save_state(folder)
    spy = sys.modules.get("kwplug_safetensorsspy")
    records = {r.name: r for r in kwplug.discover()}
    print(json.dumps({
        "dtype": str(inner.dtype),
        "grad": grad is not None and bool(grad.abs().sum() > 0),
        "spied": len(spy.SEEN) if spy else None,
        "logged": sys.modules["kwplug_atracker"].LOGGED,
        "save_file": safetensors.torch.save_file.__module__,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "status": {n: r.status for n, r in records.items()},
        "errors": {n: r.error for n, r in records.items() if r.error},
    }))
""")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_module_plugins(
        {ep: textwrap.dedent(source) for ep, source in PATCHES.items()},
        tmp_path_factory.mktemp("patches"),
    )


def test_patches_outside_kwplug_are_undone_and_named(site: Path) -> None:
    result = run_json(TRAIN, site)  # stdout works: the streams plugin's StringIO was undone
    assert result["dtype"] == "torch.float16"  # autocast is torch's again
    assert result["grad"]  # backward is torch's again
    assert result["spied"] == 0 and result["save_file"] == "safetensors.torch"
    assert result["logged"] == [{"loss": 1.0}]  # the thief's patch was undone
    assert result["sigterm_default"]
    status, errors = result["status"], result["errors"]
    assert status["atracker"] == "loaded"
    for name in ("autocastpatch", "backwardpatch", "safetensorsspy", "streams", "btrackerthief"):
        assert status[name] == "failed", name
    assert "replaced torch.autocast" in errors["autocastpatch"]
    assert "replaced torch.amp.autocast_mode.autocast" in errors["autocastpatch"]
    assert "replaced torch.Tensor.backward" in errors["backwardpatch"]
    assert "replaced torch.autograd.backward" in errors["backwardpatch"]
    assert "replaced safetensors.torch.save_file" in errors["safetensorsspy"]
    assert "replaced sys.stdout" in errors["streams"]
    assert "replaced the SIGTERM handler" in errors["streams"]
    # the thief loads first (entry-point order) and imports the tracker plugin itself
    assert "replaced kwplug_atracker.MineTracker.log" in errors["btrackerthief"]
