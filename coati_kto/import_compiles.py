"""Third-party modules that call ``torch.compile`` while they import get it deferred to their first call.

bitsandbytes (imported by peft, which ColossalAI's booster imports), ``colossalai.quantization.fp8`` (imported by
the pipeline schedules) and ``colossalai.shardformer.layer.attn`` wrap functions in ``torch.compile`` at import.
Each such call loads inductor and dynamo's compiler front end: about 1.1 CPU-seconds of every process that
imports the booster (6.4 s in all on a 2-core AMD EPYC), spent on kernels this project never calls (4-bit and
int8 matmuls, fp8 casts, flash-attention glue). Deferred, a wrapped function compiles with the same arguments
the first time it is called, so a user who does call one gets what the module asked for.

Only those modules, only while they execute: an ``import_hooks.ExecHook`` wraps their loaders, swaps
``torch.compile`` for the deferring one around ``exec_module`` and puts it back. Every other ``torch.compile``
(``model.compile``, a user's) is torch's own. :func:`install` runs when ``coati_kto`` is imported (before any of
those modules can be), imports nothing heavy, and is idempotent; ``COATI_KTO_EAGER_IMPORT_COMPILES=1`` turns it
off.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from coati_kto import import_hooks

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


def _exec_deferring(loader: importlib.abc.Loader, module: ModuleType) -> None:
    """``module`` executed with ``torch.compile`` deferred (an ``import_hooks.ExecModule``)."""
    import torch  # every deferred module imports torch itself; by now it is loaded

    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        loader.exec_module(module)
    finally:
        torch.compile = real


def install() -> None:
    """The hook first on ``sys.meta_path`` (once per process)."""
    if os.environ.get("COATI_KTO_EAGER_IMPORT_COMPILES") == "1":
        return
    import_hooks.install(DEFERRED_MODULES, _exec_deferring)
