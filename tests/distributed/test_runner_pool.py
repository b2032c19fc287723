"""run_distributed's worker pool (coati_kto.testing.worker_pool): calls reuse one set of ranks; a failed, dead
or hung call fails with the rank's traceback and the next call gets a new set; each call starts from what a fresh
process would see (environment, RNG, torch switches, process groups, signal handlers, patched attributes)."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coati_kto.testing import distributed as runner
from coati_kto.testing.distributed import pool_stats, run_distributed

_KEPT: list[Any] = []  # what a task keeps alive on purpose (a mesh whose groups must still be destroyed)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The pool enabled, even under COATI_KTO_FRESH_PROCESSES=1 (then only for this test)."""
    if runner._POOLS.enabled:
        yield
        return
    monkeypatch.delenv(runner.FRESH_ENV, raising=False)
    assert runner.enable_pool()
    try:
        yield
    finally:
        runner.shutdown_pool()


def _pid() -> int:
    return os.getpid()


def _raise_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return os.getpid()


def _exit_on_rank_0() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(7)
    time.sleep(300)
    return 0


def _hang() -> int:
    time.sleep(300)
    return 0


def _end_the_process_group() -> int:
    """What ``coati-kto``'s main does at its end (a CLI run in a worker: tests/e2e/test_train_e2e.py)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    return os.getpid()


def _exit_after_returning() -> int:
    """A thread a task leaves behind that ends its process later, between calls (a watchdog's os._exit)."""
    import threading

    threading.Timer(1.0, os._exit, (9,)).start()
    return os.getpid()


def _wait_until_a_rank_exits(pool: Any, timeout_s: float = 60) -> None:
    """Until one of ``pool``'s ranks has exited (the timer ``_exit_after_returning`` left fires after 1 s)."""
    deadline = time.monotonic() + timeout_s
    while pool.healthy():
        assert time.monotonic() < deadline, "no rank exited"
        time.sleep(0.05)


def test_a_failed_dead_or_hung_call_fails_alone_and_the_next_gets_new_ranks(pool: None) -> None:
    first = run_distributed(_pid, 2)
    assert run_distributed(_pid, 2) == first  # the same ranks serve the next call
    with pytest.raises(RuntimeError) as failed:
        run_distributed(_raise_on_rank_1, 2)
    message = str(failed.value)
    assert message.startswith("rank 1 failed:\nTraceback (most recent call last):\n"), message
    assert message.rstrip().endswith("ValueError: boom on rank 1") and "in _raise_on_rank_1" in message, (
        message
    )
    second = run_distributed(_pid, 2)
    assert not set(second) & set(first)  # killed and replaced
    with pytest.raises(RuntimeError, match="^rank 0 exited with code 7 without reporting a result$"):
        run_distributed(_exit_on_rank_0, 2)
    third = run_distributed(_pid, 2)
    assert not set(third) & set(second)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="^distributed run timed out after 1 s$"):
        run_distributed(_hang, 2, timeout_s=1)
    assert time.monotonic() - started < 60  # not the task's 300 s
    fourth = run_distributed(_pid, 2)
    assert not set(fourth) & set(third)
    assert run_distributed(_end_the_process_group, 2) == fourth  # its result stands; its ranks retire
    fifth = run_distributed(_pid, 2)
    assert not set(fifth) & set(fourth)
    lost = pool_stats().get("pool lost a rank between calls", 0)
    assert run_distributed(_exit_after_returning, 2) == fifth
    _wait_until_a_rank_exits(runner._POOLS.by_size[2])
    assert not set(run_distributed(_pid, 2)) & set(fifth)  # the next call is not blamed: new ranks
    assert pool_stats()["pool lost a rank between calls"] == lost + 1


def _leave_state_behind() -> None:
    """Everything a test could leave in a worker that a later test in the same worker could see."""
    import torch.distributed as dist
    from colossalai.cluster import ProcessGroupMesh
    from colossalai.shardformer.layer.utils import Randomizer

    from coati_kto.models.rotary import _INSIDE_FUSED_ATTENTION
    from coati_kto.parallel import distributed
    from coati_kto.runtime.signals import STOP

    torch.manual_seed(5)
    np.random.seed(0)
    random.seed(0)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    os.environ["COATI_KTO_LEFT_BEHIND"] = "1"
    os.chdir("/")
    dist.new_group([0, 1])
    mesh = ProcessGroupMesh(1, 2)
    mesh.get_group_along_axis(1)
    _KEPT.append(mesh)
    STOP.install()
    STOP.received = signal.SIGTERM
    distributed.seed_everything = None
    Randomizer.increment_index()
    logging.getLogger("coati_kto").setLevel(logging.CRITICAL)
    logging.getLogger("coati_kto.trainer").isEnabledFor(logging.ERROR)  # False, cached in that logger
    warnings.simplefilter("error")
    _INSIDE_FUSED_ATTENTION.set(True)
    torch.save = (
        None  # a fault drill's hand patch (test_operations' failing save once leaked into later tests)
    )
    os.replace = None


