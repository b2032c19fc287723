"""Packed layouts planned by the collator (coati_kto.data.packed): what each token sees, which tokens are
scored, and that padding-free rows hold exactly the data's tokens. Invariants checked with hypothesis against a
direct construction from the rows themselves."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.data.collator import KTOCollator
from coati_kto.data.packed import plan_rows
from coati_kto.models.packing import allowed_attention


@st.composite
def micro_batches(draw: st.DrawFn) -> list[dict]:
    rows = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(3, 50), min_size=1, max_size=9))
        completion = draw(st.lists(st.integers(3, 50), min_size=1, max_size=6))
        kl_completion = draw(st.lists(st.integers(3, 50), min_size=1, max_size=6))
        kl_prompt = prompt[1:] if draw(st.booleans()) and len(prompt) > 1 else prompt  # truncated differently
        rows.append(
            {
                "input_ids": prompt + completion,
                "completion_start": len(prompt),
                "label": bool(i % 2),
                "kl_input_ids": kl_prompt + kl_completion,
                "kl_completion_start": len(kl_prompt),
            }
        )
    return rows


def _documents(rows: list[dict], which: str) -> list[list[tuple[int, int, str]]]:
    """Per row, its document as (token, position, part) in the order the layout must hold it."""
    out = []
    for r in rows:
        ids, start = r["input_ids"], r["completion_start"]
        kl_ids, kl_start = r["kl_input_ids"], r["kl_completion_start"]
        shared = start if which == "pairs" and start == kl_start and ids[:start] == kl_ids[:start] else 0
        doc = [(t, p, "example") for p, t in enumerate(ids)] if which != "kl" else []
        if which != "example":
            doc += [(t, p, "kl") for p, t in enumerate(kl_ids) if p >= shared]
        out.append(doc)
    return out


def _spans(plan, n: int) -> list[tuple[int, torch.Tensor]]:
    """(row, columns) of each document 0..n-1 in ``plan``, read from its ``document`` tensor."""
    out = []
    for b in range(n):
        rows, cols = (plan.document == b).nonzero(as_tuple=True)
        assert rows.numel() > 0 and bool((rows == rows[0]).all())  # a document never spans rows
        assert bool((cols.diff() == 1).all())  # contiguous
        out.append((int(rows[0]), cols))
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=micro_batches(),
    layout=st.sampled_from(["padded", "bins", "one"]),
    which=st.sampled_from(["pairs", "example", "kl"]),
)
def test_layout_holds_each_document_and_scores_its_completions(rows, layout, which) -> None:
    batch = KTOCollator(0)(rows)
    example = batch.example if which != "kl" else None
    kl = batch.kl if which != "example" else None
    plan = plan_rows(example, kl, layout)
    documents = _documents(rows, which)
    lengths = list(map(len, documents))
    count, width = plan.input_ids.shape
    if layout == "one":
        assert (count, width) == (1, sum(lengths)) and bool((plan.document >= 0).all())  # not one pad token
    elif layout == "padded":
        assert (count, width) == (len(rows), max(lengths))
    else:  # bins: no row longer than the longest document, and no two rows whose documents would fit in one
        assert width == max(lengths) and sum(lengths) <= count * width
        fill = sorted(int((plan.document[r] >= 0).sum()) for r in range(count))
        assert count == 1 or fill[0] + fill[1] > width
    for b, (doc, (r, cols)) in enumerate(zip(documents, _spans(plan, len(rows)), strict=True)):
        assert plan.input_ids[r, cols].tolist() == [t for t, _, _ in doc]
        assert plan.position_ids[r, cols].tolist() == [p for _, p, _ in doc]
        assert layout != "padded" or (r == b and int(cols[0]) == 0)
    # Scored tokens: every completion token but a document's first, once, predicted by the column before it
    # in its own part (or, for a KL pair's first completion token, by the shared prompt's last).
    for part, targets in (("example", plan.example), ("kl", plan.kl)):
        if (part == "example" and example is None) or (part == "kl" and kl is None):
            assert targets is None
            continue
        key, start_key = (
            ("input_ids", "completion_start")
            if part == "example"
            else ("kl_input_ids", "kl_completion_start")
        )
        expected = [(b, t) for b, r in enumerate(rows) for t in r[key][max(1, r[start_key]) :]]
        assert list(zip(targets.owner.tolist(), targets.ids.tolist(), strict=True)) == expected
        assert bool((plan.document[targets.rows, targets.cols] == targets.owner).all())  # its own document


@settings(max_examples=40, deadline=None)
@given(
    rows=micro_batches(),
    layout=st.sampled_from(["bins", "one"]),
    which=st.sampled_from(["pairs", "example", "kl"]),
)
def test_packed_mask_is_each_documents_own_mask(rows, layout, which) -> None:
    """Packed attention = each document's attention in its padded row, and nothing across documents."""
    batch = KTOCollator(0)(rows)
    views = {"pairs": (batch.example, batch.kl), "example": (batch.example, None), "kl": (None, batch.kl)}[
        which
    ]
    per_row, packed = plan_rows(*views), plan_rows(*views, layout)
    separate, joined = allowed_attention(per_row), allowed_attention(packed)
    expected = torch.zeros_like(joined)
    pads = packed.document < 0
    expected[:, torch.arange(joined.shape[1]), torch.arange(joined.shape[1])] = pads  # padding sees itself
    for b, (r, cols) in enumerate(_spans(packed, len(rows))):
        n = cols.numel()
        expected[r, cols[0] : cols[0] + n, cols[0] : cols[0] + n] = separate[b, :n, :n]
    assert torch.equal(joined, expected)
    # Within a pairs document, the KL pair's tokens see the shared prompt and themselves, never y_i.
    for b in range(len(rows)):
        real = per_row.document[b] >= 0
        seen = separate[b][real][:, real]
        assert bool(seen.tril().eq(seen).all())  # causal
        assert bool(seen.diagonal().all())


