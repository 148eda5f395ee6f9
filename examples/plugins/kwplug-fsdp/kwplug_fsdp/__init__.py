"""kwplug-fsdp: shard models with PyTorch's FSDP2 (``fully_shard``) through kwplug's hooks.

``FullyShardedKwargs`` is an opt-in handler: pass it in ``kwargs_handlers`` (or configure it
as ``[handlers.fsdp]`` in a file for ``Accelerator.from_config``) and ``accelerator.prepare``
shards the model instead of wrapping it in ``DistributedDataParallel``. The plugin uses only
kwplug's public API.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

import kwplug
from kwplug.validators import optional_bool, strict_bool

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DTYPES", "FullyShardedKwargs"]
__version__ = "0.1.0"

#: The dtype names accepted by the ``*_dtype`` fields (``torch.dtype`` objects are converted).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Accelerator(mixed_precision=...) -> the dtype parameters are all-gathered in for compute.
_PARAM_DTYPES: dict[str, str | None] = {"no": None, "bf16": "bfloat16", "fp16": "float16"}

ModuleSelector = str | type[nn.Module]


def _fsdp2() -> Any:
    """The module holding ``fully_shard`` and ``MixedPrecisionPolicy``.

    Imported on first use: torch.distributed.fsdp takes over a second to import, which every
    process would pay at start-up (kwplug imports each installed plugin) even without FSDP.
    """
    fsdp = importlib.import_module("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):  # torch 2.4/2.5: FSDP2 was not yet public
        fsdp = importlib.import_module("torch.distributed._composable.fsdp")
    return fsdp


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(map(repr, values))


def _to_selectors(value: Any) -> Any:
    # TOML gives lists; one name or class is a one-element selection. Anything else is left
    # for the validator to reject with a message naming the field.
    if isinstance(value, (str, type)):
        return (value,)
    if isinstance(value, list):
        return tuple(value)
    return value


def _check_selectors(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    wanted = (
        "a tuple or list of module class names (str, e.g. 'Linear' or "
        "'torch.nn.modules.linear.Linear') or torch.nn.Module subclasses"
    )
    if not isinstance(value, tuple):
        raise TypeError(
            f"'{attribute.name}' must be {wanted}, got {value!r} of type {type(value).__name__}"
        )
    for item in value:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError(
                    f"'{attribute.name}' holds an empty class name; it must be {wanted}"
                )
        elif not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                f"'{attribute.name}' must be {wanted}, got the item {item!r} of type "
                f"{type(item).__name__}"
            )


def _to_dtype_name(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
    return value


def _check_dtype(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    wanted = f"None, one of {_quoted(DTYPES)} or the torch.dtype of one"
    if value is None:
        return
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(
            f"'{attribute.name}' must be {wanted}, got {value!r} of type {type(value).__name__}"
        )
    if value not in DTYPES:
        raise ValueError(f"'{attribute.name}' must be {wanted}, got {value!r}")


def _check_min_num_params(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"'{attribute.name}' must be an int >= 0 (0: no size-based sharding), got {value!r} "
            f"of type {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(
            f"'{attribute.name}' must be an int >= 0 (0: no size-based sharding), got {value!r}"
        )


@attrs.define
class FullyShardedKwargs(kwplug.KwargsHandler):
    """Shard the prepared model with FSDP2, ``torch.distributed.fsdp.fully_shard``.

    Opt-in (``register_default = False``): it answers only when passed in ``kwargs_handlers``,
    and then its ``wrap_model`` answers before the built-in DDP handler. Under ``torchrun``
    with ``world_size > 1``, ``accelerator.prepare(model)`` builds a one-dimensional
    ``DeviceMesh`` over all ranks (``init_device_mesh(device.type, (world_size,))``), calls
    ``fully_shard`` on each selected submodule (children before parents) and last on the model
    itself, and returns the model (the same object, now an ``FSDPModule``). Its parameters are
    then ``DTensor`` shards (``Shard(0)``): each rank holds about ``1/world_size`` of each.
    Gradients are reduce-scattered, so every rank's optimizer steps its own shard; kwplug's
    ``prepare`` points optimizers created before it at the new parameters.

    In a single process (``world_size == 1``) the handler declines: the model is used
    unwrapped, so the same script runs with ``python train.py``. The class names in
    ``shard_modules`` are still checked against the model, so a misspelt name fails there too.

    Attributes:
        shard_modules: ``tuple`` (a ``list`` or a single item is converted) of module
            classes, default ``()``. Each submodule that is an instance of one of them is
            sharded on its own (its own ``fully_shard`` call, hence its own all-gather and
            reduce-scatter: only one such group's full parameters are in memory at a time). An
            item is a ``torch.nn.Module`` subclass or a class name: ``"Linear"`` or the
            qualified ``"torch.nn.modules.linear.Linear"``, matched against the module's class
            and its base classes. With ``()`` (and ``min_num_params=0``) only the root is
            sharded: one group holding every parameter. FSDP1 calls this an auto-wrap policy
            (Accelerate: ``transformer_cls_names_to_wrap``).
        min_num_params: ``int`` >= 0, default ``0`` (off). Also shard on its own each
            submodule holding at least this many parameters that are not already in a
            sharded descendant (FSDP1's ``size_based_auto_wrap_policy``).
        reshard_after_forward: ``bool`` or ``None`` (default: torch's choice, ``True`` for
            submodules and ``False`` for the root); ``fully_shard(reshard_after_forward=...)``.
            ``True`` frees the full parameters after forward and all-gathers them again in
            backward (less memory); ``False`` keeps them until after backward (less
            communication).
        cast_params: ``bool``, default ``True``. Under the Accelerator's ``mixed_precision``
            ``"bf16"``/``"fp16"``, all-gather the parameters in bfloat16/float16 for forward
            and backward (``MixedPrecisionPolicy(param_dtype=...)``); the sharded parameters
            and the optimizer stay in float32. ``False`` keeps float32 parameters and leaves
            the low precision to ``accelerator.autocast()`` alone.
        reduce_dtype: ``None`` (default), ``"float32"``, ``"bfloat16"`` or ``"float16"`` (or
            the ``torch.dtype``; stored as the name): the dtype gradients are reduce-scattered
            in (``MixedPrecisionPolicy(reduce_dtype=...)``). ``None`` means float32 whenever
            the parameters are cast, else torch's default (the parameters' dtype). A low
            precision here compresses the gradient communication, like DDP's ``bf16`` hook.
        output_dtype: ``None`` (default: outputs as computed) or a dtype name as above: cast
            the root module's floating-point outputs (``MixedPrecisionPolicy(output_dtype=...)``).
        cast_forward_inputs: ``bool``, default ``True``; cast floating-point forward inputs to
            the parameter dtype (``MixedPrecisionPolicy(cast_forward_inputs=...)``).

    Raises:
        TypeError: a field has the wrong type (``0``/``1`` are not bools; ``min_num_params``
            is not an ``int``; an item of ``shard_modules`` is neither a ``str`` nor a module
            class). The message names the field and what it accepts.
        ValueError: an empty class name; ``min_num_params < 0``; a dtype name other than
            ``"float32"``, ``"bfloat16"``, ``"float16"``. At ``prepare``: an item of
            ``shard_modules`` that matches no submodule of the model (the message lists the
            model's module classes).
    """

    register_default: ClassVar[bool] = False  # opt-in: answers only when passed by the user

    shard_modules: tuple[ModuleSelector, ...] = attrs.field(
        default=(), converter=_to_selectors, validator=_check_selectors
    )
    min_num_params: int = attrs.field(default=0, validator=_check_min_num_params)
    reshard_after_forward: bool | None = attrs.field(default=None, validator=optional_bool)
    cast_params: bool = attrs.field(default=True, validator=strict_bool)
    reduce_dtype: str | None = attrs.field(
        default=None, converter=_to_dtype_name, validator=_check_dtype
    )
    output_dtype: str | None = attrs.field(
        default=None, converter=_to_dtype_name, validator=_check_dtype
    )
    cast_forward_inputs: bool = attrs.field(default=True, validator=strict_bool)

    def mixed_precision_policy(self, mixed_precision: str) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` given to ``fully_shard`` for the Accelerator's setting.

        ``"bf16"`` -> ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32)``, ``"fp16"`` likewise with ``torch.float16``, ``"no"``
        -> no casting (``param_dtype=None``); ``reduce_dtype``, ``output_dtype``,
        ``cast_params`` and ``cast_forward_inputs`` adjust it as described on the class.

        Raises:
            ValueError: ``mixed_precision`` is not ``"no"``, ``"fp16"`` or ``"bf16"``.
        """
        if mixed_precision not in _PARAM_DTYPES:
            raise ValueError(
                f"mixed_precision must be one of {_quoted(_PARAM_DTYPES)}, got {mixed_precision!r}"
            )
        param = _PARAM_DTYPES[mixed_precision] if self.cast_params else None
        # Low-precision parameters but full-precision gradient sums, unless told otherwise.
        reduce = self.reduce_dtype or ("float32" if param is not None else None)
        policy: MixedPrecisionPolicy = _fsdp2().MixedPrecisionPolicy(
            param_dtype=DTYPES[param] if param else None,
            reduce_dtype=DTYPES[reduce] if reduce else None,
            output_dtype=DTYPES[self.output_dtype] if self.output_dtype else None,
            cast_forward_inputs=self.cast_forward_inputs,
        )
        return policy

    def modules_to_shard(self, model: nn.Module) -> list[nn.Module]:
        """The submodules of ``model`` sharded on their own, children before parents; the
        root itself is not in the list (it is always sharded, last).

        Raises:
            ValueError: an item of ``shard_modules`` matches no submodule of ``model``.
        """
        chosen: list[nn.Module] = []
        covered: set[int] = set()  # ids of parameters already in a chosen submodule
        matched: set[int] = set()  # indices of shard_modules items that matched something
        for module in _post_order(model):
            if module is model:
                continue
            hits = [i for i, sel in enumerate(self.shard_modules) if _matches(module, sel)]
            matched.update(hits)
            own = [p for p in module.parameters() if id(p) not in covered]
            big = self.min_num_params > 0 and sum(p.numel() for p in own) >= self.min_num_params
            if hits or big:
                chosen.append(module)
                covered.update(id(p) for p in own)
        missing = [sel for i, sel in enumerate(self.shard_modules) if i not in matched]
        if missing:
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ValueError(
                f"FullyShardedKwargs.shard_modules: {_quoted(map(_selector_name, missing))} "
                f"match(es) no submodule of {type(model).__name__}; its submodule classes are "
                f"{_quoted(present) or 'none'}"
            )
        return chosen

    @kwplug.hookimpl
    def wrap_model(
        self, model: nn.Module, device: torch.device, world_size: int, mixed_precision: str
    ) -> nn.Module | None:
        """Shard ``model`` with ``fully_shard`` when distributed; ``None`` in one process.

        Args:
            model: the user's module, already on ``device``.
            device: its device; ``device.type`` is the device mesh's type (``"cpu"``: gloo).
            world_size: number of processes; ``<= 1`` declines (model used unwrapped).
            mixed_precision: the Accelerator's setting, see :meth:`mixed_precision_policy`.

        Returns:
            ``model`` itself, sharded in place (an ``FSDPModule``), or ``None``.

        Raises:
            ValueError: see :meth:`modules_to_shard` (raised before any collective runs).
            RuntimeError: ``world_size > 1`` but no default process group exists.
        """
        targets = self.modules_to_shard(model)  # checked in one process too
        if world_size <= 1:
            return None
        if not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedKwargs: world_size > 1 but torch.distributed has no default "
                "process group (run under torchrun through a kwplug Accelerator)"
            )
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fsdp2().fully_shard
        options: dict[str, Any] = {
            "mesh": init_device_mesh(device.type, (world_size,)),
            "mp_policy": self.mixed_precision_policy(mixed_precision),
        }
        if self.reshard_after_forward is not None:  # else torch's own default (per version)
            options["reshard_after_forward"] = self.reshard_after_forward
        for module in targets:
            fully_shard(module, **options)
        fully_shard(model, **options)  # the root last: it owns whatever is left
        return model

    @kwplug.hookimpl
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None] | None:
        """Skip FSDP2's gradient reduce-scatter while gradients accumulate.

        For a model sharded by ``fully_shard`` (an ``FSDPModule``), returns a context that
        calls ``model.set_requires_gradient_sync(False)`` (every sharded submodule) and
        ``set_requires_gradient_sync(True)`` on exit: backward passes inside it keep unsharded
        gradients locally, and the first backward after it reduce-scatters their sum.
        ``None`` for any other model.
        """
        if not isinstance(model, _fsdp2().FSDPModule):
            return None
        return _gradient_sync_off(model)


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _post_order(model: nn.Module) -> Iterator[nn.Module]:
    # Children before parents; a module shared by two parents is visited once.
    seen: set[int] = set()

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                yield from visit(child)
        yield module

    yield from visit(model)


def _matches(module: nn.Module, selector: ModuleSelector) -> bool:
    if isinstance(selector, type):
        return isinstance(module, selector)
    return any(
        selector in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
        for cls in type(module).__mro__
    )


def _selector_name(selector: ModuleSelector) -> str:
    return selector if isinstance(selector, str) else selector.__qualname__
