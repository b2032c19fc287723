"""The reference weights by content: a full sha256 (the cache key's, remembered per file) and a sampled digest (what
a resume compares with its checkpoint's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from pathlib import Path

from coati_kto.config.hub import local_snapshot
from coati_kto.config.schema import ModelSection
from coati_kto.errors import ConfigError
from coati_kto.parallel.distributed import on_rank0

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # plus config.json: what the forward depends on
_CODE_SUFFIX = ".py"  # a model that ships its code (model.trust_remote_code, config.json's auto_map) runs it
_SAMPLE = 1 << 20  # bytes per sampled block of a weight file (reference_weights_digest)


def _weights_dir(path: str) -> Path:
    folder = local_snapshot(path)
    if folder is None:
        raise ConfigError(
            f"model.reference_path / model.path {path}: kto.reference cached fingerprints the reference "
            "weights by content and needs them on disk (a directory or a downloaded hub snapshot)"
        )
    return folder


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def weights_hash(path: str, memo_file: Path | None = None) -> str:
    """sha256 over the reference's weight files, config.json and top-level ``.py`` files (names and contents):
    a model that ships its code runs its ``modeling_*.py`` with ``model.trust_remote_code``, so an edit of it
    changes the reference's values as a new weight would.

    ``memo_file`` remembers each file's hash under (path, size, mtime, ctime, inode), so a multi-GB model is
    read once, not at every launch. A file that changes is hashed again, even with the same size and mtime (a
    checkpoint of the same shapes extracted or copied with its timestamps: ``tar``, ``cp -p``, ``rsync -t``):
    nothing but the kernel sets ctime, and a write or a replacing rename changes it or the inode.
    """
    root = _weights_dir(path)
    memo: dict[str, str] = {}
    if memo_file is not None and memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except ValueError:
            memo = {}
    h = hashlib.sha256()
    # Top level only, as from_pretrained reads it (and reference_weights_digest below): a Trainer's checkpoint-N/
    # kept in the model's directory is not the reference, and hashing it read whole optimizer states.
    files = sorted(
        f
        for f in root.iterdir()
        if f.is_file() and (f.suffix in (*_WEIGHT_SUFFIXES, _CODE_SUFFIX) or f.name == "config.json")
    )
    for f in files:
        st = f.stat()
        stamp = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        if stamp not in memo:
            memo[stamp] = file_sha256(f)
        h.update(f"{f.relative_to(root)}\0{memo[stamp]}\0".encode())
    if memo_file is not None:
        tmp = memo_file.with_name(f".{memo_file.name}.{uuid.uuid4().hex[:8]}")
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo, indent=1))
            tmp.replace(memo_file)
        except (
            OSError
        ):  # a read-only prepared_dir (an online run writes nothing else there): hashed next time
            pass
        finally:  # a failed write's, or a stop's (precompute ends on one), partial file is not left behind
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return h.hexdigest()


def reference_weights_digest(model: ModelSection, reference: str) -> str | None:
    """The run's reference weights (``model.reference_path`` or ``model.path``) by a sample of their content,
    which a resume compares with the checkpoint's (a new SFT run saved over the reference changes every
    sample): None where the reference is not read from disk (LoRA with an online reference, ``reference``
    being ``kto.reference``: the checkpoint's own base, adapters off) or is not on disk. Reads at most 16 MiB
    per file, so a 70B reference costs a second, not a full hash while the other ranks wait. Every rank calls;
    global rank 0 reads."""
    if model.lora is not None and reference == "online":
        return None

    def digest() -> str | None:
        try:
            root = _weights_dir(model.reference_path or model.path)
        except ConfigError:
            return None
        h = hashlib.sha256()
        # Top level only, as from_pretrained reads it: not an output.dir, an export or Trainer's checkpoint-N/
        # kept under the model's directory (a run's own checkpoints there changed the digest at every save).
        for f in sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES):
            size = f.stat().st_size
            h.update(f"{f.relative_to(root)}\0{size}\0".encode())
            with f.open("rb") as handle:  # 16 blocks of 1 MiB spread over the file, its header first
                for offset in sorted({i * max(0, size - _SAMPLE) // 15 for i in range(16)}):
                    handle.seek(offset)
                    h.update(handle.read(_SAMPLE))
        return h.hexdigest()

    return on_rank0(digest, "read the reference weights")
