"""KTOCollator: prepared rows -> the batch contract, right-padded to the longest sequence in the batch.

Masks are built from each row's length and ``completion_start``, never from ``input_ids != pad_token_id``:
pad is often EOS, and a real EOS (the end of every completion) must stay attended and in the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from coati_kto.data.batch import ImageBatch, KTOBatch, TokenView
from coati_kto.data.images import open_image
from coati_kto.data.packed import counted, fold_pays, plan_continuation, plan_rows, slice_rows
from coati_kto.data.processors import image_token_counts


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
        if not 1 <= start < n:  # token 0 has no predictor: a completion must follow at least one prompt token
            raise ValueError(
                f"row {b}: completion_start {start} outside [1, {n}) of its {n} tokens (no prompt token, or no "
                "completion)"
            )
        ids[b, :n] = seq
        attention[b, :n] = 1
        loss[b, start:n] = True
    return ids, attention, loss


def padded_view(
    rows: Sequence[Any], starts: Sequence[int], pad_id: int, multiple: int | None = None
) -> TokenView:
    """Rows of token ids right-padded into a :class:`TokenView` whose loss mask covers ``[start, length)`` of
    each row, its completion positions planned (on the host)."""
    return TokenView(*_pad(rows, starts, pad_id, multiple)).planned()


class KTOCollator:
    """``features`` (rows with input_ids, completion_start, label, kl_input_ids, kl_completion_start and
    optionally index, reference_logps, reference_kl_logps) -> :class:`~coati_kto.data.batch.KTOBatch`: the
    examples and the KL pairs each padded to their own longest row, label [B] bool, the extras [B] when present,
    and the packed layouts (coati_kto.data.packed): the shared-prompt pairs always, one row per example; with
    ``padding_free`` the pairs, the examples and the KL pairs each laid out by ``plan_rows``'s ``rows`` mode:
    ``"one"`` (one row of exactly the data's tokens) or ``"bins"`` (rows as long as the longest document).
    ``sequence`` (sp_size, sp_rank): under sequence parallelism the examples' and KL pairs' rows become this
    rank's :class:`~coati_kto.data.batch.RowSlice` (``padding_free`` required).

    Image rows (an ``images`` list of references, resolved to their bytes through ``image_table``, the build's
    :class:`~coati_kto.data.image_table.PreparedImages`): ``image_processor`` (the processor's) runs once over
    the micro-batch's images, into :class:`~coati_kto.data.batch.ImageBatch` (with
    Gemma 4's ``image_position_ids`` and Qwen's ``image_grid_thw`` where it returns them), and every row's
    ``image_token_id`` count in each view must equal its images' tokens: ``image_seq_length`` each (Gemma 3), or
    with None what the image processor gives per image (Gemma 4's soft tokens, Qwen's grid:
    :func:`coati_kto.data.processors.image_token_counts`). A processor changed since prepare is one ValueError
    naming the row. Padded rows only: the packed layouts and sequence parallelism do not take images.
    """

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        padding_free: str | None = None,
        sequence: tuple[int, int] | None = None,
        image_processor: Any = None,
        image_token_id: int | None = None,
        image_seq_length: int | None = None,
        image_table: Any = None,
    ) -> None:
        if padding_free not in (None, "one", "bins"):
            raise ValueError(f"padding_free must be None, 'one' or 'bins', got {padding_free!r}")
        if sequence is not None and padding_free is None:
            raise ValueError("sequence parallelism slices the padding-free rows: padding_free must be set")
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (EOS is fine, masks use lengths)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_free = padding_free
        self.sequence = sequence if sequence is not None and sequence[0] > 1 else None
        if image_processor is not None:
            if padding_free is not None or self.sequence is not None:
                raise ValueError(
                    "images need padded rows: padding_free and sequence parallelism do not take them"
                )
            if image_token_id is None:
                raise ValueError("an image_processor needs its image_token_id")
        self.image_processor = image_processor
        self.image_table = image_table
        self.image_token_id = image_token_id
        self.image_seq_length = image_seq_length

    def _view(self, rows: list[Any], starts: list[int]) -> TokenView:
        return padded_view(rows, starts, self.pad_token_id, self.pad_to_multiple_of)

    def __call__(self, features: list[dict]) -> KTOBatch:
        if not features:
            raise ValueError("empty batch")
        first = features[0]

        def floats(key: str) -> torch.Tensor | None:
            return (
                torch.tensor([float(f[key]) for f in features], dtype=torch.float32) if key in first else None
            )

        example = self._view(
            [f["input_ids"] for f in features], [int(f["completion_start"]) for f in features]
        )
        kl = self._view(
            [f["kl_input_ids"] for f in features], [int(f["kl_completion_start"]) for f in features]
        )
        free = self.padding_free
        pairs = plan_rows(example, kl, free or "padded")
        example_rows = plan_rows(example, None, free) if free else None
        kl_rows = plan_rows(None, kl, free) if free else None
        if self.padding_free:
            fold = fold_pays(pairs, example_rows.tokens(), kl_rows.tokens())
        else:
            fold = fold_pays(pairs, example.input_ids.numel(), kl.input_ids.numel())
        if self.sequence is not None:
            example_rows, kl_rows = (slice_rows(r, *self.sequence) for r in (example_rows, kl_rows))
        batch = KTOBatch(
            example=example,
            kl=kl,
            label=torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool),
            index=torch.tensor([int(f["index"]) for f in features], dtype=torch.long)
            if "index" in first
            else None,
            reference_logps=floats("reference_logps"),
            reference_kl_logps=floats("reference_kl_logps"),
            pairs=pairs,
            example_rows=example_rows,
            kl_rows=kl_rows,
            fold_pays=fold,
            # Padded rows only: the continuation extends the examples' padded forward.
            kl_continuation=None if free else plan_continuation(example, kl),
            images=self._images(features, example, kl) if "images" in first else None,
        )
        return counted(batch)

    def _images(self, features: list[dict], example: TokenView, kl: TokenView) -> ImageBatch | None:
        """The rows' images through the image processor (None when no row has one), their token types per view,
        and the count check (see the class docstring)."""
        if self.image_processor is None or self.image_table is None:
            raise ValueError("the rows hold images but the collator has no image_processor or image_table")
        per_row = [self.image_table.row_images(f) for f in features]
        outputs = None
        counts = [[] for _ in per_row]
        if any(per_row):
            images = [open_image(image) for row in per_row for image in row]
            outputs = self.image_processor(images=images, return_tensors="pt")
            found = image_token_counts(outputs, self.image_processor, self.image_seq_length)
            if len(found) != len(images):  # Gemma 3's pan-and-scan crops: the ids hold one run per image
                raise ValueError(
                    f"the image processor gave {len(found)} images for the batch's {len(images)}: image records "
                    "take one per image (set do_pan_and_scan to false in the image processor's config)"
                )
            each = iter(found)
            counts = [[next(each) for _ in row] for row in per_row]
        views = {}
        for name, view in (("example", example), ("kl", kl)):
            types = ((view.input_ids == self.image_token_id) & view.attention_mask.bool()).long()
            for b, n in enumerate(types.sum(1).tolist()):
                if n != sum(counts[b]):
                    each = ", ".join(map(str, counts[b]))
                    raise ValueError(
                        f"row {b} ({name} view): {n} image tokens in its ids, but its {len(per_row[b])} image(s) "
                        f"give {sum(counts[b])} ({each or 'none'}): the processor changed since the data was "
                        "prepared; prepare it again"
                    )
            views[name] = types
        if outputs is None:
            return None
        rows = torch.tensor([b for b, row in enumerate(per_row) for _ in row], dtype=torch.long)
        return ImageBatch(
            outputs["pixel_values"],
            rows,
            views["example"],
            views["kl"],
            image_position_ids=outputs.get("image_position_ids"),
            image_grid_thw=outputs.get("image_grid_thw"),
        )