def _what_a_task_sees() -> dict[str, Any]:
    from colossalai.shardformer.layer.utils import Randomizer
    from torch.distributed import distributed_c10d as c10d

    from coati_kto.models.rotary import _INSIDE_FUSED_ATTENTION
    from coati_kto.parallel import distributed
    from coati_kto.runtime.signals import STOP

    return {
        "rand": torch.rand(3).tolist(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "env": os.environ.get("COATI_KTO_LEFT_BEHIND"),
        "cwd": os.getcwd(),
        "groups": len(c10d._world.pg_map),
        "stop": STOP.received,
        "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "seed_everything": callable(distributed.seed_everything),
        "randomizer": Randomizer.index(),
        "log_level": logging.getLogger("coati_kto").level,
        "errors_enabled": logging.getLogger("coati_kto.trainer").isEnabledFor(logging.ERROR),
        "warnings_error": any(f[0] == "error" and f[2] is Warning for f in warnings.filters),
        "inside_fused_attention": _INSIDE_FUSED_ATTENTION.get(),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "rank": os.environ["RANK"],
        "torch_save": f"{torch.save.__module__}.{torch.save.__qualname__}",
        "os_replace": getattr(os.replace, "__qualname__", None),
        "np": float(np.random.random()),
        "random": random.random(),
    }


def test_each_call_sees_what_a_fresh_process_sees(pool: None) -> None:
    before = pool_stats()
    run_distributed(_leave_state_behind, 2)
    pooled = run_distributed(_what_a_task_sees, 2)
    fresh = run_distributed(_what_a_task_sees, 2, fresh=True)
    assert pool_stats().get("fresh: asked", 0) == before.get("fresh: asked", 0) + 1
    seeded_np, seeded_random = np.random.RandomState(0).random_sample(), random.Random(0).random()
    for rank, (got, expected) in enumerate(zip(pooled, fresh, strict=True)):
        assert got["np"] != seeded_np and got["random"] != seeded_random  # reseeded, not left at 0
        random_draws = ("np", "random", "rand")
        assert {k: v for k, v in got.items() if k not in random_draws} == {
            k: v for k, v in expected.items() if k not in random_draws
        }
        assert got["rank"] == str(rank) and got["test"] == os.environ["PYTEST_CURRENT_TEST"]
        assert (got["groups"], got["dtype"], got["threads"], got["cwd"]) == (
            1,
            "torch.float32",
            1,
            os.getcwd(),
        )
    # torch seeds a new process at random (2.13): so does the pool, not left at the task's seed 5
    assert pooled[0]["rand"] != pooled[1]["rand"]
    assert torch.rand(3, generator=torch.Generator().manual_seed(5)).tolist() not in [
        r["rand"] for r in pooled
    ]


def _burn(seconds: float) -> int:
    """``seconds`` of this rank's CPU time, then its pid."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return os.getpid()


def test_the_cpu_log_names_each_pooled_call_its_test_and_its_ranks_cpu(
    pool: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """COATI_KTO_POOL_CPU_LOG (docs/testing.md): a line per pooled call with the ranks' CPU seconds together;
    setting it does not count as another environment (the calls stay on the pool)."""
    # A pool started without the variable (a suite sets it before any pool starts): the calls stay on it anyway.
    run_distributed(_pid, 2)
    log = tmp_path / "pool_cpu.tsv"
    monkeypatch.setenv(runner.CPU_LOG_ENV, str(log))
    before = pool_stats().get("pool", 0)
    run_distributed(_burn, 2, 0.4)
    run_distributed(_pid, 2)
    assert pool_stats()["pool"] == before + 2
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert [line[:2] for line in lines] == [[os.environ["PYTEST_CURRENT_TEST"], "2"]] * 2
    burned, idle = float(lines[0][2]), float(lines[1][2])
    assert 0.7 <= burned < 3.0 and idle < 0.3, lines  # 2 ranks x 0.4 s (in clock ticks), and the resets
    assert float(lines[0][3]) >= 0.4


def _env_probe() -> str | None:
    return os.environ.get("COATI_KTO_POOL_PROBE")


def test_a_call_with_another_environment_gets_fresh_processes(
    pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some variables are read at import time (oneDNN's and MKL's ISA caps): a pool's ranks imported with the
    environment the pool started in, so a call whose environment differs runs on fresh processes."""
    # One rank: the rule compares environments, whatever the world size (a fresh rank costs a whole import).
    pids = run_distributed(_pid, 1)
    monkeypatch.setenv("COATI_KTO_POOL_PROBE", "x")
    before = pool_stats().get("fresh: environment differs (COATI_KTO_POOL_PROBE)", 0)
    assert run_distributed(_env_probe, 1) == ["x"]
    assert pool_stats()["fresh: environment differs (COATI_KTO_POOL_PROBE)"] == before + 1
    monkeypatch.delenv("COATI_KTO_POOL_PROBE")
    assert run_distributed(_pid, 1) == pids
    assert run_distributed(_env_probe, 1) == [None]


@pytest.mark.fresh_process
def test_the_fresh_process_marker_gives_fresh_processes(pool: None) -> None:
    before = pool_stats().get("fresh: asked", 0)
    pooled = {pid for p in runner._POOLS.by_size.values() for pid in p.pids}
    (pid,) = run_distributed(_pid, 1)  # one rank: the marker's rule does not depend on the world size
    assert pid != os.getpid() and pid not in pooled
    assert pool_stats()["fresh: asked"] == before + 1
