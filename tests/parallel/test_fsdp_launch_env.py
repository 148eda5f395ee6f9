"""``kwplug launch``'s FSDP and ``ParallelismConfig`` settings, differentially: for the same
flags or config file, the variables ``kwplug launch`` sets are the ones ``accelerate launch``
sets (Accelerate's own ``_validate_launch_command`` and ``prepare_multi_gpu_env``, which run
without a GPU), and under them kwplug's ``FullyShardedDataParallelPlugin()`` and
``ParallelismConfig()`` hold the fields Accelerate's hold; ``Accelerator()`` builds them when
``ACCELERATE_USE_FSDP``/``ACCELERATE_USE_PARALLELISM_CONFIG`` say so. One process, no
torchrun (the launched training run is ``test_fsdp_launched_run.py``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import attrs
import pytest

import kwplug
from kwplug import FullyShardedDataParallelPlugin, ParallelismConfig, cli
from kwplug._cli import launch as _launch
from kwplug._cli.launch_sharding import FLAGS

pytest.importorskip("accelerate")
from accelerate.commands import launch as accelerate_launch
from accelerate.utils import launch as accelerate_env

#: The variables the comparison covers (the dynamo and thread ones are other modules').
PREFIXES = ("ACCELERATE_USE_FSDP", "FSDP_", "ACCELERATE_USE_PARALLELISM_CONFIG")
PREFIXES += ("PARALLELISM_CONFIG_", "ACCELERATE_MIXED_PRECISION")

FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block,Head
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_offload_params: true
  fsdp_activation_checkpointing: true
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""
#: `accelerate config`'s other shapes: size-based wrap, keys without the fsdp_ prefix, a mesh.
SIZE_YAML = """\
distributed_type: FSDP
fsdp_config:
  version: 2
  auto_wrap_policy: SIZE_BASED_WRAP
  min_num_params: 1000
  cpu_ram_efficient_loading: false
  state_dict_type: SHARDED_STATE_DICT
