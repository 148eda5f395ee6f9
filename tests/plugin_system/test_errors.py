"""kwplug.errors: one module, one base class, the old builtin bases, structured attributes."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest

import kwplug
import kwplug.config
import kwplug.testing
from kwplug import errors
from kwplug.config import load_config
from kwplug.testing import PluginSandbox

BUILTIN_BASES = {
    errors.PluginLoadError: RuntimeError,
    errors.PluginHookError: RuntimeError,
    errors.PluginConflictError: RuntimeError,
    errors.ConfigError: ValueError,
    errors.CheckpointError: ValueError,
    errors.DistributedRunError: AssertionError,
    errors.RankMismatchError: RuntimeError,
    errors.RankTimeoutError: RuntimeError,
    errors.PluginLoadWarning: UserWarning,
    errors.MissingFeatureError: RuntimeError,
    errors.PluginCacheWarning: UserWarning,
    errors.TrackerConfigWarning: UserWarning,
    errors.FrozenModelWarning: UserWarning,
    errors.NotCheckpointableError: ValueError,
    errors.TrackerTimeoutError: RuntimeError,
}


def test_every_error_has_the_kwplug_base_and_its_builtin_base() -> None:
    classes = {
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and obj.__module__ == errors.__name__
    }
    assert classes - {errors.KwplugError, errors.KwplugWarning} == set(BUILTIN_BASES)
    for cls, builtin in BUILTIN_BASES.items():
        assert issubclass(cls, builtin), cls
        base = errors.KwplugWarning if issubclass(cls, Warning) else errors.KwplugError
        assert issubclass(cls, base), cls


def test_old_import_paths_name_the_same_classes() -> None:
    assert kwplug.config.ConfigError is errors.ConfigError
    assert kwplug.testing.DistributedRunError is errors.DistributedRunError
    assert kwplug.PluginLoadError is errors.PluginLoadError
    assert kwplug.PluginLoadWarning is errors.PluginLoadWarning


@pytest.mark.parametrize(
    "error",
    [
        errors.PluginHookError("m", plugin="d:p", hook="autocast"),
        errors.PluginConflictError("m", conflicts={"autocast": "a and b"}, device_type="cpu"),
        errors.ConfigError("m", file="f.toml", key="handlers.ddp"),
        errors.PluginLoadError("m", plugins=(("p", "d"),)),
        errors.DistributedRunError("m", returncode=3),
        errors.RankMismatchError(
            "m", field="mixed_precision", values=('"bf16"', '"no"'), mismatches={"x": ("1", "2")}
        ),
        errors.MissingFeatureError(
            "m", feature="mixed_precision='bf16'", hook="autocast", providers=(("p", "why"),)
        ),
        errors.TrackerTimeoutError("m", tracker="mlflow", endpoint="http://h:5000", seconds=4.0),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_attributes(error: errors.KwplugError) -> None:
    copied = pickle.loads(pickle.dumps(error))
    assert type(copied) is type(error) and str(copied) == str(error)
    assert vars(copied) == vars(error)


def test_config_error_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "kwplug.toml"
    path.write_text("[handlers.ddp]\nbucket_cap_mb = 25\nno_such_option = 1\n")
    with pytest.raises(errors.ConfigError, match="unknown key 'no_such_option'") as info:
        load_config(path)
    assert (info.value.file, info.value.key) == (str(path), "handlers.ddp.no_such_option")
    with pytest.raises(errors.ConfigError) as info:
        load_config({"mixed_precision": "fp8"})
    assert (info.value.file, info.value.key) == ("<mapping>", "mixed_precision")


def test_load_warning_names_the_plugin(kwplug_plugins: PluginSandbox) -> None:
    with pytest.warns(errors.PluginLoadWarning, match="failed to load") as caught:
        kwplug_plugins.add("kwplug_no_such_module:Handler", name="gone", distribution="kwplug-gone")
    warning = next(w.message for w in caught if isinstance(w.message, errors.PluginLoadWarning))
    assert (warning.plugin, warning.distribution) == ("gone", "kwplug-gone")
