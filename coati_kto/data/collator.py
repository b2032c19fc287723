"""KTOCollator: prepared rows -> the batch contract, right-padded to the longest sequence in the batch.

Masks are built from each row's length and ``completion_start``, never from ``input_ids != pad_token_id``:
pad is often EOS, and a real EOS (the end of every completion) must stay attended and in the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _pad(
    rows: Sequence[Any], starts: Sequence[int], pad_id: int, multiple: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, S] long, attention_mask [B, S] long, loss_mask [B, S] bool); loss on [start, length)."""
    seqs = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    width = max(len(s) for s in seqs)
    if multiple:
        width = -(-width // multiple) * multiple
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    loss = torch.zeros((len(seqs), width), dtype=torch.bool)
    for b, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        n = len(seq)
        if not 0 <= start < n:
            raise ValueError(f"row {b}: completion_start {start} outside its {n} tokens (no completion)")
        ids[b, :n] = seq
        attention[b, :n] = 1
        loss[b, start:n] = True
    return ids, attention, loss


class KTOCollator:
    """``features`` (rows with input_ids, completion_start, label, kl_input_ids, kl_completion_start and
    optionally index, reference_logps, reference_kl_logps) -> dict of tensors:

    input_ids / attention_mask [B, S] long, loss_mask [B, S] bool (True exactly on completion tokens),
    label [B] bool, kl_input_ids / kl_attention_mask / kl_loss_mask [B, S_kl] (padded to their own longest),
    index [B] long, reference_logps / reference_kl_logps [B] float32 when present.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (EOS is fine, masks use lengths)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("empty batch")
        batch: dict[str, torch.Tensor] = {}
        for prefix in ("", "kl_"):
            ids, attention, loss = _pad(
                [f[f"{prefix}input_ids"] for f in features],
                [int(f[f"{prefix}completion_start"]) for f in features],
                self.pad_token_id,
                self.pad_to_multiple_of,
            )
            batch[f"{prefix}input_ids"] = ids
            batch[f"{prefix}attention_mask"] = attention
            batch[f"{prefix}loss_mask"] = loss
        batch["label"] = torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool)
        if "index" in features[0]:
            batch["index"] = torch.tensor([int(f["index"]) for f in features], dtype=torch.long)
        for key in ("reference_logps", "reference_kl_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([float(f[key]) for f in features], dtype=torch.float32)
        return batch
