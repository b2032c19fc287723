"""Third-party modules that call ``torch.compile`` while they import get it deferred to their first call.

bitsandbytes (imported by peft, which ColossalAI's booster imports), ``colossalai.quantization.fp8`` (imported by
the pipeline schedules) and ``colossalai.shardformer.layer.attn`` wrap functions in ``torch.compile`` at import.
Each such call loads inductor and dynamo's compiler front end: about 1.1 CPU-seconds of every process that
imports the booster (6.4 s in all on a 2-core AMD EPYC), spent on kernels this project never calls (4-bit and
int8 matmuls, fp8 casts, flash-attention glue). Deferred, a wrapped function compiles with the same arguments
the first time it is called, so a user who does call one gets what the module asked for.

Only those modules, only while they execute: a :class:`importlib.abc.MetaPathFinder` wraps their loaders, swaps
``torch.compile`` for the deferring one around ``exec_module`` and puts it back. Every other ``torch.compile``
(``model.compile``, a user's) is torch's own. :func:`install` runs when ``coati_kto`` is imported (before any of
those modules can be), imports nothing heavy, and is idempotent; ``COATI_KTO_EAGER_IMPORT_COMPILES=1`` turns it
off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# The modules whose import-time compiles are deferred (exact names; a package's submodules are not included).
DEFERRED_MODULES = frozenset(
    {
        "bitsandbytes.backends.default.ops",
        "colossalai.quantization.fp8",
        "colossalai.shardformer.layer.attn",
    }
)

_lock = threading.Lock()


def deferred_compile(real_compile: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``torch.compile`` that returns, for a function, a wrapper compiling it with the same
    arguments at its first call (``torch.compile(fn, **kw)`` and ``@torch.compile(**kw)`` alike). Anything that
    is not a plain function (a module) goes to ``real_compile`` at once."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda fn: compile_later(fn, **kwargs)
        if not callable(model) or isinstance(model, type) or hasattr(model, "forward"):
            return real_compile(model, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **call_kwargs: Any) -> Any:
            if not compiled:
                with _lock:
                    if not compiled:
                        compiled.append(real_compile(model, **kwargs))
            return compiled[0](*args, **call_kwargs)

        return first_call_compiles

    return compile_later


class _DeferringLoader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` with ``torch.compile`` deferred."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch  # every deferred module imports torch itself; by now it is loaded

        real = torch.compile
        torch.compile = deferred_compile(real)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _DeferringFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if os.environ.get("COATI_KTO_EAGER_IMPORT_COMPILES") == "1":
        return
    if not any(isinstance(finder, _DeferringFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferringFinder())
