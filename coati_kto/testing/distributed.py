"""Run a function on N real processes (tests, benchmarks): gloo on the CPU, or NCCL with one GPU per process. Not a
mock: each process joins a process group.

By default each call starts ``world_size`` fresh processes (interpreter, imports, process group: ~10 s on 2
cores, ~30 s on a loaded machine). Under pytest, ``enable_pool()`` (tests/conftest.py) makes CPU calls run on a
persistent pool of ranks per world size instead (coati_kto.testing.worker_pool), reset between calls to what a
fresh process would see (coati_kto.testing.isolation). A call still gets fresh processes when it asks
(``fresh=True``), inside ``fresh_processes()`` (the ``fresh_process`` marker), with ``device="cuda"``, or when
this process's environment differs from the one the pool started with (libraries read some variables at import:
``tests/regression/test_other_cpu.py``'s ISA caps).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from coati_kto.parallel.distributed import free_port, init_distributed
from coati_kto.testing.worker_pool import WorkerPool, environ, next_result, rank_env

# Variables that differ between calls without changing how a rank starts: the CPU log's file, pytest's current
# test, the runner's own GPU hiding, and those libraries set in os.environ as they are imported or run (inductor's
# cache directory and its per-process pointer, ColossalAI's CUDA_DEVICE_MAX_CONNECTIONS; a started pool adds what
# its ranks' imports set: WorkerPool.import_env).
CPU_LOG_ENV = "COATI_KTO_POOL_CPU_LOG"  # a file: each pooled call appends its test, world size and ranks' CPU
VOLATILE_ENV = frozenset(
    {
        CPU_LOG_ENV,
        "PYTEST_CURRENT_TEST",
        "CUDA_VISIBLE_DEVICES",
        "TORCHINDUCTOR_CACHE_DIR",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    }
)
# The pools' processes at once: the 1-, 2- and 4-rank sets side by side (~0.7-0.9 GiB each, ~6 GiB of a 24 GiB
# machine), so a suite that goes back and forth between world sizes starts each set once (~10 s a start).
MAX_LIVE_RANKS = 7
FRESH_ENV = "COATI_KTO_FRESH_PROCESSES"  # =1: enable_pool() does nothing, every call starts fresh processes


class _Pools:
    """The enabled pool's settings, its ranks per world size, and why calls went where they went."""

    def __init__(self) -> None:
        self.enabled = False
        self.env: dict[str, str] = {}
        self.preload: tuple[str, ...] = ()
        self.by_size: dict[int, WorkerPool] = {}
        self.fresh_depth = 0
        self.calls: Counter[str] = Counter()
        self.import_env: frozenset[str] = frozenset()


_POOLS = _Pools()


def enable_pool(preload: Sequence[str] = ()) -> bool:
    """Run later CPU calls on persistent ranks (started at the first call of each world size, with this
    process's environment as it is now); ``preload``: modules each rank imports once (``pkg.*``: every
    submodule). False, and nothing changes, when ``COATI_KTO_FRESH_PROCESSES=1``."""
    if os.environ.get(FRESH_ENV, "") not in ("", "0"):
        return False
    _POOLS.enabled, _POOLS.preload = True, tuple(preload)
    _POOLS.env = _stable(os.environ)
    atexit.register(shutdown_pool)
    return True


def shutdown_pool() -> None:
    """End every pool's ranks and go back to fresh processes for each call. Idempotent."""
    _POOLS.enabled = False
    for pool in _POOLS.by_size.values():
        pool.close()
    _POOLS.by_size.clear()


@contextlib.contextmanager
def fresh_processes() -> Iterator[None]:
    """Calls inside start fresh processes, pool or not (a test marked ``fresh_process``)."""
    _POOLS.fresh_depth += 1
    try:
        yield
    finally:
        _POOLS.fresh_depth -= 1


def pool_stats() -> dict[str, int]:
    """How many calls ran where: ``pool``, ``pool start`` (a pool started for it), ``fresh: <why>``; and ``pool
    retired``: calls after which a pool ended without failing (a rank lost its process group, or memory)."""
    return dict(_POOLS.calls)


def _stable(env: Any) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV and k not in _POOLS.import_env}


