"""What training relies on outside kwplug, watched around each third-party plugin's import.

:func:`~kwplug._plugins._guard.kwplug_kept` keeps kwplug itself; a plugin can as well change
training by replacing what kwplug calls in torch (``torch.autocast`` replaced trains fp16 in
fp32; ``torch.Tensor.backward`` replaced leaves every ``.grad`` ``None``), wrap
``safetensors.torch.save_file`` or ``torch.nn.Module.state_dict`` to see every checkpoint
tensor, silence or replace the process's streams, take over its signals, or patch a plugin
loaded before it. :class:`Outside` snapshots all of that before the import and, after it, puts
back and names what changed:

- :data:`WATCHED`: module -> names (``"Tensor.backward"``: an attribute of a class of that
  module, as found in the class's own ``__dict__``); a module not yet imported is skipped (a
  plugin that imports it first gets it as Python made it);
- ``sys.stdout``, ``sys.stderr``, ``sys.stdin``, ``sys.excepthook`` and the handler of every
  signal Python can read (``signal.getsignal``; the main thread only, as ``signal.signal``);
- the top-level bindings, and the attributes of the classes they define, of the modules of
  third-party plugins loaded earlier (:func:`watch_plugin`).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import ModuleType
from typing import Any

_MISSING: Any = object()

# fmt: off
_COLLECTIVES = (
    "init_process_group", "destroy_process_group", "new_group", "all_reduce", "all_gather",
    "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
    "reduce_scatter_tensor", "barrier", "monitored_barrier", "send", "recv",
)
# fmt: on

#: What kwplug's training path calls, by module. Each is looked up where kwplug and torch's
#: own code find it (``torch.autocast`` and the ``torch.amp.autocast_mode`` it comes from).
WATCHED: dict[str, tuple[str, ...]] = {
    "torch": ("autocast", "Tensor.backward", "compile"),
    "torch.amp": ("autocast", "GradScaler"),
    "torch.amp.autocast_mode": ("autocast", "autocast.__enter__", "autocast.__exit__"),
    "torch.amp.grad_scaler": ("GradScaler", "GradScaler.scale", "GradScaler.step"),
    "torch.autograd": ("backward", "grad"),
    # torch.nn.Module as kwplug uses it: ``isinstance(obj, torch.nn.Module)`` finds the models
    # prepare() wraps; every forward reaches kwplug's mixed-precision forward and DDP's through
    # Module.__call__ (_wrapped_call_impl) and _call_impl; save_model, save_state and the load
    # checks read state_dict; load_state writes through load_state_dict; prepare maps the
    # optimizer's parameters by named_parameters; DDP's comm-hook state, the checkpoint's
    # optimizer owners and the DDP-or-not decision iterate parameters. (Module.zero_grad is
    # not kwplug's: it zeroes through the optimizer's, watched below.)
    "torch.nn": (
        "Module",
        "Module.__call__",
        "Module._call_impl",
        "Module.state_dict",
        "Module.load_state_dict",
        "Module.named_parameters",
        "Module.parameters",
    ),
    # Each epoch of a prepared loader starts in DataLoader.__iter__ (super().__iter__() in
    # kwplug._data._loader); a DataLoader class replaced would build loaders prepare() does
    # not recognise (it checks against the class it imported).
    "torch.utils.data": ("DataLoader", "DataLoader.__iter__"),
    "torch.optim": ("Optimizer",),
    "torch.optim.optimizer": ("Optimizer", "Optimizer.step", "Optimizer.zero_grad"),
    "torch.nn.parallel": ("DistributedDataParallel",),
    "torch.nn.parallel.distributed": ("DistributedDataParallel",),
    "torch.distributed": (*_COLLECTIVES, "reduce", "reduce_scatter", "gather", "scatter"),
    "torch.distributed.distributed_c10d": _COLLECTIVES,
    "safetensors.torch": ("save_file", "load_file", "safe_open", "save", "load"),
    "safetensors": ("safe_open",),
}

_STREAMS = ("stdout", "stderr", "stdin", "excepthook")
# Dunder names of WATCHED compared all the same (another dunder is Python's own bookkeeping).
_WATCHED_DUNDERS = frozenset(
    last
    for paths in WATCHED.values()
    for last in (p.rpartition(".")[2] for p in paths)
    if last.startswith("__")
)
_plugin_modules: dict[str, ModuleType] = {}
# Top-level module names of every third-party entry point of this discovery.
_expected: frozenset[str] = frozenset()


def expect_plugins(modules: frozenset[str]) -> None:
    """The top-level modules of the third-party entry points about to load: one of them that
    another plugin's import brings in and patches is named, and dropped so that it is
    imported afresh, under its own watch, when its turn comes."""
    global _expected
    _expected = modules


def watch_plugin(obj: Any) -> None:
    """Watch the module ``obj`` (a loaded third-party plugin: a module, or a class or object
    of one) around every later plugin's import."""
    module = obj if isinstance(obj, ModuleType) else sys.modules.get(getattr(obj, "__module__", ""))
    name = getattr(module, "__name__", "")
    if isinstance(module, ModuleType) and name != "kwplug" and not name.startswith("kwplug."):
        _plugin_modules[module.__name__] = module


