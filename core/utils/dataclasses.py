"""Configuration objects with Accelerate's names and fields, validated at construction.

``DistributedType`` has the members and values of ``accelerate.utils.DistributedType``, so
``accelerator.distributed_type == DistributedType.MULTI_GPU`` ports unchanged.
``DataLoaderConfiguration``, ``ProjectConfiguration`` and ``GradientAccumulationPlugin`` keep
Accelerate's field names, order and defaults; unlike Accelerate's dataclasses they check their
values (at construction and on assignment) and name the field in the error.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Callable
from typing import Any, NoReturn

import attrs

from kwplug.validators import number, optional_bool, strict_bool

__all__ = [
    "AORecipeKwargs",
    "DataLoaderConfiguration",
    "DistributedType",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
    "RNGType",
    "TERecipeKwargs",
    "default_distributed_type",
]


class DistributedType(str, enum.Enum):
    """The kind of distributed run, as Accelerate names it.

    A ``str`` enum (``DistributedType.MULTI_CPU == "MULTI_CPU"``), JSON-serialisable. kwplug
    itself produces ``NO``, ``MULTI_CPU``, ``MULTI_GPU`` and the other ``MULTI_<device>``
    values (see :func:`default_distributed_type`); a wrapping plugin may report ``FSDP``. The
    remaining members (``DEEPSPEED``, ``XLA``, ``MEGATRON_LM``) exist so that comparisons in
    ported scripts keep working; kwplug never reports them.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class RNGType(str, enum.Enum):
    """The random number generators :func:`kwplug.utils.synchronize_rng_states` can copy from
    process 0 to the others (Accelerate's members and values)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


_MULTI_BY_DEVICE = {
    "cpu": DistributedType.MULTI_CPU,
    "cuda": DistributedType.MULTI_GPU,
    "xpu": DistributedType.MULTI_XPU,
    "npu": DistributedType.MULTI_NPU,
    "mlu": DistributedType.MULTI_MLU,
    "sdaa": DistributedType.MULTI_SDAA,
    "musa": DistributedType.MULTI_MUSA,
    "hpu": DistributedType.MULTI_HPU,
    "neuron": DistributedType.MULTI_NEURON,
}


def default_distributed_type(device_type: str, num_processes: int) -> DistributedType:
    """The ``DistributedType`` of plain data parallelism (no sharding plugin).

    Args:
        device_type: ``torch.device(...).type`` the processes train on (``"cpu"``, ``"cuda"``...).
        num_processes: number of processes, >= 1.

    Returns:
        ``NO`` for one process; otherwise ``MULTI_<device>`` as Accelerate names it
        (``"cuda"`` is ``MULTI_GPU``), and ``MULTI_GPU`` for an out-of-tree device type that
        Accelerate has no name for.

    Raises:
        ValueError: ``num_processes < 1``.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes!r}")
    if num_processes == 1:
        return DistributedType.NO
    return _MULTI_BY_DEVICE.get(device_type, DistributedType.MULTI_GPU)


def _optional_int(*, ge: int) -> Any:
    return attrs.validators.optional(number(integer=True, ge=ge))


def _torchdata_installed(instance: Any, attribute: Any, value: bool) -> None:
    # At construction, as Accelerate's loaders do when prepared: never a silent no-op.
    from kwplug.utils.imports import is_torchdata_stateful_dataloader_available

    if value and not is_torchdata_stateful_dataloader_available():
        raise ImportError(
            "DataLoaderConfiguration(use_stateful_dataloader=True) needs torchdata's "
            "StatefulDataLoader (torchdata >= 0.8.0): pip install torchdata (or "
            "pip install 'kwplug[stateful]')"
        )


def _seed(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    number(integer=True)(instance, attribute, value)
    # The range torch.Generator.manual_seed accepts.
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"'{attribute.name}' must be in [-2**63, 2**64), got {value!r}")


