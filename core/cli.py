"""The ``kwplug`` command line: ``kwplug plugins``, ``kwplug env`` and ``kwplug launch``
(:mod:`kwplug._cli.launch`)."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from kwplug._cli import child as _cli_child
from kwplug._cli.env_report import env_report, format_report
from kwplug._cli.launch import add_launch_parser
from kwplug._plugins import LoadControls, PluginRecord, clash_lines, discover, strict_error
from kwplug.errors import PluginLoadError

COLUMNS = ("name", "class", "distribution", "version", "hooks", "status", "source")


def plugin_rows(records: Sequence[PluginRecord]) -> list[dict[str, Any]]:
    """One row per discovered plugin, with the columns of ``kwplug plugins``."""
    rows = []
    for r in records:
        obj = r.obj
        target = (
            f"{obj.__module__}.{obj.__qualname__}"
            if isinstance(obj, type)
            else getattr(obj, "__name__", r.value)
        )
        rows.append(
            {
                "name": r.name,
                "class": target if r.loaded else r.value.replace(":", "."),
                "distribution": r.distribution,
                "version": r.version,
                "hooks": list(r.hooks),
                # The table keeps the status one word; why it failed is in --json ("error")
                # and on stderr, so a long traceback line never hides the other columns.
                "status": r.status,
                "source": r.source,
                "error": r.error,
                # --json only (the table keeps its columns): whether an Accelerator registers
                # the plugin without being asked, and the devices it declares.
                "default": _registered_by_default(r),
                "device_types": _declared_devices(r),
            }
        )
    return rows


def _records() -> tuple[PluginRecord, ...]:
    # discover(), with the plugins whose import ended an earlier run of the command (blocked
    # in this one, see kwplug._cli.child) listed as failed.
    ended = _cli_child.ended_plugins()
    return tuple(
        attrs.evolve(r, status="failed", error=ended[r.name]) if r.name in ended else r
        for r in discover(strict=False)
    )


def _registered_by_default(record: PluginRecord) -> bool | None:
    # None: not loaded, so not known. Plugin objects other than handler classes always are.
    if not record.loaded:
        return None
    cls = record.handler_class
    return True if cls is None else bool(cls.register_default)


def _declared_devices(record: PluginRecord) -> list[str] | None:
    declared = getattr(record.obj, "device_types", None) if record.loaded else None
    return None if declared is None else sorted(declared)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    """A plain-text table, one line per row, columns padded to their widest cell."""

    def cell(value: Any) -> str:
        return ", ".join(value) if isinstance(value, list) else str(value)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(line.rstrip() for line in lines)


def environment() -> dict[str, Any]:
    """Versions, devices and distributed backends: what a bug report needs."""
    import attrs
    import importlib_metadata
    import pluggy
    import torch
    import torch.distributed as dist

    def version(name: str) -> str:
        try:
            return importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            return "not installed"

    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    backends = {}
    if dist.is_available():
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            check = getattr(dist, f"is_{name}_available", None)
            backends[name] = bool(check()) if check is not None else False
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kwplug": version("kwplug"),
        "torch": torch.__version__,
        "pluggy": pluggy.__version__,
        "attrs": attrs.__version__,
        "importlib_metadata": version("importlib-metadata"),
        "accelerator": current.type if current is not None else None,
        "device_count": accelerator.device_count() if accelerator and current else 0,
        "cuda_available": torch.cuda.is_available(),
        "distributed_available": dist.is_available(),
        "distributed_backends": backends,
    }


def _describe_answer(result: Any) -> Any:
    """What a hook's answer would hand to torch, as plain data."""
    from kwplug.precision import LossScaler  # imports torch: only when explaining

    if isinstance(result, functools.partial):
        target = getattr(result.func, "__qualname__", repr(result.func))
        module = getattr(result.func, "__module__", "")
        return {
            "call": f"{module}.{target}".lstrip("."),
            "args": [repr(a) for a in result.args],
            "kwargs": {k: repr(v) for k, v in result.keywords.items()},
        }
    if isinstance(result, LossScaler):  # a make_scaler answer: its state is what it holds
        return {
            "call": f"{type(result).__module__}.{type(result).__qualname__}",
            **{k: repr(v) for k, v in result.state_dict().items()},
        }
    return repr(result)


