"""The ``Accelerator`` keywords that configure training rather than plugins:
``gradient_accumulation_steps``/``gradient_accumulation_plugin``, ``dataloader_config``,
``project_dir``/``project_config``, ``log_with``, ``step_scheduler_with_optimizer`` and the
legacy ``split_batches``/``even_batches``, checked once at construction; and what a launcher
passes through the environment (``ACCELERATE_MIXED_PRECISION``,
``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``: ``kwplug launch`` and ``accelerate launch`` set
them), read as Accelerate's ``Accelerator`` reads them."""

from __future__ import annotations

import enum
import os
import warnings
from typing import Any

import attrs

from kwplug._contracts.environ import get as read_environ
from kwplug._contracts.pristine import Pristine
from kwplug.accelerator._gradient_state import _check_steps
from kwplug.precision import MIXED_PRECISION
from kwplug.utils.dataclasses import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)


@attrs.frozen
class _Options:
    """What the keywords resolved to (the configuration objects stay mutable, as in
    Accelerate: ``accelerator.even_batches = False`` changes ``dataloader_config``).

    Attributes:
        gradient_accumulation: the plugin (built from ``gradient_accumulation_steps`` when
            none was given).
        dataloader_config: how prepared data loaders shard.
        project_configuration: checkpoint and logging folders.
        log_with: the trackers asked for (names or tracker objects), ``[]`` for none.
        step_scheduler_with_optimizer: prepared schedulers step only with the optimizer.
    """

    gradient_accumulation: GradientAccumulationPlugin
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    log_with: list[Any]
    step_scheduler_with_optimizer: bool


def _require(name: str, value: Any, kind: type | tuple[type, ...], wanted: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise TypeError(
            f"{name} must be {wanted} or None, got {value!r} of type {type(value).__name__}"
        )


def _trackers(log_with: Any) -> list[Any]:
    # Type only: which names exist is the trackers' plugins' business.
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    for item in items:
        if isinstance(item, bool) or not (
            isinstance(item, (str, enum.Enum)) or callable(getattr(item, "log", None))
        ):
            raise TypeError(
                "log_with must be a tracker name (str, e.g. 'tensorboard' or 'all'), a tracker "
                f"object (with a log() method), a list of these, or None; got {item!r} of type "
                f"{type(item).__name__}"
            )
    return items


# The default option objects (GradientAccumulationPlugin(num_steps=n), DataLoaderConfiguration(),
# ProjectConfiguration(project_dir=...)), built and validated once per set of arguments and
# copied for every Accelerator: their construction reads nothing but the arguments, and each
# Accelerator still gets objects of its own (they are mutable: accelerator.even_batches = ...).
_defaults = Pristine(environ=False)

MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
STEPS_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


def mixed_precision_from_env(mixed_precision: str | None) -> str:
    """``mixed_precision`` when given, else ``ACCELERATE_MIXED_PRECISION``, else ``"no"`` (as
    Accelerate's ``AcceleratorState``: the argument wins over the launcher's variable).

    Raises:
        ValueError: the variable holds something else than ``"no"``, ``"fp16"``, ``"bf16"``.
    """
    if mixed_precision is not None:
        return mixed_precision
    value = read_environ(MIXED_PRECISION_ENV)
    if value is None:
        return "no"
    if value not in MIXED_PRECISION:
        raise ValueError(
            f"{MIXED_PRECISION_ENV} must be one of {', '.join(map(repr, MIXED_PRECISION))}, "
            f"got {value!r}"
        )
    return value


def _steps_from_env(steps: int) -> int:
    # Accelerate: int(parse_choice_from_env(STEPS_ENV, gradient_accumulation_steps)) -- the
    # variable wins over the keyword, whose default 1 cannot be told from an explicit 1.
    # kwplug does the same, and says so when an explicit other value is overridden.
    value = read_environ(STEPS_ENV)
    if value is None:
        return steps
    try:
        from_env = int(value)
    except ValueError:
        from_env = 0
    if from_env < 1:
        raise ValueError(f"{STEPS_ENV} must be an integer >= 1, got {value!r}")
    if steps != 1 and steps != from_env:
        warnings.warn(
            f"Accelerator(gradient_accumulation_steps={steps}): {STEPS_ENV}={value} (set by "
            f"the launcher) wins, as in Accelerate; the run accumulates {from_env} steps",
            UserWarning,
            stacklevel=4,
        )
    return from_env


def resolve_options(
    gradient_accumulation_steps: int,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    dataloader_config: DataLoaderConfiguration | None,
    project_dir: str | os.PathLike[str] | None,
    project_config: ProjectConfiguration | None,
    log_with: Any,
    step_scheduler_with_optimizer: bool,
    split_batches: bool | None,
    even_batches: bool | None,
) -> _Options:
    """Check the keywords and build :class:`_Options`.

    Raises:
        TypeError: a keyword has the wrong type (the message names it).
        ValueError: ``gradient_accumulation_steps < 1``; both ``gradient_accumulation_steps``
            (other than 1) and ``gradient_accumulation_plugin``; ``split_batches`` or
            ``even_batches`` together with ``dataloader_config``;
            ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` is not an integer >= 1 (it replaces
            ``gradient_accumulation_steps`` when no plugin is given, as in Accelerate).
    """
    _check_steps(gradient_accumulation_steps)
    # (Each _require only for a keyword given: Accelerator() gives none, and pays no call.)
    if gradient_accumulation_plugin is not None:
        _require(
            "gradient_accumulation_plugin",
            gradient_accumulation_plugin,
            GradientAccumulationPlugin,
            "a kwplug.utils.GradientAccumulationPlugin",
        )
    if gradient_accumulation_plugin is None:
        gradient_accumulation_plugin = _defaults.new(
            GradientAccumulationPlugin, num_steps=_steps_from_env(gradient_accumulation_steps)
        )
    elif gradient_accumulation_steps != 1:
        raise ValueError(
            "pass only one of gradient_accumulation_steps and gradient_accumulation_plugin "
            "(give the number of steps as GradientAccumulationPlugin(num_steps=...))"
        )
    if dataloader_config is not None:
        _require(
            "dataloader_config",
            dataloader_config,
            DataLoaderConfiguration,
            "a kwplug.utils.DataLoaderConfiguration",
        )
    given = {}
    if split_batches is not None or even_batches is not None:
        legacy = {"split_batches": split_batches, "even_batches": even_batches}
        given = {name: value for name, value in legacy.items() if value is not None}
    if given and dataloader_config is not None:
        raise ValueError(f"pass {' and '.join(given)} inside dataloader_config, not next to it")
    dataloader_config = dataloader_config or _defaults.new(DataLoaderConfiguration, **given)
    if project_config is not None:
        _require(
            "project_config",
            project_config,
            ProjectConfiguration,
            "a kwplug.utils.ProjectConfiguration",
        )
    if project_dir is not None:
        _require("project_dir", project_dir, (str, os.PathLike), "a path (str or os.PathLike)")
    project = project_config or _defaults.new(ProjectConfiguration, project_dir=project_dir)
    if project_dir is not None and project.project_dir is None:
        project.set_directories(project_dir)
    if not isinstance(step_scheduler_with_optimizer, bool):
        raise TypeError(
            "step_scheduler_with_optimizer must be a bool, got "
            f"{type(step_scheduler_with_optimizer).__name__}"
        )
    return _Options(
        gradient_accumulation=gradient_accumulation_plugin,
        dataloader_config=dataloader_config,
        project_configuration=project,
        log_with=[] if log_with is None else _trackers(log_with),
        step_scheduler_with_optimizer=step_scheduler_with_optimizer,
    )
