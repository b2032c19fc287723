"""sequence_logps against a naive full-vocabulary fp32 log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.models.logprobs import completion_logits_to_keep, sequence_logps


def naive_logps(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The textbook version over full-sequence logits: upcast everything, shift, gather, mask."""
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    tok = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.where(loss_mask[:, 1:].bool(), tok, torch.zeros_like(tok)).sum(-1)


def make_batch(batch=4, seq=12, vocab=50, seed=0, dtype=torch.float32):
    """Random prompt lengths, completion lengths and right padding, with garbage ids on the padding."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        prompt = int(torch.randint(1, seq // 2, (1,), generator=g))
        length = int(torch.randint(prompt + 1, seq + 1, (1,), generator=g))  # right padding after it
        loss_mask[b, prompt:length] = True
    logits = (3 * torch.randn(batch, seq, vocab, generator=g)).to(dtype)
    return logits, input_ids, loss_mask


@pytest.mark.parametrize("seed", range(4))
def test_fp32_matches_naive_values_and_grads(seed):
    logits, ids, mask = make_batch(seed=seed)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got, ref = sequence_logps(a, ids, mask, chunk_size=5), naive_logps(b, ids, mask)
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])  # a non-uniform upstream gradient
    (got * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_summed_in_fp32(dtype):
    logits, ids, mask = make_batch(batch=3, seq=40, vocab=300, seed=7, dtype=dtype)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got, ref = sequence_logps(a, ids, mask), naive_logps(b, ids, mask)  # reference: same values upcast
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    got.sum().backward()
    ref.sum().backward()
    assert a.grad.dtype == dtype
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-3, rtol=1e-2)


def test_chunked_equals_unchunked():
    logits, ids, mask = make_batch(batch=5, seq=20, vocab=64, seed=3)
    whole = sequence_logps(logits, ids, mask, chunk_size=10**6)
    for chunk in (1, 2, 7, 33):
        torch.testing.assert_close(sequence_logps(logits, ids, mask, chunk_size=chunk), whole)


def test_logits_to_keep_equals_full():
    logits, ids, mask = make_batch(batch=4, seq=16, vocab=40, seed=11)
    keep = completion_logits_to_keep(mask)
    first = int(mask[:, 1:].any(0).int().argmax())  # earliest position whose logits are needed
    assert keep == 16 - first
    full_in = logits.clone().requires_grad_()
    kept_in = logits[:, -keep:].clone().requires_grad_()
    full, kept = sequence_logps(full_in, ids, mask), sequence_logps(kept_in, ids, mask)
    torch.testing.assert_close(kept, full)
    full.sum().backward()
    kept.sum().backward()
    torch.testing.assert_close(kept_in.grad, full_in.grad[:, -keep:])
    assert float(full_in.grad[:, :-keep].abs().sum()) == 0.0
    for extra in range(1, 16 - keep + 1):  # keeping more than needed changes nothing
        torch.testing.assert_close(sequence_logps(logits[:, -(keep + extra) :], ids, mask), full)
    with pytest.raises(ValueError, match="completion_logits_to_keep"):
        sequence_logps(logits[:, -(keep - 1) :], ids, mask)


def test_completion_logits_to_keep_cases():
    m = torch.zeros(2, 10, dtype=torch.bool)
    assert completion_logits_to_keep(m) == 1  # nothing to predict: HF's 0 would mean "all"
    m[0, 7:9] = True
    assert completion_logits_to_keep(m) == 4  # token 7 comes from position 6: positions 6..9
    m[1, 3] = True
    assert completion_logits_to_keep(m) == 8
    m[:, 1] = True
    assert completion_logits_to_keep(m) == 10


def test_masked_positions_contribute_exactly_zero_even_with_inf_logits():
    logits, ids, mask = make_batch(batch=3, seq=10, vocab=20, seed=5)
    base = sequence_logps(logits, ids, mask)
    poisoned = logits.clone()
    # Positions t whose next token is not a completion token hold garbage: inf and NaN.
    unused = ~mask[:, 1:]
    poisoned[:, :-1][unused] = float("inf")
    poisoned[:, -1] = float("nan")
    x = poisoned.requires_grad_()
    got = sequence_logps(x, ids, mask)
    torch.testing.assert_close(got, base)
    got.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert float(x.grad[:, :-1][unused].abs().sum()) == 0.0 and float(x.grad[:, -1].abs().sum()) == 0.0


def test_padding_only_row_and_empty_mask():
    logits, ids, mask = make_batch(batch=3, seq=8, vocab=16, seed=2)
    mask[1] = False  # a row with no completion token (e.g. all padding)
    x = logits.clone().requires_grad_()
    got = sequence_logps(x, ids, mask)
    assert float(got[1].detach()) == 0.0
    torch.testing.assert_close(got, naive_logps(logits, ids, mask))
    none = sequence_logps(x, ids, torch.zeros_like(mask))
    assert none.tolist() == [0.0, 0.0, 0.0]
    none.sum().backward()
    assert float(x.grad.abs().sum()) == 0.0


def test_padding_tokens_do_not_change_the_result():
    # Appending right padding (any ids, any logits) to a batch leaves every row's log-prob unchanged.
    logits, ids, mask = make_batch(batch=2, seq=9, vocab=30, seed=4)
    pad_logits = torch.cat([logits, 50 * torch.randn(2, 5, 30)], dim=1)
    pad_ids = torch.cat([ids, torch.randint(0, 30, (2, 5))], dim=1)
    pad_mask = torch.cat([mask, torch.zeros(2, 5, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(
        sequence_logps(pad_logits, pad_ids, pad_mask), sequence_logps(logits, ids, mask)
    )


def test_no_grad_reference_use():
    logits, ids, mask = make_batch(seed=9)
    with torch.no_grad():
        got = sequence_logps(logits.requires_grad_(), ids, mask)
    assert not got.requires_grad
    torch.testing.assert_close(got, naive_logps(logits.detach(), ids, mask))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(2, 7),
    vocab=st.integers(2, 9),
    chunk=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    trim=st.booleans(),
)
def test_property_matches_naive(batch, seq, vocab, chunk, seed, trim):
    g = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(batch, seq, vocab, generator=g)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.6  # arbitrary masks, holes included
    x = logits.clone().requires_grad_()
    keep = completion_logits_to_keep(mask) if trim else seq
    got = sequence_logps(x[:, -keep:], ids, mask, chunk_size=chunk)
    y = logits.clone().requires_grad_()
    ref = naive_logps(y, ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    got.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-5)
