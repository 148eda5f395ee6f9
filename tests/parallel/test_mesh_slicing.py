"""Reading a flattened device-mesh dimension (``dp``, ``dp_shard_cp``) does not trigger torch's
deprecation warning for slicing a flattened dim from the root mesh (torch 2.11+), and the
filter that remains for mixed slices lets every other warning through."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from kwplug.testing import run_distributed
from kwplug.utils.device_mesh import submesh


def _prepare_fsdp() -> list[str]:
    import torch

    from kwplug import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(
            parallelism_config=ParallelismConfig(dp_shard_size=2),
            fsdp_plugin=FullyShardedDataParallelPlugin(),
        )
        accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        shard = accelerator.torch_device_mesh["dp_shard"]  # a real dim: no warning either
        assert shard.size() == 2
    accelerator.end_training()
    return [str(w.message) for w in caught if "flattened dim" in str(w.message)]


def test_fsdp_on_a_mesh_reads_its_flattened_dims_without_the_deprecation() -> None:
    assert run_distributed(_prepare_fsdp, nproc=2, timeout=240) == [[], []]


class _Mesh:
    """Stands for a DeviceMesh whose slice warns twice: torch's deprecation and another."""

    def __init__(self) -> None:
        self._flatten_mapping: dict[str, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        warnings.warn(
            "Slicing a flattened dim from root mesh will be deprecated in PT 2.11. ",
            stacklevel=2,
        )
        warnings.warn("some other warning", UserWarning, stacklevel=2)
        return key


def test_the_filter_is_precise() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert submesh(_Mesh(), "dp_replicate", "dp_shard_cp") == ("dp_replicate", "dp_shard_cp")  # type: ignore[arg-type]
    assert [str(w.message) for w in caught] == ["some other warning"]


def test_a_bookkept_flattened_dim_is_not_sliced() -> None:
    mesh = _Mesh()
    mesh._flatten_mapping = {"dp": "the flattened mesh"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert submesh(mesh, "dp") == "the flattened mesh"  # type: ignore[arg-type]
    with pytest.raises(UserWarning, match="some other"), warnings.catch_warnings():
        warnings.simplefilter("error")
        submesh(mesh, "tp")  # type: ignore[arg-type]
