"""The parallel backends by name: one module per ColossalAI plugin, each owning what its plugin does differently.

``backend_class(name)`` for ``plugin.name``; ``backend_of(plugin)`` for a plugin object built elsewhere. A new
plugin (or a new axis such as sequence or pipeline parallelism) is one ``ParallelBackend`` subclass, listed in
``BACKENDS``, and its name in ``coati_kto.config.schema.PluginName``.
"""

from __future__ import annotations

from typing import Any

from coati_kto.errors import ConfigError
from coati_kto.parallel.backends.base import ParallelBackend
from coati_kto.parallel.backends.ddp import DDPBackend
from coati_kto.parallel.backends.gemini import GeminiBackend
from coati_kto.parallel.backends.hybrid_parallel import HybridParallelBackend
from coati_kto.parallel.backends.low_level_zero import LowLevelZeroBackend

BACKENDS: dict[str, type[ParallelBackend]] = {
    backend.name: backend
    for backend in (HybridParallelBackend, LowLevelZeroBackend, DDPBackend, GeminiBackend)
}


def backend_class(name: str) -> type[ParallelBackend]:
    """The backend registered as ``name``; ConfigError (one line listing the known names) for any other."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ConfigError(
            f"plugin.name {name!r} is no parallel backend; known: {', '.join(sorted(BACKENDS))}"
        )
    return backend


def backend_of(plugin: Any) -> type[ParallelBackend]:
    """The backend of a plugin object, by its class; ddp for anything else (no plugin: a plain torch run)."""
    kind = type(plugin).__name__
    return next((b for b in BACKENDS.values() if b.plugin_class == kind), DDPBackend)
