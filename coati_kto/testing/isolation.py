"""What a pooled test worker (``coati_kto.testing.worker_pool``) puts back after each task, so that the next task
sees what a fresh process would: ``FreshState.take()`` once after the worker's imports, ``restore()`` after every
task.

Reset: torch's, numpy's and Python's RNGs reseeded from the OS (a new process starts each with a random seed, torch
2.13 too: no test can rely on an unseeded draw); torch's default dtype and device, grad mode, anomaly mode, threads (1, as every worker runs),
deterministic-algorithm and matmul-precision flags; every process group but the default one; signal handlers and
the project's stop flag; logging handlers, levels and filters of the loggers that existed; warnings filters;
stdout/stderr objects and umask; module and class attributes of ``coati_kto`` and ``colossalai`` rebound by the
task (a test's monkeypatch left in place, ColossalAI's ``Randomizer._INDEX``), and the module attributes of
``torch``, ``os``, ``shutil``, ``builtins`` and the serializers (a hand-patched ``torch.save``); ColossalAI's singletons;
transformers' rotary functions the fused-rotary dispatcher replaced (``coati_kto.models.rotary``); the project's
``functools.cache`` results; dynamo's compiled code and config. Not reset: anything a C extension keeps, and new
modules a task imported (imported modules stay, as a warm cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import random
import signal
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# Modules whose attributes (and their classes' attributes) a task may rebind and a later task could see.
PATCHABLE_PREFIXES = ("coati_kto", "colossalai")
# Namespaces of libraries a task may patch by hand (``torch.save = failing_save`` in a fault drill): their own
# attributes only, not their classes or submodules. A drill that left torch.save failing at "step-8.tmp" made a
# later test's checkpoint write fail with "No space left on device" on the same worker (CI, 2026-11-29).
PATCHABLE_MODULES = ("torch", "torch.serialization", "os", "shutil", "builtins", "safetensors.torch")
_ROTARY = "apply_rotary_pos_emb"


def _flags() -> dict[str, Any]:
    """The torch process-wide switches a test may flip, as (value, setter) pairs."""
    cudnn = torch.backends.cudnn
    return {
        "default_dtype": (torch.get_default_dtype(), torch.set_default_dtype),
        "grad": (torch.is_grad_enabled(), torch.set_grad_enabled),
        "anomaly": (torch.is_anomaly_enabled(), torch.autograd.set_detect_anomaly),
        "deterministic": (
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        "matmul_precision": (torch.get_float32_matmul_precision(), torch.set_float32_matmul_precision),
        "cudnn": ((cudnn.deterministic, cudnn.benchmark), lambda v: _set_cudnn(*v)),
        "mkldnn": (torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    }


def _set_cudnn(deterministic: bool, benchmark: bool) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark


def _attributes(prefixes: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    """``{module or class: its __dict__ copied}`` for the loaded modules under ``prefixes`` and their classes."""
    out: dict[Any, dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or not name.startswith(prefixes):
            continue
        namespace = vars(module)
        out[module] = dict(namespace)
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == name and value not in out:
                out[value] = dict(vars(value))
    return out


def _namespaces(names: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    """``{module: its __dict__ copied}`` for the loaded modules named exactly ``names``."""
    return {sys.modules[n]: dict(vars(sys.modules[n])) for n in names if n in sys.modules}


def _loggers() -> dict[logging.Logger, tuple]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return {lg: (lg.level, list(lg.handlers), list(lg.filters), lg.propagate, lg.disabled) for lg in loggers}


def _signals() -> dict[signal.Signals, Any]:
    out = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(sig)
            if handler is not None:  # None: installed from C, not restorable from Python
                out[sig] = handler
    return out


@dataclass
class FreshState:
    """The process-wide state a worker had after its imports, before any task ran."""

    flags: dict[str, Any]
    attributes: dict[Any, dict[str, Any]]
    loggers: dict[logging.Logger, tuple]
    logging_disabled: int
    warnings_filters: list
    showwarning: Any
    signals: dict[signal.Signals, Any]
    streams: tuple[Any, Any]
    umask: int
    singletons: dict = field(default_factory=dict)
    dynamo_config: Any = None

    @classmethod
    def take(cls) -> FreshState:
        umask = os.umask(0o22)
        os.umask(umask)
        state = cls(
            flags=_flags(),
            attributes=_attributes(PATCHABLE_PREFIXES) | _namespaces(PATCHABLE_MODULES),
            loggers=_loggers(),
            logging_disabled=logging.root.manager.disable,
            warnings_filters=list(warnings.filters),
            showwarning=warnings.showwarning,
            signals=_signals(),
            streams=(sys.stdout, sys.stderr),
            umask=umask,
        )
        state.singletons = dict(_singleton_instances() or {})
        if "torch._dynamo" in sys.modules:
            state.dynamo_config = torch._dynamo.config.get_config_copy()
        return state

    def restore(self) -> None:
        """Put the process back as ``take`` found it (what a later task could see); every rank after each task."""
        flush_output()
        sys.stdout, sys.stderr = self.streams
        os.umask(self.umask)
        self._restore_python()
        self._restore_torch()
        _restore_attributes(self.attributes)
        _restore_rotary()
        _clear_project_caches()
        _release_prepared()
        instances = _singleton_instances()
        if instances is not None:
            instances.clear()
            instances.update(self.singletons)
        _restore_dynamo(self.dynamo_config)
        _destroy_subgroups()  # its one full collection also frees what the steps above let go
        _trim_heap()

    def _restore_python(self) -> None:
        for sig, handler in self.signals.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            signal.setitimer(signal.ITIMER_REAL, 0)
        from coati_kto.runtime.signals import STOP

        STOP.received = None
        STOP.interrupted = False
        for logger in _loggers():
            # A logger made by the task gets a new one's settings, its handlers kept (ColossalAI's
            # DistributedLogger caches itself with the handler it added once).
            level, handlers, filters, propagate, disabled = self.loggers.get(
                logger, (logging.NOTSET, logger.handlers, [], True, False)
            )
            # Not setLevel: each call clears every logger's level cache (thousands of loggers: n^2 per task).
            # logging.disable below clears them once.
            logger.level = level
            logger.handlers[:], logger.filters[:] = handlers, filters
            logger.propagate, logger.disabled = propagate, disabled
        logging.disable(self.logging_disabled)
        warnings.filters[:] = self.warnings_filters
        warnings.showwarning = self.showwarning
        warnings._filters_mutated()  # "once" and "default" warnings show again, as in a new process

    def _restore_torch(self) -> None:
        reseed()
        for value, setter in self.flags.values():
            setter(value)
        torch.set_default_device(None)
        torch.set_num_threads(1)
        torch.set_flush_denormal(False)


def reseed() -> None:
    """Python's, numpy's and torch's RNGs seeded from the OS, as a new process starts them."""
    random.seed()
    np.random.seed()
    torch.seed()


