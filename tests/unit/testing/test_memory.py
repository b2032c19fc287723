"""coati_kto.testing.memory: peaks of tensor chains small enough to count by hand (fp32: 4 bytes an element)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from coati_kto.testing.memory import LiveStorage, track_peak

F32 = 4
N = 1000  # elements of the chains' tensors: 4000 bytes each


def test_a_chain_counts_what_is_alive_together_not_what_was_made() -> None:
    """a, b = 2a, free a, c = b + 1, free b, d = c + 1: four tensors made, never more than two alive."""
    with track_peak() as memory:
        a = torch.ones(N)
        b = a * 2
        del a
        c = b + 1
        del b
        d = c + 1
    assert memory.peak_added_bytes == 2 * N * F32
    assert memory.live_added_bytes == 2 * N * F32  # c and d
    assert memory.baseline_bytes == 0 and memory.peak_bytes == 2 * N * F32
    assert memory.ops == 4
    assert sorted((s.op, s.nbytes) for s in memory.peak_live) == [("mul", N * F32), ("ones", N * F32)]
    del c, d


def test_views_and_in_place_results_share_their_base_storage() -> None:
    with track_peak() as memory:
        a = torch.ones(N)
        views = [a[10:], a.view(10, 100), a.view(10, 100).t(), a.detach(), a.unsqueeze(0)]
        a.add_(1)
        views[1].mul_(2)
    assert memory.peak_added_bytes == N * F32
    assert memory.peak_live == [LiveStorage(N * F32, "ones", (N,), torch.float32)]
    del a, views


def test_storages_made_before_count_once_in_the_baseline() -> None:
    """A tensor made before the block and read twice, one of its views, and an untouched holder's parameters."""
    x = torch.ones(N)
    idle = torch.nn.Linear(10, 20)  # 200 + 20 elements, never touched inside
    with track_peak(idle) as memory:
        y = x + 1
        z = x[5:] * y[5:]
    assert memory.baseline_bytes == (N + 220) * F32
    assert memory.peak_added_bytes == (N + (N - 5)) * F32
    assert memory.peak_bytes == (N + 220 + N + N - 5) * F32
    del y, z


def test_a_freed_earlier_storage_whose_address_comes_back_counts_as_new() -> None:
    """x (made before) is read, then freed inside; the next same-sized tensor takes its address (glibc reuses the
    chunk): it must count as made inside, not be mistaken for x. Another thread's allocation (pytest-xdist's
    I/O thread) can take the chunk first, so the case is retried until it happens."""
    for _ in range(200):
        x = torch.full((N,), 3.0)
        address = x.untyped_storage()._cdata
        with track_peak() as memory:
            y = x + 1
            del x
            z = torch.zeros(N)
        if z.untyped_storage()._cdata == address:  # the case under test happened
            break
        del y, z
    else:
        pytest.skip("the allocator never handed the freed storage's address back in 200 tries")
    assert memory.live_added_bytes == 2 * N * F32  # y and z
    assert memory.baseline_bytes == N * F32


def test_a_resized_output_is_re_read() -> None:
    with track_peak() as memory:
        out = torch.empty(0)
        torch.add(torch.ones(N), 1, out=out)  # resizes out's storage to N elements
    assert memory.live_added_bytes == N * F32  # out; the ones are freed
    assert memory.peak_added_bytes == 2 * N * F32
    del out


def test_linear_relu_forward_backward_exact() -> None:
    """x [50, 100] -> Linear(100, 200) -> ReLU -> sum, backward. Baseline: W, b and x. At the end: the gradients
    of W, b and x, and ReLU's output y (held by the test). The peak is the end plus ReLU's input gradient [50, 200]
    (alive until the last matmul of the backward) and the two scalars (the loss, its ones_like)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 200)
    x = torch.randn(50, 100, requires_grad=True)
    with track_peak(linear) as memory:
        y = linear(x).relu()
        y.sum().backward()
    weights, xs, ys = (100 * 200 + 200) * F32, 50 * 100 * F32, 50 * 200 * F32
    assert memory.baseline_bytes == weights + xs
    assert memory.live_added_bytes == weights + xs + ys
    assert memory.peak_added_bytes == weights + xs + ys + ys + 2 * F32
    assert memory.peak_live[0] == LiveStorage(200 * 100 * F32, "mm", (200, 100), torch.float32)
    del y


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = x.tanh()  # tanh saves its output for backward: one [N] per step
    return x


def test_activation_checkpointing_keeps_segment_inputs_and_recomputes() -> None:
    """Two segments of four tanh steps. Plain: the forward keeps all eight outputs for backward, and the peak comes
    at the first gradient (tanh_backward's [N]) with the loss and its ones_like: 9 N + 2 scalars. Checkpointed
    (non-reentrant): the forward keeps only the first segment's output; the backward replays the second segment
    (four outputs) and makes its first gradient: 6 N + 2 scalars, and eight more ops (the replays)."""
    x = torch.randn(N, requires_grad=True)
    with track_peak() as plain:
        _chain(_chain(x)).sum().backward()
    x.grad = None
    with track_peak() as checkpointed:
        # the first segment's output is held by the graph alone, so the backward frees it after use
        checkpoint(_chain, checkpoint(_chain, x, use_reentrant=False), use_reentrant=False).sum().backward()
    assert plain.peak_added_bytes == 9 * N * F32 + 2 * F32
    assert checkpointed.peak_added_bytes == 6 * N * F32 + 2 * F32
    assert checkpointed.ops == plain.ops + 8
    # at the peak: the first segment's output, the four replayed outputs, the first gradient and the scalars
    assert [s.op for s in checkpointed.peak_live] == ["tanh"] * 5 + ["tanh_backward", "sum", "ones_like"]


def test_nothing_changes_after_the_block() -> None:
    with track_peak() as memory:
        a = torch.ones(N)
        b = a + 1
    before = (memory.peak_added_bytes, memory.live_added_bytes, memory.baseline_bytes)
    del a, b
    c = torch.ones(10 * N)
    assert (memory.peak_added_bytes, memory.live_added_bytes, memory.baseline_bytes) == before
    del c
