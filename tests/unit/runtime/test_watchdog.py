"""The heartbeat's threads end before the process does (a store thread alive at interpreter shutdown aborted a
clean stop with SIGABRT)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from coati_kto.parallel.distributed import free_port
from coati_kto.runtime.watchdog import Heartbeat


def test_stop_returns_once_both_threads_have_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    heartbeat = Heartbeat(rank=0, world_size=2, timeout=60.0, interval=0.01)
    heartbeat.start()
    key = f"{heartbeat.prefix}beat/0"
    deadline = time.monotonic() + 30
    while not (store.check([key]) and int(store.get(key)) >= 3):  # beating: the store thread is in its loop
        assert time.monotonic() < deadline, "no heartbeat reached the store"
        time.sleep(0.01)
    heartbeat.stop()
    assert heartbeat._io is not None and not heartbeat._io.is_alive()
    assert not heartbeat.is_alive()
    heartbeat.stop()  # idempotent


def test_a_peer_still_starting_has_the_start_timeout_and_a_silent_one_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer that started late (cold imports on its node) was "never started" after train.heartbeat_timeout
    (60 s), and its live job was ended; it now has until train.dist_timeout. A peer that beat and went silent is
    still caught after heartbeat_timeout."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    failures: list[str] = []
    heartbeat = Heartbeat(rank=0, world_size=2, timeout=0.4, interval=0.05, start_timeout=1.5)
    monkeypatch.setattr(heartbeat, "_fail", lambda what: failures.append(what) or heartbeat._stopped.set())
    heartbeat.start()
    time.sleep(1.0)  # past timeout, within start_timeout: rank 1 has not beaten yet
    assert failures == []
    store.set(f"{heartbeat.prefix}beat/1", "1")  # rank 1 beats once, then goes silent
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    heartbeat.stop()
    assert len(failures) == 1 and failures[0].startswith("rank 1 stopped responding"), failures