num_processes: 4
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
"""
MINIMAL_YAML = "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No launcher variable of the calling shell, no default config file of the machine's user.
    for name in list(os.environ):
        if name.startswith(PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(accelerate_launch, "default_config_file", str(tmp_path / "none.yaml"))


def _ours(argv: list[str]) -> dict[str, str]:
    args, unknown = cli.build_parser().parse_known_args(["launch", *argv, "train.py"])
    _launch.check_unknown(unknown)
    _launch._launch_sharding.check_flags(args)
    return _launch.torchrun_arguments(_launch._settings(args))[1]


def _theirs(argv: list[str]) -> dict[str, str]:
    args = accelerate_launch.launch_command_parser().parse_args([*argv, "train.py"])
    args, _, _ = accelerate_launch._validate_launch_command(args)
    env = accelerate_env.prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(PREFIXES) and os.environ.get(k) != v}


def _kept(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(PREFIXES)}


def _fsdp_fields(plugin: Any) -> dict[str, Any]:
    # Accelerate stores torch's objects where kwplug stores names: compared as what they mean.
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as by_size
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as by_class

    policy = plugin.auto_wrap_policy
    names = {None: "NO_WRAP", by_class: "TRANSFORMER_BASED_WRAP", by_size: "SIZE_BASED_WRAP"}
    kind = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)

    def config(value: Any, optim: bool) -> tuple[str, bool, bool]:
        if value is None:  # kwplug's sharded default: Sharded[Optim]StateDictConfig(True)
            return (f"Sharded{'Optim' if optim else ''}StateDictConfig", True, False)
        return (type(value).__name__, value.offload_to_cpu, getattr(value, "rank0_only", False))

    fields = {
        name: getattr(plugin, name)
        for name in (
            "fsdp_version", "sharding_strategy", "reshard_after_forward", "backward_prefetch",
            "mixed_precision_policy", "ignored_modules", "limit_all_gathers", "use_orig_params",
            "param_init_fn", "sync_module_states", "forward_prefetch",
            "activation_checkpointing", "activation_checkpointing_offload",
            "cpu_ram_efficient_loading", "transformer_cls_names_to_wrap", "min_num_params",
        )
    }  # fmt: skip
    return fields | {
        "auto_wrap_policy": names.get(policy, policy),
        "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
        "state_dict_type": kind,
        "state_dict_config": config(plugin.state_dict_config, False),
        "optim_state_dict_config": config(plugin.optim_state_dict_config, True),
    }


def _same_plugins(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours = FullyShardedDataParallelPlugin()
    theirs = accelerate.FullyShardedDataParallelPlugin()
    assert _fsdp_fields(ours) == _fsdp_fields(theirs)
    assert [f.name for f in attrs.fields(type(ours))] == [
        f.name for f in dataclasses.fields(theirs)
    ]
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
        mesh, their_mesh = ParallelismConfig(), accelerate.ParallelismConfig()
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend"):
            assert getattr(mesh, name) == getattr(their_mesh, name), name
        assert (mesh.sp_size, mesh.sp_backend) == (their_mesh.sp_size, their_mesh.sp_backend)
        assert mesh.fsdp_dim_names == their_mesh.fsdp_dim_names


@pytest.mark.parametrize("text", [FSDP_YAML, SIZE_YAML, MINIMAL_YAML], ids=["full", "size", "min"])
@pytest.mark.parametrize("extra", [[], ["--fsdp_reshard_after_forward", "true"]], ids=["", "cli"])
def test_config_file_sets_accelerates_variables(
    text: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "fsdp.yaml"
    config.write_text(text)
    argv = ["--config_file", str(config), *extra]  # the command line wins over the file
    ours, theirs = _kept(_ours(argv)), _theirs(argv)
    assert ours == theirs
    assert ours["ACCELERATE_USE_FSDP"] == "true" and ours["FSDP_VERSION"] == "2"
    _same_plugins(ours, monkeypatch)


@pytest.mark.parametrize(
    "argv",
    [
        ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2"],
        ["--use_fsdp", "--fsdp-version", "2", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP",
         "--fsdp_min_num_params", "500", "--fsdp_offload_params", "true",
         "--fsdp_state_dict_type", "FULL_STATE_DICT", "--mixed_precision", "fp16"],
        ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "transformer_based_wrap",
         "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_activation_checkpointing",
         "true", "--fsdp_activation_checkpointing_offload", "true", "--use_parallelism_config",
         "--parallelism_config_dp_shard_size", "2", "--parallelism_config_dp_replicate_size",
         "2", "--num_processes", "4"],
    ],
    ids=["plain", "size", "mesh"],
)  # fmt: skip
def test_flags_set_accelerates_variables(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _kept(_ours(argv))
    assert ours == _theirs(argv)
    _same_plugins(ours, monkeypatch)


def test_tensor_parallel_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accelerate's ParallelismConfig(tp_size > 1) needs transformers: the variables only.
    argv = ["--use_fsdp", "--fsdp_version", "2", "--use_parallelism_config", "--num_processes"]
    argv += ["4", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
    ours = _kept(_ours(argv))
    assert ours == _theirs(argv)
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    mesh = ParallelismConfig.from_launcher()
    assert mesh is not None and (mesh.dp_shard_size, mesh.tp_size, mesh.total_size) == (2, 2, 4)


@pytest.mark.parametrize(
    "env",
    [
        {"FSDP_VERSION": "2"},
        {"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "False", "FSDP_OFFLOAD_PARAMS": "1"},
        {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "no_wrap", "FSDP_IGNORED_MODULES": "h.*"},
        {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"},
        {"FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "full_state_dict"},
        {"FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "yes", "FSDP_USE_ORIG_PARAMS": "0"},
        {"FSDP_VERSION": "2", "FSDP_SYNC_MODULE_STATES": "true", "FSDP_FORWARD_PREFETCH": "true"},
    ],
)
def test_fields_from_the_environment_are_accelerates(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _same_plugins(env, monkeypatch)


def test_accelerates_flag_defaults() -> None:
    parser = accelerate_launch.launch_command_parser()
    theirs = {a.dest: (a.default, a.type) for a in parser._actions}
    for name, (default, kind) in FLAGS.items():
        assert theirs[name] == (default, kind), name


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> str:
    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit('launched')\n")
    assert cli.main(["launch", *argv, str(script)]) == 2
    return capsys.readouterr().err


def test_what_kwplug_does_not_do_is_refused_before_launch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Accelerate's flag default is FSDP1, which kwplug does not run: the plugin's own error.
    error = _refused(["--use_fsdp", "--num_processes", "2"], capsys, tmp_path)
    assert "--fsdp_version is not set (no config file), so accelerate launch's default '1'" in error
    assert "fsdp_version must be 2" in error
    config = tmp_path / "c.yaml"
    config.write_text(MINIMAL_YAML + "  fsdp_state_dict_type: LOCAL_STATE_DICT\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "fsdp_config.fsdp_state_dict_type) = 'LOCAL_STATE_DICT'" in error
    assert "FSDP2 has no LOCAL_STATE_DICT" in error
    config.write_text(MINIMAL_YAML + "parallelism_config:\n  parallelism_config_cp_size: 2\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "--parallelism_config_cp_size (config file: parallelism_config." in error
    assert "context parallelism" in error
    config.write_text(MINIMAL_YAML + "  fsdp_prefetch_everything: true\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "fsdp_config.fsdp_prefetch_everything is no accelerate launch setting" in error
    # Accelerate's own checks, with its messages.
    error = _refused(["--cpu", "--use_fsdp", "--fsdp_version", "2"], capsys, tmp_path)
    assert "You can only use one of `--cpu`, `--multi_gpu`" in error
    error = _refused(["--use_parallelism_config", "--num_processes", "2"], capsys, tmp_path)
    assert "cannot use `--use_parallelism_config` without `--use_fsdp`" in error
    config.write_text(MINIMAL_YAML + "  fsdp_sync_module_states: false\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "set `--fsdp_sync_module_states` to `True`" in error
    with pytest.raises(ValueError, match="fsdp_sync_module_states"):
        _theirs(["--config_file", str(config)])  # Accelerate refuses it too


def test_accelerator_builds_the_launched_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kwplug.Accelerator().handlers == []  # nothing asked
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    for switch in ("1", "yes", "false"):  # Accelerate's rule: "true" in any case, nothing else
        monkeypatch.setenv("ACCELERATE_USE_FSDP", switch)
        assert kwplug.Accelerator().handlers == []
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "True")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    accelerator = kwplug.Accelerator()
    mesh, fsdp = accelerator.handlers
    assert isinstance(fsdp, FullyShardedDataParallelPlugin) and fsdp.state_dict_type == (
        "FULL_STATE_DICT"
    )
    assert isinstance(mesh, ParallelismConfig) and accelerator.parallelism_config is mesh
    assert accelerator.distributed_type is kwplug.DistributedType.FSDP and accelerator.is_fsdp2
    # A plugin passed in the script wins, as in Accelerate; one in kwargs_handlers too.
    mine = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    assert kwplug.Accelerator(fsdp_plugin=mine).handlers[1] is mine
    assert kwplug.Accelerator(kwargs_handlers=[mine]).handlers[1] is mine
    monkeypatch.setenv("FSDP_VERSION", "1")  # what the plugin refuses, refused here too
    with pytest.raises(ValueError, match="fsdp_version must be 2"):
        kwplug.Accelerator()
    # ... but only when the launcher asked for FSDP: a stray variable never stops a run that
    # did not (Accelerate's plugin is not built either).
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG")
    assert kwplug.Accelerator().handlers == []


def test_fsdp1_prefetch_is_refused_where_accelerate_drops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import accelerate

    # The one launcher value Accelerate's FSDP2 accepts and kwplug refuses: Accelerate logs
    # a deprecation and sets it to None; kwplug says it at construction (docs' migration row).
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")
    assert accelerate.FullyShardedDataParallelPlugin().backward_prefetch is None
    with pytest.raises(ValueError, match="backward_prefetch"):
        FullyShardedDataParallelPlugin()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (
            "  fsdp_activation_checkpointing: yes please\n",
            "fsdp_config.fsdp_activation_checkpointing",
        ),
        ("  fsdp_offload_params: nah\n", "fsdp_config.fsdp_offload_params"),
        ("  fsdp_activation_checkpointing: 2\n", "fsdp_config.fsdp_activation_checkpointing"),
        # FSDP2 never reads this variable: without the check, any value passed silently.
        ("  fsdp_sync_module_states: zz\n", "fsdp_config.fsdp_sync_module_states"),
        ("  fsdp_min_num_params: lots\n", "fsdp_config.fsdp_min_num_params"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_before_launch(
    line: str, named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(MINIMAL_YAML + line)
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert f"(config file: {named}) = " in error
    assert "not a boolean" in error or "not an integer" in error
    # A truth string accelerate launch reads is accepted.
    config.write_text(MINIMAL_YAML + "  fsdp_activation_checkpointing: 'yes'\n")
    assert _ours(["--config_file", str(config)])["FSDP_ACTIVATION_CHECKPOINTING"] == "yes"


def test_a_count_that_is_no_integer_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(MINIMAL_YAML.replace("num_processes: 2", "num_processes: two"))
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "--num_processes (config file: num_processes) = 'two': not an integer" in error


def test_an_unset_fsdp_version_is_named_as_unset_not_as_a_key_of_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `distributed_type: FSDP` and no fsdp_config section: the error named
    # "fsdp_config.fsdp_version", a key that is not in the user's file.
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "(config file: fsdp_config.fsdp_version)" not in error
    assert f"the config file {config} has no fsdp_config.fsdp_version" in error
    assert "write `fsdp_config: {fsdp_version: ...}`" in error
    assert "fsdp_version must be 2" in error
    # A key the file has is named as the file spells it (no fsdp_ prefix here) ...
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  version: 1\n")
    error = _refused(["--config_file", str(config)], capsys, tmp_path)
    assert "--fsdp_version (config file: fsdp_config.version) = 1: " in error
    # ... and a flag as the flag.
    error = _refused(["--config_file", str(config), "--fsdp_version", "1"], capsys, tmp_path)
    assert "--fsdp_version = '1': " in error


@pytest.mark.parametrize(
    ("argv", "yaml", "named"),
    [
        (
            [],
            "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
            "  parallelism_config_tp_size: 2\n",
            [
                "(config file: parallelism_config.parallelism_config_dp_shard_size) = 2",
                "(config file: parallelism_config.parallelism_config_tp_size) = 2",
                "multiply to 4",
                "but 2 process(es) would start (--num_processes (config file: num_processes) = 2)",
            ],
        ),
        (
            ["--num_processes", "4", "--use_parallelism_config", "--use_fsdp"],
            "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n",
            ["--parallelism_config_tp_size = 3", "multiply to 6", "(--num_processes = 4)"],
        ),
    ],
    ids=["config", "flags"],
)
def test_sizes_that_do_not_multiply_to_the_processes_are_refused_before_launch(
    argv: list[str],
    yaml: str,
    named: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(MINIMAL_YAML + yaml)
    extra = ["--parallelism_config_tp_size", "3"] if argv else []
    # _refused runs the real command: the script would print "launched" had a process started.
    error = _refused(["--config_file", str(config), *argv, *extra], capsys, tmp_path)
    for part in named:
        assert part in error
    assert "launched" not in error
    # Equal, or every size 1 (replicated over every process, as Accelerate): launched.
    config.write_text(MINIMAL_YAML + "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n")
    assert _ours(["--config_file", str(config)])["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2"
    config.write_text(MINIMAL_YAML + "parallelism_config:\n  parallelism_config_tp_size: 1\n")
    assert _ours(["--config_file", str(config)])["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
