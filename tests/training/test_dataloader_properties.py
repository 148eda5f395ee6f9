"""``Accelerator``'s views of ``dataloader_config`` behave as Accelerate's."""

from __future__ import annotations

import pytest

import kwplug

NAMES = (
    "split_batches",
    "dispatch_batches",
    "even_batches",
    "use_seedable_sampler",
    "non_blocking",
    "use_stateful_dataloader",
)


@pytest.mark.parametrize(
    "fields",
    [{}, {"split_batches": True, "even_batches": False, "use_seedable_sampler": True}],
)
def test_properties_equal_accelerates(fields: dict[str, bool]) -> None:
    accelerate = pytest.importorskip("accelerate")
    theirs = accelerate.Accelerator(
        cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(**fields)
    )
    ours = kwplug.Accelerator(cpu=True, dataloader_config=kwplug.DataLoaderConfiguration(**fields))
    for name in NAMES:
        assert getattr(ours, name) == getattr(theirs, name), name
    theirs.end_training()
    ours.end_training()


def test_even_batches_setter_is_checked_and_kept_in_the_config() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.even_batches = False
    assert accelerator.dataloader_config.even_batches is False
    with pytest.raises(TypeError, match="even_batches"):
        accelerator.even_batches = 1  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        accelerator.split_batches = True  # type: ignore[misc]
    accelerator.end_training()
