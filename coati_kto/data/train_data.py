"""What a resume checks of the training data: a digest of what the rows are made of, and its parts by name, for
a refused resume to say what changed (``coati_kto.config.resume.check_training_data``). Both read a prepared
build's fingerprint (``coati_kto.data.store.fingerprint``), wherever the files sit."""

from __future__ import annotations

import hashlib
import json


def train_data_digest(fp: dict | None) -> str | None:
    """What the training rows are made of, wherever the files sit: every train file's size and content hash and
    the tokenizer, and where records hold images the processor and the images' digests (16 hex digits; None
    without a fingerprint). A resume refuses a change of it."""
    if fp is None:
        return None
    parts = [[entry[1:] for entry in fp.get("train_files", [])], fp.get("tokenizer")]
    if fp.get("images"):  # an image file edited in place changes the rows, not the data file
        parts.append(fp["images"])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def train_data_parts(fp: dict | None) -> dict | None:
    """What :func:`train_data_digest` hashes, by part, for a refused resume to name what changed: ``files`` (each
    train file's path, size and content hash, in order), ``tokenizer`` and ``images``; and ``template_date``, the
    day a template that dates prompts rendered them as of (checked apart: builds before it have none) (None
    without a fingerprint)."""
    if fp is None:
        return None
    return {
        "files": fp.get("train_files", []),
        "tokenizer": fp.get("tokenizer"),
        "images": fp.get("images"),
        "template_date": fp.get("template_date"),
    }
