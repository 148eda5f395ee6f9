"""Issue 18 item 4: a broken third-party plugin cannot remove mixed precision.

Three plugins are pip-installed for real: one replaces ``sys.modules["kwplug"]`` and
``sys.modules["kwplug.plugins"]`` at import, one monkeypatches the built-ins (a method of
``AutocastKwargs``, the module binding of ``GradScalerKwargs``), one patches modules it imports
itself (``kwplug.utils.random.set_seed``, ``Accelerator.backward``). The built-ins still load,
``Accelerator(mixed_precision="fp16")`` trains in float16 with a gradient scaler, each broken
plugin is named with what it changed, and a feature whose provider is blocked is an error.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from plugin_site import install_module_plugins, run_json
from python import python

BROKEN = {
    "clobber": textwrap.dedent("""
        import sys, types
        import kwplug
        sys.modules["kwplug"] = types.ModuleType("kwplug")
        sys.modules["kwplug.plugins"] = types.ModuleType("kwplug.plugins")
    """),
    "monkey": textwrap.dedent("""
        import kwplug.plugins.autocast as autocast
        import kwplug.plugins.grad_scaler as grad_scaler
        autocast.AutocastKwargs.autocast = lambda self, device_type, mixed_precision: None
        grad_scaler.GradScalerKwargs = None
    """),
    # Modules that nothing of kwplug had imported when plugins load (kwplug.utils.random; and
    # kwplug.accelerator in the command line): the plugin imports them itself and patches them.
    "lazy": textwrap.dedent("""
        import kwplug.utils.random as random_utils
        import kwplug.accelerator as accelerator_module
        random_utils.set_seed = lambda seed, *args, **kwargs: None
        accelerator_module.Accelerator.backward = lambda self, loss, **kwargs: None
    """),
    # The one core module discovery does not import beforehand (its torch import costs ~0.8 s):
    # the sharded checkpoint storage, patched by the plugin that imports it.
    "storage": textwrap.dedent("""
        import kwplug.checkpoint._dcp_storage as storage
        storage.ShardWriter.write_data = lambda self, plan, planner: None
        storage.ShardReader = None
    """),
}

TRAIN = textwrap.dedent("""
    import json, sys, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import kwplug
        accelerator = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    dtypes = []
    for _ in range(3):
        with accelerator.autocast():
            x = torch.randn(8, 4)
            # The layer's own computation: prepare() converts the model's outputs to float32.
            dtypes.append(str(torch.nn.functional.linear(x, model.weight, model.bias).dtype))
            out = model(x)
            loss = out.float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    scaler = accelerator.scaler
    records = {r.name: r for r in kwplug.discover()}
    print(json.dumps({
        "dtypes": dtypes,
        "scaler": type(scaler).__name__,
        "scaler_enabled": bool(scaler is not None and scaler.is_enabled()),
        "scale": None if scaler is None else float(scaler.get_scale()),
        "trained": not torch.equal(before, accelerator.unwrap_model(model).weight.detach()),
        "kwplug_intact": sys.modules["kwplug"] is kwplug and hasattr(kwplug, "Accelerator"),
        "status": {n: r.status for n, r in records.items()},
        "errors": {n: r.error for n, r in records.items() if r.error},
        "warnings": [str(w.message) for w in caught],
    }))
""")

REFUSE = textwrap.dedent("""
    import json, sys
    import kwplug
    from kwplug.errors import MissingFeatureError
    try:
        kwplug.Accelerator(mixed_precision=sys.argv[1], cpu=True)
        print(json.dumps({"raised": None}))
    except MissingFeatureError as exc:
        print(json.dumps({
            "raised": type(exc).__name__, "message": str(exc), "feature": exc.feature,
            "hook": exc.hook, "providers": exc.providers,
        }))
