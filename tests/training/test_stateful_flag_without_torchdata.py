"""``use_stateful_dataloader=True`` without torchdata: a clear error where the configuration is
built, never a silent no-op (runs whether torchdata is installed or not; the stateful loaders'
own tests are tests/training/test_stateful_dataloader.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from kwplug.utils import DataLoaderConfiguration


def _map_loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.arange(8)), batch_size=4)


def test_without_torchdata_the_flag_is_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import kwplug.utils.imports as imports

    monkeypatch.setattr(imports, "is_torchdata_stateful_dataloader_available", lambda: False)
    with pytest.raises(ImportError, match="pip install torchdata"):
        DataLoaderConfiguration(use_stateful_dataloader=True)
    from kwplug.data_loader import prepare_data_loader

    with pytest.raises(ImportError, match="pip install torchdata"):
        prepare_data_loader(_map_loader(), use_stateful_dataloader=True)
    assert not DataLoaderConfiguration().use_stateful_dataloader  # the default needs nothing
