"""Packed rows under all_to_all sequence parallelism (issue 47, docs/sequence_parallelism_plan.md §2c): each rank
of the sp group runs the model on its slice of the columns, scores the targets its slice predicts through the
local LM head, and one all-reduce per pass sums the per-row log-probs over the group. The trainer's passes call it
for a batch whose rows the collator sliced (``KTOCollator(sequence=...)``).

Nothing here reads a value back from the device: :func:`~coati_kto.data.packed.slice_rows` splits the targets on
the host (the collator's side), and :func:`sp_packed_logps` only indexes, projects and reduces. The attention needs the whole
row, which the ``coati_sp|<inner>`` wrapper (``coati_kto.parallel.sequence``) provides: the mask is built over the
whole (padded) row as :func:`~coati_kto.models.packing.packed_logps` builds it, and the layers see only their
slice's tokens and positions.
"""

from __future__ import annotations

from typing import Any

import torch

from coati_kto.data.batch import RowSlice
from coati_kto.models.lm_head import LMHead
from coati_kto.models.logit_means import LogitMeans, active_recorder, recording
from coati_kto.models.packing import _config, packed_states, score_targets
from coati_kto.parallel.sequence import SEQUENCE_GROUP, SP_ATTENTION_PREFIX, sp_sum


def _check_attention(model: Any) -> None:
    """ValueError, on every rank alike, when the model's attention is not the ``coati_sp|`` wrapper."""
    attention = getattr(_config(model), "_attn_implementation", None)
    if not (attention or "").startswith(SP_ATTENTION_PREFIX):
        raise ValueError(
            f"sp_packed_logps needs the sequence-parallel attention installed (config._attn_implementation "
            f"'{SP_ATTENTION_PREFIX}<kernel>', coati_kto.parallel.sequence.sp_attention_name), got {attention!r}"
        )


def sp_packed_logps(
    model: Any, head: LMHead | None, piece: RowSlice, batch_size: int, grad_scale: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`~coati_kto.models.packing.packed_logps` on this rank's ``piece``
    (:func:`~coati_kto.data.packed.slice_rows`) of the rows,
    over the sp group in ``SEQUENCE_GROUP``: (example, KL) log-probs [B] fp32, the same on every rank of the
    group, equal to one process's on the whole rows up to summation order.

    The model (its ``config._attn_implementation`` the ``coati_sp|`` wrapper, installed by the caller so that
    activation-checkpoint recompute runs it too) sees the slice's columns; the head projects only the slice's
    targets (never a whole row's logits). The per-row partial sums, and the logit means when a recorder is
    active, go through one :func:`~coati_kto.parallel.sequence.sp_sum` per pass, whose backward multiplies the
    example's gradient by ``grad_scale`` (sp where gradients are averaged over dp x sp, as under all_to_all: the
    plan's §2c). Every rank of the group calls it, with slices of the same rows.
    """
    _check_attention(model)
    states = packed_states(model, head, piece.rows, slice(piece.start, piece.stop))
    grid = (batch_size, piece.stop - piece.start)
    outer = active_recorder()
    local = LogitMeans() if outer is not None else None
    with recording(local):
        example = score_targets(head, states, piece.example, grid, detach=False)
    with torch.no_grad(), recording(None):
        kl = score_targets(head, states, piece.kl, grid, detach=True)
    partial = [example, kl] + (
        [local.sums, local.tokens] if local is not None and local.sums is not None else []
    )
    present = [p for p in partial if p is not None]
    totals = iter(sp_sum(torch.stack(present), SEQUENCE_GROUP.get(), grad_scale).unbind(0))
    example, kl, *means = [None if p is None else next(totals) for p in partial]
    if means:
        outer.add(means[0].detach(), means[1].detach())
    return example, kl
