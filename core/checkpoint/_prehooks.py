"""``register_save_state_pre_hook`` / ``register_load_state_pre_hook``: user code that saves
or loads some prepared models itself (e.g. diffusers' LoRA scripts: ``save_pretrained`` of
the adapters only), as in Accelerate.

On save, every rank calls each hook as ``hook(models, weights, output_dir)`` after the new
version folder is staged: ``models`` the prepared models as they were before DDP wrapping
(Accelerate's ``_models``: ``save_pretrained`` and the model's own methods work), ``weights``
their unwrapped state dicts, ``output_dir`` the version folder. The dicts left in ``weights``
are saved in order as ``model_0``, ``model_1``... (a hook that removed a dict removed that
model from the checkpoint). The files the hooks wrote there become part of the version:
listed in its manifest with their checksums, committed, pruned and verified with kwplug's own.

On load, once every file of the version is verified, every rank calls each hook as
``hook(models, input_dir)``; the models left in the list are loaded, in order, from
``model_0``, ``model_1``...
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _manifest as manifest
from kwplug.checkpoint import _reader as reader
from kwplug.checkpoint import _sharded as sharded
from kwplug.checkpoint._checks import qualified_name
from kwplug.checkpoint._plan import Entry
from kwplug.errors import CheckpointError

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources


class _Weights:
    """A state dict a save hook left in ``weights``, saved as it is (``Stateful``)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("saved weights are loaded into their model")  # never called


def _refuse_sharded(sources: CheckpointSources, what: str) -> None:
    # A sharded model's state dict is gathered collectively: a hook that drops it on some
    # ranks (diffusers' pop on the main process only) would leave the others waiting.
    for module in sources.modules():
        if sharded.is_sharded(module):
            raise NotImplementedError(
                f"register_{what}_state_pre_hook with a sharded model "
                f"({type(module).__qualname__}, DTensor parameters) is not "
                "supported: remove the hook's handle, or save that model with save_model"
            )


def _is_model_entry(entry: Entry, count: int) -> bool:
    return entry.file in {layout.model_file(i) for i in range(count)}


def saving(
    sources: CheckpointSources, entries: list[Entry], staging: Path
) -> tuple[list[Entry], str | None]:
    """Run the save hooks (every rank) and replace the model entries by the weights they
    left; also an error message when a hook wrote a name kwplug writes itself."""
    hooks = sources.pre_hooks.save
    if not hooks:
        return entries, None
    _refuse_sharded(sources, "save")
    modules = sources.modules()
    weights: list[dict[str, Any]] = [m.state_dict() for m in modules]
    kinds = {id(w): qualified_name(m) for w, m in zip(weights, modules, strict=True)}
    for hook in list(hooks.values()):  # the models before DDP wrapping, as Accelerate's
        hook(list(modules), weights, str(staging))
    kept = [
        Entry(layout.model_file(j), _Weights(w), "main", kinds.get(id(w), qualified_name(w)))
        for j, w in enumerate(weights)
    ]
    planned = kept + [e for e in entries if not _is_model_entry(e, len(modules))]
    if not sources.is_main_process:
        return planned, None
    # Names the main process writes next (other ranks may have written theirs already).
    clash = sorted({e.file for e in planned} & {p.name for p in staging.iterdir()})
    if clash:
        return planned, f"a save_state pre-hook wrote {staging / clash[0]}, a name kwplug writes"
    return planned, None


def with_written(
    sources: CheckpointSources, staging: Path, records: dict[str, manifest.Record]
) -> dict[str, manifest.Record]:
    """``records`` and a record for each file the save hooks wrote into ``staging``.

    Raises:
        CheckpointError: a hook wrote something else than regular files in folders (a link,
            a FIFO, an empty folder), or a name kwplug writes itself.
    """
    if not sources.pre_hooks.save:
        return records
    out = dict(records)
    for name in sorted(manifest.files(staging) - records.keys()):
        if layout.is_own_file(name):
            raise CheckpointError(
                f"a save_state pre-hook wrote {staging / name}, a name kwplug writes itself",
                staging / name,
            )
        out[name] = reader.record(staging / name)  # refuses links, FIFOs, empty folders
    return out


def loading(sources: CheckpointSources, entries: list[Entry], directory: Path) -> list[Entry]:
    """Verify every file of ``directory`` (also those the save hooks wrote), then run the load
    hooks (every rank) and replace the model entries by the models they left, in order.

    Raises:
        CheckpointError: a file is missing, not listed, truncated or altered.
    """
    hooks = sources.pre_hooks.load
    if not hooks:
        return entries
    _refuse_sharded(sources, "load")
    records = manifest.read(directory)
    for name in sorted(records):  # in chunks: never a whole file in memory
        reader.verify(directory / name, records[name])
    models = sources.modules()  # before DDP wrapping, as Accelerate's (save_pretrained works)
    count = len(models)
    for hook in list(hooks.values()):
        hook(models, str(directory))
    kept = []
    for j, model in enumerate(models):
        module = sources.unwrap(model)
        kept.append(Entry(layout.model_file(j), module, "main", qualified_name(module)))
    return kept + [e for e in entries if not _is_model_entry(e, count)]
