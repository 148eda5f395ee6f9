"""``ParallelismConfig``: Accelerate's N-dimensional parallelism configuration as a kwplug
handler. It answers the ``device_mesh`` hook with one ``init_device_mesh`` over every process
and applies tensor parallelism in ``wrap_model``; the data-parallel wrapper (FSDP2, HSDP or
DDP) is the next plugin's answer on the same mesh."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from torch import nn

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.plugins.parallelism import _tp
from kwplug.validators import shown

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Accelerate's canonical order of the mesh dimensions.
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


def _size(name: str, value: Any) -> int:
    if value is None:
        value = os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1")
        value = int(value) if value.strip().isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"ParallelismConfig.{name} must be an int >= 1, got {shown(value)} of type "
            f"{type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"ParallelismConfig.{name} must be at least 1, got {value}")
    return value


@attrs.define
class ParallelismConfig(KwargsHandler):
    """How the processes split the work: one device mesh of data-parallel replication
    (``dp_replicate``), data-parallel sharding (``dp_shard``) and tensor parallelism (``tp``).

    Pass it as ``Accelerator(parallelism_config=...)`` (Accelerate's keyword). At construction
    the Accelerator builds ONE ``torch.distributed.device_mesh.init_device_mesh(device_type,
    shape, mesh_dim_names=...)`` with Accelerate's names and order (``dp_replicate``,
    ``dp_shard``, ``tp``; only the sizes > 1) and its flattened dimensions (``dp``: every data
    parallel dimension, ``dp_shard_cp``, ``dp_cp``); it is ``accelerator.torch_device_mesh``.
    Prepared data loaders shard over the ``dp`` ranks only (the ranks of one TP group read the
    same batches). ``prepare(model)`` applies tensor parallelism on the ``tp`` dimension
    (``parallelize_module``), then the data-parallel wrapper on the rest: with
    ``fsdp_plugin``, FSDP2 over ``dp_shard`` or HSDP over ``(dp_replicate, dp_shard)``;
    without, DDP over ``dp_replicate``.

    Attributes:
        dp_replicate_size, dp_shard_size, tp_size: ``int`` >= 1 (``None``:
            ``PARALLELISM_CONFIG_<FIELD>``, default 1). Their product must equal the number
            of processes (all 1: ``dp_replicate_size`` becomes the number of processes, as
            Accelerate). ``dp_shard_size > 1`` needs ``fsdp_plugin``; ``tp_size > 1`` with
            ``dp_replicate_size > 1`` needs ``dp_shard_size > 1`` (no DDP + TP, as Accelerate).
        cp_size: ``1`` only: context parallelism shards attention, which has no CPU sharding
            strategy in torch; ``cp_backend``: ``"torch"`` (``None``:
            ``PARALLELISM_CONFIG_CP_BACKEND``, default ``"torch"``).
        sp_size: ``1`` only (DeepSpeed's sequence parallelism); ``sp_backend``:
            ``"deepspeed"`` (``None``: ``PARALLELISM_CONFIG_SP_BACKEND``, default
            ``"deepspeed"``).
        tp_handler: the tensor-parallel plan (kwplug): a mapping of module path (``*``
            matches one level) to a torch ``ParallelStyle`` or ``"colwise"``/``"rowwise"``/
            ``"colwise_rep"``/``"rowwise_rep"``/``"sequence_parallel"``; ``None``: the model's
            own ``tp_plan``/``_tp_plan`` (a transformers model loaded with ``tp_plan="auto"`` is
            already parallel and is left as it is).
        cp_handler, sp_handler: ``None`` only.
        device_mesh: the mesh once built (:meth:`get_device_mesh`), else ``None``.

    Raises:
        TypeError: a size is not an int; ``tp_handler`` is not a plan.
        ValueError: a size < 1; ``cp_size``/``sp_size`` > 1; a handler for them; a
            ``cp_backend``/``sp_backend`` other than ``"torch"``/``"deepspeed"``; an unknown
            style name. At ``Accelerator()``: the sizes' product is not the number of
            processes.
    """

    register_default: ClassVar[bool] = False

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    device_mesh: Any = attrs.field(default=None, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            setattr(self, name, _size(name, getattr(self, name)))
        for name in ("cp_backend", "sp_backend"):  # Accelerate's variables, as the sizes'
            if getattr(self, name) is None:
                setattr(self, name, os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}"))
        if self.cp_backend not in (None, "torch"):
            raise ValueError(
                f"ParallelismConfig.cp_backend must be 'torch', got {shown(self.cp_backend)}"
            )
        if self.cp_size != 1 or self.cp_handler is not None:
            raise ValueError(
                f"ParallelismConfig.cp_size must be 1 (got {self.cp_size}) and cp_handler None: "
                "kwplug has no context parallelism (torch's context_parallel shards attention "
                "with a device-specific kernel and has no CPU strategy); use tp_size or "
                "dp_shard_size"
            )
        if self.sp_size != 1 or self.sp_handler is not None:
            raise ValueError(
                f"ParallelismConfig.sp_size must be 1 (got {self.sp_size}) and sp_handler None: "
                "sequence parallelism is DeepSpeed's (ALST/Ulysses), which kwplug does not run"
            )
        if self.sp_backend not in (None, "deepspeed"):
            raise ValueError(
                f"ParallelismConfig.sp_backend must be 'deepspeed', got {shown(self.sp_backend)}"
            )
        self.cp_backend = self.cp_backend or "torch"
        self.sp_backend = self.sp_backend or "deepspeed"
        if self.tp_handler is not None:
            self.tp_handler = _tp.check_plan(self.tp_handler, "ParallelismConfig.tp_handler")

    @classmethod
    def from_launcher(cls) -> ParallelismConfig | None:
        """The configuration ``accelerate launch --use_parallelism_config`` (or a config file's
        ``parallelism_config``; ``kwplug launch`` alike) asks for: ``cls()`` -- every size read
        from its ``PARALLELISM_CONFIG_*`` variable -- when ``ACCELERATE_USE_PARALLELISM_CONFIG``
        is ``"true"`` (any case; Accelerate's ``Accelerator`` rule), else ``None``.
        ``Accelerator()`` calls it when no ``parallelism_config`` is passed.

        Raises:
            ValueError, TypeError: a variable holds what the class does not take (as at
                construction; e.g. ``PARALLELISM_CONFIG_CP_SIZE=2``).
        """
        if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
            return None
        return cls()

    # -- Accelerate's derived names and sizes -------------------------------------------

    @property
    def dp_replicate_enabled(self) -> bool:
        """``dp_replicate_size > 1``."""
        return self._sizes["dp_replicate"] > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """``dp_shard_size > 1``."""
        return self._sizes["dp_shard"] > 1

    @property
    def tp_enabled(self) -> bool:
        """``tp_size > 1``."""
        return self._sizes["tp"] > 1

    @property
    def cp_enabled(self) -> bool:
        """``cp_size > 1`` (always false in kwplug)."""
        return self._sizes["cp"] > 1

    @property
    def sp_enabled(self) -> bool:
        """``sp_size > 1`` (always false in kwplug)."""
        return self._sizes["sp"] > 1

    @property
    def _sizes(self) -> dict[str, int]:
        return {
            "dp_replicate": int(self.dp_replicate_size or 1),
            "dp_shard": int(self.dp_shard_size or 1),
            "cp": int(self.cp_size or 1),
            "sp": int(self.sp_size or 1),
            "tp": int(self.tp_size or 1),
        }

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel dimensions (flattened into ``dp``)."""
        return [n for n in ("dp_replicate", "dp_shard") if self._sizes[n] > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks read the same batch."""
        return [n for n in ("tp", "cp", "sp") if self._sizes[n] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The dimensions FSDP shards over (flattened into ``dp_shard_cp``)."""
        return [n for n in ("dp_shard", "cp") if self._sizes[n] > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The dimensions the loss is averaged over (flattened into ``dp_cp``)."""
        return [n for n in ("dp_replicate", "dp_shard", "cp") if self._sizes[n] > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dimensions of FSDP's mesh: ``dp_replicate`` when enabled, ``dp_shard_cp``."""
        return ["dp_replicate"] * self.dp_replicate_enabled + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        """The product of every size."""
        sizes = self._sizes
        return sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"] * sizes["cp"] * sizes["sp"]

    @property
    def non_data_parallel_size(self) -> int:
        """``tp_size * cp_size * sp_size``."""
        return self._sizes["tp"] * self._sizes["cp"] * self._sizes["sp"]

    @property
    def data_parallel_size(self) -> int:
        """``dp_replicate_size * dp_shard_size``."""
        return self._sizes["dp_replicate"] * self._sizes["dp_shard"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """``dp_dim_names + non_dp_dim_names``."""
        return self.dp_dim_names + self.non_dp_dim_names

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (the mesh left out), as Accelerate's."""
        return {
            f.name: getattr(self, f.name)
            for f in attrs.fields(type(self))
            if f.init and f.name != "tp_handler"
        }

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """One ``init_device_mesh(device_type, shape, mesh_dim_names=names)`` over the enabled
        dimensions in Accelerate's order, with the flattened ``dp``, ``dp_shard_cp`` and
        ``dp_cp`` dimensions (``DeviceMesh._flatten``, as Accelerate); ``None`` when every
        size is 1."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = sorted(self.active_mesh_dims, key=MESH_ORDER.index)
        if not dims:
            return None
        shape = tuple(self._sizes[d] for d in dims)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(dims))
        for names, flat in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if names:
                mesh[tuple(names)]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh | None:
        """The mesh, built on first call for ``device_type``.

        Raises:
            ValueError: not built yet and no ``device_type``; built for another type.
        """
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("You need to pass a device_type e.g cuda to build the device mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device_mesh is already created with device type "
                f"{self.device_mesh.device_type}, not {device_type}"
            )
        mesh: DeviceMesh | None = self.device_mesh
        return mesh

    # -- hooks --------------------------------------------------------------------------

    @hookimpl
    def validate_setup(self, world_size: int) -> None:
        """Check the sizes against the number of processes (all 1: ``dp_replicate_size``
        becomes ``world_size``, as Accelerate's ``_validate_accelerator``).

        Raises:
            ValueError: the sizes' product is not ``world_size``.
        """
        if self.total_size == 1 and world_size > 1:
            self.dp_replicate_size = world_size
        if self.total_size != world_size:
            raise ValueError(
                f"ParallelismConfig total_size ({self.total_size} = dp_replicate_size "
                f"{self.dp_replicate_size} x dp_shard_size {self.dp_shard_size} x tp_size "
                f"{self.tp_size}) does not match the number of processes ({world_size})"
            )

    @hookimpl(specname="device_mesh")
    def mesh_hook(self, device_type: str, world_size: int) -> DeviceMesh | None:
        """The device mesh (:meth:`get_device_mesh`); ``None`` in one process."""
        if world_size <= 1:
            return None
        return self.get_device_mesh(device_type)

    @hookimpl
    def wrap_model(self, model: nn.Module, device_mesh: DeviceMesh | None) -> nn.Module | None:
        """Tensor-parallelise ``model`` over the mesh's ``tp`` dimension (in place); return it
        when no data-parallel dimension is left, else ``None`` so that the FSDP2 plugin (or
        DDP) wraps it over the data-parallel dimensions.

        Raises:
            ValueError: ``tp_size > 1`` with ``dp_replicate_size > 1`` and no ``dp_shard``
                (no DDP + TP); no plan for the model (see :mod:`._tp`).
        """
        if device_mesh is None:
            return None
        if self.tp_enabled:
            if self.dp_replicate_enabled and not self.dp_shard_enabled:
                raise ValueError(
                    "ParallelismConfig: tp_size > 1 with dp_replicate_size > 1 needs "
                    "dp_shard_size > 1 and fsdp_plugin (HSDP + TP); DDP + TP is not supported, "
                    "as in Accelerate"
                )
            _tp.parallelize(model, device_mesh["tp"], self.tp_handler)
        if self.dp_shard_enabled:
            # Only a sharding plugin may answer next; DDP would replicate over every process.
            model.register_forward_pre_hook(_require_sharded)
        if self.dp_dim_names:
            return None
        return model


def _require_sharded(module: nn.Module, args: Any) -> None:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        raise ValueError(
            "ParallelismConfig(dp_shard_size>1) needs a sharding plugin: pass "
            "fsdp_plugin=FullyShardedDataParallelPlugin(...) to the Accelerator (the model was "
            "not sharded, so its parameters would not be split over dp_shard)"
        )
