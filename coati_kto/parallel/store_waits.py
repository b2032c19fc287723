"""Waits on file work, through the job's rendezvous store instead of the process group.

Some waits are not for a computation but for one rank's file work: global rank 0 preparing the data, writing
``final/`` or the LoRA merge, the reference cache, deleting an earlier run's outputs. As a collective such a
wait is bounded by ``train.dist_timeout``, which is meant for ranks that compute together, and on NCCL the
watchdog aborts the job once it passes: a 70B model's ``final/`` (140 GB in bf16) on a shared filesystem at
200 MB/s takes 12 minutes, past the 10-minute default. (A checkpoint's agreements, where every rank writes its
own part at once, stay collectives: a rank killed there is noticed at once, through its closed sockets.)

These waits go through the store the process group was formed with (torchrun's, or the one global rank 0
started: no new connections, no second backend on GPU jobs), bounded by ``train.file_wait_timeout``. A rank
that exits meanwhile closes its sockets, and a node that vanishes stops its heartbeat
(``coati_kto.runtime.watchdog``): either still ends the job at once or within ``train.heartbeat_timeout``.

Every rank calls each function at the same point, in the same order: the keys are numbered by a per-process
count of the calls, under the launch attempt's prefix (torchrun's restarts reuse its store) and the command's
(``begin``).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from itertools import count
from typing import Any

import torch.distributed as dist

from coati_kto.parallel.advice import next_step

DEFAULT_TIMEOUT_S = 7200.0  # train.file_wait_timeout's default: a 1 TB checkpoint at 200 MB/s takes 83 min

MAX_PAUSE_S = 0.5  # between two polls of a long wait
TELL_TIMEOUT_S = 5.0  # for telling the store of a failure
_timeout_s = DEFAULT_TIMEOUT_S
# Mutated in place, never rebound: the commands this process started (begin) and the current one's waits. (The
# test suite's worker ranks put back every module attribute a task rebinds; reused keys would read stale values.)
_counts: dict[str, Any] = {"commands": 0, "waits": count()}


class FileWaitTimeoutError(RuntimeError):
    """A wait on file work passed ``train.file_wait_timeout``; its message is the one line to print."""


class PeerFailedError(RuntimeError):
    """Another rank failed while this one waited (``tell_peers``); its message is the one line to print."""


def set_timeout(seconds: float) -> None:
    """``train.file_wait_timeout`` for this process's waits (``init_distributed`` sets it; any rank, local)."""
    global _timeout_s
    _timeout_s = float(seconds)


def begin() -> None:
    """A command starts (``init_distributed``: every rank, once per command, whether or not it creates the
    group): its waits, and a failure told during them, get keys of their own. A process that runs several
    commands on one process group (library use, the test suite's worker ranks) then never reads an earlier
    command's failure, nor a count of waits that an earlier failure left unequal between ranks."""
    _counts["commands"] += 1
    _counts["waits"] = count()


def _prefix() -> str:
    return f"coati_kto/file_wait/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_counts['commands']}"


def _key(what: str) -> str:
    return f"{_prefix()}/{next(_counts['waits'])}/{what}"


def failure_key() -> str:
    """Where a rank that fails says so (``tell_peers``): every wait of this launch attempt reads it."""
    return f"{_prefix()}/failed"


