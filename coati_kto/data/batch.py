"""The batch contract between :class:`~coati_kto.data.collator.KTOCollator` and the trainer.

A KTO micro-batch holds two views of B rows: the examples (x_i, y_i) and their KL pairs (x_i, y_j), each a
:class:`TokenView` padded to its own longest row. Everything that reads token tensors reads ``batch.example``
or ``batch.kl``; grep ``.kl.`` to find every consumer of the KL pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class TokenView:
    """Right-padded sequences of one view.

    input_ids [B, S] long; attention_mask [B, S] long, 1 on the row's tokens; loss_mask [B, S] bool, True
    exactly on completion tokens (the prompt and padding are False).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    # The host-side plan of the completion positions (``planned``), so that scoring reads no value back from
    # the GPU: logits_to_keep K, and the (row, column) of every completion token among the last K positions.
    keep: int | None = None
    rows: torch.Tensor | None = None  # [T] long
    cols: torch.Tensor | None = None  # [T] long
    # Whether any row is shorter than the view (planned on the host): the padded passes build their sdpa mask
    # from it without reading the mask back (coati_kto.models.packing.padded_attention).
    padded: bool | None = None

    def lengths(self) -> torch.Tensor:
        """[B] long: tokens per row (padding excluded)."""
        return self.attention_mask.sum(1)

    def completion_starts(self) -> torch.Tensor:
        """[B] long: the first completion column of each row (its prompt length)."""
        return self.loss_mask.int().argmax(dim=1)

    def planned(self) -> TokenView:
        """This view with its completion positions planned; called on the host (the collator), where reading
        the mask costs no device sync. Same K and (row, column) order as the device path computes."""
        seq = self.loss_mask.shape[1]
        predicted = self.loss_mask[:, 1:].bool().any(dim=0)
        keep = seq - int(predicted.int().argmax()) if seq >= 2 and bool(predicted.any()) else 1
        rows, cols = self.loss_mask[:, seq - keep + 1 :].bool().nonzero(as_tuple=True)
        padded = not bool(self.attention_mask.bool().all())
        return replace(self, keep=keep, rows=rows, cols=cols, padded=padded)

    def targets(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) of the planned completion positions, or None when not planned."""
        return None if self.rows is None else (self.rows, self.cols)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenView:
        rows = None if self.rows is None else fn(self.rows)
        cols = None if self.cols is None else fn(self.cols)
        return TokenView(
            fn(self.input_ids),
            fn(self.attention_mask),
            fn(self.loss_mask),
            self.keep,
            rows,
            cols,
            self.padded,
        )


@dataclass(frozen=True)
class Targets:
    """The tokens a layout scores: example ``owner`` (0..B-1), the (row, column) whose hidden state predicts
    the token, and the token id; [T] long each, ordered by owner then column."""

    owner: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    ids: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Targets:
        return Targets(*(fn(getattr(self, f.name)) for f in fields(self)))


@dataclass(frozen=True)
class PackedRows:
    """One layout of a micro-batch, planned by coati_kto.data.packed (its docstring: the attention rule);
    tensors [R, L] long unless noted."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor  # each document's own positions (a KL completion continues its prompt's)
    document: torch.Tensor  # the example b a token belongs to; padding -1 - column
    segment: torch.Tensor  # 0 example tokens, 1 the KL pair's own
    prompt_seen: torch.Tensor  # on a KL token: it sees the example's positions below this; 0 elsewhere
    example: Targets | None  # None in the kl layout
    kl: Targets | None  # None in the example layout
    shared: torch.Tensor  # [B] long: prompt tokens processed once instead of twice (pairs layout)
    # Host fact: every row is one document from column 0 (the rest padding) that attends causally, so a kernel's
    # own causal attention computes the rows without a mask (the example and kl layouts, bins of one document).
    causal_rows: bool = False

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedRows:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Targets):
                value = value.map(fn)
            elif isinstance(value, torch.Tensor):
                value = fn(value)
            out[f.name] = value
        return PackedRows(**out)

    def tokens(self) -> int:
        """Tokens processed per forward: R x L (padding included)."""
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class RowSlice:
    """One sequence-parallel rank's share of packed rows (:func:`coati_kto.data.packed.slice_rows`): ``rows``
    whole (widened to a multiple of sp with padding columns, each its own document and never a target: the
    attention mask is built over the whole rows), the rank's columns [``start``, ``stop``), and the targets whose
    column lies there (``example``, ``kl``: columns relative to ``start``, the order of ``rows``' targets kept)."""

    rows: PackedRows
    start: int
    stop: int
    example: Targets | None
    kl: Targets | None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RowSlice:
        local = [None if t is None else t.map(fn) for t in (self.example, self.kl)]
        return RowSlice(self.rows.map(fn), self.start, self.stop, *local)

    def tokens(self) -> int:
        """Tokens this rank's forward processes: R x (stop - start)."""
        return int(self.rows.input_ids.shape[0] * (self.stop - self.start))