def explain(device_type: str, mixed_precision: str) -> dict[str, Any]:
    """For each setup hook (:attr:`kwplug.hookspecs.HookInfo.setup`): the plugins implementing
    it in call order, and for the side-effect-free hooks (:attr:`~kwplug.hookspecs.HookInfo.pure`:
    ``autocast``, ``make_scaler``) who answers and what would reach torch. The hooks that act
    (``init_process_group``, ``wrap_model``, ``make_profiler``) are not called; the answering
    handler's resolved fields are shown instead. A hook that two third-party defaults claim for
    ``device_type`` (an Accelerator would raise :class:`~kwplug.errors.PluginConflictError`)
    has a ``conflict`` entry naming them."""
    from kwplug._plugins import KwplugPluginManager
    from kwplug.hookspecs import HOOKS

    pm = KwplugPluginManager.for_handlers([], discover(strict=False))
    conflicts = pm.conflicts(device_type)
    report: dict[str, Any] = {}
    for hook_name, info in HOOKS.items():
        if not info.setup:
            continue
        impls = list(reversed(pm.hook_impls(hook_name)))
        entry: dict[str, Any] = {"order": [pm.describe(i.plugin_name) for i in impls]}
        if hook_name in conflicts:
            entry["conflict"] = conflicts[hook_name]
        elif info.pure:
            # The pure hooks all take (device_type, mixed_precision); HOOKS names them.
            getattr(pm.first, hook_name)(device_type=device_type, mixed_precision=mixed_precision)
            answer = pm.plan[hook_name]
            entry["answered_by"] = pm.describe(answer.plugin) if answer.plugin else None
            entry["reaches_torch"] = _describe_answer(answer.result)
        elif impls:
            plugin = impls[0].plugin
            entry["first"] = entry["order"][0]
            to_dict = getattr(plugin, "to_dict", None)
            if callable(to_dict):
                entry["fields"] = {k: repr(v) for k, v in to_dict().items()}
            resolve = getattr(plugin, "resolved_backend", None)
            if callable(resolve):  # the backend the default "nccl" becomes on this device
                entry["fields"]["backend"] = repr(resolve(device_type))
        report[hook_name] = entry
    return report


TRACKER_COLUMNS = ("tracker", "plugin", "status", "install")


def tracker_rows() -> list[dict[str, Any]]:
    """One row per tracker the loaded plugins contribute (their ``trackers`` hook), sorted by
    name: the plugin giving it, and ``status`` ``"available"`` or ``"missing"`` (its
    ``is_available()`` is false; ``install`` then says what to ``pip install``). A plugin
    whose ``trackers`` hook raises is listed once with status ``"failed"``."""
    from kwplug._plugins import KwplugPluginManager
    from kwplug.errors import PluginHookError

    pm = KwplugPluginManager.for_handlers([], discover(strict=False))
    rows: list[dict[str, Any]] = []
    for impl in pm.hook_impls("trackers"):
        plugin = pm.describe(impl.plugin_name)
        try:
            answers = pm.each_of(impl.plugin_name).trackers()
        except PluginHookError as exc:
            rows.append({"tracker": "-", "plugin": plugin, "status": "failed", "install": ""})
            rows[-1]["error"] = str(exc)
            continue
        for _, answer in answers:
            for name, factory in dict(answer or {}).items():
                available = bool(getattr(factory, "is_available", lambda: True)())
                install = "" if available else getattr(factory, "requirement", None) or ""
                rows.append(
                    {
                        "tracker": str(name),
                        "plugin": plugin,
                        "status": "available" if available else "missing",
                        "install": f"pip install '{install}'" if install else "",
                    }
                )
    return sorted(rows, key=lambda row: (row["tracker"], row["plugin"]))


