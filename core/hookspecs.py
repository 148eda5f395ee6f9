"""The hook contract between the kwplug core and handler plugins.

Every torch object an :class:`~kwplug.Accelerator` builds comes from one of these hooks. A plugin
implements any of them with methods marked ``@kwplug.hookimpl``; an implementation may take any
subset of a spec's arguments (pluggy passes only the ones it names).

Order of answers: handlers the user passed in ``kwargs_handlers`` answer first (in list order),
then third-party defaults (by distribution name, then entry-point name), then kwplug's built-in
defaults. For ``firstresult`` hooks the first answer that is not ``None`` wins, so returning
``None`` means "not mine, ask the next plugin". Hooks receive ``device_type`` (``"cpu"``,
``"cuda"``, ``"xpu"``, ...) so that a backend plugin answers for its device and declines for the
others.

The core calls these hooks at construction, in ``prepare()``, in ``autocast(handler)`` when a
per-call handler is given, at each entry of ``profile()``, ``no_sync`` on the accumulation
steps of ``accumulate()`` that skip gradient synchronisation and ``sync_in_backward`` in
``trigger_sync_in_backward()`` -- no other hook per training step.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

from kwplug._contracts.answers import AutocastFactory, DeviceChoice
from kwplug._contracts.hookinfo import (
    ADDITIVE,
    EVERY,
    INFO,
    ONE_ANSWER,
    PER_PLUGIN,
    PROJECT_NAME,
    HookInfo,
    hookspec,
    spec,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from kwplug.comm_hooks import CommHook
    from kwplug.precision import LossScaler
    from kwplug.tracking import TrackerFactory

__all__ = [  # the policies and the decorator live in kwplug._contracts.hookinfo; this is their face
    "ADDITIVE",
    "EVERY",
    "HOOKS",
    "HOOK_POLICY",
    "ONE_ANSWER",
    "PER_PLUGIN",
    "PROJECT_NAME",
    "AutocastFactory",
    "DeviceChoice",
    "HandlerSpec",
    "HookInfo",
    "hook_infos",
    "hookimpl",
    "hookspec",
    "spec",
]

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class HandlerSpec:
    """Hook specifications of the ``kwplug`` project (registered with ``add_hookspecs``)."""

    @spec(ONE_ANSWER, pure=True)
    def autocast(self, device_type: str, mixed_precision: str) -> AutocastFactory | None:
        """Return a zero-argument factory of the autocast context manager, or ``None``.

        Args:
            device_type: ``torch.device(...).type`` of the Accelerator's device, e.g. ``"cpu"``.
            mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` as given to the Accelerator.

        Returns:
            A callable that, called with no arguments, returns a fresh context manager
            (typically ``functools.partial(torch.autocast, ...)``) -- or ``None`` for "not mine".
            If no plugin answers, ``Accelerator.autocast()`` yields ``contextlib.nullcontext()``.

        Called by: ``Accelerator.__init__`` once (the factory is cached and reused at every
        ``accelerator.autocast()``), and by ``accelerator.autocast(handler)`` with the given
        handler answering first. ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def wrap_model(
        self,
        model: torch.nn.Module,
        device: torch.device,
        device_type: str,
        world_size: int,
        mixed_precision: str,
        comm_hooks: Mapping[str, CommHook],
        device_mesh: DeviceMesh | None,
    ) -> torch.nn.Module | None:
        """Wrap a model for distributed training, or return ``None``.

        Args:
            model: the user's module, already moved to ``device``.
            device: the Accelerator's device (``torch.device``).
            device_type: ``device.type``.
            world_size: number of processes (``torch.distributed`` world size; 1 when not
                distributed).
            mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
            comm_hooks: every named DDP communication hook known to this Accelerator
                (built-in, registered with :func:`kwplug.register_comm_hook`, and contributed by
                plugins' :meth:`comm_hooks`), by name.
            device_mesh: the :meth:`device_mesh` answer (a ``DeviceMesh``), or ``None``.

        Returns:
            The wrapped module (e.g. ``torch.nn.parallel.DistributedDataParallel``), or
            ``None`` for "not mine". If no plugin answers, the model is used unwrapped.

        Called by: ``Accelerator.prepare()``, once per model. ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def device_mesh(self, device_type: str, world_size: int) -> DeviceMesh | None:
        """Build the Accelerator's one device mesh, or return ``None``.

        Args: ``device_type`` (the Accelerator's), ``world_size`` (number of processes).

        Returns:
            A ``DeviceMesh`` over every process, or ``None`` ("not mine"). Ranks along its
            ``dp`` dimension (may be flattened) read different batches from prepared loaders;
            without one, all read the same. It is ``accelerator.torch_device_mesh``.

        Called by: ``Accelerator.__init__`` once, on every rank, after the process group exists
        (``init_device_mesh`` is collective). ``firstresult``: yes.
        """

    @spec(ONE_ANSWER, pure=True)
    def make_scaler(self, device_type: str, mixed_precision: str) -> LossScaler | None:
        """Return the loss scaler (the precision backend) for this setting, or ``None``.

        The answer decides how ``Accelerator.backward`` scales the loss, how gradient clipping
        unscales the gradients, how ``optimizer.step()`` steps (or skips) and adjusts the
        scale, and what ``save_state`` saves of it: the core calls only the
        :class:`kwplug.precision.LossScaler` methods (``scale``, ``unscale_``, ``step``,
        ``update``, ``get_scale``, ``state_dict``, ``load_state_dict``) on it, directly, with no
        hook call per step. The built-in ``GradScalerKwargs`` answers with a
        ``torch.amp.GradScaler`` under ``"fp16"``; another loss-scaling rule is a plugin
        answering with its own object (docs/writing-plugins.md, "A precision backend").

        Args:
            device_type: device type the scaler works on (``torch.amp.GradScaler(device)``).
            mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.

        Returns:
            A :class:`kwplug.precision.LossScaler` (e.g. ``torch.amp.GradScaler``), or
            ``None`` for "not mine". If no plugin answers, training runs without a scaler.

        Raises:
            TypeError: (raised by ``Accelerator.__init__``) the answer lacks a ``LossScaler``
                method.

        Called by: ``Accelerator.__init__`` once. ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def init_process_group(
        self, device_type: str, world_size: int, rank: int, local_rank: int
    ) -> bool | None:
        """Initialise the default ``torch.distributed`` process group, or return ``None``.

        Args:
            device_type: device type the processes train on; selects the backend.
            world_size: ``WORLD_SIZE`` set by ``torchrun`` (>= 1).
            rank: global rank ``RANK`` of this process, ``0 <= rank < world_size``.
            local_rank: ``LOCAL_RANK`` of this process on its node.

        Returns:
            ``True`` once the process group is initialised (via
            ``torch.distributed.init_process_group``), or ``None`` for "not mine".

        Called by: ``Accelerator.__init__`` once, only when ``world_size > 1`` and no default
        process group exists yet. If no plugin answers then, the Accelerator raises
        ``RuntimeError``. ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def make_profiler(self, device_type: str, rank: int) -> torch.profiler.profile | None:
        """Return a ``torch.profiler.profile`` (not started), or ``None``.

        Args:
            device_type: the Accelerator's device type; selects default profiler activities.
            rank: global rank of this process (0 when not distributed), e.g. for per-rank
                trace file names.

        Returns:
            A profiler context manager, or ``None`` for "not mine". If no plugin answers,
            ``accelerator.profile()`` raises ``RuntimeError``.

        Called by: ``accelerator.profile(handler=None)`` each time it is entered (profiling is
        not a per-step path). ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
        """Return a context manager in which ``model`` skips gradient synchronisation, or
        ``None``.

        Inside the context, backward passes accumulate gradients locally without
        communicating; the first backward after it synchronises the accumulated gradients
        (e.g. ``DistributedDataParallel.no_sync()``, FSDP2's
        ``set_requires_gradient_sync(False)`` restored on exit).

        Args:
            model: a model returned by ``Accelerator.prepare`` (the wrapper a plugin built).

        Returns:
            A fresh, not yet entered context manager, or ``None`` for "not mine" (e.g. the
            model is not this plugin's wrapper). If no plugin answers, ``Accelerator.no_sync``
            returns ``contextlib.nullcontext()``: the model does not synchronise anyway.

        Called by: ``Accelerator.no_sync(model)``, and ``Accelerator.accumulate(*models)`` for
        each model on the micro-batches that do not end an accumulation (not at all with
        ``gradient_accumulation_steps=1``). A plugin implementing this hook is asked on every
        such micro-batch; only while kwplug's own implementations alone answer it (and
        nothing traces the plugin manager) does ``accumulate`` ask once per model and then
        call the one that answered directly. ``firstresult``: yes.
        """

    @spec(ONE_ANSWER)
    def sync_in_backward(self, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
        """Return a context manager in which ``model``'s next backward synchronises the
        gradients, even when its forward ran under :meth:`no_sync`; or ``None``.

        Args:
            model: a model returned by ``Accelerator.prepare`` (the wrapper a plugin built).

        Returns:
            A fresh, not yet entered context manager (the built-in DDP handler re-arms the
            reducer), or ``None`` for "not mine". If no plugin answers,
            ``Accelerator.trigger_sync_in_backward`` is ``contextlib.nullcontext()``.

        Called by: ``Accelerator.trigger_sync_in_backward(model)``. ``firstresult``: yes.
        """

    @spec(ADDITIVE)
    def comm_hooks(self) -> Mapping[str, CommHook] | None:
        """Contribute named DDP communication hooks.

        Returns:
            A mapping of hook name to :class:`kwplug.CommHook`, or ``None``. Names are
            additive across plugins; a name given twice is an error naming both sources.

        Called by: ``Accelerator.__init__`` once; the merged mapping is passed to
        :meth:`wrap_model`. ``firstresult``: no (every plugin's answer is collected).
        """

    @spec(ADDITIVE)
    def trackers(self) -> Mapping[str, TrackerFactory] | None:
        """Contribute named experiment trackers (see :mod:`kwplug.tracking`).

        Returns:
            A mapping of tracker name (what ``Accelerator(log_with=...)`` and
            ``get_tracker`` use) to a :data:`kwplug.tracking.TrackerFactory`, usually a
            :class:`kwplug.tracking.GeneralTracker` subclass; or ``None``. Names are additive across
            plugins; a name given twice is an error naming both sources.

        Called by: ``Accelerator.__init__`` once, only when ``log_with`` names a tracker (or
        ``"all"``); the factories are called later by ``init_trackers`` on the main process.
        ``firstresult``: no (every plugin's answer is collected).
        """

    @spec(PER_PLUGIN)
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Take off one layer of a model wrapper this plugin added.

        Args:
            model: a prepared model, or a module found inside one.

        Returns:
            The module ``model`` wraps when ``model`` is this plugin's wrapper, else ``None``.
            The core peels torch's own wrappers itself (``DistributedDataParallel``,
            ``DataParallel``, ``torch.compile``'s ``_orig_mod``); a wrapper that changes the
            module in place (FSDP2's ``fully_shard``) needs no answer.

        Called by: ``Accelerator.unwrap_model`` (and ``get_state_dict``/``save_model``),
        repeatedly until neither the core nor any plugin unwraps further; the first non-``None``
        answer in precedence order is used. ``firstresult``: no (every plugin is asked, so that
        two wrapper plugins never conflict).
        """

    @spec(EVERY)
    def validate_setup(
        self,
        device_type: str,
        world_size: int,
        mixed_precision: str,
        comm_hooks: Mapping[str, CommHook],
    ) -> None:
        """Reject a configuration early, before any process group or torch object exists.

        Args:
            device_type: the Accelerator's device type, e.g. ``"cpu"``.
            world_size: number of processes (``WORLD_SIZE``; 1 when not distributed).
            mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
            comm_hooks: every named DDP communication hook known to this Accelerator.

        Returns:
            ``None``. Raise ``TypeError``/``ValueError`` naming the field and what it
            accepts to reject the setting (e.g. an unknown ``comm_hook`` name, or options the
            named hook refuses); it propagates out of ``Accelerator()``.

        Called by: ``Accelerator.__init__`` once, on every rank, after the communication hooks
        are collected and before ``init_process_group``, so that a mistake costs no
        rendezvous and no data loading. ``firstresult``: no (every plugin is called).
        """

    @spec(PER_PLUGIN)
    def handler_state(self) -> Mapping[str, Any] | None:
        """Contribute state to checkpoints written by ``Accelerator.save_state``.

        Returns:
            A mapping of tensors, NumPy arrays and JSON values (saved on each rank;
            checkpoints hold no pickles, see ``kwplug.checkpoint._codec``), or ``None``
            when there is nothing to save.

        Called by: ``Accelerator.save_state`` on every rank; the answers are stored by the
        plugin's registered name and given back to the same plugin by
        :meth:`load_handler_state`. ``firstresult``: no (every plugin's answer is collected).
        """

    @spec(PER_PLUGIN)
    def load_handler_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`handler_state` saved.

        Args:
            state: the mapping this plugin returned from ``handler_state`` when the
                checkpoint was written (plugins that saved nothing are not called).

        Called by: ``Accelerator.load_state`` on every rank, once per plugin with saved state,
        after the models and optimizers are restored. ``firstresult``: no.
        """

    @spec(ONE_ANSWER)
    def compile_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Compile a prepared model (e.g. ``torch.compile``), or return ``None``.

        Args:
            model: the model ``prepare`` built, after :meth:`wrap_model` (the wrapper, if any).

        Returns:
            The module that ``prepare`` returns instead (the built-in ``TorchDynamoPlugin``
            answers ``torch.compile(model, ...)``), or ``None`` for "not mine".

        Called by: ``Accelerator.prepare()`` (and ``prepare_model()``), once per model, last,
        as Accelerate compiles last. ``firstresult``: yes.
        """

    # -- the device (issue 29) ------------------------------------------------------------

    @spec(ONE_ANSWER)
    def select_device(self, cpu: bool, local_rank: int, world_size: int) -> DeviceChoice | None:
        """Choose the device this process trains on, or return ``None``.

        Args:
            cpu: ``True`` when the CPU is forced (``Accelerator(cpu=True)`` or
                ``ACCELERATE_USE_CPU``); a device plugin then declines.
            local_rank: ``LOCAL_RANK`` of this process on its node (0 when not distributed).
            world_size: ``WORLD_SIZE`` (1 when not distributed).

        Returns:
            A :class:`DeviceChoice` (device type and index, ``distributed_type``), or ``None``
            for "not mine". If no plugin answers, the built-in choice applies: the CPU when
            forced, else ``torch.accelerator``'s current accelerator (CUDA, XPU, MPS...) with
            index ``local_rank`` modulo its device count, made current; else the CPU.

        Called by: ``Accelerator.__init__`` (and ``kwplug.state.PartialState``) once, before
        the process group is created. ``firstresult``: yes.
        """


def hook_infos() -> dict[str, HookInfo]:
    """Every hook spec's :class:`HookInfo`, by name, in the order :class:`HandlerSpec`
    declares them."""
    return {
        name: getattr(member, INFO)
        for name, member in vars(HandlerSpec).items()
        if hasattr(member, INFO)
    }


#: Every hook's :class:`HookInfo`, by name, in declaration order.
HOOKS: dict[str, HookInfo] = hook_infos()
#: Hook name -> combination policy (derived from :data:`HOOKS`).
HOOK_POLICY: dict[str, str] = {name: info.policy for name, info in HOOKS.items()}
