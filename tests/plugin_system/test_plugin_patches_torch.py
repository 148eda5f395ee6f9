"""A plugin whose import patches what training relies on outside kwplug is undone and named
(issue 30, item 1): ``torch.autocast`` replaced made fp16 train in fp32, ``Tensor.backward``
replaced left every ``.grad`` ``None``, a wrapped ``safetensors.torch.save_file`` saw every
checkpoint tensor, and one plugin could patch another's tracker -- each listed ``loaded``.
Also the process's streams and signal handlers (item 4), and ``torch.nn.Module``'s methods and
``DataLoader.__iter__`` (a patched ``state_dict`` saw every tensor a checkpoint saved). Each
plugin is pip-installed for real and the training runs in a fresh process."""

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
    # Sees every tensor save_state and save_model read (and could change them), and every
    # batch a prepared loader hands out.
    "modulespy": """
        import torch, torch.utils.data
        SEEN, BATCHES = [], []
        real_state_dict = torch.nn.Module.state_dict
        def state_dict(self, *args, **kwargs):
            state = real_state_dict(self, *args, **kwargs)
            SEEN.extend(state)
            return state
        torch.nn.Module.state_dict = state_dict
        real_iter = torch.utils.data.DataLoader.__iter__
        def spy_iter(self):
            for batch in real_iter(self):
                BATCHES.append(batch)
                yield batch
        torch.utils.data.DataLoader.__iter__ = spy_iter
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
    import json, signal, sys, tempfile, warnings
    import torch
    import kwplug
    import safetensors.torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = kwplug.Accelerator(mixed_precision="fp16", cpu=True, log_with="mine")
    warned = {
        w.message.plugin: str(w.message)
        for w in caught
        if isinstance(w.message, kwplug.errors.PluginLoadWarning)
    }
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
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    batches = sum(1 for _ in loader)
    accelerator.log({"loss": 1.0})
    with tempfile.TemporaryDirectory() as folder:
        accelerator.save_state(folder)
    spy = sys.modules.get("kwplug_safetensorsspy")
    module_spy = sys.modules.get("kwplug_modulespy")
    records = {r.name: r for r in kwplug.discover()}
    print(json.dumps({
        "dtype": str(inner.dtype),
        "grad": grad is not None and bool(grad.abs().sum() > 0),
        "spied": len(spy.SEEN) if spy else None,
        "logged": sys.modules["kwplug_atracker"].LOGGED,
        "save_file": safetensors.torch.save_file.__module__,
        "module_spied": [len(module_spy.SEEN), len(module_spy.BATCHES)] if module_spy else None,
        "batches": batches,
        "state_dict": torch.nn.Module.state_dict.__module__,
        "loader_iter": torch.utils.data.DataLoader.__iter__.__module__,
        "warned": warned,
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
    assert result["module_spied"] == [0, 0] and result["batches"] == 2  # torch's own again
    assert result["state_dict"] == "torch.nn.modules.module"
    assert result["loader_iter"] == "torch.utils.data.dataloader"
    assert result["logged"] == [{"loss": 1.0}]  # the thief's patch was undone
    assert result["sigterm_default"]
    status, errors = result["status"], result["errors"]
    assert status["atracker"] == "loaded"
    names = ("autocastpatch", "backwardpatch", "safetensorsspy", "modulespy", "streams")
    for name in (*names, "btrackerthief"):
        assert status[name] == "failed", name
    assert "replaced torch.autocast" in errors["autocastpatch"]
    assert "replaced torch.amp.autocast_mode.autocast" in errors["autocastpatch"]
    assert "replaced torch.Tensor.backward" in errors["backwardpatch"]
    assert "replaced torch.autograd.backward" in errors["backwardpatch"]
    assert "replaced safetensors.torch.save_file" in errors["safetensorsspy"]
    assert "replaced torch.nn.Module.state_dict" in errors["modulespy"]
    assert "replaced torch.utils.data.DataLoader.__iter__" in errors["modulespy"]
    # the one PluginLoadWarning names the plugin, its distribution and what it replaced
    assert "'modulespy' (kwplug-modulespy 0.0.1)" in result["warned"]["modulespy"]
    assert "replaced torch.nn.Module.state_dict" in result["warned"]["modulespy"]
    assert "replaced sys.stdout" in errors["streams"]
    assert "replaced the SIGTERM handler" in errors["streams"]
    # the thief loads first (entry-point order) and imports the tracker plugin itself
    assert "replaced kwplug_atracker.MineTracker.log" in errors["btrackerthief"]
