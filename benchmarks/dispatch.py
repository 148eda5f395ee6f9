"""Plugin dispatch: pluggy hook calls per training step (must be 0) and µs per setup-time call.

1. A kwplug training loop (tiny model; fp32, bf16 and fp16 with its gradient scaler) runs with
   ``accelerator.plugin_manager.add_hookcall_monitoring`` counting every pluggy hook call, a
   counter on kwplug's own dispatcher (which calls implementations itself, unseen by pluggy's
   monitoring) and a counter on every registered implementation: the calls during
   ``prepare()`` and per training step are reported (per step must be 0 for all three).
2. The number of Python function calls per step that execute framework code (kwplug's or
   Accelerate's own source files, counted with ``sys.setprofile``); raw PyTorch makes none.
3. µs per setup-time hook call through pluggy (``plugin_manager.hook.<name>(...)``, all
   registered plugins consulted) against calling the answering handler's method directly
   (the raw column). Accelerate has no hooks (``n/a``).

Run: ``python -m benchmarks.dispatch [--quick] [--json PATH]``.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import pluggy
import torch

from benchmarks._common import Result, Row, Target, block, interleave, median, run_main, timing_row
from benchmarks.step_overhead import (
    framework_loop,
    make_batches,
    make_model,
    make_optimizer,
)

DESCRIPTION = "Pluggy hook calls per training step and µs per setup-time hook call."


class HookCallCounter:
    """Counts every way a hook of one kwplug Accelerator can run, while active.

    - ``pluggy``: calls through pluggy's ``HookCaller`` (``add_hookcall_monitoring``);
    - ``kwplug``: calls through a provenance-tracking dispatcher of the core that walks the
      implementations itself, out of pluggy's monitoring's sight (``call_first`` in
      ``kwplug.accelerator``), when the core has one (today's goes through pluggy: counted
      as ``pluggy``);
    - ``impl``: invocations of any registered hook implementation function, however reached.
    """

    SOURCES = ("pluggy", "kwplug", "impl")

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.calls: list[tuple[str, str]] = []
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> HookCallCounter:
        import kwplug.accelerator._setup as core

        pm = self.accelerator.plugin_manager
        calls = self.calls

        def before(hook_name: str, hook_impls: Sequence[Any], kwargs: dict[str, Any]) -> None:
            calls.append(("pluggy", hook_name))

        def after(outcome: Any, hook_name: str, hook_impls: Sequence[Any], kwargs: Any) -> None:
            pass

        self._undo.append(pm.add_hookcall_monitoring(before, after))
        dispatcher = getattr(core, "call_first", None)
        if dispatcher is not None:

            def counting_dispatch(pm: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
                calls.append(("kwplug", hook_name))
                return dispatcher(pm, hook_name, *args, **kwargs)

            attr = "call_first"
            setattr(core, attr, counting_dispatch)
            self._undo.append(lambda: setattr(core, attr, dispatcher))
        for name in dir(pm.hook):
            caller = getattr(pm.hook, name)
            if not isinstance(caller, pluggy.HookCaller):
                continue
            for impl in caller.get_hookimpls():
                self._wrap(impl, name)
        return self

    def _wrap(self, impl: Any, hook_name: str) -> None:
        original = impl.function
        calls = self.calls

        def counting_impl(*args: Any, **kwargs: Any) -> Any:
            calls.append(("impl", hook_name))
            return original(*args, **kwargs)

        impl.function = counting_impl
        self._undo.append(lambda: setattr(impl, "function", original))

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def take(self) -> dict[str, list[str]]:
        """The hooks called since the last ``take()``, by source; then forget them."""
        taken = {source: [h for s, h in self.calls if s == source] for source in self.SOURCES}
        self.calls.clear()
        return taken


def count_hook_calls(precision: str, steps: int) -> dict[str, Any]:
    """Hook calls of a kwplug Accelerator during ``prepare`` and during ``steps`` steps."""
    import kwplug

    mixed = "no" if precision == "fp32" else precision
    accelerator = kwplug.Accelerator(mixed_precision=mixed, cpu=True)
    with HookCallCounter(accelerator) as counter:
        model = make_model("tiny")
        model, opt = accelerator.prepare(model, make_optimizer(model))
        at_prepare = counter.take()
        batches, loss_fn = make_batches("tiny")
        data = (batches * (steps // len(batches) + 1))[:steps]
        framework_loop(accelerator, model, opt, data, loss_fn)
        in_loop = counter.take()
    per_step = {source: len(hooks) / steps for source, hooks in in_loop.items()}
    return {
        "precision": precision,
        "steps": steps,
        "calls_at_prepare": at_prepare,
        "calls_in_loop": in_loop,
        "per_step": per_step,
        "calls_per_step": max(per_step.values()),
    }


def framework_calls_per_step(impl: str, precision: str, steps: int) -> float:
    """Python calls into the framework's own files per training step (``sys.setprofile``)."""
    mixed = "no" if precision == "fp32" else precision
    model = make_model("tiny")
    opt = make_optimizer(model)
    batches, loss_fn = make_batches("tiny")
    data = (batches * (steps // len(batches) + 1))[:steps]
    if impl == "raw":
        return 0.0
    if impl == "kwplug":
        import kwplug
        import kwplug.plugins

        accelerator: Any = kwplug.Accelerator(mixed_precision=mixed, cpu=True)
        roots: tuple[str, ...] = (
            os.path.dirname(kwplug.__file__) + os.sep,
            os.path.dirname(kwplug.plugins.__file__) + os.sep,
        )
    else:
        import accelerate
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = accelerate.Accelerator(mixed_precision=mixed, cpu=True)
        torch.set_num_threads(1)
        roots = (os.path.dirname(accelerate.__file__) + os.sep,)
    model, opt = accelerator.prepare(model, opt)
    framework_loop(accelerator, model, opt, data[:2], loss_fn)  # warm up
    count = 0

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            count += 1

    sys.setprofile(profiler)
    try:
        framework_loop(accelerator, model, opt, data, loss_fn)
    finally:
        sys.setprofile(None)
    return count / steps


def hook_call_blocks(hook_name: str, n: int) -> tuple[dict[str, Callable[[], float]], str]:
    """Blocks timing ``n`` calls of a setup-time hook through pluggy and directly."""
    import kwplug
    from kwplug import AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs

    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True)
    caller = getattr(accelerator.plugin_manager.hook, hook_name)
    device = torch.device("cpu")
    model = make_model("tiny")
    # The hook's keyword arguments, and the subset the answering method takes.
    kwargs: dict[str, Any] = {"device_type": "cpu", "mixed_precision": "bf16"}
    direct_kwargs = dict(kwargs)
    direct: Callable[..., Any]
    if hook_name == "autocast":
        direct = AutocastKwargs().autocast
    elif hook_name == "make_scaler":
        direct = GradScalerKwargs().make_scaler
    else:
        direct = DistributedDataParallelKwargs().wrap_model
        direct_kwargs = {
            "model": model,
            "device": device,
            "world_size": 1,
            "comm_hooks": accelerator.comm_hooks,
        }
        kwargs.update(direct_kwargs)
        # The hook's full signature: a mesh, when a kwplug with device meshes defines one.
        from kwplug.hookspecs import HandlerSpec

        if "device_mesh" in inspect.signature(HandlerSpec.wrap_model).parameters:
            kwargs["device_mesh"] = None

    def via_pluggy(k: int) -> None:
        for _ in range(k):
            caller(**kwargs)

    def via_direct(k: int) -> None:
        for _ in range(k):
            direct(**direct_kwargs)

    # What the Accelerator itself calls at setup: kwplug's provenance-tracking relay when the
    # core has one (it runs through pluggy's _hookexec), else pluggy's HookCaller.
    pm = accelerator.plugin_manager
    relay = getattr(pm, "first", None)  # the typed relay: pm.first.<hook>(...)
    dispatcher = getattr(relay, hook_name, None) or getattr(pm, "call_first", None)
    if dispatcher is not None:
        name_first = relay is None  # an older kwplug: call_first(hook_name, ...)

        def via_kwplug(k: int) -> None:
            if name_first:
                for _ in range(k):
                    dispatcher(hook_name, **kwargs)
            else:
                for _ in range(k):
                    dispatcher(**kwargs)

        how = "KwplugPluginManager.call_first" if name_first else f"plugins.first.{hook_name}"
    else:
        via_kwplug = via_pluggy
        how = "pluggy HookCaller"
    impls = len(caller.get_hookimpls())
    blocks = {
        "raw": block(via_direct, n),
        "kwplug": block(via_kwplug, n),
        "pluggy": block(via_pluggy, n),
    }
    return blocks, (
        f"{impls} implementation(s) registered; kwplug = {how}, raw = the answering method "
        "called directly"
    )


def run(quick: bool, with_accelerate: bool) -> Result:
    """Count hook calls and framework calls per step; time setup-time hook calls."""
    steps = 20 if quick else 200
    result = Result("dispatch", quick)
    monitored = [count_hook_calls(p, steps) for p in ("fp32", "bf16", "fp16")]
    per_step = max(m["calls_per_step"] for m in monitored)
    result.rows.append(
        Row(
            case="hook calls per training step",
            unit="calls",
            raw=0,
            kwplug=per_step,
            accelerate="n/a" if with_accelerate else None,
            note=(
                "pluggy HookCaller calls, kwplug dispatcher calls and hook implementation "
                "invocations (max over the three and over fp32/bf16/fp16); at prepare(): "
                + ", ".join(
                    f"{source} {hooks}"
                    for source, hooks in monitored[0]["calls_at_prepare"].items()
                )
                + "; Accelerate has no plugin hooks"
            ),
        )
    )
    frame_counts: dict[str, dict[str, float]] = {}
    for precision in ("fp32", "bf16"):
        counts = {
            impl: framework_calls_per_step(impl, precision, steps)
            for impl in ["raw", "kwplug"] + (["accelerate"] if with_accelerate else [])
        }
        frame_counts[precision] = counts
        result.rows.append(
            Row(
                case=f"framework Python calls per step, {precision}",
                unit="calls",
                raw=counts["raw"],
                kwplug=counts["kwplug"],
                accelerate=counts.get("accelerate"),
                note="calls executing the framework's own source files (sys.setprofile)",
            )
        )
    reps = 3 if quick else 31
    n = 200 if quick else 1000
    samples = {}
    for hook_name in ("autocast", "make_scaler", "wrap_model"):
        blocks, note = hook_call_blocks(hook_name, n)
        s = interleave(blocks, reps=reps, warmup=1)
        samples[hook_name] = s
        pluggy_us = median(s.pop("pluggy")) * 1e6
        note += f"; through pluggy's HookCaller: {pluggy_us:.2f} µs"
        row = timing_row(f"setup-time hook call: {hook_name}", s, note=note)
        if with_accelerate:
            row.accelerate = "n/a"
        result.rows.append(row)
    result.checks = {
        "pluggy_calls_per_step": per_step,
        "pluggy_calls_per_step_is_zero": per_step == 0,
        "monitored": monitored,
    }
    result.info = {
        "framework_calls_per_step": frame_counts,
        "reps": reps,
        "hook_calls_per_block": n,
        "samples_s_per_call": samples,
    }
    result.targets = [Target("hook calls per training step", per_step, "<=", 0, "calls")]
    return result


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.dispatch``; fails if any pluggy hook runs per training step."""
    result = run_main("dispatch", DESCRIPTION, run, argv)
    assert result.checks["pluggy_calls_per_step_is_zero"], result.checks["monitored"]
    return result


if __name__ == "__main__":
    main()