@dataclass(frozen=True)
class KLContinuation:
    """The KL pairs as a continuation of the examples' forward (coati_kto.models.continuation), planned on the
    host by :func:`coati_kto.data.packed.plan_continuation` where every row's KL pair shares its example's prompt.

    ``view``: [B, W] right-padded rows [x_i's last token, y_j], its loss mask on y_j, completion positions
    planned; ``position_ids`` [B, W] long: the positions continuing the prompt (|x_i| - 1 ..); ``visible`` [B]
    long: the examples' cached columns each row attends to (its prompt but the last token, which ``view``
    recomputes; every column past them holds the example's completion or padding); ``visible_width`` (a host
    int, at least 1): the largest of them, so the continuation attends to no cached column past it.
    """

    view: TokenView
    position_ids: torch.Tensor
    visible: torch.Tensor
    visible_width: int = 1

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KLContinuation:
        return KLContinuation(self.view.map(fn), fn(self.position_ids), fn(self.visible), self.visible_width)


@dataclass(frozen=True)
class TokenCounts:
    """Non-padding tokens of a micro-batch's valid rows, as host ints: the examples, the KL pairs, the prompt
    tokens the shared-prompt layout processes once, and the KL continuation's cached columns and its own rows
    (0 without one). Counted by the collator (coati_kto.data.packed.count_tokens), so the step's token and
    FLOP figures read nothing back from the device."""

    example: int
    kl: int
    pairs_shared: int = 0
    continuation_visible: int = 0
    continuation: int = 0


@dataclass(frozen=True)
class ImageBatch:
    """A micro-batch's images (issue 49), built by the collator from its rows' image bytes.

    ``pixel_values``: every row's images in row order, as the model's image processor gives them (Gemma 3
    [N, 3, H, W]); ``image_rows`` [N] long: the row each image belongs to. ``example_token_types`` /
    ``kl_token_types`` [B, S] long per view: 1 on the image (soft) tokens, 0 elsewhere and on padding. Both
    views of row i hold prompt i, so they share its images. ``image_position_ids`` (Gemma 4) and
    ``image_grid_thw`` (Qwen 3.5): the family's extras, None for Gemma 3.
    """

    pixel_values: torch.Tensor
    image_rows: torch.Tensor
    example_token_types: torch.Tensor
    kl_token_types: torch.Tensor
    image_position_ids: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ImageBatch:
        return ImageBatch(**{f.name: _apply(fn, getattr(self, f.name)) for f in fields(self)})


def _apply(fn: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else fn(value)


@dataclass(frozen=True)
class KTOBatch:
    """One micro-batch: examples, their KL pairs, labels and optional per-row extras ([B] each).

    ``reference_logps`` / ``reference_kl_logps`` (fp32) are present when the reference cache supplies them,
    so no reference model runs. ``valid`` is False on evaluation padding rows, which count nowhere; None means
    every row is real. ``pairs`` / ``example_rows`` / ``kl_rows``: the packed layouts the collator planned on
    the host (coati_kto.data.packed; the last two with ``padding_free`` only), ``fold_pays`` whether the
    policy's folded pass processes fewer tokens than its two, and ``kl_continuation`` the KL pairs planned as
    a continuation of the examples' padded forward (None where a row's prompts differ), ``counts`` its valid
    rows' tokens, counted on the host. ``images``: the rows' images (:class:`ImageBatch`), None when no row
    has one.
    """

    example: TokenView
    kl: TokenView
    label: torch.Tensor  # [B] bool: desirable
    index: torch.Tensor | None = None  # [B] long: row in the prepared split
    reference_logps: torch.Tensor | None = None  # [B] fp32
    reference_kl_logps: torch.Tensor | None = None  # [B] fp32
    valid: torch.Tensor | None = None  # [B] bool
    pairs: PackedRows | None = None
    # Under sequence parallelism each rank's RowSlice of the padding-free rows (the collator's ``sequence``).
    example_rows: PackedRows | RowSlice | None = None
    kl_rows: PackedRows | RowSlice | None = None
    fold_pays: bool = False
    kl_continuation: KLContinuation | None = None
    counts: TokenCounts | None = None  # host ints: not moved with the tensors
    images: ImageBatch | None = None

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def valid_rows(self) -> torch.Tensor:
        """[B] bool: ``valid``, or all True."""
        return self.valid.bool() if self.valid is not None else torch.ones_like(self.label, dtype=torch.bool)

    def with_valid(self, valid: torch.Tensor) -> KTOBatch:
        """The batch with ``valid`` rows (its counts dropped: they count valid rows)."""
        return replace(self, valid=valid, counts=None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KTOBatch:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KTOBatch:
        """Called by DataLoader(pin_memory=True)."""
        return self.map(lambda t: t.pin_memory())

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KTOBatch:
        """The batch with ``fn`` applied to every tensor of both views and every present extra."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = fn(value)
            elif hasattr(value, "map"):  # TokenView, PackedRows, KLContinuation, ImageBatch
                value = value.map(fn)
            out[f.name] = value
        return KTOBatch(**out)
