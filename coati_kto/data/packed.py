"""Packed rows: a micro-batch's sequences laid out for one forward, planned on the host by the collator.

A *document* is what one separate forward pass would see. Three layouts serve the passes of a KTO step:

    pairs    document b = [x_i, y_i] then [y_j]: the example, then its KL pair's completion, which sees the
             shared prompt x_i (positions continue from |x_i|) and itself, never y_i (coati_kto.models.packing)
    example  document b = [x_i, y_i]
    kl       document b = [x_j', y_j] (the KL pair alone)

Each layout holds one document per row, right-padded to the longest (``rows="padded"``), every document of the
micro-batch in one row (``"one"``: the model processes exactly the data's tokens), or the documents in bins as
long as the longest (``"bins"``: for dense masks, whose cost grows with the square of a row's length).
Attention is described per token, so that the device builds the mask with broadcasts alone, reading nothing
back: query q may attend key k in the same row iff

    document[q] == document[k]  and  k <= q  and  (segment[q] == segment[k]  or  position[k] < prompt_seen[q])

(segment 0: the example's tokens, 1: the KL pair's own; ``prompt_seen`` is the shared prompt length on a KL
token, 0 elsewhere). A padding token is a document of its own (``-1 - column``): it sees itself only.
Everything here runs on CPU tensors; the batch then moves to the device whole (``KTOBatch.to``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from coati_kto.data.batch import (
    KLContinuation,
    KTOBatch,
    PackedRows,
    RowSlice,
    Targets,
    TokenCounts,
    TokenView,
)


def shared_prompt_lengths(example: TokenView, kl: TokenView) -> torch.Tensor:
    """[B] long: tokens the KL pair shares with the example (its prompt), 0 where the prompts differ.

    Both loss masks start at the completion; the shared prompt is everything before, when equal token for token.
    """
    ids, kl_ids = example.input_ids, kl.input_ids
    start, kl_start = example.completion_starts(), kl.completion_starts()
    width = min(ids.shape[1], kl_ids.shape[1])
    cols = torch.arange(width, device=ids.device)
    before = cols[None, :] < start[:, None]
    same = ((ids[:, :width] == kl_ids[:, :width]) | ~before).all(dim=1)
    ok = (start == kl_start) & same & example.loss_mask.any(dim=1) & kl.loss_mask.any(dim=1) & (start > 0)
    return torch.where(ok, start, 0)


ROW_LAYOUTS = ("padded", "bins", "one")


def plan_rows(example: TokenView | None, kl: TokenView | None, rows: str = "padded") -> PackedRows:
    """The pairs layout (both views), the example layout (``kl`` None) or the kl layout (``example`` None),
    from host tensors. Scored tokens are the loss masks' (token 0 of a document is never predicted).

    ``rows``: ``padded``, a document per row; ``one``, every document in one row (no padding: for kernels that
    skip what no document reaches, flex attention); ``bins``, documents first-fit (longest first) into rows as
    long as the longest document (padding only where no document fits; a dense 4D mask then costs no more than
    the padded rows' attention, as no row is longer than theirs).
    """
    if rows not in ROW_LAYOUTS:
        raise ValueError(f"rows must be one of {ROW_LAYOUTS}, got {rows!r}")
    view = example if example is not None else kl
    n = view.input_ids.shape[0]
    shared = (
        shared_prompt_lengths(example, kl)
        if example is not None and kl is not None
        else torch.zeros(n, dtype=torch.long)
    )
    a_len = example.lengths().tolist() if example is not None else [0] * n
    k_len = kl.lengths().tolist() if kl is not None else [0] * n
    docs = [_document(example, kl, b, a_len[b], k_len[b], int(shared[b])) for b in range(n)]
    place, width = _placement([len(d[0]) for d in docs], rows)
    count = max(r for r, _ in place) + 1
    ids, positions, segment, seen = (torch.zeros(count, width, dtype=torch.long) for _ in range(4))
    document = -1 - torch.arange(width).expand(count, width).clone()
    targets: dict[str, list[torch.Tensor]] = {"example": [], "kl": []}
    for b, ((doc_ids, doc_pos, doc_seg, doc_seen, doc_targets), (r, offset)) in enumerate(
        zip(docs, place, strict=True)
    ):
        span = slice(offset, offset + len(doc_ids))
        ids[r, span], positions[r, span], segment[r, span], seen[r, span] = (
            doc_ids,
            doc_pos,
            doc_seg,
            doc_seen,
        )
        document[r, span] = b
        for name, (cols, tgt) in doc_targets.items():
            owner, row = torch.full_like(cols, b), torch.full_like(cols, r)
            targets[name].append(torch.stack([owner, row, cols + offset, tgt]))

    def gather(name: str, present: bool) -> Targets | None:
        parts = targets[name]
        return Targets(*torch.cat(parts, dim=1)) if present and parts else None

    example_targets, kl_targets = gather("example", example is not None), gather("kl", kl is not None)
    # One view (no pairs rule) and one document a row, at column 0: plain causal rows.
    causal = (example is None or kl is None) and len(place) == count and all(o == 0 for _, o in place)
    return PackedRows(ids, positions, document, segment, seen, example_targets, kl_targets, shared, causal)


def _placement(lengths: list[int], rows: str) -> tuple[list[tuple[int, int]], int]:
    """(row, first column) of each document, and the rows' width, for ``rows`` (:func:`plan_rows`)."""
    if rows == "padded":
        return [(b, 0) for b in range(len(lengths))], max(lengths)
    if rows == "one":
        starts = itertools.accumulate(lengths[:-1], initial=0)
        return [(0, start) for start in starts], sum(lengths)
    capacity, fill = max(lengths), []
    place = [(0, 0)] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):  # stable: ties keep batch order
        r = next((r for r, used in enumerate(fill) if used + lengths[b] <= capacity), len(fill))
        if r == len(fill):
            fill.append(0)
        place[b] = (r, fill[r])
        fill[r] += lengths[b]
    return place, capacity


