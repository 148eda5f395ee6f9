"""``FullyShardedDataParallelPlugin``: Accelerate's FSDP plugin (``fsdp_version=2``) as a
kwplug handler that shards prepared models with torch's ``fully_shard``."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from torch import nn

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.plugins.fsdp import _fields, _shard
from kwplug.utils.dataclasses import DistributedType
from kwplug.utils.device_mesh import submesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_FSDP1 = "an FSDP1 (FullyShardedDataParallel) option; kwplug shards with FSDP2's fully_shard"


@attrs.define
class FullyShardedDataParallelPlugin(KwargsHandler):
    """Shard the prepared model with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Pass it as ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))`` (Accelerate's
    keyword) or in ``kwargs_handlers``; it is opt-in, nothing is sharded without it. Under
    torchrun with several processes, ``prepare(model)`` shards the model in place over the data
    parallel ranks -- the ``dp_shard_cp`` dimension of the ``ParallelismConfig``'s device mesh,
    ``(dp_replicate, dp_shard_cp)`` for HSDP, else a 1-D mesh over every process -- and returns
    it (an ``FSDPModule``: ``DTensor`` parameters, each rank holding ``1/n`` of each);
    optimizers are pointed at the sharded parameters. In one process it declines (the model is
    used as it is). ``accelerator.distributed_type`` is ``DistributedType.FSDP`` and
    ``accelerator.is_fsdp2`` is true.

    The fields are Accelerate 1.16's, in its order; ``None`` reads the ``FSDP_*`` environment
    variable Accelerate reads, then Accelerate's FSDP2 default.

    Attributes:
        fsdp_version: ``2`` (``None``: ``FSDP_VERSION``, else 2; Accelerate's default is 1).
        sharding_strategy: ``None`` only (FSDP1; use ``reshard_after_forward``).
        reshard_after_forward: ``bool`` (``"true"``/``"false"`` read as bools; ``None``:
            ``FSDP_RESHARD_AFTER_FORWARD``, default ``True``): ``fully_shard``'s option for
            the auto-wrapped submodules (the root keeps torch's default, ``False``).
        backward_prefetch: ``None`` or ``"NO_PREFETCH"`` (FSDP1).
        mixed_precision_policy: ``None`` (default: under ``Accelerator(mixed_precision=
            "bf16"/"fp16")``, ``MixedPrecisionPolicy(param_dtype=d, reduce_dtype=d)`` as
            Accelerate, gradients reduced in that dtype), a name (``"bf16"``, ``"fp16"``,
            ``"fp32"``, ``"fp8"``), a ``dict`` with ``param_dtype``/``reduce_dtype`` or a
            ``torch.distributed.fsdp.MixedPrecisionPolicy``; stored as the policy.
        auto_wrap_policy: ``"transformer_based_wrap"`` (the classes named by
            ``transformer_cls_names_to_wrap``, default the model's ``_no_split_modules``),
            ``"size_based_wrap"`` (every module with more than ``min_num_params``
            parameters), ``"no_wrap"`` (the root only) -- any case, stored upper-case; torch's
            ``transformer_auto_wrap_policy``/``size_based_auto_wrap_policy`` stand for those;
            or a callable ``policy(module) -> bool``. ``None``: ``FSDP_AUTO_WRAP_POLICY``,
            default ``"NO_WRAP"``. Each selected submodule gets its own ``fully_shard``
            (children first).
        cpu_offload: ``bool`` or ``OffloadPolicy``, stored as ``CPUOffloadPolicy()``
            (``True``) or ``OffloadPolicy()``; ``fully_shard(offload_policy=...)``.
        ignored_modules: ``None``, a regular expression over module names (full match), or
            modules; their parameters are left unsharded (``fully_shard(ignored_params=...)``).
        state_dict_type: ``"FULL_STATE_DICT"`` or ``"SHARDED_STATE_DICT"`` (default, as
            Accelerate's FSDP2): what ``save_state`` writes (read by kwplug's checkpoints).
        state_dict_config, optim_state_dict_config: torch's ``StateDictConfig`` /
            ``OptimStateDictConfig`` (``None``: Accelerate's default for ``state_dict_type``,
            ``offload_to_cpu=True``, and ``rank0_only=True`` for full state dicts); their
            ``offload_to_cpu``/``rank0_only`` are what FSDP2's state dicts read.
        limit_all_gathers: ``bool``, default ``True``; FSDP1's rate limiter, which FSDP2 does
            not have (ignored, as Accelerate ignores it for FSDP2).
        use_orig_params: ``None`` or ``True`` (FSDP2 always uses the original parameters).
        param_init_fn: ``None`` only. sync_module_states: ``None`` or ``False`` (use
            ``cpu_ram_efficient_loading``). forward_prefetch: ``None`` or ``False``.
        activation_checkpointing: ``bool`` (``None``: ``FSDP_ACTIVATION_CHECKPOINTING``):
            recompute the auto-wrapped modules' forward in backward (``torch.utils.checkpoint``,
            non-reentrant); needs an ``auto_wrap_policy``.
        activation_checkpointing_offload: ``bool``; also keep their saved inputs on the CPU
            (``torch.autograd.graph.save_on_cpu``); needs ``activation_checkpointing``.
        cpu_ram_efficient_loading: ``bool``: after sharding, rank 0's weights are broadcast
            into every rank's shards (``set_model_state_dict(broadcast_from_rank0=True)``), so
            only rank 0 needs the real weights.
        transformer_cls_names_to_wrap: class names (a list, or one comma-separated str).
        min_num_params: ``int`` >= 0 for ``"size_based_wrap"`` (``FSDP_MIN_NUM_PARAMS``).

    Raises:
        ValueError: ``fsdp_version`` other than 2; an FSDP1-only option set (the message
            names it); an unknown policy, precision or state dict type name;
            ``activation_checkpointing_offload`` without ``activation_checkpointing``.
        TypeError: a field of the wrong type (named in the message).
    """

    register_default: ClassVar[bool] = False  # opt-in: answers only when the user passes it
    #: What ``accelerator.distributed_type`` reports while this handler is passed.
    distributed_type: ClassVar[DistributedType] = DistributedType.FSDP

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | str | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: int | None = None

    def __attrs_post_init__(self) -> None:
        unset = _fields.must_be_unset
        self.fsdp_version = _fields.fsdp_version(self.fsdp_version)
        unset(
            "sharding_strategy",
            self.sharding_strategy,
            (None,),
            "FSDP1's ShardingStrategy; use reshard_after_forward (True: FULL_SHARD, False: "
            "SHARD_GRAD_OP) and a ParallelismConfig's dp_replicate_size for HYBRID_SHARD",
        )
        self.reshard_after_forward = _fields.reshard_after_forward(self.reshard_after_forward)
        _fields.backward_prefetch(self.backward_prefetch)
        self.backward_prefetch = None
        self.mixed_precision_policy = _fields.mixed_precision_policy(self.mixed_precision_policy)
        self.auto_wrap_policy = _fields.auto_wrap_policy(self.auto_wrap_policy)
        self.cpu_offload = _fields.cpu_offload(self.cpu_offload)
        self.ignored_modules = _fields.ignored_modules(self.ignored_modules)
        self.state_dict_type = _fields.state_dict_type(self.state_dict_type)
        self.state_dict_config = _fields.state_dict_config(
            "state_dict_config", self.state_dict_config, self.state_dict_type, optim=False
        )
        self.optim_state_dict_config = _fields.state_dict_config(
            "optim_state_dict_config", self.optim_state_dict_config, self.state_dict_type, True
        )
        _fields.check_bool("limit_all_gathers", self.limit_all_gathers)
        unset(
            "use_orig_params",
            self.use_orig_params,
            (None, True),
            "FSDP2 always trains the original parameters",
        )
        unset(
            "param_init_fn",
            self.param_init_fn,
            (None,),
            "FSDP1's meta-device initialiser; use cpu_ram_efficient_loading",
        )
        unset(
            "sync_module_states",
            self.sync_module_states,
            (None, False),
            "FSDP1's broadcast of rank 0's weights; use cpu_ram_efficient_loading",
        )
        unset(
            "forward_prefetch",
            self.forward_prefetch,
            (None, False),
            "not implemented by FSDP2 (Accelerate raises too)",
        )
        for name in (
            "activation_checkpointing",
            "activation_checkpointing_offload",
            "cpu_ram_efficient_loading",
        ):
            value = _fields.env_flag(name.upper(), getattr(self, name))
            setattr(self, name, _fields.check_bool(name, value))
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError(
                "FullyShardedDataParallelPlugin.activation_checkpointing_offload=True requires "
                "activation_checkpointing=True"
            )
        policy = self.auto_wrap_policy
        self.transformer_cls_names_to_wrap = _fields.class_names(
            self.transformer_cls_names_to_wrap, policy
        )
        self.min_num_params = _fields.min_num_params(self.min_num_params, policy)

    @classmethod
    def from_launcher(cls) -> FullyShardedDataParallelPlugin | None:
        """The plugin ``accelerate launch --use_fsdp`` (or a config file's
        ``distributed_type: FSDP``; ``kwplug launch`` alike) asks for: ``cls()`` -- every field
        read from its ``FSDP_*`` variable -- when ``ACCELERATE_USE_FSDP`` is ``"true"`` (any
        case; Accelerate's ``Accelerator`` rule), else ``None``. ``Accelerator()`` calls it
        when no ``fsdp_plugin`` is passed.

        Raises:
            ValueError, TypeError: a variable holds what the plugin does not take (as at
                construction; e.g. ``FSDP_VERSION=1``).
        """
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
            return None
        return cls()

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from a default plugin's (Accelerate's ``KwargsHandler``
        rule; the environment is read as at construction)."""
        default = type(self)()
        return {
            field.name: getattr(self, field.name)
            for field in attrs.fields(type(self))
            if repr(getattr(self, field.name)) != repr(getattr(default, field.name))
        }

    @hookimpl
    def device_mesh(self, device_type: str, world_size: int) -> DeviceMesh | None:
        """Without a ``ParallelismConfig`` (which answers first when passed), a 1-D mesh over
        every process: ``ParallelismConfig(dp_shard_size=world_size)``'s. ``None`` in one
        process."""
        if world_size <= 1:
            return None
        from kwplug.plugins.parallelism import ParallelismConfig

        return ParallelismConfig(dp_shard_size=world_size).build_device_mesh(device_type)

    @hookimpl
    def wrap_model(
        self,
        model: nn.Module,
        world_size: int,
        mixed_precision: str,
        device_mesh: DeviceMesh | None,
    ) -> nn.Module | None:
        """Shard ``model`` in place (see the class) and return it; ``None`` in one process.

        Raises:
            ValueError: the device mesh has no dimension to shard over (``dp_shard_size`` and
                ``cp_size`` both 1); a ``transformer_cls_names_to_wrap`` name is no class of
                the model; ``activation_checkpointing`` without an ``auto_wrap_policy``.
        """
        if world_size <= 1:
            return None
        mesh = device_mesh
        if mesh is None:  # another plugin's hook declined; build the 1-D mesh here
            mesh = self.device_mesh(_device_type(model), world_size)
        assert mesh is not None
        return _shard.shard(self, model, _fsdp_mesh(mesh), mixed_precision)

    @hookimpl
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None] | None:
        """For a sharded model, ``set_requires_gradient_sync(False)`` until the context exits
        (gradients kept unsharded locally; the next synchronising backward reduce-scatters
        their sum); ``None`` for any other model."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return None
        return _shard.gradient_sync_off(model)


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def _fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    # Accelerate's ParallelismConfig.fsdp_dim_names: shard over dp_shard (and cp), replicate
    # over dp_replicate (HSDP: a 2-D mesh for fully_shard).
    names = mesh.mesh_dim_names or ()
    try:
        # dp_shard_cp is a flattened dim: slicing it from the root mesh warns on torch 2.11+.
        if "dp_replicate" in names:
            return submesh(mesh, "dp_replicate", "dp_shard_cp")
        return submesh(mesh, "dp_shard_cp")
    except KeyError:
        raise ValueError(
            "FullyShardedDataParallelPlugin: the ParallelismConfig leaves no dimension to shard "
            "over (dp_shard_size and cp_size are both 1); set dp_shard_size > 1 or drop "
            "fsdp_plugin"
        ) from None