def tell_peers(line: str) -> None:
    """A rank leaving with an error (``line``, one line) tells the ranks waiting in the store, which then stop
    at once with it instead of waiting for train.heartbeat_timeout or train.file_wait_timeout (a failed rank's
    closed sockets end a collective, not a store wait). The first failure is kept. Any rank, local; nothing
    without a process group or when the store itself is gone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    previous = store.timeout
    # An unreachable store must not hold up this rank's exit.
    store.set_timeout(timedelta(seconds=TELL_TIMEOUT_S))
    try:
        store.compare_set(failure_key(), "", f"rank {dist.get_rank()}: {line}")
    except Exception:  # noqa: BLE001 - the store (rank 0's process, torchrun's agent) is gone: nobody to tell
        pass
    finally:
        store.set_timeout(previous)


def peer_failed(line: str, waiting_for: str) -> PeerFailedError:
    """The error a rank raises when ``line`` (``rank R: ...``, another rank's failure) ended its wait for
    ``waiting_for``; the CLI prints it as this rank's one line (exit 1)."""
    return PeerFailedError(f"{line} (this rank was waiting for {waiting_for}); {next_step()}")


def _poll(ready: Callable[[], bool], waiting_for: str, store: Any) -> None:
    """Until ``ready()`` (a store read). Polled, with pauses from 1 ms growing to MAX_PAUSE_S, rather than one
    blocking ``store.wait``: between polls the interpreter runs signal handlers (a stop, a second Ctrl-C's
    abort) and reads whether a rank failed (``tell_peers``); a wait of minutes costs four requests a second per
    rank."""
    deadline, pause, failed = time.monotonic() + _timeout_s, 0.001, failure_key()
    while not ready():
        if store.check([failed]):
            raise peer_failed(store.get(failed).decode(), waiting_for)
        if time.monotonic() > deadline:
            raise FileWaitTimeoutError(
                f"waited {_timeout_s:.0f} s (train.file_wait_timeout) for {waiting_for}; a rank is stuck or a "
                f"node is gone: its own error, if any, is in its log; {next_step()}"
            )
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)


def _all_arrived(store: Any, key: str, size: int, waiting_for: str) -> None:
    store.add(f"{key}/arrived", 1)
    _poll(lambda: store.add(f"{key}/arrived", 0) == size, waiting_for, store)


def _leave(store: Any, key: str, rank: int, size: int) -> None:
    """Every rank is done reading under ``key``; global rank 0 returns last. Without torchrun's agent the store
    lives in rank 0's process: it must not exit (a user error, the end of the run) while a peer still reads."""
    store.add(f"{key}/left", 1)
    if rank == 0:
        _poll(lambda: store.add(f"{key}/left", 0) == size, "the other ranks to read the store", store)


def _world() -> tuple[Any, int, int] | None:
    """(store, rank, world size), or None for a world of one (nothing to wait for)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def wait_for_all(waiting_for: str) -> None:
    """A barrier: returns on every rank once every rank has called it. Every rank calls. ``waiting_for`` says
    whose work it waits for, in the timeout's line ("global rank 0 to write final/")."""
    world = _world()
    if world is None:
        return
    store, rank, size = world
    key = _key(waiting_for)
    _all_arrived(store, key, size, waiting_for)
    _leave(store, key, rank, size)


def from_rank0(value: Any, what: str) -> Any:
    """Global rank 0's ``value`` (picklable; the others pass anything) on every rank. Every rank calls; the
    others return once rank 0 has called, rank 0 once they have its value."""
    world = _world()
    if world is None:
        return value
    store, rank, size = world
    key = _key(what)
    if rank == 0:
        store.set(f"{key}/value", pickle.dumps(value))
    else:
        _poll(lambda: store.check([f"{key}/value"]), f"global rank 0 to {what}", store)
        value = pickle.loads(store.get(f"{key}/value"))
    _leave(store, key, rank, size)
    return value


def first_failure(failure: str | None, what: str) -> tuple[int, str] | None:
    """Every rank calls with its own failure (one line) or None, and gets the lowest failed rank and its line,
    or None when no rank failed; returns once every rank has called (a barrier)."""
    world = _world()
    if world is None:
        return None if failure is None else (0, failure)
    store, rank, size = world
    key = _key(what)
    if failure is not None:  # before arriving: every failure is counted once all have arrived
        store.set(f"{key}/failed/{rank}", failure.encode())
        store.add(f"{key}/failures", 1)
    _all_arrived(store, key, size, f"the slowest rank to {what}")
    found = None
    if store.add(f"{key}/failures", 0) > 0:
        failed = next(r for r in range(size) if store.check([f"{key}/failed/{r}"]))
        found = failed, store.get(f"{key}/failed/{failed}").decode()
    _leave(store, key, rank, size)
    return found
