"""``prepare``, ``prepare_model``, ``prepare_optimizer``, ``prepare_data_loader`` and
``prepare_scheduler`` of the Accelerator (a base class of ``Accelerator``), with Accelerate's
keywords; the work is done by :class:`kwplug.accelerator._prepare._Prepared`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from kwplug.accelerator import _keywords
from kwplug.accelerator._agreement import LiveAgreement
from kwplug.accelerator._params import ParameterRemap
from kwplug.accelerator._prepare import _Prepared
from kwplug.utils.other import extract_model_from_parallel

if TYPE_CHECKING:
    from kwplug.optimizer import AcceleratedOptimizer
    from kwplug.scheduler import AcceleratedScheduler


class _PrepareAPI:
    """The ``prepare*`` methods: each object is placed on the device unless its
    ``device_placement`` (or the Accelerator's) is ``False``."""

    _prepared: _Prepared
    _agreement: LiveAgreement
    device_placement: bool

    # Accelerate's private lists of what this Accelerator prepared, which code written for it
    # reads (``len(accelerator._models)``); the lists themselves, emptied by ``free_memory``.
    @property
    def _models(self) -> list[torch.nn.Module]:
        return self._prepared.models

    @property
    def _optimizers(self) -> list[AcceleratedOptimizer]:
        return self._prepared.optimizers

    @property
    def _schedulers(self) -> list[AcceleratedScheduler]:
        return self._prepared.schedulers

    @property
    def _dataloaders(self) -> list[DataLoader[Any]]:
        return self._prepared.dataloaders

    def _get_named_parameters(self, *args: Any, drop_refs: bool = False) -> dict[str, Any]:
        """Accelerate's internal that code written for it calls around ``prepare``: the
        parameters of the modules among ``args``, unwrapped (``torch.compile``'s wrapper
        too), by name, prefixed with the module's index when there are several; with
        ``drop_refs=True`` a key per parameter instead (its ``data_ptr()``, ``id`` on the meta
        device), as Accelerate's."""
        models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
        named: dict[str, Any] = {}
        for index, model in enumerate(models):
            inner = extract_model_from_parallel(model, keep_torch_compile=False)
            prefix = str(index) if len(models) > 1 else ""
            for name, param in inner.named_parameters(prefix=prefix):
                key = id(param) if param.is_meta else param.data_ptr()
                named[name] = key if drop_refs else param
        return named

    def _remap_optimizer_parameters(self, old_named_params: dict[str, Any], *args: Any) -> None:
        """Accelerate's internal: point the optimizers among ``args`` at the parameters of the
        modules among ``args`` that replaced ``old_named_params`` (from
        :meth:`_get_named_parameters`) under the same name; nothing when none was replaced
        (``prepare`` already does this for the optimizers it prepares)."""
        remap = ParameterRemap()
        if remap.learn(old_named_params, self._get_named_parameters(*args)):
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer):
                    remap.apply(getattr(obj, "optimizer", obj))

    def _agree_on_models(self, count: int) -> None:
        # Preparing a model is a collective (DDP's broadcast): the ranks' settings, as they
        # are now, are compared first, and the first backward compares them again.
        if count:
            self._agreement.check("prepare")
            self._agreement.backward_due = True

    def _placement(self, value: bool | None) -> bool:
        return (
            self.device_placement
            if value is None
            else _keywords.check_bool("device_placement", value)
        )

    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """Prepare models, optimizers and data loaders for training, in the order given.

        - ``torch.nn.Module``: moved to :attr:`device`, then wrapped through the
          ``wrap_model`` hook (DDP when ``num_processes > 1`` by default).
        - ``torch.optim.Optimizer``: wrapped in a :class:`~kwplug.optimizer.AcceleratedOptimizer`
          (skips steps while gradients accumulate; steps through the gradient scaler).
        - ``torch.optim.lr_scheduler.LRScheduler``: wrapped in a
          :class:`~kwplug.scheduler.AcceleratedScheduler` (after the other objects, so it finds
          its optimizer) and saved by :meth:`save_state`.
        - ``torch.utils.data.DataLoader``: each rank gets Accelerate's batches
          (:func:`kwplug.data.prepare_dataloader`, ``dataloader_config``), moved to
          :attr:`device`.
        - anything else: returned unchanged.

        Create the optimizer from the model's parameters before or after ``prepare``: DDP
        shares the parameters, and when a wrapper replaces them (FSDP2's ``fully_shard``
        registers ``DTensor`` parameters) every optimizer prepared by this Accelerator, before
        or after the model, is pointed at the new parameters, matched by name.

        Args:
            args: the objects.
            device_placement: as Accelerate, one ``bool`` (or ``None``: the Accelerator's
                ``device_placement``) per object: ``False`` leaves that model on its device,
                that optimizer's state where it is, that loader's batches where the collate
                function put them. Default ``None``: every object follows the Accelerator.

        Returns:
            The prepared object when one was given, else a tuple in the same order.

        Raises:
            ValueError: ``device_placement`` does not have one entry per object.
            TypeError: ``device_placement`` is not a list of ``bool``/``None``.
        """
        placements = _keywords.device_placements(device_placement, len(args))
        self._agree_on_models(sum(isinstance(a, torch.nn.Module) for a in args))
        return self._prepared.prepare(args, [self._placement(p) for p in placements])

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Move ``model`` to :attr:`device` and wrap it through the ``wrap_model`` hook.

        Parameters the wrapper replaced are recorded by name; optimizers prepared by this
        Accelerator (already, or later) are pointed at the replacements.

        Args:
            model: the module.
            device_placement: ``False``: leave it on its device; ``None`` (default): the
                Accelerator's ``device_placement``.
            evaluation_mode: ``True``: a model only evaluated, not wrapped (no DDP; as
                Accelerate); default ``False``.

        Raises:
            TypeError: a flag is not a ``bool``.
        """
        place = self._placement(device_placement)
        evaluation_mode = _keywords.check_bool("evaluation_mode", evaluation_mode)
        self._agree_on_models(0 if evaluation_mode else 1)
        return self._prepared.model(model, place, evaluation_mode)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` in an :class:`~kwplug.optimizer.AcceleratedOptimizer`.

        When a prepared model's wrapper replaced parameters, the optimizer's param groups are
        pointed at the replacements first. With ``device_placement`` (``None``, default: the
        Accelerator's), existing optimizer state is moved to :attr:`device`.
        """
        return self._prepared.optimizer(optimizer, self._placement(device_placement))

    def prepare_data_loader(
        self,
        data_loader: DataLoader[Any],
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
        *,
        seed: int | None = None,
    ) -> DataLoader[Any]:
        """Shard ``data_loader`` per rank as Accelerate does
        (:func:`kwplug.data.prepare_dataloader`).

        Args:
            data_loader: the user's loader.
            device_placement: ``False``: batches stay where the collate function put them;
                ``None`` (default): the Accelerator's ``device_placement``.
            slice_fn_for_dispatch: Accelerate's, for dispatched batches only; kwplug does
                not dispatch (every rank reads its shard): must be ``None``.
            seed: kwplug's own: fixes the shuffle instead of a draw from torch's global
                generator.

        Raises:
            ValueError: ``slice_fn_for_dispatch`` is given.
        """
        if slice_fn_for_dispatch is not None:
            raise ValueError(
                "prepare_data_loader(slice_fn_for_dispatch=...) applies only to dispatched "
                "batches (dispatch_batches=True), which kwplug does not do: every rank reads "
                "its own shard; pass slice_fn_for_dispatch=None"
            )
        return self._prepared.data_loader(
            data_loader, seed, device_placement=self._placement(device_placement)
        )

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> Any:
        """Wrap ``scheduler`` in an :class:`~kwplug.scheduler.AcceleratedScheduler` (stepped
        once per process per optimizer step, see there) and save it with :meth:`save_state`.
        """
        wrapped: AcceleratedScheduler = self._prepared.scheduler(scheduler)
        return wrapped
