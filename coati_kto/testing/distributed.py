"""Run a function on N real processes (tests, benchmarks): gloo on the CPU, or NCCL with one GPU per process. Not a
mock: each process joins a process group."""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from coati_kto.parallel.distributed import free_port, init_distributed


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        init_distributed(timeout_s=120)
        results.put((rank, True, fn(*args)))
    except BaseException:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _next_result(
    results: Any, procs: list[Any], reported: dict[int, Any], deadline: float, timeout_s: float
) -> tuple[int, bool, Any]:
    """The next (rank, ok, value) from the workers; RuntimeError when a worker died without reporting (a
    signal, os._exit, the OOM killer) or the run passed its deadline, instead of waiting out the timeout."""
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


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600, device: str = "cpu"
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes joined in one process group; return each rank's result.

    ``fn`` must be importable (a module-level function); its return value must be picklable. A failure on
    any rank raises RuntimeError with that rank's traceback. ``device="cpu"``: the workers see no GPU, even on
    a GPU machine: the CPU path (gloo) everywhere, the same numbers as on CI. ``device="cuda"``: rank r takes
    GPU r on NCCL (the ``gpu`` tests); ``world_size`` must not exceed the GPUs, as NCCL refuses two ranks on one.
    """
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise RuntimeError(
            f"{world_size} CUDA ranks need {world_size} GPUs, {torch.cuda.device_count()} visible"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results), daemon=False)
        for rank in range(world_size)
    ]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device != "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # spawned children copy the environment at start()
    try:
        for p in procs:
            p.start()
    finally:
        if device == "cuda":
            pass
        elif visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    outputs: dict[int, Any] = {}
    finished = False
    try:
        deadline = time.monotonic() + timeout_s
        while len(outputs) < world_size:
            rank, ok, value = _next_result(results, procs, outputs, deadline, timeout_s)
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
