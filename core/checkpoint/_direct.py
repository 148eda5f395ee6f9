"""A verified file read straight into the live tensors it loads into: no new memory.

A load verifies every file it needs before it changes anything (the first pass of
:func:`kwplug.checkpoint._api.load_state`, hashed in chunks). A model's file, and an
optimizer's whose state tensors exist, are then read a second time straight into the tensors
their ``load_state_dict`` would copy into (``preadv`` into each tensor's memory, each chunk
hashed right after it is read, in the file's order), and ``load_state_dict`` gets those same
tensors: torch's ``copy_`` of a tensor onto itself returns at once, and
``Optimizer.load_state_dict`` keeps a state tensor already of its parameter's dtype and device.

Why: making memory is most of what a load cost on a virtual machine (the kernel zeroes and
maps every page: 2.3 of a fresh process's 3 s to load a 1 GiB model with SGD), while reading a
GiB from the page cache into memory that exists takes ~0.2 s. A file's tensors with no live
counterpart of the same name, dtype and shape (an optimizer's state for a parameter that has
none yet, tied weights' second name) are read into new tensors.

What it changes: the second read is hashed, and a file whose bytes changed between the two
reads (a program writing into the checkpoint while it loads: kwplug never rewrites a file) is
refused, but only after its bytes were copied: the object holds part of the changed file until
a checkpoint is loaded again. A file damaged before the load is refused before anything
changes, as before. Objects whose loading runs code of their own (``load_state_dict`` hooks,
``_load_from_state_dict`` overrides outside ``torch.nn``, an optimizer class's own
``load_state_dict``, loading methods set on the object itself) are loaded from a private copy
that is decoded only once it matched (:func:`kwplug.checkpoint._reader.read_state`), as are
optimizers with no state yet (the memory is made either way).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _decode as decode
from kwplug.checkpoint import _reader as reader
from kwplug.errors import CheckpointError

_OPTIMIZER_HOOKS = (
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
)
_MODULE_HOOKS = (
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)


def live_state(target: Any) -> Any | None:
    """The live ``state_dict()`` of ``target`` (a checkpoint entry's object) that its load may
    read straight into, or ``None`` where it is loaded from a private copy (see the module
    docstring)."""
    live = _state(target)
    # On an accelerator every tensor would be read into new CPU memory: the private copy's
    # one buffer is cheaper to make. Most bytes, not any tensor, decide: Adam keeps its
    # ``step`` counts on the CPU beside CUDA moments.
    if live is None:
        return None
    tensors = codec.named_tensors(live).values()
    on_cpu = sum(t.nbytes for t in tensors if t.is_cpu)
    return live if on_cpu and 2 * on_cpu >= sum(t.nbytes for t in tensors) else None


def _state(target: Any) -> Any | None:
    if isinstance(target, torch.nn.Module):
        return target.state_dict() if _plain_module(target) else None
    if isinstance(target, torch.optim.Optimizer):
        inner = getattr(target, "optimizer", target)  # an AcceleratedOptimizer's optimizer
        if not isinstance(inner, torch.optim.Optimizer) or not inner.state:
            return None
        if any(getattr(inner, hooks, None) for hooks in _OPTIMIZER_HOOKS):
            return None
        base = torch.optim.Optimizer
        if type(inner).load_state_dict is not base.load_state_dict or _own(inner, target):
            return None
        return target.state_dict() if type(inner).state_dict is base.state_dict else None
    return None


def _plain_module(module: torch.nn.Module) -> bool:
    # Loading it only copies each tensor of the state into the one of the same name: no hook,
    # and no _load_from_state_dict but torch.nn's own (BatchNorm's adds a key, then copies).
    base = torch.nn.Module
    if type(module).load_state_dict is not base.load_state_dict or _own(module):
        return False
    for sub in module.modules():
        if any(getattr(sub, hooks, None) for hooks in _MODULE_HOOKS) or _own(sub):
            return False
        own = type(sub)._load_from_state_dict
        if own is not base._load_from_state_dict and not getattr(own, "__module__", "").startswith(
            "torch.nn.modules."
        ):
            return False
    return True


def _own(*objects: object) -> bool:
    # A loading method set on the object itself (a patched ``load_state_dict``) runs code of
    # its own, that the type's checks above do not see: it may read the state's tensors
    # after they were overwritten (a transpose copied onto itself fails).
    names = ("load_state_dict", "state_dict", "_load_from_state_dict")
    return any(name in getattr(o, "__dict__", {}) for o in objects for name in names)


def read_into(path: Path, expected: tuple[int, str], live: Any) -> tuple[Any, dict[str, str]]:
    """The state and metadata of the state file ``path`` (verified before: see the module
    docstring), its tensors read into those of ``live`` (a ``state_dict()``) of the same name,
    dtype and shape, the others into new tensors; hashed as read.

    Raises:
        CheckpointError: ``path`` is missing, not regular, not ``expected``'s size, not a
            state file kwplug wrote, could not be read, or its bytes no longer match
            ``expected`` (changed since it was verified: the tensors read into hold part of
            it).
    """
    algorithm = reader.algorithm_of(path, expected)
    try:
        fd = reader.open_regular(path, expected[0])
        try:
            source = _Into(fd, path, expected[0], codec.named_tensors(live), algorithm)
            state, meta = decode.checked(path, source, expected[0])
            got = (source.count, f"{algorithm}:{source.hashed.hexdigest()}")
        finally:
            os.close(fd)
    except CheckpointError:
        raise
    except Exception as exc:
        # Anything else (an OSError opening it or reading its header) names the file, as
        # the first pass's readers do: load_state refuses a CheckpointError on every rank
        # together, where another exception would leave the other ranks waiting.
        raise CheckpointError(
            f"{path} could not be read: {type(exc).__name__}: {exc}", path
        ) from exc
    if got != expected:
        raise CheckpointError(
            f"{path} changed while it was loaded: it matched its checksum in the manifest "
            "when verified, not when read again into the live tensors, which now hold part "
            "of it (was another program writing into the checkpoint?); load a checkpoint "
            "again",
            path,
        )
    return state, meta


@contextlib.contextmanager
def reading(
    files: dict[str, tuple[Path, tuple[int, str], Any]], workers: int = reader.WORKERS
) -> Iterator[dict[str, Future[tuple[Any, dict[str, str]]]]]:
    """Within this block, :func:`read_into` of each ``name: (path, expected, live)`` of
    ``files`` runs ahead, ``workers`` files at a time (threads: ``preadv`` and the hashers
    release the GIL, and reading into live tensors makes no memory however many run), in the
    order given; the block gets each file's future by name. On leaving, the reads not started
    are cancelled and the running ones waited for: no thread writes into a tensor after it.
    """
    if not files:
        yield {}
        return
    with ThreadPoolExecutor(min(workers, len(files)), thread_name_prefix="kwplug-load") as pool:
        futures = {name: pool.submit(read_into, *args) for name, args in files.items()}
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()


class _Into:
    # A file's header read from its descriptor; its tensors read into live ones (or new).
    def __init__(
        self, fd: int, path: Path, size: int, targets: dict[str, torch.Tensor], algorithm: str
    ) -> None:
        self._fd, self._path, self._size, self._targets = fd, path, size, targets
        self.hashed = checksum.hasher(algorithm, path)
        self.count = 0

    def read(self, count: int, offset: int) -> bytes:
        return reader.pread(self._fd, count, offset)

    def tensors(self, start: int, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
        placed = decode.spans(start, entries, self._size)
        chosen = _chosen(placed, self._targets)
        head = reader.pread(self._fd, start, 0)  # what the first pass hashed first
        self.hashed.update(head)
        self.count = len(head)
        tensors = {}
        for name, begin, end, dtype, shape in placed:
            tensor = chosen.get(name)
            tensors[name] = torch.empty(shape, dtype=dtype) if tensor is None else tensor
            self._fill(tensors[name], begin, end)
        return tensors

    def _fill(self, tensor: torch.Tensor, begin: int, end: int) -> None:
        # The file's bytes begin..end into the tensor's memory, each chunk hashed right after
        # it is read (while in the CPU's cache).
        view = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
        done = 0
        try:
            while done < end - begin:
                piece = view[done : min(done + checksum.CHUNK, end - begin)]
                count = os.preadv(self._fd, [piece], begin + done)
                if count == 0:
                    raise CheckpointError(
                        f"{self._path} ended at byte {begin + done} while it was loaded "
                        "(truncated since it was verified?)",
                        self._path,
                    )
                self.hashed.update(view[done : done + count])
                done += count
        except OSError as exc:
            raise CheckpointError(
                f"{self._path} could not be read: {type(exc).__name__}: {exc}", self._path
            ) from exc
        finally:
            view.release()
        self.count += done


def _chosen(
    placed: list[tuple[str, int, int, torch.dtype, list[int]]], targets: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    # The live tensors each file tensor is read into: same name, dtype and shape, dense CPU
    # memory. ``load_state_dict`` then copies every other file tensor into its live one in
    # the state's order, the later winning where two share bytes; a tensor read into ahead
    # of all those copies keeps torch's result only if every other one sharing its bytes
    # covers exactly them and is copied after it (tied weights: the first name). Partly
    # overlapping views of one buffer are all copied, as from the private copy.
    in_file = {name for name, *_ in placed}
    spans = {n: s for n, t in targets.items() if n in in_file and (s := _span(t)) is not None}
    first: dict[tuple[int, int], str] = {}
    for name, span in spans.items():  # in the state's order
        first.setdefault(span, name)
    shared = _overlapped(sorted(first))
    chosen = {}
    for name, _begin, _end, dtype, shape in placed:
        tensor = targets.get(name)
        if tensor is None or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            continue
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue
        if tensor.dtype != dtype or list(tensor.shape) != shape or not tensor.is_contiguous():
            continue
        if tensor.is_conj() or tensor.is_neg() or name not in spans:
            continue
        if first[spans[name]] == name and spans[name] not in shared:
            chosen[name] = tensor
    return chosen


def _overlapped(spans: list[tuple[int, int]]) -> set[tuple[int, int]]:
    # Those of ``spans`` (distinct, sorted) that share a byte with another: one pass.
    found, reached = set(), 0
    for i, (start, stop) in enumerate(spans):
        if start < reached or (i + 1 < len(spans) and spans[i + 1][0] < stop):
            found.add((start, stop))
        reached = max(reached, stop)
    return found


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    # The bytes ``tensor`` may touch (first to past the last element), or ``None`` where it
    # touches none or none in CPU memory.
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.numel():
        return None
    if tensor.layout != torch.strided:
        return None
    low = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True) if s > 0)
    size = tensor.element_size()
    return tensor.data_ptr() + low * size, tensor.data_ptr() + (high + 1) * size
