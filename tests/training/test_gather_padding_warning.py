"""A deliberate difference reaches the user at the call: kwplug's ``gather_for_metrics`` drops
the padding of a sharded (``dispatch_batches=False``) iterable data set's last round, which
Accelerate counts (it records no remainder there), so the call warns."""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from kwplug.accelerator import _metrics
from kwplug.data import ActiveLoaders, IterableDatasetShard
from kwplug.errors import KwplugWarning


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(29.0))


def _loaders(dataset: Any, remainder: int) -> ActiveLoaders:
    # The last batch of an epoch whose last global batch held `remainder` real samples.
    loader = types.SimpleNamespace(dataset=dataset, end_of_dataloader=True, remainder=remainder)
    return ActiveLoaders(stack=[loader])  # type: ignore[list-item]


def test_sharded_stream_trim_warns_and_names_the_fix() -> None:
    shard = IterableDatasetShard(_Stream(), batch_size=4, num_processes=2, process_index=0)
    with pytest.warns(KwplugWarning, match="dispatch_batches=None") as caught:
        kept = _metrics.gather_for_metrics(torch.arange(8.0), False, _loaders(shard, 5))
    assert kept.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # the true count, as before
    assert "Accelerate keeps them" in str(caught[0].message)


@pytest.mark.parametrize("remainder", [0, 5])
def test_no_warning_where_both_libraries_agree(remainder: int) -> None:
    # A map-style or dispatched loader: Accelerate trims the same samples; a full last batch.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = _metrics.gather_for_metrics(torch.arange(8.0), False, _loaders(object(), remainder))
    assert len(kept) == (remainder or 8)
