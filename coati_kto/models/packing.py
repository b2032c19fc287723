"""Log-probs of an example and its KL pair in one forward: the shared prompt is processed once.

The example (x_i, y_i) and its KL pair (x_i, y_j) share the prompt x_i. One packed row holds

    A = [x_i, y_i]  positions 0 .. |A|-1, causal                                     (the example)
    B = [y_j]       positions |x_i| .. , each token sees x_i (in A) and B causally, never y_i

so a model processes P + C_i + C_j tokens instead of 2P + C_i + C_j, and the log-probs are those of two
separate passes (same positions, same visible tokens; fp32 differences are summation-order only). The
reference (online and precomputed) uses it without gradient; the policy's gradient pass uses it where
:func:`fold_pays` (long prompts, short completions), its KL-pair pass then folded into the gradient pass. A row whose
KL prompt is not the example's prompt (truncation cut them differently) packs as two independent documents
(B = the whole KL sequence, positions from 0, seeing only itself): still one forward, nothing shared.

It needs a 4D additive mask, which Hugging Face's Llama-family models take with ``eager`` and ``sdpa``
attention (transformers 5 applies a 4D mask as given, in every layer), and so do the plugins' wrappers of them
(the project's shardformer policies keep transformers' forwards; tested through HybridParallelModule and
LowLevelZeroModel). Models whose layers mix window sizes (Gemma 3) run two passes. With flash_attention_2, or a model whose head the chunked path
does not cover (tensor parallelism's vocabulary slices), :func:`pair_logps` runs two passes. The
mask costs B x L^2 elements of the model dtype (L = the packed length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from coati_kto.data.batch import KTOBatch
from coati_kto.families import attention_window, uniform_windows
from coati_kto.models.logprobs import LMHead, head_token_logps, model_sequence_logps, sum_per_row
from coati_kto.models.lora import base_module

PACKABLE_ATTENTION = ("eager", "sdpa")


@dataclass
class PackedPairs:
    """One packed row per example; targets as (row, predictor column, token id) for example and KL pair."""

    input_ids: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    allowed: torch.Tensor  # [B, L, L] bool: query t may attend key s
    example: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, predictor cols, targets
    kl: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    shared: torch.Tensor  # [B] long: prompt tokens of each row not processed twice
    shared_tokens: int  # their sum
    tokens: int  # non-padding tokens of the packed rows


def shared_prompt_lengths(batch: KTOBatch) -> torch.Tensor:
    """[B] long: tokens the KL pair shares with the example (its prompt), 0 where the prompts differ.

    Both loss masks start at the completion; the shared prompt is everything before, when equal token for token.
    """
    ids, loss = batch.example.input_ids, batch.example.loss_mask
    kl_ids, kl_loss = batch.kl.input_ids, batch.kl.loss_mask
    start, kl_start = batch.example.completion_starts(), batch.kl.completion_starts()
    width = min(ids.shape[1], kl_ids.shape[1])
    cols = torch.arange(width, device=ids.device)
    before = cols[None, :] < start[:, None]
    same = ((ids[:, :width] == kl_ids[:, :width]) | ~before).all(dim=1)
    ok = (start == kl_start) & same & loss.any(dim=1) & kl_loss.any(dim=1) & (start > 0)
    return torch.where(ok, start, 0)


def pack_pairs(batch: KTOBatch, window: int | None = None) -> PackedPairs:
    """The packed rows of a batch (right-padded; loss masks mark completions); ``window``: the model's sliding
    window (:func:`attention_window`), applied on the logical positions as a separate pass applies it."""
    ids, loss, kl_ids, kl_loss = (
        batch.example.input_ids,
        batch.example.loss_mask,
        batch.kl.input_ids,
        batch.kl.loss_mask,
    )
    shared_rows = shared_prompt_lengths(batch)
    shared = shared_rows.tolist()
    lengths, kl_lengths = batch.example.lengths().tolist(), batch.kl.lengths().tolist()
    n = ids.shape[0]
    width = max(a + k - s for a, k, s in zip(lengths, kl_lengths, shared, strict=True))
    device = ids.device
    packed = torch.zeros(n, width, dtype=torch.long, device=device)
    positions = torch.zeros(n, width, dtype=torch.long, device=device)
    allowed = torch.zeros(n, width, width, dtype=torch.bool, device=device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    ex_rows, ex_cols, ex_tgt, kl_rows, kl_cols, kl_tgt = ([] for _ in range(6))
    for b in range(n):
        a, k, s = lengths[b], kl_lengths[b], shared[b]
        bl = k - s  # KL tokens placed after A
        packed[b, :a] = ids[b, :a]
        packed[b, a : a + bl] = kl_ids[b, s:k]
        positions[b, :a] = torch.arange(a, device=device)
        positions[b, a : a + bl] = torch.arange(s, k, device=device)
        allowed[b, :a, :a] = causal[:a, :a]
        allowed[b, a : a + bl, a : a + bl] = causal[:bl, :bl]
        allowed[b, a : a + bl, :s] = True
        pad = torch.arange(a + bl, width, device=device)
        allowed[b, pad, pad] = True  # padding sees itself only: no empty softmax row, output unused
        # Token t of the example is predicted at column t - 1; KL token u at its predictor's packed column.
        t = loss[b, 1:a].nonzero().squeeze(1) + 1
        ex_rows.append(torch.full_like(t, b))
        ex_cols.append(t - 1)
        ex_tgt.append(ids[b, t])
        u = kl_loss[b, 1:k].nonzero().squeeze(1) + 1
        pred = u - 1
        kl_rows.append(torch.full_like(u, b))
        kl_cols.append(torch.where(pred < s, pred, a + pred - s))
        kl_tgt.append(kl_ids[b, u])
    if window is not None:
        allowed &= (positions[:, :, None] - positions[:, None, :]) < window
    return PackedPairs(
        input_ids=packed,
        position_ids=positions,
        allowed=allowed,
        example=(torch.cat(ex_rows), torch.cat(ex_cols), torch.cat(ex_tgt)),
        kl=(torch.cat(kl_rows), torch.cat(kl_cols), torch.cat(kl_tgt)),
        shared=shared_rows,
        shared_tokens=int(sum(shared)),
        tokens=int(sum(lengths) + sum(kl_lengths) - sum(shared)),
    )


def _config(model: Any) -> Any:
    """The Hugging Face config under any plugin wrapper or LoRA PeftModel (a LoRA reference included)."""

    return getattr(base_module(model), "config", None)


def can_pack(model: Any) -> bool:
    """eager/sdpa attention, one attention window for every layer, and a head covered by the chunked path (a
    plain model or a plugin's wrapper)."""
    config = _config(model)
    attention = getattr(config, "_attn_implementation", None)
    # Layers with different windows (Gemma 3's sliding / full mix) would each need their own mask.
    return attention in PACKABLE_ATTENTION and uniform_windows(config) and LMHead.find(model) is not None


def packed_pair_logps(model: Any, head: LMHead, packed: PackedPairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(example, KL) log-probs [B] fp32 from one forward over the packed rows; the example's carry gradient
    when grad is enabled, the KL pair's never."""
    dtype = head.weight.dtype  # the working dtype (a LoRA reference is no module with parameters of its own)
    mask = torch.zeros(packed.allowed.shape, dtype=dtype, device=packed.allowed.device)
    mask.masked_fill_(~packed.allowed, torch.finfo(dtype).min)
    hidden = head.capture(
        model,
        input_ids=packed.input_ids,
        attention_mask=mask[:, None],
        position_ids=packed.position_ids,
        use_cache=False,
    )
    shape = tuple(packed.input_ids.shape)
    rows, cols, targets = packed.example
    example = sum_per_row(
        head_token_logps(hidden[rows, cols], head.weight, head.bias, targets), rows, cols, shape
    )
    with torch.no_grad():  # KTO's reference point is a constant: the KL pair's log-probs never carry gradient
        rows, cols, targets = packed.kl
        logps = head_token_logps(
            hidden.detach()[rows, cols], head.weight.detach(), _detach(head.bias), targets
        )
        kl = sum_per_row(logps, rows, cols, shape)
    return example, kl


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def fold_pays(batch: KTOBatch) -> bool:
    """Whether one packed pass with gradient over [x_i, y_i, y_j] costs less than the policy's two passes
    (the KL pair without gradient, the example with): every row shares its prompt and 3 L <= S_kl + 3 S
    in padded widths (a forward plus a backward of ~2 forwards; the packed KL tokens ride through the backward
    with zero gradient). True for long prompts and short completions (P > 2C), false for P ~ C."""
    starts = shared_prompt_lengths(batch)
    if not bool((starts > 0).all()):
        return False
    lengths, kl_lengths = batch.example.lengths(), batch.kl.lengths()
    width = int((lengths + kl_lengths - starts).max())
    return 3 * width <= batch.kl.input_ids.shape[1] + 3 * batch.example.input_ids.shape[1]


def pair_logps(model: Any, batch: KTOBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(example log-probs [B], KL-pair log-probs [B]) fp32 of ``model``, and the prompt tokens [B] its one
    packed pass did not process twice (zeros with two passes). Packed when :func:`can_pack`. The reference
    model's and the cache's passes run it under no_grad; the trainer's folded policy pass with gradient (the
    example's log-probs differentiable, the KL pair's detached)."""
    head = LMHead.find(model)
    if head is not None and can_pack(model):
        packed = pack_pairs(batch, attention_window(_config(model)))
        example, kl = packed_pair_logps(model, head, packed)
        return example, kl, packed.shared
    example, kl = batch.example, batch.kl
    return (
        model_sequence_logps(model, example.input_ids, example.attention_mask, example.loss_mask, head),
        model_sequence_logps(model, kl.input_ids, kl.attention_mask, kl.loss_mask, head),
        torch.zeros(len(batch), dtype=torch.long, device=example.input_ids.device),
    )
