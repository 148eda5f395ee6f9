"""``kwplug launch``: ``accelerate launch``'s flags and config file, run by
``torch.distributed.run``; the same script launched by ``accelerate launch`` gets the same
settings and trains to the same weights (2 gloo processes). ``print(accelerator.state)`` and
``accelerator.device`` as Accelerate's, in 1 and 2 processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kwplug import cli
from kwplug._cli.launch_config import LaunchConfigError, read_config
from kwplug.testing.distributed import child_environment, run_bounded

WORKER = Path(__file__).resolve().parents[1] / "workers" / "launched_training.py"
TIMEOUT = 300.0

# What `accelerate config` writes for one machine, 2 CPU processes, bf16 (its own key names).
CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def _run(command: list[str], out: Path, library: str, **env: str) -> dict[str, Any]:
    out.mkdir()
    environment = child_environment({"LAUNCH_LIBRARY": library, **env})
    # No default config file of the machine's user may change the run.
    environment["HF_HOME"] = str(out / "hf_home")
    done = run_bounded([*command, str(WORKER), str(out)], timeout=TIMEOUT, env=environment)
    assert done.returncode == 0, done.stdout[-6000:]
    ranks = sorted(out.glob("rank*.json"))
    return {
        "ranks": [json.loads(p.read_text()) for p in ranks],
        "weights": torch.load(out / "weights.pt", weights_only=True),
        "output": done.stdout,
    }


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("launch") / "accelerate"
    # On a machine without GPUs, accelerate launch starts torchrun only with --multi_gpu (else
    # one plain process), its Accelerator takes the CPU and gloo only with ACCELERATE_USE_CPU,
    # and its --gradient_accumulation_steps reaches DeepSpeed runs only: the variable is set
    # by hand, so both runs ask for the same thing (kwplug launch says so in a note).
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    command += ["--num_processes", "2", "--mixed_precision", "bf16"]
    command += ["--gradient_accumulation_steps", "2", "--main_process_port", "0"]
    env = {"ACCELERATE_USE_CPU": "1", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}
    return _run(command, out, "accelerate", **env)


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["ranks"] == theirs["ranks"]
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, tensor in theirs["weights"].items():
        assert torch.equal(ours["weights"][name], tensor), name


def test_flags_reach_the_accelerator_as_under_accelerate_launch(
    accelerate_run: dict[str, Any], tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "kwplug", "launch", "--num_processes", "2"]
    command += ["--mixed_precision", "bf16", "--gradient_accumulation_steps", "2"]
    ours = _run(command, tmp_path / "kwplug", "kwplug")
    assert [r["process_index"] for r in ours["ranks"]] == [0, 1]
    for record in ours["ranks"]:
        assert record["num_processes"] == 2
        assert record["mixed_precision"] == "bf16"
        assert record["gradient_accumulation_steps"] == 2
        assert record["optimizer_steps"] == 3  # 6 batches per rank, 2 per step
        assert record["device"] == "cpu:0"  # Accelerate's MULTI_CPU device
        assert record["state"] == (
            "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo\n"
            "Num processes: 2\n"
            f"Process index: {record['process_index']}\n"
            f"Local process index: {record['process_index']}\n"
            "Device: cpu:0\n\nMixed precision type: bf16\n"
        )
    _assert_same(ours, accelerate_run)
    assert "accelerate launch passes it only with --use_deepspeed" in ours["output"]


def test_accelerates_config_file_keys(accelerate_run: dict[str, Any], tmp_path: Path) -> None:
    config = tmp_path / "default_config.yaml"
    config.write_text(CONFIG)
    # The file is one Accelerate itself reads.
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    assert config_args.load_config_from_file(str(config)).num_processes == 2
    # The command line adds to the file (and would win over it).
    command = [sys.executable, "-m", "kwplug", "launch", "--config_file", str(config)]
    command += ["--gradient_accumulation_steps", "2"]
    _assert_same(_run(command, tmp_path / "kwplug", "kwplug"), accelerate_run)


def test_state_and_device_in_one_process_are_accelerates() -> None:
    pytest.importorskip("accelerate")
    code = (
        "import json, sys, accelerate, kwplug\n"
        "lib = accelerate if sys.argv[1] == 'accelerate' else kwplug\n"
        "a = lib.Accelerator()\n"
        "print(json.dumps([str(a.state), str(a.device), a.mixed_precision,"
        " a.gradient_accumulation_steps]))\n"
    )
    env = child_environment(
        {"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3"}
    )
    printed = []
    for library in ("accelerate", "kwplug"):
        done = run_bounded([sys.executable, "-c", code, library], timeout=120, env=env)
        assert done.returncode == 0, done.stdout[-4000:]
        printed.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert printed[0] == printed[1]
    assert printed[1][0].startswith("Distributed environment: DistributedType.NO\n")
    assert printed[1][1:] == ["cpu", "fp16", 3]


def test_explicit_arguments_and_the_launchers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    import kwplug

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert kwplug.Accelerator().mixed_precision == "bf16"
    assert kwplug.Accelerator(mixed_precision="no").mixed_precision == "no"  # the argument wins
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    assert kwplug.Accelerator().gradient_accumulation_steps == 3
    # Accelerate: the variable wins over the keyword; kwplug says so.
    with pytest.warns(UserWarning, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS=3"):
        assert kwplug.Accelerator(gradient_accumulation_steps=2).gradient_accumulation_steps == 3
    plugin = kwplug.utils.GradientAccumulationPlugin(num_steps=5)
    assert kwplug.Accelerator(gradient_accumulation_plugin=plugin).gradient_accumulation_steps == 5
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "two")
    with pytest.raises(ValueError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        kwplug.Accelerator()
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION"):
        kwplug.Accelerator()


def _accelerate_options() -> dict[str, list[str]]:
    launch = pytest.importorskip("accelerate.commands.launch")
    parser = launch.launch_command_parser()
    return {a.dest: a.option_strings for a in parser._actions if a.option_strings}


def test_every_kwplug_flag_is_accelerates() -> None:
    accelerate_flags = {o for options in _accelerate_options().values() for o in options}
    parser = cli.build_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    ours = {o for a in launch._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert ours <= accelerate_flags, ours - accelerate_flags


def test_accelerates_other_flags_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    parser = cli.build_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    ours = {o for a in launch._actions for o in a.option_strings}
    refused = [o[0] for o in _accelerate_options().values() if not set(o) & ours]
    assert {"--use_deepspeed", "--zero_stage", "--tpu", "--megatron_lm_tp_degree"} <= set(refused)
    # FSDP and the device mesh are kwplug launch's (tests/parallel/test_fsdp_launch_env.py).
    assert not {"--use_fsdp", "--fsdp_version", "--parallelism_config_tp_size"} & set(refused)
    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit('launched')\n")
    for option in refused:
        assert cli.main(["launch", option, str(script)]) == 2, option
        error = capsys.readouterr().err
        assert f"accelerate launch's {option} is not supported by kwplug launch" in error, error
    assert cli.main(["launch", "--zero_stage", "2", str(script)]) == 2  # with its value
    error = capsys.readouterr().err
    assert "--zero_stage is not supported" in error and "DeepSpeed" in error
    assert cli.main(["launch", "--cpu", "--multi_gpu", str(script)]) == 2
    assert "only use one of `--cpu` and `--multi_gpu`" in capsys.readouterr().err


def test_config_file_keys_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def config(text: str) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(text)
        return path

    assert read_config(config(CONFIG))["num_processes"] == 2
    with pytest.raises(LaunchConfigError, match="deepspeed_config.*DeepSpeed"):
        read_config(config(CONFIG + "deepspeed_config:\n  zero_stage: 2\n"))
    with pytest.raises(LaunchConfigError, match="distributed_type='MEGATRON_LM'.*Megatron"):
        read_config(config(CONFIG.replace("MULTI_CPU", "MEGATRON_LM")))
    fsdp = read_config(config(CONFIG.replace("MULTI_CPU", "FSDP") + "fsdp_config: {version: 2}"))
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    with pytest.raises(LaunchConfigError, match=r"unknown key\(s\) \['num_gpus'\]"):
        read_config(config(CONFIG + "num_gpus: 2\n"))
    with pytest.raises(LaunchConfigError, match="distributed_type` must be specified"):
        read_config(config("num_processes: 2\n"))
    with pytest.raises(LaunchConfigError, match="mixed_precision"):
        read_config(config(CONFIG.replace("bf16", "fp8")))
    legacy = read_config(config("distributed_type: 'NO'\nfp16: true\ndynamo_backend: INDUCTOR\n"))
    assert legacy == {"distributed_type": "NO", "mixed_precision": "fp16"} | {
        "dynamo_backend": "INDUCTOR"
    }
    json_file = tmp_path / "config.json"
    json_file.write_text(json.dumps({"distributed_type": "MULTI_CPU", "num_processes": 2}))
    assert read_config(json_file) == {"distributed_type": "MULTI_CPU", "num_processes": 2}
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(LaunchConfigError, match=r"needs PyYAML: pip install 'kwplug\[launch\]'"):
        read_config(config(CONFIG))
    assert read_config(json_file)["num_processes"] == 2  # JSON needs nothing


def _fields(text: str) -> dict[str, str]:
    # "- Key: value" lines (the config's lines start with a tab and are left to the caller).
    lines = [line[2:] for line in text.splitlines() if line.startswith("- ")]
    return dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in lines)


def test_env_prints_what_accelerate_env_prints(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    env = child_environment({"HF_HOME": str(tmp_path / "hf_home")})
    printed = []
    for command in (["accelerate.commands.env"], ["kwplug", "env"]):
        argv = [sys.executable, "-m", *command, "--config_file", str(config)]
        done = run_bounded(argv, timeout=120, env=env)
        assert done.returncode == 0, done.stdout[-4000:]
        printed.append(done.stdout)
    theirs, ours = (_fields(text) for text in printed)
    renamed = {
        k.replace("`Accelerate`", "`kwplug`").replace("`accelerate`", "`kwplug`"): v
        for k, v in theirs.items()
    }
    assert set(renamed) <= set(ours), set(renamed) - set(ours)
    for key in ("Platform", "Python version", "Numpy version", "PyTorch version"):
        assert ours[key] == renamed[key], key
    assert ours["PyTorch accelerator"] == renamed["PyTorch accelerator"]
    assert ours["System RAM"] == renamed["System RAM"]
    assert ours["`Accelerate` API version"] == theirs["`Accelerate` version"]  # the mirror
    # The config file's keys, as accelerate env shows them (it adds the defaults it fills).
    config_lines = [line for line in printed[1].splitlines() if line.startswith("\t- ")]
    assert len(config_lines) == len(CONFIG.splitlines())
    assert set(config_lines) <= set(printed[0].splitlines())
    assert "Copy-and-paste the text below in your GitHub issue" in printed[1]


def test_torchrun_command_lines() -> None:
    from kwplug._cli.launch import torchrun_arguments

    base = {"training_script": "train.py", "training_script_args": ["--lr", "1"]}
    argv, env = torchrun_arguments({**base, "num_processes": 2, "mixed_precision": "bf16"})
    assert argv[:2] == ["--nnodes=1", "--nproc-per-node=2"] and "--standalone" in argv
    assert argv[-3:] == ["train.py", "--lr", "1"]
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16"}
    several = {**base, "num_processes": 16, "num_machines": 2, "machine_rank": 1}
    argv, _ = torchrun_arguments(
        {**several, "main_process_ip": "10.0.0.1"} | {"main_process_port": 29400}
    )
    assert argv[:2] == ["--nnodes=2", "--nproc-per-node=8"]
    assert {"--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"} <= set(argv)
    argv, _ = torchrun_arguments(
        {**several, "main_process_ip": "h", "main_process_port": 1, "rdzv_backend": "c10d"}
    )
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:1"} <= set(argv)
    with pytest.raises(ValueError, match="main_process_ip and --main_process_port"):
        torchrun_arguments(several)
    _, env = torchrun_arguments(
        {**base, "cpu": True, "gradient_accumulation_steps": 4, "dynamo_backend": "eager"}
    )
    assert env == {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_DYNAMO_BACKEND": "EAGER",
    }
    assert "--nproc-per-node=1" in torchrun_arguments({**base, "distributed_type": "NO"})[0]
    with pytest.raises(ValueError, match="pass --num_processes"):
        torchrun_arguments({**base, "distributed_type": "MULTI_CPU", "num_processes": -1})
