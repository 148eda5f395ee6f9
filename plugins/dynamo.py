"""``TorchDynamoPlugin``: answers the ``compile_model`` hook with ``torch.compile``.

Accelerate's ``Accelerator(dynamo_backend=...)`` and ``Accelerator(dynamo_plugin=...)``: the
Accelerator passes this handler on (the built-in default instance reads Accelerate's
``ACCELERATE_DYNAMO_*`` variables, so ``accelerate launch --dynamo_backend`` settings apply),
and ``prepare`` hands it each model last, after the wrapper (DDP), as Accelerate does.
``Accelerator.unwrap_model(model, keep_torch_compile=False)`` takes the compiled wrapper off
again; ``save_model``/``save_state`` store the module's own keys (no ``_orig_mod.``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch

from kwplug.handler import TO_KWARGS, KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.utils.environment import str_to_bool
from kwplug.validators import optional_bool, shown, strict_bool

#: Accelerate's environment variables (``accelerate launch`` sets them).
_PREFIX = "ACCELERATE_DYNAMO_"


class DynamoBackend(str, enum.Enum):
    """A ``torch.compile`` backend, Accelerate's ``DynamoBackend`` members and values.

    A ``str`` enum (``DynamoBackend.EAGER == "EAGER"``); ``torch.compile`` gets the lower-case
    value (``backend="eager"``). ``NO``: no compilation. Whether torch has a backend (e.g.
    ``TENSORRT``, ``TVM``) is torch's to say: ``torch.compile`` raises when it has not
    (``torch._dynamo.list_backends()`` lists what it has).
    """

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


def _backend(value: DynamoBackend | str | None) -> DynamoBackend:
    # Accelerate's rule: None reads ACCELERATE_DYNAMO_BACKEND (default "no"), any case.
    if value is None:
        value = os.environ.get(_PREFIX + "BACKEND", "no")
    if not isinstance(value, str):
        raise TypeError(f"'backend' must be a str or DynamoBackend, got {type(value).__name__}")
    try:
        return DynamoBackend(value.upper())
    except ValueError:
        accepted = ", ".join(repr(b.value.lower()) for b in DynamoBackend)
        raise ValueError(
            f"'backend' must be one of {accepted} (any case), got {shown(value)}"
        ) from None


def _mode(value: str | None) -> str:
    if value is None:
        value = os.environ.get(_PREFIX + "MODE", "default")
    if not isinstance(value, str):
        raise TypeError(f"'mode' must be a str, got {type(value).__name__}")
    if value == "default":  # torch's own default: no need to import the inductor (1.5 s)
        return value
    import torch._inductor

    accepted = list(torch._inductor.list_mode_options())  # torch.compile's modes
    if value not in accepted:
        raise ValueError(
            f"'mode' must be one of {', '.join(map(repr, accepted))}, got {shown(value)}"
        )
    return value


def _env_flag(value: Any, name: str) -> Any:
    if value is None:
        return bool(str_to_bool(os.environ.get(_PREFIX + name, "False")))
    return value


def _fullgraph(value: Any) -> Any:
    return _env_flag(value, "USE_FULLGRAPH")


def _regional(value: Any) -> Any:
    return _env_flag(value, "USE_REGIONAL_COMPILATION")


def _dynamic(value: Any) -> Any:
    if value is None and os.environ.get(_PREFIX + "USE_DYNAMIC") is not None:
        return bool(str_to_bool(os.environ[_PREFIX + "USE_DYNAMIC"]))
    return value


def _options(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (
        isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    ):
        raise TypeError(f"'options' must be a dict with str keys or None, got {shown(value)}")


def _no_regions(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    strict_bool(instance, attribute, value)
    if value:
        raise ValueError(
            "'use_regional_compilation' must be False: kwplug does not compile regions "
            "(Accelerate's compile_regions); compile the repeated blocks yourself "
            "(`block.compile()` for each) and leave the backend 'no', or compile the whole "
            f"model (use_regional_compilation=False; {_PREFIX}USE_REGIONAL_COMPILATION)"
        )


#: A default plugin's fields (:meth:`TorchDynamoPlugin.to_dict`) with no ``ACCELERATE_DYNAMO_*``
#: variable set: what :meth:`TorchDynamoPlugin.to_kwargs` compares with (the converters'
#: fallbacks above; tests/training/test_peer_suite_fidelity.py checks them against a plugin
#: built so, and the result against Accelerate's).
_UNSET_ENVIRONMENT: dict[str, Any] = {
    "backend": "no",
    "mode": "default",
    "fullgraph": False,
    "dynamic": None,
    "options": None,
    "disable": False,
}


@attrs.define
class TorchDynamoPlugin(KwargsHandler):
    """``torch.compile`` of every prepared model, Accelerate's ``TorchDynamoPlugin``.

    ``prepare`` returns ``torch.compile(model, backend=..., mode=..., fullgraph=...,
    dynamic=..., options=..., disable=...)`` of the model it built (the DDP wrapper in a
    multi-process run), last, unless the backend is ``"no"`` or the model is compiled already
    (a ``torch._dynamo.eval_frame.OptimizedModule``). ``Accelerator(dynamo_backend="eager")`` is
    ``Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager"))``.

    A field left ``None`` reads Accelerate's environment variable, as Accelerate does:

    Attributes:
        backend: a :class:`DynamoBackend` or its name in any case (``"eager"``,
            ``"aot_eager"``, ``"inductor"``...); ``None``: ``ACCELERATE_DYNAMO_BACKEND``, else
            ``"no"`` (no compilation). Stored as a :class:`DynamoBackend`.
        mode: one of torch's modes (``torch._inductor.list_mode_options()``: ``"default"``,
            ``"reduce-overhead"``, ``"max-autotune"``...); ``None``: ``ACCELERATE_DYNAMO_MODE``,
            else ``"default"`` (passed to torch as its default, ``mode=None``).
        fullgraph: ``bool``; ``None``: ``ACCELERATE_DYNAMO_USE_FULLGRAPH``, else ``False``.
        dynamic: ``bool`` or ``None`` (torch decides); ``None``: ``ACCELERATE_DYNAMO_USE_DYNAMIC``
            when set.
        options: a ``dict`` of backend options (``torch.compile(options=...)``) or ``None``.
        disable: ``bool``, default ``False``: ``torch.compile(disable=True)``, a no-op.
        use_regional_compilation: must be ``False`` (``None``:
            ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION``, else ``False``): kwplug does not
            compile regions.

    Raises:
        ValueError: an unknown backend or mode (the message lists the accepted ones);
            ``use_regional_compilation`` true; an ``ACCELERATE_DYNAMO_USE_*`` variable that is
            neither true nor false.
        TypeError: a field of the wrong type.
    """

    backend: DynamoBackend = attrs.field(default=None, converter=_backend)
    mode: str = attrs.field(default=None, converter=_mode)
    fullgraph: bool = attrs.field(default=None, converter=_fullgraph, validator=strict_bool)
    dynamic: bool | None = attrs.field(default=None, converter=_dynamic, validator=optional_bool)
    options: Any = attrs.field(default=None, validator=_options)
    disable: bool = attrs.field(default=False, validator=strict_bool)
    use_regional_compilation: bool = attrs.field(
        default=None,
        converter=_regional,
        validator=_no_regions,
        metadata={TO_KWARGS: False},
    )

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, the backend as its lower-case name (as Accelerate's)."""
        fields = super().to_dict()
        fields["backend"] = self.backend.value.lower()
        return fields

    def to_kwargs(self) -> dict[str, Any]:
        """The fields (as :meth:`to_dict` gives them: the backend as its lower-case name) that
        differ from a plugin built with no ``ACCELERATE_DYNAMO_*`` variable set, as
        Accelerate's ``TorchDynamoPlugin.to_kwargs()`` (which builds its default under a
        cleared environment): a field read from the environment counts as given.
        ``use_regional_compilation`` is left out, as in Accelerate. Reads, and changes, no
        environment variable."""
        fields = self.to_dict()
        return {k: fields[k] for k, default in _UNSET_ENVIRONMENT.items() if fields[k] != default}

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile``: ``backend`` lower-case, ``mode=None``
        for ``"default"`` (torch's default; a mode other than the inductor's default is
        refused by other backends), and the other fields as they are."""
        return {
            "backend": self.backend.value.lower(),
            "mode": None if self.mode == "default" else self.mode,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "options": None if self.options is None else dict(self.options),
            "disable": self.disable,
        }

    @hookimpl
    def compile_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """``torch.compile(model, **compile_kwargs())``; ``None`` with the backend ``"no"``
        or for a model compiled already (another plugin may answer)."""
        if self.backend is DynamoBackend.NO:
            return None
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            return None
        # torch.compile of a module is an OptimizedModule (a Module); its stub says Callable.
        return cast(torch.nn.Module, torch.compile(model, **self.compile_kwargs()))
