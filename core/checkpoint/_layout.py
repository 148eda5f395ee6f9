"""Every name kwplug writes into a checkpoint directory: the one place that says what goes
where (format ``kwplug-checkpoint-3``; format 2 differs only in its manifest's
checksums: sha256, read still).

A checkpoint directory ``DIR`` (which may hold anything else too)::

    .kwplug.lock                  the save lock (lock.py), naming its holder's host and pid
    kwplug-<n>/                   one version per save, n = 00000001, 00000002, ...
        model_<i>.safetensors       each prepared model, unwrapped: a plain safetensors
                                    state dict (rank 0; sharded models gathered in full)
        optimizer_<i>.safetensors   each prepared optimizer's state dict (rank 0)
        scaler.safetensors          the GradScaler (rank 0, fp16 only)
        custom_<i>.safetensors      objects given to register_for_checkpointing (rank 0)
        model_<i>-shard_<r>.safetensors  a sharded model saved as SHARDED_STATE_DICT, in
                                    place of model_<i>.safetensors (torch.distributed.
                                    checkpoint, _dcp.py): the local shards rank r wrote,
                                    each with its offsets in the header (r: 5 digits)
        model_<i>-other.state       its non-tensor entries (rank 0; JSON in a safetensors
                                    file without tensors)
        optimizer_<i>-shard_<r>.safetensors, optimizer_<i>-other.state
                                    its optimizer, the same way (other: param_groups)
        rank_<r>.safetensors        per rank: RNG states, data loader positions, states
                                    attached by wrapper plugins (communication hooks),
                                    plugins' handler_state
        accumulation_<r>.safetensors  per rank, only when saved in the middle of a
                                    gradient accumulation: the models' local .grad, the
                                    micro-batch count, the optimizers' per-step flags
        <anything>                  files a save_state pre-hook wrote (_prehooks.py)
        MANIFEST.json               every file above with its size and checksum (xxh3-128)
        COMPLETE                    written last: a version without it does not exist
        .tmpXXXXXX                  only in an unfinished version: safetensors' file being
                                    written (renamed into place when done)
    .kwplug-trash-<n>-<pid>/      a version being deleted (never read)
    <name> -> kwplug-<n>/<name>   a relative link for each top-level name a save_state
                                  pre-hook wrote into the newest version (Accelerate's
                                  checkpoint/<name>; _links.py)
    .kwplug-link-<pid>            such a link being made (killed saves leave it)

Every ``.safetensors`` file is written by :mod:`kwplug.checkpoint._codec` (no pickles).
"""

from __future__ import annotations

import re

FORMAT = "kwplug-checkpoint-3"
LOCK = ".kwplug.lock"
MARKER = "COMPLETE"
MARKER_TMP = ".COMPLETE.tmp"
MANIFEST = "MANIFEST.json"
SCALER = "scaler.safetensors"
_VERSION = re.compile(r"kwplug-(\d{8})")
_TRASH = re.compile(r"\.kwplug-trash-(\d{8})-\d+")
_OWN_FILE = re.compile(
    r"(model|optimizer|custom|rank|accumulation)_\d+\.safetensors|scaler\.safetensors"
    r"|MANIFEST\.json|COMPLETE|\.COMPLETE\.tmp"
    r"|(model|optimizer)_\d+-(shard_\d{5}\.safetensors|other\.state)"
)
_SHARDED = re.compile(r"((model|optimizer)_\d+)-(shard_\d{5}\.safetensors|other\.state)")
#: safetensors' ``save_file`` (0.8 and later) writes ``.tmp`` and six letters or digits beside
#: its target and renames it into place: a save killed meanwhile leaves one behind.
_WRITER_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def model_file(index: int) -> str:
    """File of the ``index``-th prepared model."""
    return f"model_{index}.safetensors"


def optimizer_file(index: int) -> str:
    """File of the ``index``-th prepared optimizer."""
    return f"optimizer_{index}.safetensors"


def custom_file(index: int) -> str:
    """File of the ``index``-th object given to ``register_for_checkpointing``."""
    return f"custom_{index}.safetensors"


def rank_file(rank: int) -> str:
    """File of the per-rank state of process ``rank``."""
    return f"rank_{rank}.safetensors"


def accumulation_file(rank: int) -> str:
    """File of process ``rank``'s unfinished gradient accumulation."""
    return f"accumulation_{rank}.safetensors"


def sharded_prefix(kind: str, index: int) -> str:
    """What the files of the ``index``-th model's or optimizer's shards start with
    (``kind``: ``"model"`` or ``"optimizer"``)."""
    return f"{kind}_{index}"


def shard_file(prefix: str, rank: int) -> str:
    """File of the local shards rank ``rank`` wrote of the state ``prefix`` names."""
    return f"{prefix}-shard_{rank:05d}.safetensors"


def other_file(prefix: str) -> str:
    """File of the non-tensor entries of the sharded state ``prefix`` names."""
    return f"{prefix}-other.state"


def sharded_prefix_of(name: str) -> str | None:
    """The prefix (``model_<i>``, ``optimizer_<i>``) of a sharded state's file ``name``, or
    ``None`` for any other name."""
    match = _SHARDED.fullmatch(name)
    return match.group(1) if match else None


def is_shard_file(name: str) -> bool:
    """True for the name of a file of local shards (``<prefix>-shard_<r>.safetensors``)."""
    return name.endswith(".safetensors") and sharded_prefix_of(name) is not None


def is_rank_file(name: str) -> bool:
    """True for the name of a per-rank state file (``rank_<r>``, ``accumulation_<r>``)."""
    return name.startswith(("rank_", "accumulation_")) and _OWN_FILE.fullmatch(name) is not None


def is_own_file(name: str) -> bool:
    """True for a name kwplug writes inside a version folder."""
    return _OWN_FILE.fullmatch(name) is not None


def is_writer_temp(name: str) -> bool:
    """True for the temporary file safetensors' ``save_file`` writes a state file through
    (``.tmpXXXXXX`` in the version folder): an unfinished version that holds one is a killed
    save's, deleted and saved into again like any other."""
    return _WRITER_TEMP.fullmatch(name) is not None


def version_name(number: int) -> str:
    """The folder of version ``number``."""
    return f"kwplug-{number:08d}"


def version_number(name: str) -> int | None:
    """The number of a version folder's ``name``, or ``None`` for any other name."""
    match = _VERSION.fullmatch(name)
    return int(match.group(1)) if match else None


def trash_name(number: int, pid: int) -> str:
    """The name a version folder takes while process ``pid`` deletes it."""
    return f".kwplug-trash-{number:08d}-{pid}"


def trash_number(name: str) -> int | None:
    """The version number of a trash folder's ``name``, or ``None`` for any other name."""
    match = _TRASH.fullmatch(name)
    return int(match.group(1)) if match else None
