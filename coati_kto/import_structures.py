"""transformers' lazy-module import structures, read from a disk cache instead of rebuilt by every process.

``transformers.utils.import_utils.define_import_structure`` builds the map a lazy module imports from by
reading every ``.py`` file under a package and parsing its ``__all__`` and ``@requires`` lines: for
``transformers.models``, 2,600 files, 0.25 CPU-seconds of every process that imports a model class (with the
collector held off, coati_kto.runtime.startup), paid again by every rank, launcher and command. The map is a pure
function of those files.

Here, while ``transformers.utils.import_utils`` executes, a :class:`importlib.abc.MetaPathFinder` wraps its
loader; once the module has run, ``define_import_structure`` is replaced by :func:`cached`, before any
transformers package binds it by name. A call's result is stored as JSON under ``cache_root()``, keyed by the
transformers version, the path, the prefix and a fingerprint of the tree it reads (each ``.py`` file's relative
path, size and modification time, each directory's name: 50 ms for ``transformers.models``, against 250 to
build). A changed, added or removed file gives another key, so a stale map is never read. Anything unexpected (an
unreadable or unwritable cache, a result that does not round-trip through JSON, another signature) falls back
to transformers' own function. ``COATI_KTO_NO_IMPORT_STRUCTURE_CACHE=1`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

MODULE = "transformers.utils.import_utils"
SWITCH = "COATI_KTO_NO_IMPORT_STRUCTURE_CACHE"
Structure = dict[frozenset[str], dict[str, set[str]]]


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/coati_kto/import_structures`` (``~/.cache`` without XDG_CACHE_HOME); OSError when that
    is not an absolute path."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):  # no home to expand "~" to: no cache (not a folder named "~" in the cwd)
        raise OSError(f"no absolute cache directory: {base}")
    return Path(base) / "coati_kto" / "import_structures"


def fingerprint(module_path: str) -> str:
    """What ``define_import_structure(module_path)`` reads: the tree of the package (a file's directory), each
    ``.py`` file's relative path, size and mtime and each directory's name, hashed."""
    root = os.path.dirname(module_path) if os.path.isfile(module_path) else module_path
    digest = hashlib.sha256()
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        digest.update(f"d {os.path.relpath(directory, root)}\n".encode())
        for name in sorted(files):
            if name.endswith(".py"):
                stat = os.stat(os.path.join(directory, name))
                digest.update(f"f {name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _to_json(structure: Structure) -> str:
    return json.dumps([[sorted(k), {m: sorted(v) for m, v in d.items()}] for k, d in structure.items()])


def _from_json(text: str) -> Structure:
    return {frozenset(k): {m: set(v) for m, v in d.items()} for k, d in json.loads(text)}


def cached(original: Callable[..., Structure], version: str) -> Callable[..., Structure]:
    """``original`` (transformers' ``define_import_structure(module_path, prefix=None)``) with its results read
    from and written to ``cache_root()``; memoized in the process, as the original is."""

    @functools.lru_cache
    def define_import_structure(*args: Any, **kwargs: Any) -> Structure:
        call = dict(zip(("module_path", "prefix"), args, strict=False)) | kwargs
        if len(args) > 2 or set(call) - {"module_path", "prefix"} or "module_path" not in call:
            return original(*args, **kwargs)  # a signature this module does not know
        module_path, prefix = str(call["module_path"]), call.get("prefix")
        try:
            key = json.dumps([version, os.path.abspath(module_path), prefix, fingerprint(module_path)])
            path = cache_root() / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
        except OSError:
            return original(*args, **kwargs)
        try:
            return _from_json(path.read_text())
        except (OSError, ValueError, TypeError):
            pass
        structure = original(*args, **kwargs)
        try:
            text = _to_json(structure)
            if _from_json(text) == structure:  # only what JSON gives back exactly
                path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                    f.write(text)
                os.replace(f.name, path)  # whole or not at all: another process may read it now
        except (OSError, TypeError, ValueError):
            pass
        return structure

    define_import_structure.__wrapped__ = original  # type: ignore[attr-defined]
    return define_import_structure


class _CachingLoader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module``, then swaps the module's ``define_import_structure``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        original = getattr(module, "define_import_structure", None)
        if callable(original):
            from importlib.metadata import PackageNotFoundError, version

            with contextlib.suppress(PackageNotFoundError):  # no metadata: no version to key on, no cache
                module.define_import_structure = cached(original, version("transformers"))

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _CachingFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CachingLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process; not once transformers is imported)."""
    if os.environ.get(SWITCH) == "1" or MODULE in sys.modules:
        return
    if not any(isinstance(finder, _CachingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CachingFinder())