def _document(example: TokenView | None, kl: TokenView | None, b: int, a: int, k: int, s: int):
    """Row b's document: ids, positions, segments, prompt_seen [len] and {view: (predictor columns, targets)}.

    The example [x_i, y_i] takes columns 0..a-1; the KL pair's tokens from ``s`` on follow at a.. (positions
    s..k-1): a KL token u is predicted at column u - 1 inside the shared prompt, else at a + u - 1 - s.
    """
    pieces, targets = [], {}
    if example is not None:
        ids = example.input_ids[b, :a]
        pieces.append(
            (ids, torch.arange(a), torch.zeros(a, dtype=torch.long), torch.zeros(a, dtype=torch.long))
        )
        t = example.loss_mask[b, 1:a].nonzero().squeeze(1) + 1
        targets["example"] = (t - 1, ids[t])
    if kl is not None:
        ids = kl.input_ids[b, :k]
        n = k - s
        pieces.append((ids[s:], torch.arange(s, k), torch.ones(n, dtype=torch.long), torch.full((n,), s)))
        u = kl.loss_mask[b, 1:k].nonzero().squeeze(1) + 1
        pred = u - 1
        targets["kl"] = (torch.where(pred < s, pred, a + pred - s), ids[u])
    return (*(torch.cat(parts) for parts in zip(*pieces, strict=True)), targets)


def pad_columns(rows: PackedRows, multiple: int) -> PackedRows:
    """``rows`` widened to a multiple of ``multiple`` columns of padding (each its own document, never a target):
    flex attention's block, sequence parallelism's sp_size."""
    length = rows.input_ids.shape[1]
    extra = -length % multiple
    if extra == 0:
        return rows
    pad = lambda t: torch.nn.functional.pad(t, (0, extra))  # noqa: E731
    col = torch.arange(length + extra, device=rows.document.device)
    document = torch.where(col < length, pad(rows.document), -1 - col)
    return replace(
        rows,
        input_ids=pad(rows.input_ids),
        position_ids=pad(rows.position_ids),
        document=document,
        segment=pad(rows.segment),
        prompt_seen=pad(rows.prompt_seen),
    )


