"""Test artifacts built once and reused: tiny models and tokenizers saved under a content address.

``built(name, build, inputs)`` returns ``<root>/<name>-<key>``, a directory ``build(path)`` filled. The key hashes
``inputs`` (the builder's arguments), the source of the modules that build (``BUILDER_MODULES``) and the versions of
the libraries that write the files, so a changed builder, argument or library gets a new directory and the old
one is never read again. A directory counts only once its ``COMPLETE`` marker is written: a build that failed or
was killed leaves a temporary directory that is never returned, and two processes building the same key at once
both succeed (the first rename wins, the other's copy is removed). The marker holds every file's sha256; a
directory whose files no longer match (a test that wrote into a shared model) is built again, not handed out.

tests/conftest.py roots it in pytest's cache (``.pytest_cache/d/coati-kto-built``), so later runs on the same
checkout reuse it; without the cache provider (``-p no:cacheprovider``), in the session's temporary directory.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# What decides the bytes a builder writes: the modules that build tokenizers and models, and the libraries that
# serialize them.
BUILDER_MODULES = (
    "coati_kto.testing.built",
    "coati_kto.testing.tiny",
    "coati_kto.testing.tiny_types",
    "coati_kto.testing.tiny_vision",
    "coati_kto.models.tiny",
)
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")
COMPLETE = "COMPLETE"


def content_key(name: str, inputs: Mapping[str, Any]) -> str:
    """16 hex digits of sha256 over ``name``, ``inputs`` (JSON: keys sorted; anything else by ``repr``), the
    builder modules' source bytes and the libraries' versions."""
    digest = hashlib.sha256()
    digest.update(json.dumps([name, inputs], sort_keys=True, default=repr).encode())
    for module in BUILDER_MODULES:
        digest.update(Path(importlib.import_module(module).__file__ or "").read_bytes())
    for library in LIBRARIES:
        digest.update(f"{library}=={importlib.import_module(library).__version__}".encode())
    return digest.hexdigest()[:16]


def _digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` but the marker: its relative path -> sha256."""
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != COMPLETE
    }


def _complete(directory: Path) -> bool:
    marker = directory / COMPLETE
    return marker.is_file() and json.loads(marker.read_text())["files"] == _digest(directory)


def built(root: str | Path, name: str, build: Callable[[Path], Any], inputs: Mapping[str, Any]) -> Path:
    """``<root>/<name>-<key>``, built by ``build(directory)`` unless a complete one is there. ``inputs`` must hold
    every argument ``build`` uses besides the builder modules' code (the key is all that tells builds apart)."""
    root = Path(root)
    final = root / f"{name}-{content_key(name, inputs)}"
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(staging)
        marker = {"inputs": inputs, "files": _digest(staging)}
        (staging / COMPLETE).write_text(json.dumps(marker, sort_keys=True, default=repr, indent=1) + "\n")
        if final.exists():
            if _complete(final):
                return final  # another process finished the same key meanwhile
            shutil.rmtree(final)  # a leftover whose files changed or whose marker is missing
        os.rename(staging, final)
    except OSError:
        if not _complete(final):
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final
