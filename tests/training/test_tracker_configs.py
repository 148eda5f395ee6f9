"""``init_trackers(config=...)`` with the TensorBoard tracker: ``hparams.yml`` as Accelerate
writes it, and configurations holding lists, tuples or nested dicts (torch's ``add_hparams``
raises ``ValueError`` on them, under Accelerate too) flattened with a warning naming the keys."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug.errors import TrackerConfigWarning
from kwplug.tracking import flatten_config

pytest.importorskip("tensorboard")
yaml = pytest.importorskip("yaml")

#: What Accelerate's ``by_feature/tracking.py`` and transformers' ``run_clm_no_trainer.py``
#: pass: ``vars(args)``-like scalars (Accelerate accepts only these).
FLAT = {"learning_rate": 5e-05, "num_train_epochs": 3, "seed": 42, "output_dir": "out"}
FLAT |= {"with_tracking": True, "max_train_steps": None, "lr_scheduler_type": "linear"}
NESTED = {"lr": 0.1, "betas": (0.9, 0.99), "layers": [64, 32], "optim": {"name": "adam"}}


def _hparams_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("*/hparams.yml"))


def _hparams_in_events(run_dir: Path) -> dict[str, Any]:
    """The hparams TensorBoard reads back (its own EventAccumulator and hparams metadata)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    (folder,) = [p for p in run_dir.iterdir() if p.is_dir()]
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    content = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)
    info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def _run(accelerator: Any, config: dict[str, Any]) -> None:
    accelerator.init_trackers("run", config=config)
    accelerator.log({"loss": 0.5}, step=0)
    accelerator.end_training()


def test_hparams_yml_equals_accelerates(tmp_path: Path) -> None:
    import accelerate

    try:
        directory = tmp_path / "a"
        _run(accelerate.Accelerator(cpu=True, log_with="tensorboard", project_dir=directory), FLAT)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    _run(kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path / "k"), FLAT)
    (their_file,) = _hparams_files(tmp_path / "a" / "run")
    (our_file,) = _hparams_files(tmp_path / "k" / "run")
    assert our_file.read_text() == their_file.read_text()
    assert yaml.safe_load(our_file.read_text()) == FLAT
    # The hparams events hold the same values as Accelerate's (None is skipped by torch).
    ours = _hparams_in_events(tmp_path / "k" / "run")
    assert ours["learning_rate"] == 5e-05 and ours["output_dir"] == "out"
    assert "max_train_steps" not in ours


def test_accelerate_refuses_a_nested_config(tmp_path: Path) -> None:
    # The divergence this file is about: Accelerate stops before training starts.
    import accelerate

    try:
        accelerator = accelerate.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
        with pytest.raises(ValueError, match="value should be one of"):
            accelerator.init_trackers("run", config=dict(NESTED))
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_nested_config_is_flattened_with_a_warning(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    with pytest.warns(TrackerConfigWarning, match="'betas', 'layers', 'optim'") as record:
        _run(accelerator, NESTED)
    (warning,) = [w.message for w in record if isinstance(w.message, TrackerConfigWarning)]
    assert warning.keys == ("betas", "layers", "optim") and warning.tracker == "tensorboard"
    assert record[0].filename == __file__  # points at the init_trackers line
    hparams = _hparams_in_events(tmp_path / "run")
    assert hparams == {"lr": 0.1, "betas": "(0.9, 0.99)", "layers": "[64, 32]"} | {
        "optim/name": "adam"
    }
    # hparams.yml keeps the configuration as given (tuples as YAML lists).
    (file,) = _hparams_files(tmp_path / "run")
    assert yaml.safe_load(file.read_text()) == {**NESTED, "betas": [0.9, 0.99]}


def test_flat_config_gives_no_warning(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(accelerator, {"lr": 0.1, "steps": torch.tensor(3), "name": "x"})
    (file,) = _hparams_files(tmp_path / "run")
    assert yaml.safe_load(file.read_text()) == {"lr": 0.1, "steps": 3, "name": "x"}


def test_flatten_config() -> None:
    numpy = pytest.importorskip("numpy")
    values = {"a": {"b": {"c": 1}, "d": [1]}, "t": torch.tensor([2.5]), "n": numpy.int64(7)}
    values |= {"big": torch.zeros(2), "none": None, "path": Path("x")}
    with pytest.warns(TrackerConfigWarning) as record:
        flat = flatten_config(values, "mine", separator=".")
    assert flat == {"a.b.c": 1, "a.d": "[1]", "t": 2.5, "n": 7, "big": str(torch.zeros(2))} | {
        "none": None,
        "path": "x",
    }
    assert record[0].message.keys == ("a", "big", "path")  # type: ignore[union-attr]