def _local(targets: Targets | None, start: int, stop: int) -> Targets | None:
    if targets is None:
        return None
    mine = (targets.cols >= start) & (targets.cols < stop)
    return Targets(targets.owner[mine], targets.rows[mine], targets.cols[mine] - start, targets.ids[mine])


def slice_rows(rows: PackedRows, sp: int, rank: int) -> RowSlice:
    """Rank ``rank``'s share of ``rows`` among ``sp`` sequence-parallel ranks (contiguous equal column slices).
    Called on the host by the collator (CPU tensors): the targets' split is a boolean select, which on an
    accelerator would read back its count."""
    if not 0 <= rank < sp:
        raise ValueError(f"slice_rows: rank {rank} is not one of sp_size={sp} ranks")
    rows = pad_columns(rows, sp)
    width = rows.input_ids.shape[1] // sp
    start, stop = rank * width, (rank + 1) * width
    return RowSlice(rows, start, stop, _local(rows.example, start, stop), _local(rows.kl, start, stop))


def fold_pays(pairs: PackedRows, example_tokens: int, kl_tokens: int) -> bool:
    """Whether one packed pass with gradient over [x_i, y_i, y_j] costs less than the policy's two passes (the
    KL pair without gradient, the example with), in tokens processed, padding included (a forward plus a
    backward of ~2 forwards; the packed KL tokens ride through the backward with zero gradient): every row
    shares its prompt and 3 x packed <= kl + 3 x example. True for long prompts and short completions
    (P > 2C), false for P ~ C. Host tensors."""
    if not bool((pairs.shared > 0).all()):
        return False
    return 3 * pairs.tokens() <= kl_tokens + 3 * example_tokens


def plan_continuation(example: TokenView, kl: TokenView) -> KLContinuation | None:
    """The KL pairs as a continuation of the examples' padded forward (:class:`KLContinuation`), or None unless
    every row's KL pair shares its example's prompt (:func:`shared_prompt_lengths`). Host tensors.

    Row b is [x_b's last token, y_j] at positions |x_b| - 1 .., seeing the example's cached columns below
    |x_b| - 1 and itself causally; the prompt's last token is recomputed as the first query so that its hidden
    state predicts y_j's first token. Padding columns repeat the row's last token (never scored nor seen by a
    real token).
    """
    shared = shared_prompt_lengths(example, kl)
    if not bool((shared > 0).all()):
        return None
    start, lengths = shared - 1, kl.lengths()
    width = int((lengths - start).max())
    position_ids = start[:, None] + torch.arange(width)[None, :]
    real = position_ids < lengths[:, None]
    cols = torch.minimum(position_ids, lengths[:, None] - 1)
    view = TokenView(
        kl.input_ids.gather(1, cols),
        real.long(),
        kl.loss_mask.gather(1, cols) & real,
    ).planned()
    return KLContinuation(view, position_ids, start, max(1, int(start.max())))


def count_tokens(batch: KTOBatch) -> TokenCounts:
    """The tokens of ``batch``'s valid rows (:class:`~coati_kto.data.batch.TokenCounts`), from host tensors (a
    device batch would be read back)."""
    valid = batch.valid_rows()

    def total(per_row: torch.Tensor) -> int:
        return int(per_row[valid].sum())

    # Without the collator's pairs: what coati_kto.models.packing.pair_logps plans for the batch.
    shared = batch.pairs.shared if batch.pairs is not None else shared_prompt_lengths(batch.example, batch.kl)
    continuation = batch.kl_continuation
    return TokenCounts(
        example=total(batch.example.lengths()),
        kl=total(batch.kl.lengths()),
        pairs_shared=total(shared),
        continuation_visible=0 if continuation is None else total(continuation.visible),
        continuation=0 if continuation is None else total(continuation.view.lengths()),
    )


def counted(batch: KTOBatch) -> KTOBatch:
    """``batch`` with its :func:`count_tokens` (the collator's, and the evaluation sampler's once it marks
    padding rows)."""
    return replace(batch, counts=count_tokens(batch))