@attrs.define
class DataLoaderConfiguration:
    """How ``Accelerator.prepare`` shards data loaders (Accelerate's fields and defaults).

    Attributes:
        split_batches: ``bool``, default ``False``. ``True``: each batch the loader yields is
            split across the processes (its size must be a multiple of ``num_processes``);
            ``False``: each process gets whole batches, so the global batch is
            ``batch_size * num_processes``.
        dispatch_batches: ``bool`` or ``None`` (default). ``True``: process 0 reads every
            batch and sends each process its slice (``torch.distributed.broadcast_object_list``
            for the shapes, ``broadcast`` for the tensors): without ``split_batches``
            ``num_processes`` batches of the loader are concatenated into one global batch,
            with it one batch is sliced. The last global batch, when its size is not a
            multiple of ``num_processes``, is completed with the epoch's first samples, and
            the loader's ``remainder`` is its number of real samples (``gather_for_metrics``
            keeps those); ``even_batches`` has no effect (a warning says so). Batches must be
            tensors. ``False``: every process reads its own shard (an ``IterableDataset`` is
            read whole by every process, which keeps its slices). ``None``: ``True`` for an
            ``IterableDataset``, ``False`` otherwise, as Accelerate (its per-rank batches,
            ``remainder`` and ``gather_for_metrics`` counts).
        even_batches: ``bool``, default ``True``; complete the last global batch with samples
            from the start of the data set so that every process gets the same number of
            batches (``gather_for_metrics`` drops the duplicates again).
        use_seedable_sampler: ``bool``, default ``False``; shuffle with a sampler seeded from
            ``data_seed`` (or the seed given to ``set_seed``) that yields the same order on
            every process. Without ``data_seed``, process 0's seed is broadcast to the others
            when the loader is prepared, so the shards partition the data even after
            ``set_seed(seed, device_specific=True)`` (Accelerate shuffles each process with
            its own seed there; a warning is issued where the seeds differed).
        data_seed: ``int`` or ``None`` (default); the seed of that sampler's generator.
        non_blocking: ``bool``, default ``False``; copy batches to the device with
            ``non_blocking=True`` (pair with ``pin_memory=True``).
        use_stateful_dataloader: ``bool``, default ``False``; prepared loaders are torchdata's
            ``torchdata.stateful_dataloader.StatefulDataLoader`` (torchdata >= 0.8, the
            ``stateful`` extra: ``pip install torchdata``), as Accelerate's: their
            ``state_dict()`` is torchdata's (with kwplug's position keys), so a data set or
            sampler with ``state_dict``/``load_state_dict`` resumes from its own state, in
            ``load_state_dict``, ``load_state`` and in data loader workers. Without it the
            loaders keep their position too (kwplug's keys only).

    Raises:
        TypeError: a field has the wrong type (``0``/``1`` are not booleans).
        ValueError: ``data_seed`` outside torch's seed range.
        ImportError: ``use_stateful_dataloader=True`` without torchdata >= 0.8 installed.
    """

    split_batches: bool = attrs.field(default=False, validator=strict_bool)
    dispatch_batches: bool | None = attrs.field(default=None, validator=optional_bool)
    even_batches: bool = attrs.field(default=True, validator=strict_bool)
    use_seedable_sampler: bool = attrs.field(default=False, validator=strict_bool)
    data_seed: int | None = attrs.field(default=None, validator=_seed)
    non_blocking: bool = attrs.field(default=False, validator=strict_bool)
    use_stateful_dataloader: bool = attrs.field(
        default=False, validator=[strict_bool, _torchdata_installed]
    )


def _fspath(value: Any) -> Any:
    # Paths become str; anything else is left for _optional_path to reject by name.
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _optional_path(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be a path (str or os.PathLike) or None, got {value!r} "
            f"of type {type(value).__name__}"
        )


