"""KTOCollator: shapes, right padding, masks from lengths (correct when pad == eos)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CORPUS
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.data.collator import KTOCollator
from coati_kto.data.tokenize import encode
from coati_kto.testing.tiny import build_tokenizer


def row(prompt: list[int], completion: list[int], kl_completion: list[int], label: bool, index: int) -> dict:
    return {
        "input_ids": prompt + completion,
        "completion_start": len(prompt),
        "label": label,
        "kl_input_ids": prompt + kl_completion,
        "kl_completion_start": len(prompt),
        "index": index,
    }


def test_shapes_padding_and_masks() -> None:
    features = [
        row([1, 2, 3], [4, 5], [6], True, 7),
        row([8], [9, 10, 11, 12], [13, 14, 15, 16, 17], False, 3),
    ]
    batch = KTOCollator(pad_token_id=0)(features)
    assert batch.example.input_ids.tolist() == [[1, 2, 3, 4, 5], [8, 9, 10, 11, 12]]
    assert batch.example.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.example.loss_mask.tolist() == [[False] * 3 + [True] * 2, [False] + [True] * 4]
    assert batch.kl.input_ids.tolist() == [[1, 2, 3, 6, 0, 0], [8, 13, 14, 15, 16, 17]]  # its own width
    assert batch.kl.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert batch.kl.loss_mask.tolist() == [[False, False, False, True, False, False], [False] + [True] * 5]
    assert batch.label.tolist() == [True, False] and batch.index.tolist() == [7, 3]
    for view in (batch.example, batch.kl):
        assert (view.input_ids.dtype, view.attention_mask.dtype, view.loss_mask.dtype) == (
            torch.long,
            torch.long,
            torch.bool,
        )
    assert batch.label.dtype == torch.bool and batch.index.dtype == torch.long
    assert batch.reference_logps is None and batch.valid is None and len(batch) == 2


def test_pad_to_multiple_of_and_numpy_rows() -> None:
    features = [row([1, 2], [3], [4, 5, 6], True, 0), row([7], [8], [9], False, 1)]
    features[0] = {k: np.asarray(v) if isinstance(v, list) else v for k, v in features[0].items()}
    batch = KTOCollator(pad_token_id=-1, pad_to_multiple_of=8)(features)
    assert batch.example.input_ids.shape == (2, 8) and batch.kl.input_ids.shape == (2, 8)
    assert batch.example.attention_mask.sum(1).tolist() == [3, 2]
    assert batch.example.input_ids[1].tolist() == [7, 8] + [-1] * 6


def test_attention_and_loss_masks_when_pad_is_eos() -> None:
    """EOS ends every completion; with pad == eos, `input_ids != pad` would hide it from attention and loss."""
    tok = build_tokenizer(CORPUS, pad_is_eos=True)
    assert tok.pad_token_id == tok.eos_token_id
    features = []
    for i, (prompt, completion) in enumerate([("2+3=", " 5"), ("The capital of France is", " Paris.")]):
        p, c = encode(tok, prompt, completion, chat=False)
        assert c[-1] == tok.eos_token_id
        features.append(row(p, c, c, bool(i % 2), i))
    batch = KTOCollator(tok.pad_token_id)(features)
    lengths = [len(f["input_ids"]) for f in features]
    assert batch.example.attention_mask.sum(1).tolist() == lengths
    for b, f in enumerate(features):
        n = lengths[b]
        assert (
            batch.example.input_ids[b, n - 1] == tok.eos_token_id
            and batch.example.attention_mask[b, n - 1] == 1
        )
        assert batch.example.loss_mask[b, n - 1]  # the EOS is trained on
        assert not batch.example.loss_mask[b, n:].any() and not batch.example.attention_mask[b, n:].any()
        completion = tok.decode(batch.example.input_ids[b][batch.example.loss_mask[b]])
        assert completion == tok.decode(f["input_ids"][f["completion_start"] :])
    assert (
        batch.example.input_ids[0, lengths[0] :] == tok.eos_token_id
    ).all()  # padded with eos, yet masked out


def test_rejects_rows_without_completion() -> None:
    with pytest.raises(ValueError, match="completion_start"):
        KTOCollator(0)([row([1, 2], [], [3], True, 0)])


def test_rejects_rows_without_a_prompt_token() -> None:
    """A completion at token 0 has no token before it to predict it from: its first token would be left out of
    the log-prob in silence (``prepare`` refuses such records as no_prompt_tokens; a batch built by hand did not)."""
    with pytest.raises(ValueError, match=r"completion_start 0 .*\(no prompt token"):
        KTOCollator(0)([row([], [4, 5, 6], [3], True, 0)])


def test_tokenizer_without_pad_token_collates_to_the_same_logprobs() -> None:
    """Issue 17: GPT-2-like tokenizers (no pad token) passed prepare, then train died on every rank. pad_id pads
    with EOS; masks come from lengths, so the log-probs equal those of any other pad id."""
    from test_tokenize import sentencepiece_tokenizer

    from coati_kto.data.vocabulary import pad_id
    from coati_kto.models.packing import pair_logps
    from coati_kto.testing.tiny import build_llama

    tok = sentencepiece_tokenizer("legacy-prepend")
    assert tok.pad_token_id is None
    pad, note = pad_id(tok)
    assert pad == tok.eos_token_id and note.startswith("note: the tokenizer has no pad token")
    features = []
    for i, (prompt, completion) in enumerate(
        [("2+3=", " 5"), ("The capital of France is", " Paris, in France.")]
    ):
        p, c = encode(tok, prompt, completion, chat=False)
        features.append(row(p, c, c[:2], bool(i % 2), i))
    model = build_llama(tok, hidden_size=32, num_layers=1, num_heads=2).eval()
    with torch.no_grad():
        by_eos = pair_logps(model, KTOCollator(pad, pad_to_multiple_of=8)(features))
        by_other = pair_logps(model, KTOCollator(tok.unk_token_id, pad_to_multiple_of=8)(features))
    assert by_eos[0].isfinite().all() and not torch.equal(by_eos[0], by_eos[1])
    torch.testing.assert_close(by_eos[0], by_other[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(by_eos[1], by_other[1], rtol=0, atol=1e-6)


_TOKENS = st.lists(st.integers(1, 50), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(_TOKENS, _TOKENS, _TOKENS, st.booleans(), st.booleans()), min_size=1, max_size=6),
    st.sampled_from([None, "one", "bins"]),
)
def test_token_counts_equal_the_rows_by_hand(rows: list[tuple], padding_free: str | None) -> None:
    """The collator's host counts (what the step's tokens and FLOPs come from, nothing read back) against the
    feature lists: every valid row's example and KL tokens, the prompt tokens a shared-prompt pass and the KL
    continuation process once, and the continuation's own rows (a KL pair with a prompt of its own shares
    none of it)."""
    from coati_kto.data.packed import counted

    features = []
    for i, (prompt, completion, kl_completion, label, own_prompt) in enumerate(rows):
        feature = row(prompt, completion, kl_completion, label, i)
        if own_prompt:  # a KL pair whose prompt differs from its example's: no shared prompt
            feature["kl_input_ids"] = [51, *prompt] + kl_completion
            feature["kl_completion_start"] = len(prompt) + 1
        features.append(feature)
    valid = torch.tensor([i % 3 != 2 for i in range(len(rows))])  # evaluation padding rows count nowhere
    batch = counted(KTOCollator(0, padding_free=padding_free)(features).with_valid(valid))
    real = [(f, r) for f, r, ok in zip(features, rows, valid.tolist(), strict=True) if ok]
    shared = [0 if r[4] else len(r[0]) for _, r in real]
    counts = batch.counts
    assert counts.example == sum(len(f["input_ids"]) for f, _ in real)
    assert counts.kl == sum(len(f["kl_input_ids"]) for f, _ in real)
    assert counts.pairs_shared == sum(shared)
    if batch.kl_continuation is None:  # padding-free rows, or a row whose prompts differ
        assert padding_free or any(r[4] for _, r in zip(features, rows, strict=True))
        assert counts.continuation == counts.continuation_visible == 0
    else:  # each row: its prompt but the last token cached; that token and the KL completion run
        assert counts.continuation_visible == sum(len(r[0]) - 1 for _, r in real)
        assert counts.continuation == sum(1 + len(r[2]) for _, r in real)


@pytest.mark.parametrize("layout", ["one", "bins"])
def test_sequence_parallel_ranks_split_each_pass_rows_targets_between_them(layout: str) -> None:
    """``sequence=(2, rank)``: both ranks hold the same whole rows (widened to an even width with padding columns,
    each its own document), rank r the columns [r L/2, (r+1) L/2), and every scored target on exactly one rank, its
    column relative to the slice; the padded views, labels and pairs are those of the unsliced batch."""
    features = [
        row([1, 2, 3], [4, 5], [6], True, 0),
        row([8], [9, 10, 11, 12], [13, 14, 15, 16, 17], False, 1),
        row([20, 21], [22], [23, 24], True, 2),
    ]
    whole = KTOCollator(0, padding_free=layout)(features)
    ranks = [KTOCollator(0, padding_free=layout, sequence=(2, r))(features) for r in (0, 1)]
    for kl in (False, True):
        rows = whole.kl_rows if kl else whole.example_rows
        pieces = [b.kl_rows if kl else b.example_rows for b in ranks]
        width = pieces[0].rows.input_ids.shape[1]
        assert width % 2 == 0 and width - rows.input_ids.shape[1] in (0, 1)
        assert torch.equal(pieces[0].rows.input_ids, pieces[1].rows.input_ids)
        assert [(p.start, p.stop) for p in pieces] == [(0, width // 2), (width // 2, width)]
        want = rows.kl if kl else rows.example
        got = [p.kl if kl else p.example for p in pieces]
        # every target once: global columns rebuilt from the slices' local ones, in the whole batch's order
        merged = sorted(
            (int(o), int(r), int(c) + p.start, int(i))
            for p, t in zip(pieces, got, strict=True)
            for o, r, c, i in zip(t.owner, t.rows, t.cols, t.ids, strict=True)
        )
        assert merged == sorted(
            zip(*(x.tolist() for x in (want.owner, want.rows, want.cols, want.ids)), strict=True)
        )
        assert all(bool((t.cols < width // 2).all()) for t in got)
    assert torch.equal(ranks[1].example.input_ids, whole.example.input_ids)
    assert torch.equal(ranks[1].pairs.input_ids, whole.pairs.input_ids)
    with pytest.raises(ValueError, match="padding_free must be set"):
        KTOCollator(0, sequence=(2, 0))
