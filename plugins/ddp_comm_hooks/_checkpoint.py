"""A communication hook's live state with its record's checkpoint rules, for
:func:`kwplug.attached_state.attach_state`.

The checkpoint code knows no hook: it saves, restores and resizes what is attached through
``state_dict()``, ``load_state_dict(saved)`` and, when present,
``resize_state_dict(saved, old_world_size, new_world_size)`` and ``resize_note``.
:func:`checkpointed_state` gives it a :class:`HookCheckpoint` answering these from the
:class:`~kwplug.CommHook`'s ``state_dict``, ``load_state_dict``, ``resize`` and
``resize_note``.
"""

from typing import Any

import attrs

from kwplug.comm_hooks import CommHook


def _public_name(state: Any) -> str:
    # The first class of the state's MRO not named as private (a private subclass of a
    # public state class is named as that class).
    for cls in type(state).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__qualname__
    return type(state).__qualname__


@attrs.frozen
class HookCheckpoint:
    """``state`` as the checkpoint code saves, restores and resizes it, by ``record``'s rules.

    Attributes:
        record: the hook whose ``state_dict``/``load_state_dict``/``resize`` rules apply (a
            rule left ``None`` falls back to the state's own method of that name).
        state: the live state ``record.make_state`` built.
    """

    record: CommHook
    state: Any

    @property
    def label(self) -> str:
        """The state's class, as messages name it."""
        return _public_name(self.state)

    @property
    def resize_note(self) -> str:
        """What ``record.resize`` does not carry over (``""``: nothing is lost)."""
        return self.record.resize_note

    def state_dict(self) -> Any:
        """What a checkpoint saves of the state on this rank."""
        if self.record.state_dict is not None:
            return self.record.state_dict(self.state)
        return self.state.state_dict()

    def load_state_dict(self, saved: Any) -> None:
        """Restore ``saved`` (from :meth:`state_dict`, or :meth:`resize_state_dict`)."""
        if self.record.load_state_dict is not None:
            self.record.load_state_dict(self.state, saved)
        else:
            self.state.load_state_dict(saved)

    def resize_state_dict(self, saved: Any, old_world_size: int, new_world_size: int) -> Any:
        """``record.resize(saved, old_world_size, new_world_size)``, or ``None`` (afresh)."""
        if self.record.resize is None:
            return None
        return self.record.resize(saved, old_world_size, new_world_size)


def checkpointed_state(record: CommHook, state: Any) -> Any:
    """What the DDP handler attaches to checkpoints for ``record``'s ``state``.

    Args:
        record: the hook registered with DDP.
        state: its live state (``None`` or a process group: nothing to save).

    Returns:
        ``state`` itself when ``record`` declares no checkpoint rule (the checkpoint code then
        uses the state's ``state_dict()``/``load_state_dict()`` or its ``__getstate__``), else
        a :class:`HookCheckpoint`.

    Raises:
        TypeError: ``record`` has a ``load_state_dict`` or ``resize`` rule, but no
            ``state_dict`` rule and the state has no ``state_dict()`` method (or the reverse
            for loading): it could not be saved or restored.
    """
    rules = (record.state_dict, record.load_state_dict, record.resize)
    if state is None or all(rule is None for rule in rules):
        return state
    for rule, method in (
        (record.state_dict, "state_dict"),
        (record.load_state_dict, "load_state_dict"),
    ):
        if rule is None and not callable(getattr(state, method, None)):
            raise TypeError(
                f"communication hook {record.name!r} (from {record.source}) declares "
                f"checkpoint rules but no {method}, and its state "
                f"{type(state).__qualname__} has no {method}() method"
            )
    return HookCheckpoint(record, state)