@attrs.define
class ProjectConfiguration:
    """Where a project saves checkpoints and logs (Accelerate's fields and defaults).

    Attributes:
        project_dir: ``str`` or ``os.PathLike`` (stored as ``str``), or ``None`` (default);
            the project's folder (trackers' logs unless ``logging_dir`` is set).
        logging_dir: folder for trackers' logs; ``None`` (default) means ``project_dir``.
        automatic_checkpoint_naming: ``bool``, default ``False``. ``True``: ``save_state()``
            saves into ``<project_dir>/checkpoints/checkpoint_<iteration>`` and
            ``load_state()`` reads the newest complete one (see
            :mod:`kwplug.checkpoint._naming`).
        total_limit: ``int`` >= 1 or ``None`` (default, no limit); with automatic naming,
            how many kwplug checkpoints ``checkpoints/`` keeps (older ones are deleted after
            each save; nothing else there is touched).
        iteration: ``int`` >= 0, default 0; the number of the next automatic checkpoint.
            Every ``save_state`` increments it; ``load_state`` of ``checkpoint_<n>`` sets it
            to ``n + 1``.
        save_on_each_node: ``bool``, default ``False``; save on each node's local main
            process instead of only on the global main process.

    Raises:
        TypeError: a field has the wrong type (a path that is not ``str``/``os.PathLike``,
            a bool as a number).
        ValueError: ``total_limit < 1`` or ``iteration < 0``.
    """

    project_dir: str | None = attrs.field(default=None, converter=_fspath, validator=_optional_path)
    logging_dir: str | None = attrs.field(default=None, converter=_fspath, validator=_optional_path)
    automatic_checkpoint_naming: bool = attrs.field(default=False, validator=strict_bool)
    total_limit: int | None = attrs.field(default=None, validator=_optional_int(ge=1))
    iteration: int = attrs.field(default=0, validator=number(integer=True, ge=0))
    save_on_each_node: bool = attrs.field(default=False, validator=strict_bool)

    def __attrs_post_init__(self) -> None:
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``; ``logging_dir`` follows it unless it was given.

        Args:
            project_dir: the new project folder, or ``None``.
        """
        self.project_dir = project_dir  # type: ignore[assignment]  # converted to str
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@attrs.define
class GradientAccumulationPlugin:
    """Gradient accumulation options (Accelerate's fields and defaults).

    A plain configuration object for ``Accelerator(gradient_accumulation_plugin=...)``, not a
    kwargs handler: it answers no hook.

    Attributes:
        num_steps: ``int`` >= 1 or ``None`` (default); batches per optimizer step.
        adjust_scheduler: ``bool``, default ``True``; step prepared schedulers as if no
            accumulation happened (once per optimizer step, not per batch).
        sync_with_dataloader: ``bool``, default ``True``; the end of a prepared data loader
            forces a synchronising step.
        sync_each_batch: ``bool``, default ``False``; synchronise gradients on every batch
            (less memory, more communication).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: ``num_steps < 1``.
    """

    num_steps: int | None = attrs.field(default=None, validator=_optional_int(ge=1))
    adjust_scheduler: bool = attrs.field(default=True, validator=strict_bool)
    sync_with_dataloader: bool = attrs.field(default=True, validator=strict_bool)
    sync_each_batch: bool = attrs.field(default=False, validator=strict_bool)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default, as Accelerate's ``to_kwargs``."""
        return {
            name: value
            for name, default in _accumulation_defaults()
            if (value := getattr(self, name)) != default
        }


@functools.cache
def _accumulation_defaults() -> tuple[tuple[str, Any], ...]:
    # GradientAccumulationPlugin()'s field values, built once (every Accelerator asks its
    # to_kwargs(); the defaults are constants).
    default = GradientAccumulationPlugin()
    return tuple(
        (f.name, getattr(default, f.name)) for f in attrs.fields(GradientAccumulationPlugin)
    )


def _no_fp8(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name}: kwplug has no FP8 training (Accelerate's mixed_precision='fp8' with "
        f"Transformer Engine or torchao); see the `{name}` row of "
        "docs/migrating-from-accelerate.md"
    )


class TERecipeKwargs:
    """Accelerate's Transformer Engine FP8 recipe, under its name and signature so that a
    script importing it imports; kwplug has no FP8 training.

    Raises:
        NotImplementedError: at construction, naming the migration row.
    """

    def __init__(
        self,
        use_autocast_during_eval: bool | None = None,
        margin: int | None = None,
        interval: int | None = None,
        fp8_format: str | None = None,
        amax_history_len: int | None = None,
        amax_compute_algo: str | None = None,
        override_linear_precision: tuple[bool, bool, bool] | None = None,
        use_mxfp8_block_scaling: bool | None = None,
    ) -> None:
        _no_fp8("TERecipeKwargs")


class AORecipeKwargs:
    """Accelerate's torchao FP8 recipe, under its name and signature so that a script
    importing it imports; kwplug has no FP8 training.

    Raises:
        NotImplementedError: at construction, naming the migration row.
    """

    def __init__(
        self,
        config: Any = None,
        module_filter_func: Callable[..., Any] | None = None,
        pad_inner_dim: bool | None = None,
        enable_fsdp_float8_all_gather: bool | None = None,
    ) -> None:
        _no_fp8("AORecipeKwargs")
