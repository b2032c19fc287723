"""transformers' lazy-module import structures, read from a disk cache instead of rebuilt by every process.

``transformers.utils.import_utils.define_import_structure`` builds the map a lazy module imports from by
reading every ``.py`` file under a package and parsing its ``__all__`` and ``@requires`` lines: for
``transformers.models``, 2,600 files, 0.25 CPU-seconds inside the function and 0.4-0.5 less for importing a
model class and the booster once it is cached (with the collector held off, coati_kto.runtime.startup), in
every rank, launcher and command. The map is a pure function of those files.

Here an ``import_hooks.ExecHook`` wraps the loader of ``transformers.utils.import_utils``; once the module has
run, ``define_import_structure`` is replaced by :func:`cached`, before any transformers package binds it by
name. A call's result is stored as JSON under ``cache_root()``, keyed by the transformers version, the path,
the prefix and a fingerprint of the tree it reads (each ``.py`` file's relative path, size and modification
time, each directory's name: 50 ms for ``transformers.models``). A changed, added or removed file gives another
key, so a stale map is never read. Anything unexpected (an unreadable or unwritable cache, a result that does
not round-trip through JSON, another signature) falls back to transformers' own function.
``COATI_KTO_NO_IMPORT_STRUCTURE_CACHE=1`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from coati_kto import import_hooks

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


def _exec_caching(loader: importlib.abc.Loader, module: ModuleType) -> None:
    """``module`` (transformers' import_utils) executed, then its ``define_import_structure`` swapped for
    :func:`cached` (an ``import_hooks.ExecModule``)."""
    loader.exec_module(module)
    original = getattr(module, "define_import_structure", None)
    if callable(original):
        from importlib.metadata import PackageNotFoundError, version

        with contextlib.suppress(PackageNotFoundError):  # no metadata: no version to key on, no cache
            module.define_import_structure = cached(original, version("transformers"))


def install() -> None:
    """The hook first on ``sys.meta_path`` (once per process; not once transformers is imported)."""
    if os.environ.get(SWITCH) == "1" or MODULE in sys.modules:
        return
    import_hooks.install(frozenset({MODULE}), _exec_caching)
