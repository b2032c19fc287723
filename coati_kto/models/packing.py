"""Log-probs from packed rows (coati_kto.data.packed): several documents in one forward, each seeing only
what its own forward pass would see.

The pairs layout puts an example (x_i, y_i) and its KL pair (x_i, y_j) in one document,

    A = [x_i, y_i]  positions 0 .. |A|-1, causal                                     (the example)
    B = [y_j]       positions |x_i| .. , each token sees x_i (in A) and B causally, never y_i

so a model processes P + C_i + C_j tokens instead of 2P + C_i + C_j, and the log-probs are those of two
separate passes (same positions, same visible tokens; fp32 differences are summation-order only). The
reference (online and precomputed) uses it without gradient; the policy's gradient pass uses it where the
collator found that folding pays (long prompts, short completions), its KL-pair pass then folded into the
gradient pass. A row whose KL prompt is not the example's prompt (truncation cut them differently) packs as two
independent documents (B = the whole KL sequence, positions from 0, seeing only itself). With ``padding_free``
the documents of a micro-batch share rows in each of the three layouts: one row (flex attention) or bins as
long as the longest document (dense masks).

The layout is planned on the host; here the device builds the attention mask from per-token vectors with
broadcasts alone (no value read back): a 4D additive mask [R, 1, L, L] of the model dtype for ``eager`` and
``sdpa`` (transformers applies a 4D mask as given, in every layer, and so do the plugins' wrappers: the
project's shardformer policies keep transformers' forwards), a flex-attention BlockMask for ``flex_attention``
(blocks no document reaches are skipped, so one long row costs what its documents cost; built compiled on a GPU,
so no [L, L] mask exists there even for a moment: what ``model.attn_implementation: auto`` runs). Layers that mix
windows (Gemma 3, Qwen2 with max_window_layers) get one mask per layer type, as the mapping transformers 5
takes (``coati_kto.families.packed_masks``). Log-probs come through the chunked LM head, or under tensor
parallelism (each rank holds a vocabulary slice of the head) through the model's logits, gathered whole.
flash_attention_2, and heads neither covers (soft-capped logits), run the padded passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from coati_kto.config.schema import DataSection, ModelSection
from coati_kto.data.batch import KTOBatch, PackedRows, Targets, TokenView
from coati_kto.data.packed import pad_columns, plan_rows
from coati_kto.families import MASK_POSITION_FAMILIES, packed_masks, text_vocab_size
from coati_kto.models.lm_head import LMHead, forward_inputs, model_sequence_logps
from coati_kto.models.logit_means import record_head, record_logits, recording
from coati_kto.models.logprobs import head_token_logps, logits_token_logps, sum_per_row
from coati_kto.models.lora import base_module
from coati_kto.parallel.sequence import inner_attention

PACKABLE_ATTENTION = ("eager", "sdpa", "flex_attention")
FLEX_BLOCK = 128  # flex attention's block: rows are padded to a multiple of it (a partial block misreads)


def allowed_attention(rows: PackedRows, window: int | None = None) -> torch.Tensor:
    """[R, L, L] bool: query t may attend key s (coati_kto.data.packed's rule); ``window``: the model's sliding
    window (:func:`~coati_kto.families.packed_masks`), applied on the documents' positions as a separate pass
    applies it."""
    doc, seg, pos, seen = rows.document, rows.segment, rows.position_ids, rows.prompt_seen
    col = torch.arange(doc.shape[1], device=doc.device)
    ok = (doc[:, :, None] == doc[:, None, :]) & (col[:, None] >= col[None, :])
    ok &= (seg[:, :, None] == seg[:, None, :]) | (pos[:, None, :] < seen[:, :, None])
    if window is not None:
        ok &= (pos[:, :, None] - pos[:, None, :]) < window
    return ok


def _additive_mask(rows: PackedRows, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, L, L] of ``dtype``: 0 where :func:`allowed_attention`, the dtype's minimum elsewhere."""
    allowed = allowed_attention(rows, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _flex_mask(rows: PackedRows, window: int | None) -> Any:
    """The same rule as a flex-attention BlockMask over rows already padded to :data:`FLEX_BLOCK`."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc, seg, pos, seen = rows.document, rows.segment, rows.position_ids, rows.prompt_seen

    def mask_mod(b, h, q, k):
        ok = (doc[b, q] == doc[b, k]) & (q >= k) & ((seg[b, q] == seg[b, k]) | (pos[b, k] < seen[b, q]))
        return ok & (pos[b, q] - pos[b, k] < window) if window is not None else ok

    n, length = doc.shape
    # Eager, create_block_mask evaluates mask_mod over the whole [R, L, L] grid (a dense bool mask, for a moment);
    # compiled, it reduces to blocks without it, as transformers builds its own BlockMasks. On CPU (forward only:
    # no flex backward there) the eager build is kept: inductor's CPU compile of it took 37 s here.
    build = create_block_mask if doc.device.type == "cpu" else _compiled_block_mask()
    return build(mask_mod, n, None, length, length, device=doc.device)


@functools.cache
def _compiled_block_mask() -> Callable[..., Any]:
    """``torch.compile(create_block_mask)``, made once per process (dynamo re-specializes on new row widths,
    then goes dynamic)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def padded_attention(model: Any, view: TokenView) -> Any:
    """The attention mask to give ``model`` for the right-padded ``view``: none where the layers attend causally
    without a window, so sdpa runs its own causal kernel (flash on a GPU) on padded rows too.

    Rows are right-padded: a real token's causal keys are all real, so masking the padding keys changes only the
    padding positions' outputs, which no log-prob, loss or gradient reads (their head positions are dropped, so
    their gradient is 0). transformers would build a dense [B, 1, L, L] mask from the 2D one as soon as one row is
    padded (after asking the device whether it is all ones: a host sync per pass), and sdpa takes its slower
    masked kernel for it. Layers with a sliding window shorter than the row get the window's 4D bool mask, by
    broadcasts. Other kernels, an unplanned view, windows no 4D mask reproduces, or a family that reads its
    positions from the 2D mask (``MASK_POSITION_FAMILIES``) get the 2D mask.
    """
    config = _config(model)
    windows = packed_masks(config)
    sdpa = getattr(config, "_attn_implementation", None) == "sdpa"
    if not sdpa or view.padded is None or windows is None or config.model_type in MASK_POSITION_FAMILIES:
        return view.attention_mask
    rows, seq = view.input_ids.shape
    col = torch.arange(seq, device=view.input_ids.device)

    def build(window: int | None) -> torch.Tensor | None:
        if window is None or seq < window:
            return None  # sdpa's is_causal
        # transformers' sliding window: causal, and key > query - window
        allowed = (col[None, :] <= col[:, None]) & (col[None, :] > col[:, None] - window)
        return allowed[None, None].expand(rows, 1, seq, seq)  # [B, 1, Q, K]

    return _by_layer_type(windows, build)


def padded_logps(
    model: Any, view: TokenView, head: LMHead | None, vision: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Completion log-probs [B] fp32 of ``model`` on the right-padded ``view``: its planned completion positions,
    the mask :func:`padded_attention` gives (graph only under grad); ``vision``: the view's image keywords."""
    return model_sequence_logps(
        model,
        view.input_ids,
        padded_attention(model, view),
        view.loss_mask,
        head,
        view.keep,
        view.targets(),
        vision=vision,
    )


def _by_layer_type(windows: dict[str, int | None], build: Callable[[int | None], Any]) -> Any:
    """``build(window)`` once per distinct window (:func:`~coati_kto.families.packed_masks`), handed out as the
    model takes masks: one, or a mapping per layer type where layers mix windows."""
    built = {window: build(window) for window in set(windows.values())}
    return built[windows[""]] if "" in windows else {kind: built[w] for kind, w in windows.items()}


def _config(model: Any) -> Any:
    """The Hugging Face config under any plugin wrapper or LoRA PeftModel (a LoRA reference included)."""

    return getattr(base_module(model), "config", None)


def can_pack(model: Any) -> bool:
    """eager, sdpa or flex attention, 4D masks that reproduce every layer's window
    (:func:`~coati_kto.families.packed_masks`), and a plain head: covered by the chunked path (a plain model or
    a plugin's wrapper), or sliced over the vocabulary by tensor parallelism (the model's own logits)."""
    config = _config(model)
    attention = getattr(config, "_attn_implementation", None)
    return (
        attention in PACKABLE_ATTENTION
        and packed_masks(config) is not None
        and (LMHead.find(model) is not None or LMHead.vocab_parallel(model))
    )


def example_tokens(model: Any, rows: PackedRows, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[R, L] long over the rows :func:`packed_logps` runs ``model`` on (flex attention's padding columns
    included): 1 on the tokens of the examples' documents ([x_i, y_i]), 0 on padding (a document of its own,
    ``-1 - column``), on a KL pair's own tokens (segment 1) and, with ``valid`` [B] bool, on the documents of
    invalid rows (evaluation padding). The tokens a padded pass over the examples holds, as its 2D attention
    mask marks them: the router loss's weights (``coati_kto.models.router``)."""
    if getattr(_config(model), "_attn_implementation", None) == "flex_attention":
        rows = pad_columns(rows, FLEX_BLOCK)
    tokens = (rows.document >= 0) & (rows.segment == 0)
    if valid is not None:
        tokens = tokens & valid[rows.document.clamp(min=0)]
    return tokens.long()


def packed_logps(
    model: Any, head: LMHead | None, rows: PackedRows, batch_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(example, KL) log-probs [B] fp32 from one forward over ``rows`` (None for a view the layout lacks); the
    example's carry gradient when grad is enabled, the KL pair's never. Reads nothing back from the device.

    Through ``head`` (the chunked head: no logits tensor), or with ``head`` None through the model's logits
    [R, L, V] (a vocabulary-parallel head under tensor parallelism, which returns them whole on every rank).
    """
    if getattr(_config(model), "_attn_implementation", None) == "flex_attention":
        rows = pad_columns(rows, FLEX_BLOCK)
    states = packed_states(model, head, rows)
    grid = (batch_size, rows.input_ids.shape[1])
    example = score_targets(head, states, rows.example, grid, detach=False)
    # KTO's reference point is a constant: the KL pair's log-probs never carry gradient (nor logits/ metrics).
    with torch.no_grad(), recording(None):
        kl = score_targets(head, states, rows.kl, grid, detach=True)
    return example, kl


def packed_states(
    model: Any, head: LMHead | None, rows: PackedRows, columns: slice | None = None
) -> torch.Tensor:
    """One forward over ``rows``' ``columns`` with the masks of the whole rows (flex's BlockMask under
    flex_attention, else the additive 4D masks): the hidden states [R, C, H] ``head`` captures, or with ``head``
    None the logits [R, C, V] of the real vocabulary. ``columns`` (None: all) is set under sequence parallelism
    only, whose attention wrapper sees the whole rows' mask while the layers see the slice's tokens."""
    config = _config(model)
    flex = getattr(config, "_attn_implementation", None) == "flex_attention"
    # The working dtype (a LoRA reference is no module with parameters of its own, hence the head's).
    dtype = head.weight.dtype if head is not None else base_module(model).get_input_embeddings().weight.dtype
    windows = packed_masks(config)
    if columns is not None and _causal_without_mask(config, rows, windows):
        mask = None  # the wrapper's sdpa attends causally over the whole rows: no [R, 1, L, L] tensor
    else:
        mask = _by_layer_type(
            windows, lambda window: _flex_mask(rows, window) if flex else _additive_mask(rows, window, dtype)
        )
    ids, positions = rows.input_ids, rows.position_ids
    # No slicing op without columns: the kernel counts of the unsliced path stay as they were.
    if columns is not None:
        ids, positions = ids[:, columns], positions[:, columns]
    inputs = forward_inputs(config, input_ids=ids, attention_mask=mask, position_ids=positions)
    if head is not None:
        return head.capture(model, **inputs)
    # the real vocabulary only (coati_kto.models.lm_head.model_sequence_logps says why)
    return model(**inputs).logits[..., : text_vocab_size(config)]


def _causal_without_mask(config: Any, rows: PackedRows, windows: dict[str, int | None] | None) -> bool:
    """Whether a sequence-parallel pass over ``rows`` may give no mask: every row one document from column 0 (the
    padding after it is never a target and no real token sees it), no sliding window, and the ``coati_sp|sdpa``
    wrapper, which then runs sdpa's own causal attention on the whole rows (eager would attend to everything)."""
    inner = inner_attention(getattr(config, "_attn_implementation", None))
    return rows.causal_rows and windows == {"": None} and inner == "sdpa"


def score_targets(
    head: LMHead | None, states: torch.Tensor, targets: Targets | None, grid: tuple[int, int], detach: bool
) -> torch.Tensor | None:
    """Per-row log-prob sums [B] fp32 of ``targets`` (None: None) over a [B, L] ``grid``: through ``head`` from
    the hidden states [R, L, H] it captured, or with ``head`` None from the logits [R, L, V]; ``detach``: no
    gradient (the KL pair's). Adds the logit means to the active recorder (``recording``)."""
    if targets is None:
        return None
    if head is None:
        source = states.detach() if detach else states
        token_logps = logits_token_logps(source, targets.rows, targets.cols, targets.ids)
        record_logits(source, (targets.rows, targets.cols), targets.owner, grid)  # if recording
        return sum_per_row(token_logps, targets.owner, targets.cols, grid)
    h, w, b = states[targets.rows, targets.cols], head.weight, head.bias
    if detach:
        h, w, b = h.detach(), w.detach(), None if b is None else b.detach()
    record_head(h, w, b, targets.owner, targets.cols, grid)  # the trainer's logits/ metrics, if recording
    token_logps = head_token_logps(h, w, b, targets.ids, compiled=head.compiled)
    return sum_per_row(token_logps, targets.owner, targets.cols, grid)


def pair_logps(model: Any, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(example log-probs [B], KL-pair log-probs [B]) fp32 of ``model``, and the prompt tokens [B] its one
    packed pass did not process twice (zeros with two passes). Packed when :func:`can_pack`, over the
    collator's ``batch.pairs`` (planned here from a host copy when absent). The reference model's and the
    cache's passes run it under no_grad; the trainer's folded policy pass with gradient (the example's log-probs
    differentiable, the KL pair's detached)."""
    head = LMHead.find(model)
    if can_pack(model):
        pairs = batch.pairs
        if pairs is None:  # a batch built without the collator: plan it now (host reads)
            host = batch.to("cpu")
            pairs = plan_rows(host.example, host.kl).map(lambda t: t.to(batch.label.device))
        example, kl = packed_logps(model, head, pairs, len(batch))
        return example, kl, pairs.shared
    example, kl = batch.example, batch.kl
    example_logps = model_sequence_logps(
        model, example.input_ids, example.attention_mask, example.loss_mask, head
    )
    with recording(None):  # the examples' pass alone feeds the trainer's logits/ metrics
        kl_logps = model_sequence_logps(model, kl.input_ids, kl.attention_mask, kl.loss_mask, head)
    return example_logps, kl_logps, torch.zeros(len(batch), dtype=torch.long, device=example.input_ids.device)


def padding_free_rows(data: DataSection, model: ModelSection) -> str | None:
    """The collator's ``padding_free`` mode (``data.padding_free``, by ``model.attn_implementation``): one row per
    pass where flex attention skips what no document reaches; bins as long as the longest row for dense-mask
    kernels (eager, sdpa), whose attention then costs no more than the padded rows'; None when off."""
    if not data.padding_free:
        return None
    return "one" if model.attn_implementation == "flex_attention" else "bins"


def padding_free_note(data: DataSection, model: ModelSection, cuda: bool) -> str | None:
    """One line when padding-free rows meet a dense-mask kernel on a GPU: they are packed into bins there, so some
    padding remains, which flex attention would remove. None otherwise."""
    if padding_free_rows(data, model) != "bins" or not cuda:
        return None
    attention = model.attn_implementation or "the model's default"
    return (
        f"note: data.padding_free with attention {attention}: rows are packed into bins as long as the longest "
        "(a dense mask attends across a whole row, so one row per pass would cost more than padding); "
        "model.attn_implementation flex_attention (or auto) runs each pass as one row, with no padding"
    )
