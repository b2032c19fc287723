"""coati_kto.runtime.host_memory: a CPU step's activations reuse the pages the previous step freed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coati_kto.runtime.host_memory import keep_freed_memory

# A child process: "steps" that each allocate 20 activations of 4.5-5.5 MiB (sequence lengths vary step to
# step), keep them (as autograd keeps activations for the backward) and free them at the end. Per step after
# the second (the heap has reached its peak): the bytes mmapped while they live, and the free bytes the heap
# keeps once they are freed (glibc's mallinfo2). Page faults would be the direct measure, but transparent huge
# pages make their count vary run to run; these do not.
_STEPS = """
import ctypes, json, sys, torch
if sys.argv[1] == "keep":
    from coati_kto.runtime.host_memory import keep_freed_memory
    assert keep_freed_memory() is not None
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
steps = []
for size in [20, 22, 18, 21, 19, 22, 20, 18]:  # x 256 KiB
    a = torch.ones(size << 16)
    kept = [a * 2 for _ in range(20)]
    mapped = libc.mallinfo2().hblkhd
    del kept, a
    steps.append((mapped, libc.mallinfo2().fordblks))
print(json.dumps(steps[2:]))
"""


def _steps(mode: str) -> list[list[int]]:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(keep_freed_memory() is None, reason="not glibc: nothing is changed")
def test_steps_after_the_first_reuse_the_freed_heap() -> None:
    peak = 20 * (22 << 18)  # the largest step's activations, bytes
    kept = _steps("keep")
    # Nothing of a step is mapped afresh (a few MiB mapped at import, before the setting, stay mapped), and the
    # heap keeps the largest step's bytes once they are freed, at every step.
    assert all(mapped < peak // 8 and free >= peak for mapped, free in kept), kept
    # glibc's default: some step maps its activations afresh, or the heap gives part of what they freed back
    default = _steps("default")
    assert not all(mapped < peak // 8 and free >= peak for mapped, free in default), default


def test_the_note_names_what_it_changed() -> None:
    note = keep_freed_memory()
    assert note is None or ("32 MiB" in note and "glibc" in note)
