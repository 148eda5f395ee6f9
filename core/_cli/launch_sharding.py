"""``kwplug launch``'s FSDP and ``ParallelismConfig`` settings: ``accelerate launch``'s
``--use_fsdp``/``--fsdp_*`` and ``--use_parallelism_config``/``--parallelism_config_*`` flags
and a config file's ``distributed_type: FSDP``, ``fsdp_config`` and ``parallelism_config``,
turned into the variables Accelerate's launcher sets (``accelerate/utils/launch.py``'s
``prepare_multi_gpu_env`` and ``prepare_extend_env_parallelism_config``), which the script's
``Accelerator()`` reads through the plugins' ``from_launcher()``.

The flags' defaults are Accelerate 1.16's; a setting kwplug's plugins do not take (FSDP1's
``fsdp_version: 1``, ``parallelism_config_cp_size > 1``...) is refused before any process
starts, with the plugin's own construction error, naming the flag and the config key.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from typing import Any

from kwplug.utils.environment import patch_environment, str_to_bool

__all__ = [
    "FILE",
    "FLAGS",
    "GIVEN",
    "WRITTEN",
    "add_flags",
    "check_environment",
    "check_flags",
    "config_settings",
    "environment",
    "origin",
    "resolve",
    "value_of",
]

#: Accelerate's ``--fsdp_*`` and ``--parallelism_config_*`` flags with their defaults and types.
FLAGS: Mapping[str, tuple[Any, Callable[[str], Any]]] = {
    "fsdp_version": ("1", str),
    "fsdp_offload_params": ("false", str),
    "fsdp_min_num_params": (100_000_000, int),
    "fsdp_sharding_strategy": ("FULL_SHARD", str),
    "fsdp_reshard_after_forward": ("true", str),
    "fsdp_auto_wrap_policy": (None, str),
    "fsdp_transformer_layer_cls_to_wrap": (None, str),
    "fsdp_backward_prefetch": (None, str),
    "fsdp_state_dict_type": (None, str),
    "fsdp_forward_prefetch": ("false", str),
    "fsdp_use_orig_params": ("true", str),
    "fsdp_cpu_ram_efficient_loading": ("true", str),
    "fsdp_sync_module_states": ("true", str),
    "fsdp_activation_checkpointing": ("false", str),
    "fsdp_activation_checkpointing_offload": ("false", str),
    "parallelism_config_dp_replicate_size": (1, int),
    "parallelism_config_dp_shard_size": (1, int),
    "parallelism_config_tp_size": (1, int),
    "parallelism_config_cp_size": (1, int),
    "parallelism_config_cp_backend": ("torch", str),
    "parallelism_config_cp_comm_strategy": ("allgather", str),
    "parallelism_config_sp_size": (1, int),
    "parallelism_config_sp_backend": ("deepspeed", str),
    "parallelism_config_sp_seq_length": (None, str),
    "parallelism_config_sp_seq_length_is_variable": (True, bool),
    "parallelism_config_sp_attn_implementation": ("sdpa", str),
}
#: Keys of the launch settings that say where each value came from (set by
#: :func:`config_settings` and ``kwplug._cli.launch._settings``), so that an error names what
#: the user wrote -- a flag, a config file key as spelt there -- or says the value is a default.
WRITTEN, GIVEN, FILE = "origin_config_keys", "origin_flags", "origin_file"
#: A config file's ``fsdp_config`` key with no flag (Accelerate reads it if present).
_CONFIG_ONLY = {"fsdp_ignored_modules": None}

#: The plugin field a refusal names -> the flag (FSDP2 fields; ParallelismConfig's add the
#: ``parallelism_config_`` prefix).
_FSDP_FIELD_FLAGS = {
    "fsdp_version": "fsdp_version",
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "backward_prefetch": "fsdp_backward_prefetch",
    "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
    "state_dict_type": "fsdp_state_dict_type",
    "cpu_offload": "fsdp_offload_params",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "activation_checkpointing_offload": "fsdp_activation_checkpointing_offload",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "ignored_modules": "fsdp_ignored_modules",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--use_fsdp``, ``--use_parallelism_config`` and :data:`FLAGS` to ``parser``
    (``-`` or ``_`` spellings; default ``None``, so that a config file fills what the command
    line leaves unset and Accelerate's default what both leave)."""
    for name in ("use_fsdp", "use_parallelism_config"):
        parser.add_argument(
            f"--{name}", f"--{name.replace('_', '-')}", action="store_true", default=None,
            help=f"as accelerate launch (ACCELERATE_{name.upper()})",
        )  # fmt: skip
    for name, (default, kind) in FLAGS.items():
        # Accelerate's types, `type=bool` included (any non-empty string is True).
        parser.add_argument(
            f"--{name}", f"--{name.replace('_', '-')}", type=kind, default=None,
            help=f"as accelerate launch (default {default!r})",
        )  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    """Accelerate's checks of the command line alone (before the config file is read).

    Raises:
        ValueError: ``--use_fsdp`` with ``--cpu`` or ``--multi_gpu``;
            ``--use_parallelism_config`` without ``--use_fsdp`` (Accelerate's messages).
    """
    if sum(bool(getattr(args, n, None)) for n in ("multi_gpu", "cpu", "use_fsdp")) > 1:
        raise ValueError(
            "You can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`, "
            "`--use_fsdp` at a time."
        )
    if args.use_parallelism_config and not args.use_fsdp:
        raise ValueError(
            "You cannot use `--use_parallelism_config` without `--use_fsdp` and "
            "`--fsdp_version=2`. "
        )