def flush_output() -> None:
    """Python's buffers and C stdio's (a library's printf) out to the file descriptors."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    libc = _libc()
    if libc is not None:
        libc.fflush(None)


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one (ColossalAI's meshes, a test's ``new_group``): each rank
    destroys its own handles, no collective. Collected first: a plugin's ``__del__`` destroys its mesh itself."""
    gc.collect()
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


def _restore_attributes(saved: dict[Any, dict[str, Any]]) -> None:
    """Rebind what a task rebound or deleted; delete what it added to a class (new module attributes stay: they
    are submodules a task imported, or names a later import defines the same way)."""
    for owner, before in saved.items():
        now = vars(owner)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(owner, name, value)
        if isinstance(owner, type):  # dunders are left: Python adds some lazily (__annotations__)
            for name in [n for n in now if n not in before and not n.startswith("__")]:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(owner, name)


_MISSING = object()


def _restore_rotary() -> None:
    """transformers' ``apply_rotary_pos_emb`` back where the fused-rotary dispatcher replaced it."""
    for module in list(sys.modules.values()):
        current = getattr(module, "__dict__", {}).get(_ROTARY)
        if getattr(current, "coati_fused_rotary_dispatcher", False):
            setattr(module, _ROTARY, current.__wrapped__)


def _clear_project_caches() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("coati_kto") and isinstance(module, types.ModuleType):
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()


def _release_prepared() -> None:
    """The prepared builds a task used (``data.prepared_lock``): a fresh process holds none, and a pooled rank 0
    that kept one refused another process's build there for the rest of the session."""
    module = sys.modules.get("coati_kto.data.prepared_lock")
    if module is not None:
        module.release_all()


def _singleton_instances() -> dict | None:
    meta = sys.modules.get("colossalai.context.singleton_meta")
    return meta.SingletonMeta._instances if meta is not None else None


def _restore_dynamo(config: Any) -> None:
    if "torch._dynamo" not in sys.modules:
        return
    torch._dynamo.reset()
    if config is None:
        return
    now = torch._dynamo.config.get_config_copy()
    with warnings.catch_warnings():  # setting a deprecated key warns, even back to its value
        warnings.simplefilter("ignore")
        for name, value in config.items():
            if now.get(name, _MISSING) != value:
                setattr(torch._dynamo.config, name, value)


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _trim_heap() -> None:
    """Hand freed heap back to the OS (the run may have set glibc to keep it: runtime.host_memory), so a
    long-lived worker's memory stays that of its largest task, not the sum."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