def _cmd_plugins(args: argparse.Namespace) -> int:
    if args.trackers:
        tracker_table = tracker_rows()
        if args.json:
            print(json.dumps(tracker_table, indent=2))
        else:
            print(format_table(tracker_table, TRACKER_COLUMNS))
        return 0
    if args.explain:
        report = explain(args.device, args.mixed_precision)
        if args.json:
            print(json.dumps(report, indent=2))
            return 0
        print(f"device_type={args.device}  mixed_precision={args.mixed_precision}")
        for hook_name, entry in report.items():
            print(f"\n{hook_name}")
            for position, name in enumerate(entry["order"], 1):
                print(f"  {position}. {name}")
            for key in ("conflict", "answered_by", "reaches_torch", "fields"):
                if key in entry:
                    print(f"  {key}: {json.dumps(entry[key])}")
        return 0
    records = _records()
    rows = plugin_rows(records)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if not args.json:  # the JSON rows hold every name and distribution already
        for line in clash_lines(records):
            print(line)
    return _report_failures(records)


def _report_failures(records: Sequence[PluginRecord]) -> int:
    # Under KWPLUG_STRICT_PLUGINS the listing still prints (it is how one finds the culprit);
    # the failures go to stderr and the exit status says the run would have stopped.
    if not LoadControls.from_env().strict:
        return 0
    error = strict_error(tuple(records))
    if error is None:
        return 0
    print(f"kwplug: {error}", file=sys.stderr)
    return 1


def _cmd_env(args: argparse.Namespace) -> int:
    rows = plugin_rows(_records())
    if args.json:
        print(json.dumps({**environment(), "plugins": rows}, indent=2))
        return 0
    # accelerate env's text, then the plugins (what a kwplug bug report needs besides).
    print(format_report(env_report(args.config_file)))
    print()
    print(format_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kwplug`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="kwplug", description="Inspect kwplug's handler plugins and environment."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser(
        "plugins",
        help="list discovered handler plugins",
        description="List every kwplug.handlers entry point with its status. The NAME and "
        "DISTRIBUTION shown are what KWPLUG_PLUGINS and KWPLUG_BLOCK_PLUGINS accept.",
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument(
        "--explain",
        action="store_true",
        help="show, for each hook, the plugins in call order and what would reach torch",
    )
    plugins.add_argument(
        "--trackers",
        action="store_true",
        help="list the trackers (log_with names) the plugins contribute, and whether each "
        "one's package is installed",
    )
    plugins.add_argument(
        "--mixed-precision",
        choices=("no", "fp16", "bf16"),
        default="no",
        help="the Accelerator setting to explain (default: no)",
    )
    plugins.add_argument(
        "--device", default="cpu", help="device type to explain, e.g. cpu, cuda (default: cpu)"
    )
    plugins.set_defaults(func=_cmd_plugins)
    env = sub.add_parser("env", help="versions, devices, backends and plugins, for bug reports")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument(
        "--config_file",
        "--config-file",
        default=None,
        help="the launch config file to show (default: Accelerate's default one)",
    )
    env.set_defaults(func=_cmd_env)
    add_launch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kwplug`` console script; returns the exit status.

    Without ``argv`` (the console script, ``python -m kwplug``) ``kwplug plugins`` and
    ``kwplug env`` run in a child process (:mod:`kwplug._cli.child`), so that a plugin whose
    import calls ``os._exit`` is listed ``failed`` by name and distribution, and a plugin's
    non-daemon thread cannot keep the command from exiting; ``kwplug launch`` runs torch's
    ``torch.distributed.run`` in this process (it imports no plugin, and torchrun's signal
    handling stays direct). With ``argv`` every command runs in this process.
    """
    if argv is None:
        if _cli_child.in_child():
            return _cli_child.child(sys.argv[1:], main)
        if sys.argv[1:2] != ["launch"]:
            return _cli_child.run(sys.argv[1:])
        argv = sys.argv[1:]
    parser = build_parser()
    # Unknown options are kwplug launch's to explain (accelerate launch's DeepSpeed, TPU...
    # flags are refused by name); every other command refuses them as argparse does.
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        result: int = args.func(args, unknown) if args.command == "launch" else args.func(args)
    except BrokenPipeError:  # `kwplug plugins | head`
        sys.stderr.close()
        return 0
    except PluginLoadError as exc:  # a loading control that cannot be read
        print(f"kwplug: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
