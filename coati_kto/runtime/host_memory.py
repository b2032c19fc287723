"""Training on the CPU: freed tensor memory stays in the process, so each step's activations reuse pages.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised to at most 32 MiB as such blocks
are freed) with a fresh mmap and returns it to the system when freed. A training step frees its activations and
allocates them again in the next step: every page of every such tensor is faulted in (and zeroed by the kernel)
once per step. On the 7.4M-parameter fixture of benchmarks/step_bench.py that is about 25,000 page faults per
step, and the step runs about 5% faster without them (docs/performance.md). A fixed threshold of 32 MiB (glibc's
largest) serves those blocks from the heap, and a trim threshold of 2 GiB (mallopt takes an int) keeps what is
freed there for the next step: the process's resident memory stays at its peak instead of falling back between
steps; the peak itself is the same. Tensors above 32 MiB are still mapped per allocation.

On a GPU the device's caching allocator already keeps its memory, and host memory is not the step's cost:
nothing is changed there. Elsewhere than Linux with glibc: nothing either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from coati_kto.parallel.upstream.cpu import cuda_available

# glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt's value is a C int


@functools.cache
def keep_freed_memory() -> str | None:
    """Set glibc's thresholds for this process (once; every rank calls for itself) and return the one-line note
    the run prints, or None where CUDA is available, the C library is not glibc or it refused a setting."""
    if cuda_available():
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError, TypeError):
        return None
    if not (
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return None
    return (
        f"CPU: freed host memory stays in the process for the next step (glibc {version}: allocations up to "
        f"{MMAP_THRESHOLD >> 20} MiB from the heap, trimmed only above 2 GiB free), so activations are not faulted in again"
    )