def _why_fresh(device: str, fresh: bool) -> str | None:
    """Why this call starts fresh processes (None: it runs on the pool)."""
    if not _POOLS.enabled:
        return "no pool"
    if device != "cpu":
        return "device"
    if fresh or _POOLS.fresh_depth:
        return "asked"
    env, start = _stable(os.environ), _stable(_POOLS.env)
    if env != start:
        changed = sorted(k for k in env.keys() | start.keys() if env.get(k) != start.get(k))
        return "environment differs (" + ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "") + ")"
    return None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600,
    device: str = "cpu",
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes joined in one process group; return each rank's result.

    ``fn`` must be importable (a module-level function); its arguments and return value must be picklable. A
    failure on any rank raises RuntimeError with that rank's traceback; so does a rank that exits without a
    result, and a call past ``timeout_s``. ``device="cpu"``: the workers see no GPU, even on a GPU machine: the
    CPU path (gloo) everywhere, the same numbers as on CI. ``device="cuda"``: rank r takes GPU r on NCCL (the
    ``gpu`` tests); ``world_size`` must not exceed the GPUs, as NCCL refuses two ranks on one. ``fresh``: new
    processes even where the pool is enabled (module docstring).
    """
    why = _why_fresh(device, fresh)
    if why is not None:
        _POOLS.calls["fresh: " + why] += 1
        return _run_fresh(fn, world_size, args, timeout_s, device)
    pool = _POOLS.by_size.pop(world_size, None)  # put back last: the dict runs from least to most recent
    if pool is not None and pool.alive and not pool.healthy():
        _POOLS.calls["pool lost a rank between calls"] += 1
        pool.close(kill=True)
    if pool is None or not pool.alive:
        _POOLS.calls["pool start"] += 1
        _make_room(world_size)
        pool = WorkerPool(world_size, dict(os.environ), _POOLS.preload)
        _POOLS.import_env |= pool.import_env
    else:
        _POOLS.calls["pool"] += 1
    _POOLS.by_size[world_size] = pool
    log = os.environ.get(CPU_LOG_ENV)
    cpu_s, started = (_ranks_cpu(pool.pids), time.monotonic()) if log else (0.0, 0.0)
    results = pool.run(fn, args, timeout_s)
    if log and pool.alive:  # a pool that retired after the call has no processes left to read
        _log_cpu(log, fn, world_size, _ranks_cpu(pool.pids) - cpu_s, time.monotonic() - started)
    if not pool.alive:  # a rank lost its process group or grew past MAX_RSS_MB: the next call starts anew
        _POOLS.calls["pool retired"] += 1
    return results


def _ranks_cpu(pids: Sequence[int]) -> float:
    """CPU seconds (user + system, every thread) the processes ``pids`` have used so far; 0.0 for one that is gone."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def _log_cpu(path: str, fn: Callable, world_size: int, cpu_s: float, wall_s: float) -> None:
    """One line for ``COATI_KTO_POOL_CPU_LOG``: the test and its phase (``PYTEST_CURRENT_TEST``; the function
    outside pytest), the world size, the ranks' CPU seconds together and the call's wall seconds, tab-separated.
    Appended in one write, so both xdist workers may share the file."""
    where = os.environ.get("PYTEST_CURRENT_TEST", f"{fn.__module__}.{fn.__qualname__}")
    with open(path, "a") as f:
        f.write(f"{where}\t{world_size}\t{cpu_s:.2f}\t{wall_s:.2f}\n")


def _make_room(world_size: int) -> None:
    """Close the least recently used pools until ``world_size`` more ranks fit in MAX_LIVE_RANKS (each holds
    ~0.7-0.9 GiB): the 1-, 2- and 4-rank pools live side by side."""
    while _POOLS.by_size and sum(p.world_size for p in _POOLS.by_size.values()) + world_size > MAX_LIVE_RANKS:
        _POOLS.by_size.pop(next(iter(_POOLS.by_size))).close()


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, device: str
) -> None:
    os.environ.update(rank_env(dict(os.environ), rank, world_size, port, cpu=device != "cuda"))
    torch.set_num_threads(1)
    try:
        init_distributed(timeout_s=120)
        results.put((0, rank, True, fn(*args), False))
    except BaseException:  # report every failure to the parent, then exit non-zero
        results.put((0, rank, False, traceback.format_exc(), False))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_fresh(fn: Callable, world_size: int, args: tuple, timeout_s: float, device: str) -> list[Any]:
    """``run_distributed`` on ``world_size`` new processes, ended when the call ends."""
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise RuntimeError(
            f"{world_size} CUDA ranks need {world_size} GPUs, {torch.cuda.device_count()} visible"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results, device), daemon=False)
        for rank in range(world_size)
    ]
    with environ({"CUDA_VISIBLE_DEVICES": ""} if device != "cuda" else {}):  # children copy it at start()
        for p in procs:
            p.start()
    outputs: dict[int, Any] = {}
    finished = False
    try:
        deadline = time.monotonic() + timeout_s
        while len(outputs) < world_size:
            _, rank, ok, value, _ = next_result(results, procs, outputs, deadline, timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outputs[rank] = value
        finished = True
    finally:
        for p in procs:
            # On failure the other ranks may wait in a collective for the one that died: no grace then.
            p.join(timeout=30 if finished else 1)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]
