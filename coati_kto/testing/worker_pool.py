"""A persistent set of gloo ranks that runs test functions one after another (``run_distributed``'s pool).

``WorkerPool(world_size)`` starts ``world_size`` processes that import once (torch, ColossalAI, the ``preload``
modules), join one default process group and then serve tasks: each task is a module-level function
and its arguments, run on every rank with the caller's environment, working directory and ``sys.path``, in a
fresh ``contextvars`` context, and followed by ``FreshState.restore()`` (coati_kto.testing.isolation). A task that
fails on any rank, a rank that dies, or a call past its timeout fails the call with the failing rank's traceback,
and the pool kills its processes: ``alive`` turns False and the caller starts a new pool for the next call (the
other ranks may be stuck in a collective the failed one never reached).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib
import itertools
import os
import pkgutil
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

from coati_kto.parallel.distributed import free_port, init_distributed

READY = -1  # the task id of a worker's start-up report
PRELOAD_ENV = "COATI_KTO_POOL_PRELOAD"  # the fork server's preload list (coati_kto.testing.pool_server)
MAX_RSS_MB = (
    4096  # a rank holding more after a task's reset retires its pool (the next call starts a new one)
)
STARTUP_TIMEOUT_S = 600.0  # imports and the first process group on a loaded 2-core machine
_IDLE_POLL_S = 1.0  # how often an idle worker checks that its parent is alive


def rank_env(env: dict[str, str], rank: int, world_size: int, port: int, cpu: bool = True) -> dict[str, str]:
    """``env`` with the launcher variables of ``rank``; ``cpu``: no GPU visible (the CPU path)."""
    gpus = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    return {
        **env,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **gpus,
    }


@contextlib.contextmanager
def environ(changes: Mapping[str, str | None], whole: Mapping[str, str] | None = None) -> Iterator[None]:
    """``os.environ`` inside: ``whole`` in place of it (when given), then ``changes`` (None: removed); as it was
    after. Children started inside copy it."""
    saved = dict(os.environ)
    if whole is not None:
        os.environ.clear()
        os.environ.update(whole)
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def next_result(
    results: Any, procs: list[Any], reported: dict[int, Any], deadline: float, timeout_s: float
) -> tuple[int, int, bool, Any, bool]:
    """The next (task id, rank, ok, value, whether the rank can take another task) from the workers; RuntimeError when a worker died without reporting
    (a signal, os._exit, the OOM killer) or the call passed its deadline, instead of waiting out the timeout."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
        if dead:
            try:  # a worker's result is flushed before it exits: give the queue a moment
                return results.get(timeout=5.0)
            except queue.Empty:
                rank = dead[0]
                raise RuntimeError(
                    f"rank {rank} exited with code {procs[rank].exitcode} without reporting a result"
                ) from None
        if time.monotonic() > deadline:
            raise RuntimeError(f"distributed run timed out after {timeout_s} s")


