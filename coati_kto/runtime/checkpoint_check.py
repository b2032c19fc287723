"""Whether a checkpoint marked COMPLETE still holds what a resume reads, before anything loads it.

A COMPLETE marker says the save finished; files lost or cut short since (a node crash before the page cache
reached the disk, a copy stopped partway, a file removed by hand) used to surface as a raw traceback from deep in
the load (FileNotFoundError on meta.json or trainer_state/rank-0.pt, safetensors' "invalid header length").
:func:`damage` names the first such file in a few words. Cheap: it reads the JSON files, each safetensors header
and each torch file's zip directory (the end of the file), no tensor; filesystem reads only, any process may call.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from coati_kto.runtime.run_dir import MASTER_WEIGHTS_DIR, TRAINER_STATE_DIR

_BOOSTER_DIRS = (
    "model",
    "optimizer",
)  # ColossalAI's sharded saves: index JSON files and the shards they name


def damage(checkpoint: Path) -> str | None:
    """What is missing or unreadable in ``checkpoint`` ("meta.json is missing", "model/model-00001.safetensors
    is cut short: ..."), or None when every file a resume reads is there and whole as far as these checks tell."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except FileNotFoundError:
        return "meta.json is missing"
    except (OSError, ValueError) as err:
        return f"meta.json is unreadable ({err})"
    if not isinstance(meta, dict):
        return "meta.json is unreadable (not a JSON object)"
    try:  # Every rank of the saving layout wrote its trainer state; a resume on another layout reads them all.
        world = int(meta.get("world_size") or 1)
        listed = (
            [int(rank) for rank in meta["master_ranks"]]
            if isinstance(meta.get("master_ranks"), list)
            else None
        )
    except (TypeError, ValueError) as err:
        return f"meta.json is unreadable ({err})"
    needed = [checkpoint / TRAINER_STATE_DIR / f"rank-{rank}.pt" for rank in range(world)]
    needed.append(checkpoint / "lr_scheduler.pt")
    # Only ranks holding lower-precision weights write one; meta.json names them (saves since 2026-12-02): a
    # missing one would be rebuilt from the bf16 weights, unsaid, and the resume would not be exact.
    masters = checkpoint / MASTER_WEIGHTS_DIR
    if listed is not None:
        needed += [masters / f"rank-{rank}.pt" for rank in listed]
    else:
        needed += sorted(masters.glob("*.pt")) if masters.is_dir() else []
    for path in needed:
        why = _file_damage(path)
        if why is not None:
            return f"{path.relative_to(checkpoint)} {why}"
    for folder in _BOOSTER_DIRS:
        why = _folder_damage(checkpoint, checkpoint / folder)
        if why is not None:
            return why
    return None


def _folder_damage(checkpoint: Path, folder: Path) -> str | None:
    """A booster folder: its index files readable, every file they name there, every file in it whole."""
    if not folder.is_dir():
        return f"{folder.name}/ is missing"
    named: set[str] = set()
    for index in sorted(folder.glob("*.index.json")):
        try:
            data = json.loads(index.read_text())
            named |= {str(v) for v in (data.get("weight_map") or {}).values()}
            groups = (data.get("metadata") or {}).get("param_groups")
        except (OSError, ValueError, AttributeError) as err:
            return f"{index.relative_to(checkpoint)} is unreadable ({err})"
        if groups:
            named.add(str(groups))
    files = {p.name: p for p in folder.iterdir() if p.is_file()}
    for name in sorted(named - set(files)):
        return f"{folder.name}/{name} is missing"
    for name in sorted(files):
        why = _file_damage(files[name])
        if why is not None:
            return f"{files[name].relative_to(checkpoint)} {why}"
    return None


def _file_damage(path: Path) -> str | None:
    """Why ``path`` cannot be read back ("is missing", "is cut short: ..."), or None."""
    if not path.is_file():
        return "is missing"
    try:
        if path.suffix == ".safetensors":
            return _safetensors_damage(path)
        if path.suffix in (".pt", ".bin", ".pth"):  # torch.save's zip archive: its directory sits at the end
            return None if zipfile.is_zipfile(path) else "is cut short or not a torch file (no zip directory)"
    except OSError as err:
        return f"is unreadable ({err.strerror or err})"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file: an 8-byte header length, the JSON header, then the tensors' bytes up to the last
    offset the header names. A file cut short fails one of these."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"is cut short ({size} bytes, no header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"is cut short ({size} bytes; its header alone needs {8 + length})"
        try:
            header = json.loads(handle.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has an unreadable header"
    needed = 8 + length + max(ends, default=0)
    return f"is cut short ({size} bytes of {needed})" if size < needed else None