def _owner(module: ModuleType, path: str) -> tuple[Any, str] | None:
    # (object holding the last name, last name); None when a class on the way is missing.
    owner: Any = module
    *classes, last = path.split(".")
    for name in classes:
        owner = vars(owner).get(name, _MISSING) if isinstance(owner, ModuleType) else _MISSING
        if not isinstance(owner, type):
            return None
    return owner, last


def _read(owner: Any, name: str) -> Any:
    return (vars(owner) if isinstance(owner, ModuleType) else owner.__dict__).get(name, _MISSING)


def _put(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if isinstance(owner, ModuleType):
            vars(owner).pop(name, None)
        elif name in owner.__dict__:
            type.__delattr__(owner, name)
    elif isinstance(owner, ModuleType):
        vars(owner)[name] = value
    else:
        type.__setattr__(owner, name, value)


class Outside:
    """One snapshot of everything above; :meth:`restore` puts it back and names the changes."""

    def __init__(self, loading: str | None = None) -> None:
        self.loading = loading  # the top-level module of the plugin being imported
        self.before = frozenset(sys.modules)
        self.values: list[tuple[str, Any, str, Any]] = []  # (label, owner, name, value)
        for module_name, paths in WATCHED.items():
            module = sys.modules.get(module_name)
            if not isinstance(module, ModuleType):
                continue
            for path in paths:
                found = _owner(module, path)
                if found is not None:
                    owner, name = found
                    self.values.append((f"{module_name}.{path}", owner, name, _read(owner, name)))
        for module in list(_plugin_modules.values()):
            for name, value in list(vars(module).items()):
                self.values.append((f"{module.__name__}.{name}", module, name, value))
                if isinstance(value, type) and value.__module__ == module.__name__:
                    for attr, member in list(value.__dict__.items()):
                        label = f"{module.__name__}.{value.__qualname__}.{attr}"
                        self.values.append((label, value, attr, member))
        self.streams = {name: getattr(sys, name) for name in _STREAMS}
        self.signals: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in signal.valid_signals():
                try:
                    self.signals[signum] = signal.getsignal(signum)
                except (OSError, ValueError):
                    continue

    def restore(self) -> list[str]:
        """Put back what changed since the snapshot; one line per change."""
        changes = []
        for label, owner, name, value in self.values:
            if name.startswith("__") and name not in _WATCHED_DUNDERS:
                continue  # Python's own bookkeeping (__warningregistry__, __slotnames__...)
            if _read(owner, name) is not value:
                what = "added" if value is _MISSING else "replaced"
                changes.append(f"{what} {label}")
                _put(owner, name, value)
        for name, stream in self.streams.items():
            if getattr(sys, name) is not stream:
                changes.append(f"replaced sys.{name}")
                setattr(sys, name, stream)
        for signum, handler in self.signals.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                changes.append(f"replaced the {signal.Signals(signum).name} handler")
                signal.signal(signum, handler)
        return changes + self._patched_newcomers()

    def _patched_newcomers(self) -> list[str]:
        # Another plugin's module this import brought in, with a function of a plugin module
        # (this one) planted on it: its pristine state is unknown, so it is named and dropped
        # from sys.modules; its own load imports it afresh.
        new = [n for n in sys.modules if n not in self.before]
        planted = {n.partition(".")[0] for n in new} & _expected
        changes: list[str] = []
        for top in sorted(planted - {self.loading}):
            found = [
                label
                for name in new
                if name == top or name.startswith(top + ".")
                for label in _foreign(sys.modules[name], planted)
            ]
            if found:
                changes.extend(f"replaced {label} (another plugin's module)" for label in found)
                for name in [n for n in new if n == top or n.startswith(top + ".")]:
                    del sys.modules[name]
        return changes


def _foreign(module: Any, plugins: set[str]) -> list[str]:
    # module.f or module.Class.f set to a function of another plugin module.
    if not isinstance(module, ModuleType):
        return []
    home = module.__name__.partition(".")[0]
    found = []
    for name, value in list(vars(module).items()):
        owners = [(f"{module.__name__}.{name}", value)]
        if isinstance(value, type) and value.__module__ == module.__name__:
            owners += [
                (f"{module.__name__}.{value.__qualname__}.{a}", v) for a, v in vars(value).items()
            ]
        for label, member in owners:
            origin = getattr(member, "__module__", None)
            if (
                callable(member)
                and isinstance(origin, str)
                and origin.partition(".")[0] in plugins - {home}
            ):
                found.append(label)
    return found