class WorkerPool:
    """``world_size`` ranks that import once and run one task at a time on all of them (see the module)."""

    def __init__(self, world_size: int, env: dict[str, str], preload: Sequence[str] = ()) -> None:
        """Start the ranks with ``env`` as their whole environment (read at import time by some libraries) and
        wait until each has imported ``preload`` (a name ending in ``.*``: the package and every submodule) and
        joined the process group; RuntimeError with a rank's traceback when one cannot."""
        self.world_size, self.alive = world_size, False
        ctx = _fork_server(preload)
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._port = free_port()
        self._ids = itertools.count()
        # The fork server copies the environment when it starts (at the first pool's start), its ranks inherit it.
        with environ({"CUDA_VISIBLE_DEVICES": "", PRELOAD_ENV: ",".join(preload)}, whole=env):
            self._procs = [
                ctx.Process(
                    target=serve,
                    args=(rank, world_size, self._port, self._tasks[rank], self._results, tuple(preload)),
                )
                for rank in range(world_size)
            ]
            for p in self._procs:
                p.start()
        self.alive = True
        ready = self._collect(READY, STARTUP_TIMEOUT_S)
        self.pids = [pid for pid, _ in ready]
        # Variables the ranks' imports set themselves (ColossalAI's CUDA_DEVICE_MAX_CONNECTIONS): a caller that
        # imported the same libraries holds them too, and a difference there is no different start.
        start = rank_env(env, 0, world_size, self._port)
        self.import_env = frozenset(k for k, v in ready[0][1].items() if start.get(k) != v)

    def healthy(self) -> bool:
        """Whether every rank is alive and waiting for a task (False too after one died between tasks: a thread a
        task left behind, the OOM killer)."""
        return self.alive and all(p.exitcode is None for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> list[Any]:
        """``fn(*args)`` on every rank with this process's environment, cwd and sys.path; each rank's result.
        Any failure kills the pool (``alive`` False) and raises RuntimeError with the failing rank's traceback."""
        task_id = next(self._ids)
        env, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
        try:
            for rank, tasks in enumerate(self._tasks):
                # Pickled once per rank: a tensor argument travels as a file descriptor each rank takes once.
                payload = bytes(ForkingPickler.dumps((fn, args)))
                tasks.put((task_id, payload, rank_env(env, rank, self.world_size, self._port), cwd, path))
        except BaseException:
            self.close(kill=True)
            raise
        return self._collect(task_id, timeout_s)

    def _collect(self, task_id: int, timeout_s: float) -> list[Any]:
        outputs: dict[int, Any] = {}
        deadline, keep = time.monotonic() + timeout_s, True
        try:
            while len(outputs) < self.world_size:
                got, rank, ok, payload, kept = next_result(
                    self._results, self._procs, outputs, deadline, timeout_s
                )
                if got != task_id:
                    continue  # cannot happen while every failure ends the pool; never mix tasks
                value = ForkingPickler.loads(payload)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                outputs[rank], keep = value, keep and kept
        except BaseException:
            self.close(kill=True)
            raise
        if not keep:  # a rank lost its process group or grew past MAX_RSS_MB: the next call starts anew
            self.close()
        return [outputs[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """End the ranks: ``kill`` at once (a failed or hung task), else ask them to exit and kill what is left
        after a grace period. Idempotent."""
        if not self.alive and all(p.exitcode is not None for p in self._procs):
            return
        self.alive = False
        for p, tasks in zip(self._procs, self._tasks, strict=True):
            if kill:
                p.kill()
            else:
                with contextlib.suppress(OSError, ValueError):  # a rank already gone
                    tasks.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._results.cancel_join_thread()
        self._results.close()
        for tasks in self._tasks:
            tasks.close()


def _fork_server(preload: Sequence[str]) -> Any:
    """The multiprocessing context that starts ranks: forked from one server process (started with the first
    pool, then kept) that imported torch, ColossalAI and ``preload`` once, after the project's ColossalAI patches,
    as a rank would (coati_kto.testing.pool_server). A rank then starts in ~0.2 s instead of ~10 s of imports on
    2 cores. Every pool of a run shares the server, so they all start from one environment: a call with another
    one gets fresh, spawned processes (coati_kto.testing.distributed)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["coati_kto.testing.pool_server"])
    return ctx


def _preload(names: Sequence[str]) -> None:
    """Import ``names``; for ``pkg.*`` every submodule too, skipping one that fails to import (the task that
    imports it reports the error itself, as in a fresh process)."""
    for name in names:
        package = importlib.import_module(name.removesuffix(".*"))
        if not name.endswith(".*"):
            continue
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=lambda _: None):
            if not info.name.endswith("__main__"):  # a package's __main__ runs its command when imported
                with contextlib.suppress(Exception):
                    importlib.import_module(info.name)


def serve(rank: int, world_size: int, port: int, tasks: Any, results: Any, preload: tuple[str, ...]) -> None:
    """A worker's life: imports, the default process group, then each task from ``tasks`` until None arrives or
    the parent process is gone."""
    from coati_kto.testing.isolation import FreshState, reseed

    parent = os.getppid()  # the fork server: it exits when the process that owns the pools does
    os.environ.update(rank_env({}, rank, world_size, port))
    os.environ.pop(PRELOAD_ENV, None)
    reseed()  # a forked rank starts with the server's RNG states: new ones, as a new process gets
    torch.set_num_threads(1)
    try:
        # The group first: it applies the project's ColossalAI patches (parallel.upstream) before any preloaded
        # module binds a patched function by name, as in a fresh process, where the task's imports come after.
        init_distributed(timeout_s=120)
        _preload(preload)
        gc.collect()
        state = FreshState.take()
        gc.freeze()  # the imports' objects: every gc.collect after a task (ColossalAI's teardown) skips them
    except BaseException:
        results.put((READY, rank, False, bytes(ForkingPickler.dumps(traceback.format_exc())), False))
        raise
    results.put((READY, rank, True, bytes(ForkingPickler.dumps((os.getpid(), dict(os.environ)))), True))
    try:
        while True:
            while not tasks._reader.poll(_IDLE_POLL_S):
                if os.getppid() != parent:
                    return  # the parent died without closing the pool: do not outlive it
            message = tasks.get()
            if message is None:
                break
            task_id, payload, env, cwd, path = message
            ok, value = _run_task(payload, env, cwd, path)
            keep = _reset(state)
            results.put((task_id, rank, ok, value, keep))
            if not keep:
                break
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports it
        return
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _reset(state: Any) -> bool:
    """``state.restore()``; whether this rank can serve another task: not when the reset failed, the task
    destroyed the default process group (``coati-kto``'s main does, at its end) or the rank holds more than
    MAX_RSS_MB."""
    import torch.distributed as dist

    try:
        state.restore()
    except Exception:  # the task's result stands; this rank retires
        traceback.print_exc()
        return False
    with open("/proc/self/statm") as f:
        rss_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return dist.is_initialized() and rss_mb < MAX_RSS_MB


def _run_task(payload: bytes, env: dict[str, str], cwd: str, path: list[str]) -> tuple[bool, bytes]:
    """(ok, the pickled result or the traceback) of one task, in the caller's environment, cwd and sys.path."""
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    try:
        os.chdir(cwd)
        fn, args = ForkingPickler.loads(payload)
        value = contextvars.copy_context().run(fn, *args)
        return True, bytes(ForkingPickler.dumps(value))
    except BaseException:  # every failure (SystemExit too) goes back to the caller as this rank's traceback
        return False, bytes(ForkingPickler.dumps(traceback.format_exc()))
    finally:  # what the task printed lands in its own test's captured output
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
