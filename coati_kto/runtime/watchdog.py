"""Heartbeats between ranks: a rank or node that disappears ends the whole job within ``timeout`` seconds.

A killed process is noticed by its peers in a collective at once (their sockets close), but a node that
becomes unreachable (link down, frozen host) or a rank that dies before the process group forms leaves the
others waiting in a collective for ``train.dist_timeout``; and the waits for file work (rank 0 preparing data
or writing final/: ``coati_kto.parallel.store_waits``) go through the store,
bounded only by ``train.file_wait_timeout`` (two hours), where no closed socket tells of a rank that died. So
every rank runs a daemon thread that bumps a counter in the job's rendezvous
store (MASTER_ADDR:MASTER_PORT: torchrun's store, or rank 0's) every ``interval`` seconds and watches the
others' counters. A peer whose counter has not moved for ``timeout`` seconds (one never heard from: for
``start_timeout``, train.dist_timeout), or a store that cannot be reached, ends this process with one line naming
the rank and its host, and exit status 1.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta

from coati_kto.parallel.advice import next_step

EXIT_CODE = 1


class Heartbeat(threading.Thread):
    """Start on every rank once the store exists (``start``); ``stop`` before a normal exit."""

    def __init__(
        self, rank: int, world_size: int, timeout: float, interval: float = 5.0, start_timeout: float = 0.0
    ) -> None:
        super().__init__(name="coati-kto-heartbeat", daemon=True)
        self.rank, self.world_size = rank, world_size
        self.timeout, self.interval = timeout, min(interval, timeout / 4)
        # A peer not heard from yet may still be starting (imports from a cold shared filesystem, its node's checks):
        # it has until the process group would give up on it (train.dist_timeout), not ``timeout``.
        self.start_timeout = max(timeout, start_timeout)
        self.address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        # One key space per launch attempt: torchrun restarts reuse its store.
        self.prefix = f"coati_kto/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._stopped = threading.Event()
        self._io: threading.Thread | None = None

    def stop(self, wait: float = 10.0) -> None:
        """Stop both threads; returns once they have ended (or after ``wait`` seconds: a store call stuck on a
        dead link). The store thread must not outlive the interpreter: a daemon thread that comes back from a
        store call while Python shuts down is ended by pthread_exit, whose unwinding through the binding's C++
        frames aborts the process ("terminate called without an active exception", SIGABRT instead of the
        clean stop's exit 75)."""
        self._stopped.set()
        for thread in (self._io, self):
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                thread.join(wait)

    def run(self) -> None:
        """Store traffic in a second thread; this one only watches the clock, so a store call that blocks on a
        dead link (a reply that never comes) cannot stall the watchdog itself."""
        self._last_round = time.monotonic()
        self._io = threading.Thread(target=self._talk, name="coati-kto-heartbeat-io", daemon=True)
        self._io.start()
        while not self._stopped.wait(self.interval):
            silent = time.monotonic() - self._last_round
            if silent > self.timeout + 2 * self.interval:
                host, port = self.address
                self._fail(
                    f"lost contact with the job's rendezvous store at {host}:{port} for {silent:.0f} s"
                )

    def _talk(self) -> None:
        try:
            self._watch()
        except Exception as err:  # the store is gone: its host (rank 0's node) or the network failed
            if self._stopped.wait(10):  # ... or the job just ended and rank 0's process took its store along
                return
            host, port = self.address
            self._fail(
                f"lost contact with the job's rendezvous store at {host}:{port} ({type(err).__name__})"
            )

    def _watch(self) -> None:
        import torch.distributed as dist

        host, port = self.address
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=self.timeout), wait_for_workers=False
        )
        key = (self.prefix + "{}/{}").format
        store.set(key("host", self.rank), socket.gethostname())
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, time.monotonic()) for r in peers}
        beat = 0
        while not self._stopped.wait(0 if beat == 0 else self.interval):
            beat += 1
            store.set(key("beat", self.rank), str(beat))
            now = time.monotonic()
            for peer in peers:
                value = store.get(key("beat", peer)) if store.check([key("beat", peer)]) else None
                last_value, since = seen[peer]
                bound = self.timeout if value is not None else self.start_timeout
                if value != last_value:
                    seen[peer] = (value, now)
                elif now - since > bound and not self._stopped.is_set():
                    where = (
                        store.get(key("host", peer)).decode() if store.check([key("host", peer)]) else None
                    )
                    what = "never started" if value is None else f"stopped responding {now - since:.0f} s ago"
                    self._fail(
                        f"rank {peer}{f' on {where}' if where else ''} {what} (its process or node is gone)"
                    )
            self._last_round = time.monotonic()

    def _fail(self, what: str) -> None:
        print(
            f"[rank {self.rank} on {socket.gethostname()}] error: {what}; stopping this job ({next_step()})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CODE)


def new_heartbeat(timeout: float, start_timeout: float = 0.0) -> Heartbeat | None:
    """This rank's Heartbeat, not started; None for one process or ``timeout`` 0. Every rank calls.
    ``start_timeout``: how long a peer never heard from may take to start (at least ``timeout``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if timeout <= 0 or world_size < 2 or "MASTER_ADDR" not in os.environ:
        return None
    return Heartbeat(int(os.environ["RANK"]), world_size, timeout, start_timeout=start_timeout)
