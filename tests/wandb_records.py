"""Read an offline W&B run back from its ``run-<id>.wandb`` file, for the tests.

wandb (0.17 and later) ships no Python reader of its transaction log, so this reads the
framing and parses each record with wandb's own protobuf schema
(``wandb.proto.wandb_internal_pb2.Record``). The file is a 7-byte header (``:W&B``, a 2-byte
magic, a version byte) followed by LevelDB-log framed chunks in 32 KiB blocks: each chunk is a
CRC (4 bytes), a length (2 bytes, little endian) and a type (1: whole record, 2/3/4: first,
middle and last piece of a record); a block's tail shorter than a chunk header is padding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every ``Record`` of the run file at ``path``, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out: list[Any] = []
    pending = b""
    offset = HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # padding at the end of a block
            offset += room
            continue
        length = int.from_bytes(data[offset + 4 : offset + 6], "little")
        kind = data[offset + 6]
        chunk = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _value(item: Any) -> Any:
    # A history or config item's value: value_json in every wandb version; newer ones may
    # fill a typed field instead.
    if item.value_json:
        return json.loads(item.value_json)
    for field in ("number", "integer", "boolean", "text"):
        if _has(item, field):
            return getattr(item, field)
    return None


def _has(item: Any, field: str) -> bool:
    try:
        return bool(item.HasField(field))
    except ValueError:  # not a field of this version's schema, or one without presence
        return False


def run_folder(wandb_dir: Path) -> Path:
    """The one offline run folder under ``<WANDB_DIR>/wandb``."""
    (folder,) = (wandb_dir / "wandb").glob("offline-run-*")
    return folder


def finished_records(folder: Path, timeout: float = 60.0) -> list[Any]:
    """The records of the run in ``folder`` once its ``exit`` record is written: wandb-core
    writes the file on its own schedule, and an offline ``run.finish()`` can return before the
    file holds more than its header."""
    (path,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        found = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found):
            return found
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)


def read_run(folder: Path) -> dict[str, Any]:
    """What an offline run logged: ``project``, ``tags``, ``config`` (key -> value) and
    ``history`` (one dict per logged step, ``_step`` included)."""
    run: dict[str, Any] = {"project": None, "tags": [], "config": {}, "history": []}
    for record in finished_records(folder):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"] = record.run.project
            run["tags"] = list(record.run.tags)
            for item in record.run.config.update:
                run["config"][item.key] = _value(item)
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key] = _value(item)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                *outer, last = item.nested_key or [item.key]
                place = row
                for key in outer:  # a logged dict (or a media object) is a nested key path
                    place = place.setdefault(key, {})
                place[last] = _value(item)
            run["history"].append(row)
    return run