def config_settings(file: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's ``fsdp_config`` and ``parallelism_config`` as flat launch settings
    (``fsdp_config``'s keys get Accelerate's ``fsdp_`` prefix when they lack it), plus
    ``config_use_fsdp: True`` for ``distributed_type: FSDP`` and
    ``config_use_parallelism_config: True`` for a non-empty ``parallelism_config``, and
    ``{WRITTEN: {flat name: "section.key as written"}}`` (what error messages name).

    Raises:
        ValueError: a key that is no ``accelerate launch`` flag (names the file and key), or
            a section that is not a mapping.
    """
    settings: dict[str, Any] = {}
    written: dict[str, str] = {}  # flat name -> the key as the file spells it
    if data.get("distributed_type") == "FSDP":
        settings["config_use_fsdp"] = True
    if data.get("parallelism_config"):
        settings["config_use_parallelism_config"] = True
    for section, prefix in (("fsdp_config", "fsdp_"), ("parallelism_config", "")):
        values = data.get(section) or {}
        if not isinstance(values, Mapping):
            raise ValueError(f"{file}: {section} must be a mapping, got {values!r}")
        for key, value in values.items():
            name = key if key.startswith(prefix) else prefix + key
            if name not in FLAGS and name not in _CONFIG_ONLY:
                raise ValueError(
                    f"{file}: {section}.{key} is no accelerate launch setting; the keys are "
                    f"{sorted(n for n in (*FLAGS, *_CONFIG_ONLY) if n.startswith(section[:4]))}"
                )
            settings[name] = value
            written[name] = f"{section}.{key}"
    if written:  # else nothing to name: the file has neither section
        settings[WRITTEN] = written
    return settings


def resolve(settings: dict[str, Any], args: argparse.Namespace) -> None:
    """Set ``use_fsdp``/``use_parallelism_config`` in ``settings`` as Accelerate decides them:
    the command line's, else the config file's unless ``--multi_gpu`` (or ``--use_fsdp``, for
    the parallelism config) was passed."""
    if not args.use_fsdp and not args.multi_gpu:
        settings["use_fsdp"] = bool(settings.get("config_use_fsdp"))
        settings["use_parallelism_config"] = bool(settings.get("config_use_parallelism_config"))
    settings.pop("config_use_fsdp", None)
    settings.pop("config_use_parallelism_config", None)


def value_of(settings: Mapping[str, Any], name: str) -> Any:
    """The setting ``name``: given on the command line or in the config file, else the flag's
    ``accelerate launch`` default (:data:`FLAGS`)."""
    value = settings.get(name)
    return FLAGS[name][0] if value is None and name in FLAGS else value


def environment(settings: Mapping[str, Any]) -> dict[str, str]:
    """The variables ``accelerate launch`` sets for these settings (``prepare_multi_gpu_env``'s
    FSDP part and ``prepare_extend_env_parallelism_config``), checked by building kwplug's
    plugins from them (:func:`check_environment`).

    Raises:
        ValueError: ``fsdp_cpu_ram_efficient_loading`` without ``fsdp_sync_module_states``
            (Accelerate's check); a value kwplug's plugin refuses (see
            :func:`check_environment`).
    """
    v = value_of
    _check_types(settings)
    env: dict[str, str] = {}
    if settings.get("use_fsdp"):
        env["ACCELERATE_USE_FSDP"] = "true"
        if v(settings, "fsdp_cpu_ram_efficient_loading") and not v(
            settings, "fsdp_sync_module_states"
        ):
            raise ValueError(
                "When using `--fsdp_cpu_ram_efficient_loading` set `--fsdp_sync_module_states` "
                "to `True`"
            )
        env["FSDP_VERSION"] = str(v(settings, "fsdp_version"))
        env["FSDP_SHARDING_STRATEGY"] = str(v(settings, "fsdp_sharding_strategy"))
        for name in ("reshard_after_forward", "offload_params"):
            env[f"FSDP_{name.upper()}"] = str(v(settings, f"fsdp_{name}")).lower()
        env["FSDP_MIN_NUM_PARAMS"] = str(v(settings, "fsdp_min_num_params"))
        for name, variable in (
            ("auto_wrap_policy", "AUTO_WRAP_POLICY"),
            ("transformer_layer_cls_to_wrap", "TRANSFORMER_CLS_TO_WRAP"),
            ("backward_prefetch", "BACKWARD_PREFETCH"),
            ("state_dict_type", "STATE_DICT_TYPE"),
        ):
            if v(settings, f"fsdp_{name}") is not None:
                env[f"FSDP_{variable}"] = str(v(settings, f"fsdp_{name}"))
        for name in (
            "forward_prefetch", "use_orig_params", "cpu_ram_efficient_loading",
            "sync_module_states", "activation_checkpointing", "activation_checkpointing_offload",
        ):  # fmt: skip
            env[f"FSDP_{name.upper()}"] = str(v(settings, f"fsdp_{name}")).lower()
        if settings.get("fsdp_ignored_modules") is not None:
            env["FSDP_IGNORED_MODULES"] = str(settings["fsdp_ignored_modules"])
    if settings.get("use_parallelism_config"):
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            size = v(settings, f"parallelism_config_{name}")
            env[f"PARALLELISM_CONFIG_{name.upper()}"] = str(size)
        env["PARALLELISM_CONFIG_CP_BACKEND"] = str(v(settings, "parallelism_config_cp_backend"))
        env["PARALLELISM_CONFIG_SP_SIZE"] = str(v(settings, "parallelism_config_sp_size"))
        env["PARALLELISM_CONFIG_SP_BACKEND"] = str(v(settings, "parallelism_config_sp_backend"))
        if int(v(settings, "parallelism_config_cp_size")) > 1:
            strategy = v(settings, "parallelism_config_cp_comm_strategy")
            env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] = str(strategy)
        if int(v(settings, "parallelism_config_sp_size")) > 1:
            for name in ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"):
                env[f"PARALLELISM_CONFIG_{name.upper()}"] = str(
                    v(settings, f"parallelism_config_{name}")
                )
    if env:
        check_environment(env, settings)
    return env


def check_environment(env: Mapping[str, str], settings: Mapping[str, Any]) -> None:
    """Build kwplug's ``ParallelismConfig`` and ``FullyShardedDataParallelPlugin`` from
    ``env`` as the script's ``Accelerator()`` will (their ``from_launcher()``), so that what
    they refuse is refused now, in the launcher, instead of in every process.

    Raises:
        ValueError: the plugin's error (``TypeError``s too), prefixed with the flag and
            config key of the field it names and their value.
    """
    from kwplug.plugins.fsdp import FullyShardedDataParallelPlugin
    from kwplug.plugins.parallelism import ParallelismConfig

    with patch_environment(**env):  # the plugins read os.environ
        try:
            ParallelismConfig.from_launcher()
            FullyShardedDataParallelPlugin.from_launcher()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{_named(str(exc), settings)}{exc}") from None


_BOOLS = (
    "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_forward_prefetch",
    "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
    "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload",
    "parallelism_config_sp_seq_length_is_variable",
)  # fmt: skip
_INTS = (
    "fsdp_min_num_params", "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
    "parallelism_config_cp_size", "parallelism_config_sp_size",
)  # fmt: skip


def _check_types(settings: Mapping[str, Any]) -> None:
    # What the plugins would only see as an environment string ("invalid truth value 'x'",
    # or nothing at all for a variable FSDP2 does not read) is refused here, by its name.
    used = [
        (names, section)
        for names, section, switch in (
            (_BOOLS[:8] + _INTS[:1], "fsdp_config", "use_fsdp"),
            (_BOOLS[8:] + _INTS[1:], "parallelism_config", "use_parallelism_config"),
        )
        if settings.get(switch)
    ]
    for names, section in used:
        for name in names:
            value = value_of(settings, name)
            if value is None:
                continue
            where = origin(settings, name, section)
            if name in _BOOLS and not _is_truth(value):
                raise ValueError(
                    f"{where}not a boolean (true/false, yes/no, on/off, 1/0, as accelerate "
                    "launch reads it)"
                )
            if name in _INTS and not _is_integer(value):
                raise ValueError(f"{where}not an integer")


def _is_truth(value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return True
    try:
        str_to_bool(str(value))
    except ValueError:
        return False
    return True


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        int(str(value))
    except ValueError:
        return False
    return True


def _named(message: str, settings: Mapping[str, Any]) -> str:
    found = re.search(r"\b(FullyShardedDataParallelPlugin|ParallelismConfig)\.(\w+)", message)
    if found is None:
        return ""
    cls, field = found.groups()
    if cls == "ParallelismConfig":
        flag, section = f"parallelism_config_{field}", "parallelism_config"
    else:
        flag, section = _FSDP_FIELD_FLAGS.get(field, f"fsdp_{field}"), "fsdp_config"
    return origin(settings, flag, section)


def origin(settings: Mapping[str, Any], name: str, section: str | None = None) -> str:
    """How an error names the launch setting ``name`` and its value: the flag the command
    line gave, the config file key as written there, or -- set by neither -- that it is
    ``accelerate launch``'s default and where to set it; ends with ``": "``.

    Args:
        settings: the launch settings (see :func:`config_settings` for the origin keys).
        name: the flag's name without ``--`` (``"fsdp_version"``, ``"num_processes"``).
        section: the config file section the key belongs in (``"fsdp_config"``,
            ``"parallelism_config"``), ``None`` for a top-level key.
    """
    value = value_of(settings, name)
    if name in settings.get(GIVEN, ()):
        return f"--{name} = {value!r}: "
    written = settings.get(WRITTEN, {}).get(name)
    if written is None and section is None and name in settings:
        written = name  # a top-level key of the file
    if written is not None:
        return f"--{name} (config file: {written}) = {value!r}: "
    key = f"{section}.{name}" if section else name
    entry = f"{section}: {{{name}: ...}}" if section else f"{name}: ..."
    in_file = settings.get(FILE)
    unset = (
        f"--{name} is not set on the command line and the config file {in_file} has no {key}"
        if in_file
        else f"--{name} is not set (no config file)"
    )
    return (
        f"{unset}, so accelerate launch's default {value!r} applies (pass --{name}, or write "
        f"`{entry}` in the config file): "
    )