def test_padding_free_batch_plans_its_layouts() -> None:
    rows = [
        {
            "input_ids": [5, 6, 7, 8],
            "completion_start": 2,
            "label": True,
            "kl_input_ids": [5, 6, 9],
            "kl_completion_start": 2,
        },
        {
            "input_ids": [4, 3],
            "completion_start": 1,
            "label": False,
            "kl_input_ids": [4, 11, 12],
            "kl_completion_start": 1,
        },
    ]
    padded, free = KTOCollator(0)(rows), KTOCollator(0, padding_free="one")(rows)
    assert padded.example_rows is None and padded.kl_rows is None
    assert tuple(padded.pairs.input_ids.shape) == (2, 5)  # [5 6 7 8 | 9] and [4 3 | 11 12 + pad]
    assert free.pairs.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3, 11, 12]]
    assert free.pairs.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 1, 2]]
    assert free.example_rows.input_ids.tolist() == [[5, 6, 7, 8, 4, 3]]
    assert free.kl_rows.input_ids.tolist() == [[5, 6, 9, 4, 11, 12]]
    assert free.kl_rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert free.pairs.shared.tolist() == [2, 1]
    # y_j's first token is predicted by the shared prompt's last (9 by 6 at column 1, 11 by 4 at column 5),
    # never by y_i's last; 12 by 11 at column 7.
    assert free.pairs.kl.cols.tolist() == [1, 5, 7] and free.pairs.kl.ids.tolist() == [9, 11, 12]
    # bins as long as the longest document (5): [5 6 7 8 | 9] fills one, [4 3 | 11 12] the next
    bins = KTOCollator(0, padding_free="bins")(rows)
    assert bins.pairs.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 11, 12, 0]]
    assert bins.example_rows.input_ids.tolist() == [[5, 6, 7, 8], [4, 3, 0, 0]]  # 4 + 2 > 4: no room
    # Lengths 6, 2, 3 (longest first): the 3 opens a second bin, the 2 joins it after the 3.
    rows = [
        {
            "input_ids": [5, 6, 7, 8, 9, 10],
            "completion_start": 3,
            "label": True,
            "kl_input_ids": [5, 1],
            "kl_completion_start": 1,
        },
        {
            "input_ids": [4, 3],
            "completion_start": 1,
            "label": False,
            "kl_input_ids": [4, 2],
            "kl_completion_start": 1,
        },
        {
            "input_ids": [7, 7, 7],
            "completion_start": 2,
            "label": True,
            "kl_input_ids": [7, 2],
            "kl_completion_start": 1,
        },
    ]
    example_rows = KTOCollator(0, padding_free="bins")(rows).example_rows
    assert example_rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [7, 7, 7, 4, 3, 0]]
    assert example_rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    assert example_rows.document.tolist() == [[0, 0, 0, 0, 0, 0], [2, 2, 2, 1, 1, -6]]


