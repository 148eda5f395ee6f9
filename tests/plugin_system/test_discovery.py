"""Discovery order and records, independent of the order entry points are found in."""

from __future__ import annotations

import importlib_metadata
import pytest

from kwplug._plugins import _discovery as discovery


def test_builtins_are_discovered_with_their_hooks() -> None:
    # Built-ins only (the example plugins are installed too).
    records = {r.name: r for r in discovery.discover() if r.builtin}
    assert {n: r.hooks for n, r in records.items()} == {
        "aim": ("trackers",),
        "autocast": ("autocast",),
        "comet_ml": ("trackers",),
        "ddp": ("no_sync", "sync_in_backward", "validate_setup", "wrap_model"),
        "ddp_comm_hooks": ("comm_hooks",),
        "dynamo": ("compile_model",),
        "fsdp": ("device_mesh", "no_sync", "wrap_model"),
        "grad_scaler": ("make_scaler",),
        "init_process_group": ("init_process_group", "validate_setup"),
        "mlflow": ("trackers",),
        "parallelism": ("device_mesh", "validate_setup", "wrap_model"),
        "profile": ("make_profiler",),
        "trackers": ("trackers",),
        "wandb": ("trackers",),
    }
    assert all(
        r.status == "loaded" and r.source == "built-in" for r in records.values() if r.builtin
    )


def test_order_does_not_depend_on_entry_point_order(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(dist: str, name: str) -> importlib_metadata.EntryPoint:
        ep = importlib_metadata.EntryPoint(
            name, "kwplug.plugins.autocast:AutocastKwargs", discovery.GROUP
        )
        meta = (  # built-in means kwplug's own installed distribution, not just the name
            importlib_metadata.distribution("kwplug")
            if dist == "kwplug"
            else type("Dist", (), {"name": dist, "version": "1.0"})()
        )
        return ep._for(meta)  # type: ignore[attr-defined, no-any-return]

    eps = [
        fake("kwplug", "autocast"),
        fake("zeta-plugins", "a"),
        fake("alpha-plugins", "z"),
        fake("alpha-plugins", "b"),
        fake("kwplug", "ddp"),
    ]
    orders = []
    try:
        for arrangement in (eps, eps[::-1], eps[2:] + eps[:2]):
            monkeypatch.setattr(discovery, "_entry_points", lambda a=tuple(arrangement): a)
            discovery._discover.cache_clear()
            orders.append([(r.distribution, r.name) for r in discovery.discover()])
    finally:
        discovery._discover.cache_clear()  # forget the fake entry points
    assert (
        orders[0]
        == orders[1]
        == orders[2]
        == [
            ("alpha-plugins", "b"),
            ("alpha-plugins", "z"),
            ("zeta-plugins", "a"),
            ("kwplug", "autocast"),
            ("kwplug", "ddp"),
        ]
    )


def test_control_names_are_normalised_like_pip() -> None:
    from kwplug._plugins._controls import LoadControls

    controls = LoadControls.from_env({"KWPLUG_BLOCK_PLUGINS": "KWPLUG_MyBackend, Other.Dist:ep"})
    assert controls.status("anything", "kwplug-mybackend", builtin=False) == "blocked"
    assert controls.status("ep", "other-dist", builtin=False) == "blocked"
    assert controls.status("ep", "third", builtin=False) is None
