"""Where run_distributed sends a call (coati_kto.testing.distributed): the pool, or fresh processes and why; and
which pools it closes to stay within MAX_LIVE_RANKS. No process is started here (tests/distributed/
test_runner_pool.py runs the pool itself)."""

from __future__ import annotations

import pytest

from coati_kto.testing import distributed as runner


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.closed = world_size, False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> runner._Pools:
    state = runner._Pools()
    monkeypatch.setattr(runner, "_POOLS", state)
    return state


def test_the_one_two_and_four_rank_pools_live_together_and_the_least_recent_goes_first(
    pools: runner._Pools,
) -> None:
    assert runner.MAX_LIVE_RANKS == 7
    one, two = _Pool(1), _Pool(2)
    pools.by_size.update({1: one, 2: two})
    runner._make_room(4)  # 3 + 4 ranks fit
    assert list(pools.by_size) == [1, 2] and not one.closed and not two.closed
    four = _Pool(4)
    pools.by_size.update({4: four})
    runner._make_room(1)  # 7 + 1 do not: the least recently used (1) goes, the others stay
    assert list(pools.by_size) == [2, 4] and one.closed and not two.closed and not four.closed
    runner._make_room(6)  # 6 ranks fit only alone: both go, least recent first
    assert pools.by_size == {} and two.closed and four.closed


def test_why_a_call_gets_fresh_processes(pools: runner._Pools, monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner._why_fresh("cpu", False) == "no pool"
    monkeypatch.setenv("COATI_KTO_RUNNER_PROBE", "1")
    monkeypatch.delenv(runner.FRESH_ENV, raising=False)
    assert runner.enable_pool()
    assert runner._why_fresh("cpu", False) is None
    assert runner._why_fresh("cuda", False) == "device"
    assert runner._why_fresh("cpu", True) == "asked"
    with runner.fresh_processes():
        assert runner._why_fresh("cpu", False) == "asked"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # volatile: pytest sets it for every test
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # set by ColossalAI's import
    assert runner._why_fresh("cpu", False) is None
    monkeypatch.setenv("COATI_KTO_RUNNER_PROBE", "2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert (
        runner._why_fresh("cpu", False) == "environment differs (COATI_KTO_RUNNER_PROBE, ONEDNN_MAX_CPU_ISA)"
    )
    monkeypatch.setenv(runner.FRESH_ENV, "1")
    assert not runner.enable_pool()
    runner.shutdown_pool()
    assert runner._why_fresh("cpu", False) == "no pool"
