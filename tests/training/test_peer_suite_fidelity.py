"""The last causes that failed Accelerate's own pytest files on kwplug (issue 28, item 3;
measured by tests/compat/peer_suite.py with Accelerate's 1.16.0 source archive), each as a
self-contained test compared with the installed Accelerate where it can be: no archive, no
network."""

from __future__ import annotations

import os

import pytest

from kwplug.utils.environment import clear_environment

_DYNAMO_ENVIRONMENTS = [
    {},
    {"ACCELERATE_DYNAMO_BACKEND": "aot_ts_nvfuser", "ACCELERATE_DYNAMO_MODE": "reduce-overhead"},
    {"ACCELERATE_DYNAMO_BACKEND": "EAGER", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true"},
    {"ACCELERATE_DYNAMO_USE_DYNAMIC": "1", "ACCELERATE_DYNAMO_MODE": "default"},
]


@pytest.mark.parametrize("environment", _DYNAMO_ENVIRONMENTS)
def test_dynamo_to_kwargs_counts_what_the_environment_set_as_accelerate(
    environment: dict[str, str],
) -> None:
    from accelerate.utils import TorchDynamoPlugin as Theirs

    from kwplug.utils import TorchDynamoPlugin

    # Accelerate's test_torch_dynamo_plugin: `accelerate launch --dynamo_backend` settings
    # are what to_kwargs() reports (its default instance is built under a cleared environment).
    with clear_environment():
        os.environ.update(environment)
        ours, theirs = TorchDynamoPlugin().to_kwargs(), Theirs().to_kwargs()
        given = TorchDynamoPlugin(backend="inductor", options={"trace.enabled": False})
        given_theirs = Theirs(backend="inductor", options={"trace.enabled": False})
        assert given.to_kwargs() == given_theirs.to_kwargs()
    assert ours == theirs
    if environment.get("ACCELERATE_DYNAMO_BACKEND") == "aot_ts_nvfuser":
        assert ours == {"backend": "aot_ts_nvfuser", "mode": "reduce-overhead"}


def test_dynamo_to_kwargs_defaults_are_a_plugin_built_without_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kwplug.utils import TorchDynamoPlugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    with clear_environment():
        default = TorchDynamoPlugin()
        assert default.to_kwargs() == {}
        fields = default.to_dict()
    fields.pop("use_regional_compilation")
    from kwplug.plugins.dynamo import _UNSET_ENVIRONMENT

    assert fields == _UNSET_ENVIRONMENT
    # The environment is read, not changed, by to_kwargs().
    assert TorchDynamoPlugin().to_kwargs() == {"backend": "eager"}
    assert os.environ["ACCELERATE_DYNAMO_BACKEND"] == "eager"