def test_pad_fractions_by_hand() -> None:
    """Examples of 4 + 2 tokens, then 6 + 2 + 3: padded rows process 2 x 4 + 3 x 6 = 26 tokens for 17; bins as
    long as the longest process [4] [2.] and [6] [3 2.] = 8 + 12 = 20; one row 17."""
    from coati_kto.data.inspect import pad_fractions

    def row(n: int) -> dict:
        return {
            "input_ids": [5] * n,
            "completion_start": 1,
            "label": True,
            "kl_input_ids": [5, 6],
            "kl_completion_start": 1,
        }

    f = pad_fractions([[row(4), row(2)], [row(6), row(2), row(3)]])
    assert abs(f["example/padded"] - (1 - 17 / 26)) < 1e-12
    assert abs(f["example/bins"] - (1 - 17 / 20)) < 1e-12
    assert f["example/one"] == 0.0 and f["kl/padded"] == 0.0 and f["kl/one"] == 0.0  # KL pairs all 2 long
    assert abs(pad_fractions([[row(4), row(2)]], 8)["example/padded"] - (1 - 6 / 16)) < 1e-12  # to a multiple


@settings(max_examples=60, deadline=None)
@given(micro_batches())
def test_kl_continuation_holds_the_kl_pair_after_its_shared_prompt(rows: list[dict]) -> None:
    """The collator plans the KL pairs as a continuation of the examples' forward exactly when every row shares
    its prompt: row b is [x_b's last token, y_j] at positions |x_b| - 1 .., scores y_j and nothing else, and its
    mask over (the examples' cached columns, its own) shows each KL token the keys a separate pass over
    [x_b, y_j] shows it: the prompt and the KL tokens before it."""
    from coati_kto.models.continuation import continuation_mask

    batch = KTOCollator(0)(rows)
    shares = all(
        r["kl_input_ids"][: r["kl_completion_start"]] == r["input_ids"][: r["completion_start"]] for r in rows
    )
    assert (batch.kl_continuation is not None) == shares
    if not shares:
        return
    cont, cached = batch.kl_continuation, batch.example.input_ids.shape[1]
    allowed = continuation_mask(cont, cached, torch.float32)[:, 0] == 0
    for b, r in enumerate(rows):
        start, kl_ids = r["kl_completion_start"], r["kl_input_ids"]
        n = len(kl_ids) - start + 1
        assert cont.view.input_ids[b, :n].tolist() == kl_ids[start - 1 :]
        assert cont.view.attention_mask[b].tolist() == [1] * n + [0] * (cont.view.input_ids.shape[1] - n)
        assert cont.position_ids[b, :n].tolist() == list(range(start - 1, len(kl_ids)))
        assert int(cont.visible[b]) == start - 1
        scored = cont.view.input_ids[b][cont.view.loss_mask[b]].tolist()
        assert scored == kl_ids[start:]
        for t in range(n):
            cached_keys = allowed[b, t, :cached].nonzero().flatten().tolist()
            own_keys = allowed[b, t, cached:].nonzero().flatten().tolist()
            assert cached_keys == list(range(start - 1)) and own_keys == list(range(t + 1))
    # the continuation keeps only the cached columns some row sees (the longest prompt but its last token): the
    # mask over them is the full mask without the columns no row sees
    assert cont.visible_width == max(1, max(r["kl_completion_start"] - 1 for r in rows))
    kept = cont.visible_width
    assert not allowed[:, :, kept:cached].any()
    narrow = continuation_mask(cont, kept, torch.float32)[:, 0] == 0
    assert torch.equal(narrow, torch.cat([allowed[:, :, :kept], allowed[:, :, cached:]], dim=2))
    # the planned completion positions are those of the loss mask (the view's host plan)
    rows_t, cols_t = cont.view.targets()
    keep = cont.view.keep
    width = cont.view.input_ids.shape[1]
    assert sorted(zip(rows_t.tolist(), (cols_t + width - keep).tolist(), strict=True)) == sorted(
        (b, c - 1) for b, c in cont.view.loss_mask.nonzero().tolist()
    )
