"""Peak live tensor storage on the CPU, counted exactly: :func:`track_peak` around a forward and backward.

    with track_peak(model) as memory:
        loss = model(x).sum()
        loss.backward()
    memory.peak_bytes       # baseline_bytes + peak_added_bytes
    memory.baseline_bytes   # storages that existed before the block (weights, buffers, grads, inputs)
    memory.peak_added_bytes # the most bytes of storages made inside the block alive at one time (activations)

What it counts: every tensor storage on the CPU that an aten op inside the block returns, once per storage (views
and in-place results share their base's storage), by ``untyped_storage().nbytes()``, alive from the op that made it
until its last reference goes (a weakref finalizer on the storage: CPython frees at once, autograd's saved
tensors and activation-checkpoint recompute included). A storage an op resizes is re-read at its next op.
``peak_added_bytes`` is the largest sum of live storages made inside the block, taken after each op, when the
op's inputs are still alive: the same instant the allocator would see. ``baseline_bytes`` is the bytes of the
storages made before the block that an op inside it read or wrote, and of the ``holders`` given (modules: their
parameters, buffers and existing gradients; tensors), each once; one freed inside the block still counts (an
upper bound then: weights and inputs live throughout). ``peak_live`` lists what was alive at the peak.

What it misses: memory a kernel allocates and frees inside itself (CPU flash attention's per-thread blocks,
oneDNN workspaces, gloo's buffers), allocations of code that does not go through the dispatcher
(``torch.from_numpy``, pinned host staging), storages on other devices, and allocator overhead (the numbers
are tensor bytes, not RSS). Objects kept by reference cycles count until the garbage collector frees them.
Ops run by other threads count only where autograd carries the mode there (CPU backward runs on the caller's
thread); a storage freed on another thread (gloo's work objects release a collective's buffers there) is
subtracted when that thread frees it, so around collectives the peak can differ by such a buffer from run to
run, as the allocator's would. Everything inside the block is dispatched through Python, so it runs slower (about 10 µs an op).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class LiveStorage:
    """One storage alive at the peak: its bytes, the op that made it and that op's output shape and dtype."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PeakMemory:
    """What :func:`track_peak` measured (read after the block; the numbers grow while it runs)."""

    baseline_bytes: int = 0
    peak_added_bytes: int = 0
    live_added_bytes: int = 0  # made inside the block and alive now (at exit: still alive after it)
    peak_live: list[LiveStorage] = field(default_factory=list)  # at the peak, largest first
    ops: int = 0  # aten ops seen

    @property
    def peak_bytes(self) -> int:
        """Baseline plus the peak of what the block made: the most storage bytes alive at one time."""
        return self.baseline_bytes + self.peak_added_bytes


def _storage(t: torch.Tensor) -> Any:
    """``t``'s untyped storage on the CPU, or None (another device, a tensor without storage)."""
    if t.device.type != "cpu" or t.is_sparse or t.is_nested:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class _Tracker(TorchDispatchMode):
    def __init__(self, result: PeakMemory) -> None:
        super().__init__()
        self.result = result
        self.added: dict[int, tuple[int, str, tuple[int, ...], torch.dtype]] = {}  # key -> (bytes, op, ...)
        self.before: set[int] = set()  # storages made before the block, counted in the baseline
        self.finalizers: dict[int, weakref.finalize] = {}
        self.closed = False
        # A storage's last reference may go on another thread (gloo's work objects hold a collective's buffers):
        # its finalizer then runs there, so the counts change under a lock (re-entrant: a finalizer may also run
        # on this thread while the lock is held).
        self.lock = threading.RLock()

    def note_before(self, storage: Any) -> None:
        key = storage._cdata
        if key in self.before or key in self.added:
            return
        self.before.add(key)
        self.result.baseline_bytes += storage.nbytes()
        # forget it when freed: a later storage may reuse the address
        self.finalizers[key] = weakref.finalize(storage, self._forget, key)

    def _forget(self, key: int) -> None:
        with self.lock:
            if self.closed:
                return
            self.finalizers.pop(key, None)
            self.before.discard(key)
            entry = self.added.pop(key, None)
            if entry is not None:
                self.result.live_added_bytes -= entry[0]

    def _note_output(self, t: torch.Tensor, op: str) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = storage._cdata
        if key in self.before:
            return
        nbytes = storage.nbytes()
        entry = self.added.get(key)
        if entry is None:
            self.finalizers[key] = weakref.finalize(storage, self._forget, key)
        elif entry[0] == nbytes:
            return
        self.added[key] = (nbytes, op, tuple(t.shape), t.dtype)
        self.result.live_added_bytes += nbytes - (entry[0] if entry else 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        with self.lock:
            for t in inputs:  # a storage first met as an input was made before the block
                storage = _storage(t)
                if storage is not None and storage._cdata not in self.added:
                    self.note_before(storage)
        out = func(*args, **kwargs)
        op = str(func.overloadpacket.__name__)
        with self.lock:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._note_output(t, op)
            self.result.ops += 1
            if self.result.live_added_bytes > self.result.peak_added_bytes:
                self.result.peak_added_bytes = self.result.live_added_bytes
                self.result.peak_live = [LiveStorage(*entry) for entry in self.added.values()]
        return out

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for finalizer in self.finalizers.values():
                finalizer.detach()
            self.finalizers.clear()
            self.result.peak_live.sort(key=lambda s: -s.nbytes)


def _holder_tensors(holders: Iterable[torch.nn.Module | torch.Tensor]) -> Iterator[torch.Tensor]:
    for holder in holders:
        if isinstance(holder, torch.Tensor):
            yield holder
            continue
        for p in holder.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from holder.buffers()


@contextlib.contextmanager
def track_peak(*holders: torch.nn.Module | torch.Tensor) -> Iterator[PeakMemory]:
    """Within: every CPU tensor storage made is counted until freed (module docstring); yields the
    :class:`PeakMemory` it fills. ``holders``: modules (parameters, buffers, existing gradients) and tensors
    whose storages count in the baseline from the start, whether or not an op inside touches them."""
    result = PeakMemory()
    tracker = _Tracker(result)
    for t in _holder_tensors(holders):
        storage = _storage(t)
        if storage is not None:
            tracker.note_before(storage)
    try:
        with tracker:
            yield result
    finally:
        tracker.close()
