"""Requested features never disappear: what ``Accelerator()`` was asked for has a provider.

Mixed precision, its gradient scaler and DDP wrapping come from plugins (the built-ins
``autocast``, ``grad_scaler`` and ``ddp``, or third-party ones). A blocked, disabled or broken
provider used to leave the run training in float32, without a scaler, or unwrapped, with at most
a warning at discovery. :func:`require_features` runs once the set-up hooks have answered and
raises :class:`~kwplug.errors.MissingFeatureError` instead, naming what was asked and why each
plugin that could have provided it did not.
"""

from __future__ import annotations

from collections.abc import Sequence

from kwplug._plugins import KwplugPluginManager, PluginRecord, discover
from kwplug.errors import MissingFeatureError

#: Hook -> the built-in entry point that provides it.
BUILTIN_PROVIDERS = {"autocast": "autocast", "make_scaler": "grad_scaler", "wrap_model": "ddp"}

_WHY = {
    "blocked": "is blocked by KWPLUG_BLOCK_PLUGINS",
    "disabled": "is disabled (KWPLUG_DISABLE_PLUGIN_AUTOLOAD or KWPLUG_PLUGINS)",
    "incompatible": "is not loaded",
    "failed": "failed to load",
}


def require_features(
    plugins: KwplugPluginManager, mixed_precision: str, world_size: int, device_type: str
) -> None:
    """Raise unless every feature asked for has a plugin that provides it.

    Asked for: ``mixed_precision="fp16"``/``"bf16"`` needs an ``autocast`` answer (a
    ``torch.autocast`` factory), ``"fp16"`` also a ``make_scaler`` answer (a
    ``torch.amp.GradScaler``); ``world_size > 1`` needs a ``wrap_model`` implementation (DDP).
    A plugin that the user turned off on purpose still counts as an answer
    (``AutocastKwargs(enabled=False)``, ``GradScalerKwargs(enabled=False)``).

    Args:
        plugins: the Accelerator's manager, after the set-up hooks were called (its
            ``plan`` says who answered).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        world_size: the number of processes.
        device_type: the device type the hooks were asked for, e.g. ``"cpu"``.

    Raises:
        kwplug.errors.MissingFeatureError: a feature has no provider; the message names the
            feature, the hook and, for each possible provider, why it did not answer.
    """
    asked = f"mixed_precision={mixed_precision!r}"
    if mixed_precision != "no":
        _require_answer(plugins, "autocast", asked, device_type)
    if mixed_precision == "fp16":
        _require_answer(plugins, "make_scaler", f"{asked} (its gradient scaler)", device_type)
    if world_size > 1 and not plugins.hook_impls("wrap_model"):
        _missing(f"DDP wrapping (WORLD_SIZE={world_size})", "wrap_model", plugins, device_type)


def _require_answer(
    plugins: KwplugPluginManager, hook: str, feature: str, device_type: str
) -> None:
    answer = plugins.plan.get(hook)
    if answer is None or answer.result is None:
        _missing(feature, hook, plugins, device_type)


def _missing(feature: str, hook: str, plugins: KwplugPluginManager, device_type: str) -> None:
    # Only on the error path: discovery's records are cached, so this reads nothing again.
    providers = _providers(hook, discover(strict=False), plugins, device_type)
    listed = "; ".join(f"{who} {why}" for who, why in providers) or "no plugin implements it"
    raise MissingFeatureError(
        f"{feature} was asked for, but no plugin provides it (hook {hook!r} got no answer for "
        f"device type {device_type!r}): {listed}. kwplug does not train without it; unblock or "
        "repair the plugin, pass a handler that provides it, or do not ask for it",
        feature=feature,
        hook=hook,
        providers=tuple(providers),
    )


def _providers(
    hook: str,
    records: Sequence[PluginRecord],
    plugins: KwplugPluginManager,
    device_type: str,
) -> list[tuple[str, str]]:
    # The built-in that normally answers, every loaded plugin implementing the hook, and every
    # third-party plugin that is not loaded (what it would implement cannot be known).
    builtin = BUILTIN_PROVIDERS.get(hook)
    found: list[tuple[str, str]] = []
    if builtin is not None and not any(r.builtin and r.name == builtin for r in records):
        found.append((f"built-in plugin {builtin!r}", "is not installed as an entry point"))
    implementing = {impl.plugin_name for impl in plugins.hook_impls(hook)}
    for record in records:
        who = f"{record.source} plugin {record.describe()}"
        if record.loaded:
            if f"{record.distribution}:{record.name}" in implementing:
                found.append((who, f"answered None for device type {device_type!r}"))
            elif record.builtin and record.name == builtin:
                found.append((who, "is loaded but not registered (register_default is false)"))
        elif (record.builtin and record.name == builtin) or not record.builtin:
            reason = _WHY.get(record.status, record.status)
            detail = f": {record.error}" if record.error else ""
            found.append((who, f"{reason}{detail}"))
    for name in implementing:  # the user's handlers that implement it answered None too
        if name.startswith("user["):
            found.append((plugins.describe(name), f"answered None for device type {device_type!r}"))
    return found
