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
