"""The ranks of one machine generate and build each compiled graph once, not once per rank.

With ``model.compile`` (and the fused optimizer's compiled step), every rank traces the same regions and, on a
cold inductor cache (a new machine, a new torch or a changed model), every rank then generates and builds the same
kernels at the same moment: N ranks on a node pay N times the CPU of one compile, and finish no sooner. Inductor
already keeps each graph it built in its FX graph cache (on the machine's disk, ``TORCHINDUCTOR_CACHE_DIR``), but
two ranks that start the same graph together both miss it.

``install`` wraps inductor's per-graph compile (``torch._inductor.compile_fx._compile_fx_inner``: cache lookup,
codegen, the C++/Triton build, cache write) in a file lock named after the graph's code and its inputs' shapes,
strides and dtypes, under inductor's own lock directory. The first rank to reach a graph builds it; the others wait
on the lock and then find it in the cache (a hit: the very kernels the first rank built). Same result as a warm
cache, which every run after the first already gets.

- Only inductor's lookup-and-build of one graph runs under the lock: no collective is reached while it is held,
  and a thread never holds two (a compile nested in another runs unlocked), so ranks cannot wait on each other in
  a circle. The lock is an ``flock``: a rank that dies holding it releases it.
- A rank that waits longer than ``WAIT_S`` for another's build stops waiting and compiles the graph itself.
- Measured on a 2-core AMD EPYC, cold cache: see docs/performance.md ("Compiling once per machine").
- ``COATI_KTO_NO_COMPILE_LOCK=1`` leaves inductor untouched; so does a torch without that function.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WAIT_S = 900.0  # longer than any one graph's build seen here (the largest: 40 s on 2 cores)
_state = threading.local()  # .holding: this thread runs a compile under the lock


def graph_key(gm: Any, example_inputs: Any) -> str:
    """A name for the lock of one graph: its generated code and each input's shape, stride and dtype (symbolic
    sizes as their names). Two ranks tracing the same region with the same inputs get the same key; a collision
    only makes two different graphs build one after the other."""
    parts = [str(getattr(gm, "code", "")), str(len(example_inputs))]
    for value in example_inputs:
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            stride = value.stride() if hasattr(value, "stride") else ()
            parts.append(f"{value.dtype}{tuple(value.shape)}{tuple(stride)}")
        else:
            parts.append(type(value).__name__)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _locked(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (inductor's per-graph compile) run under the graph's machine-wide lock."""
    from filelock import FileLock, Timeout
    from torch._inductor.codecache import get_lock_dir

    @functools.wraps(original)
    def compile_once(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "holding", False):
            return original(gm, example_inputs, *args, **kwargs)
        path = os.path.join(get_lock_dir(), f"coati-graph-{graph_key(gm, example_inputs)}.lock")
        lock = FileLock(path, timeout=WAIT_S)
        try:
            lock.acquire()
        except Timeout:
            log.warning(
                "waited %.0f s for another rank's compile of the same graph; compiling it here", WAIT_S
            )
            return original(gm, example_inputs, *args, **kwargs)
        _state.holding = True
        try:
            return original(gm, example_inputs, *args, **kwargs)
        finally:
            _state.holding = False
            lock.release()

    compile_once.coati_compile_lock = True  # type: ignore[attr-defined]
    return compile_once


def install() -> bool:
    """Put the lock around inductor's per-graph compile in this process (idempotent; cheap after the first call).
    Whether it is in place."""
    if os.environ.get("COATI_KTO_NO_COMPILE_LOCK") == "1":
        return False
    try:
        import torch._inductor.compile_fx as compile_fx
    except ImportError:
        return False
    current = getattr(compile_fx, "_compile_fx_inner", None)
    if current is None:
        return False
    if not getattr(current, "coati_compile_lock", False):
        compile_fx._compile_fx_inner = _locked(current)
    return True