""")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_module_plugins(BROKEN, tmp_path_factory.mktemp("broken"))


def test_broken_plugins_leave_fp16_training_with_a_scaler(site: Path) -> None:
    result = run_json(TRAIN, site)
    assert result["dtypes"] == ["torch.float16"] * 3
    assert result["scaler"] == "GradScaler" and result["scaler_enabled"]
    # the scaler is in use (it may have backed off from its 2**16 start on an overflow)
    assert 0 < result["scale"] <= 65536.0 and result["trained"]
    assert result["kwplug_intact"]
    status = result["status"]
    assert status["autocast"] == status["grad_scaler"] == status["ddp"] == "loaded"
    assert status["clobber"] == status["monkey"] == "failed"
    errors = result["errors"]
    assert "replaced sys.modules['kwplug']" in errors["clobber"]
    assert "replaced sys.modules['kwplug.plugins']" in errors["clobber"]
    assert "replaced kwplug.plugins.autocast.AutocastKwargs.autocast" in errors["monkey"]
    assert "replaced kwplug.plugins.grad_scaler.GradScalerKwargs" in errors["monkey"]
    named = [w for w in result["warnings"] if "'clobber' (kwplug-clobber 0.0.1)" in w]
    assert len(named) == 1 and "changed kwplug" in named[0]
    assert any("'monkey' (kwplug-monkey 0.0.1)" in w for w in result["warnings"])


@pytest.mark.parametrize(
    ("blocked", "precision", "hook", "builtin"),
    [
        ("autocast", "bf16", "autocast", "autocast"),
        ("grad_scaler", "fp16", "make_scaler", "grad_scaler"),
    ],
)
def test_a_blocked_provider_is_an_error_not_float32(
    site: Path, blocked: str, precision: str, hook: str, builtin: str
) -> None:
    code = REFUSE.replace("sys.argv[1]", repr(precision))
    result = run_json(code, site, KWPLUG_BLOCK_PLUGINS=blocked)
    assert result["raised"] == "MissingFeatureError"
    assert result["feature"].startswith(f"mixed_precision={precision!r}")
    assert result["hook"] == hook
    message = result["message"]
    assert f"built-in plugin '{builtin}' (kwplug " in message
    assert "is blocked by KWPLUG_BLOCK_PLUGINS" in message
    # the broken third-party plugins are listed too, with why they did not load
    assert "third-party plugin 'clobber' (kwplug-clobber 0.0.1) failed to load" in message


def test_a_plugin_cannot_patch_a_module_it_imports_itself(site: Path) -> None:
    code = textwrap.dedent("""
        import json
        import kwplug
        kwplug.Accelerator(cpu=True)
        from kwplug.utils import set_seed
        import kwplug.utils.random as random_utils
        records = {r.name: r for r in kwplug.discover()}
        print(json.dumps({
            "set_seed": f"{set_seed.__module__}.{set_seed.__qualname__}",
            "backward": "backward" in vars(kwplug.Accelerator),
            "status": records["lazy"].status, "error": records["lazy"].error,
        }))
    """)
    result = run_json(code, site)
    # the plugin imported kwplug.utils.random after nothing had: it was taken as found before
    assert result["set_seed"] == "kwplug.utils.random.set_seed"
    assert not result["backward"]
    assert result["status"] == "failed"
    assert "replaced kwplug.utils.random.set_seed" in result["error"]
    assert "added kwplug.accelerator.Accelerator.backward" in result["error"]


def test_a_plugin_patching_the_sharded_storage_is_named_and_undone(site: Path) -> None:
    code = textwrap.dedent("""
        import json, sys
        import kwplug
        kwplug.Accelerator(cpu=True)
        records = {r.name: r for r in kwplug.discover()}
        loaded_then = "torch.distributed.checkpoint" in sys.modules
        from kwplug.checkpoint._dcp_storage import ShardReader, ShardWriter
        print(json.dumps({
            "write_data": ShardWriter.write_data.__qualname__,
            "reader": getattr(ShardReader, "__name__", None),
            "loaded_then": loaded_then, "status": records["storage"].status,
            "error": records["storage"].error,
        }))
    """)
    result = run_json(code, site)
    # the plugin's import brought torch.distributed.checkpoint in: discovery did not need to
    assert result["loaded_then"]
    assert result["write_data"] == "ShardWriter.write_data"
    assert result["reader"] == "ShardReader"
    assert result["status"] == "failed"
    assert "replaced kwplug.checkpoint._dcp_storage.ShardReader" in result["error"]
    assert "replaced kwplug.checkpoint._dcp_storage.ShardWriter.write_data" in result["error"]


def test_plugins_do_not_make_every_process_import_the_sharded_storage(tmp_path: Path) -> None:
    # A third-party plugin makes discovery import the core first (the guard's snapshot); the
    # sharded checkpoint storage (torch.distributed.checkpoint, ~0.8 s) is not part of it.
    site = install_module_plugins({"quiet": "import kwplug\n"}, tmp_path)
    code = textwrap.dedent("""
        import json, sys
        import kwplug
        kwplug.Accelerator(cpu=True)
        records = {r.name: r for r in kwplug.discover()}
        print(json.dumps({
            "status": records["quiet"].status,
            "utils_random": "kwplug.utils.random" in sys.modules,
            "dcp": sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")),
        }))
    """)
    result = run_json(code, site)
    assert result["status"] == "loaded"
    assert result["utils_random"]  # the rest of the core was imported for the snapshot
    assert result["dcp"] == []


def test_the_command_line_reports_what_a_script_sees(site: Path) -> None:
    # `kwplug plugins` discovers before anything imports kwplug.accelerator: it said "loaded".
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    out = python("-m", "kwplug", "plugins", "--json", env=env, timeout=120, check=True)
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["lazy"]["status"] == "failed"
    assert "added kwplug.accelerator.Accelerator.backward" in rows["lazy"]["error"]
    assert rows["monkey"]["status"] == rows["clobber"]["status"] == "failed"
