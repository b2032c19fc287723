"""Sequence log-probs over completion tokens, in fp32, without an fp32 copy of the [B, S, V] logits.

A naive ``log_softmax(logits.float())`` holds a full fp32 copy of the logits (and autograd keeps it for the
backward pass): 8 x 512 x 32000 x 4 bytes = 0.5 GiB on top of the bf16 logits. Here only the positions the
loss mask selects are processed, a chunk of rows at a time, and a custom backward recomputes each chunk's
softmax from the saved logits and one fp32 log-sum-exp per position.
"""

from __future__ import annotations

import torch

# Default chunk: 2**22 fp32 elements (16 MiB; 131 positions at V=32000) of upcast logits at a time. On CPU
# 64-128 positions ran ~2x faster than 2048 (cache-resident chunks): benchmarks/logprobs_bench.py.
_CHUNK_ELEMENTS = 1 << 22


class _CompletionLogps(torch.autograd.Function):
    """sum_t log softmax(logits[b, t])[target] over the given (b, t) positions, per row b."""

    @staticmethod
    def forward(ctx, logits, rows, cols, targets, batch_size: int, chunk_size: int):
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(token_logps)
        for s in range(0, rows.numel(), chunk_size):
            e = s + chunk_size
            chunk = logits[rows[s:e], cols[s:e]].float()  # [n, V]: the only fp32 copy alive
            lse[s:e] = torch.logsumexp(chunk, dim=-1)
            token_logps[s:e] = chunk.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
        # Scatter into [B, T] and sum rows, rather than index_add_: deterministic on every device.
        per_pos = torch.zeros(batch_size, logits.shape[1], dtype=torch.float32, device=logits.device)
        per_pos[rows, cols] = token_logps
        ctx.save_for_backward(logits, rows, cols, targets, lse)
        ctx.chunk_size = chunk_size
        return per_pos.sum(dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        logits, rows, cols, targets, lse = ctx.saved_tensors
        # Unselected positions get exactly 0, even where their logits are inf/NaN (no 0 * NaN).
        grad_logits = torch.zeros_like(logits)
        g = grad_out.float()[rows]  # [N]
        for s in range(0, rows.numel(), ctx.chunk_size):
            e = s + ctx.chunk_size
            # d/dlogits (logit[target] - lse) = onehot(target) - softmax(logits)
            chunk = logits[rows[s:e], cols[s:e]].float()
            grad = chunk.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])
            grad.scatter_add_(1, targets[s:e, None], g[s:e, None])
            grad_logits[rows[s:e], cols[s:e]] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None, None


def sequence_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sum over completion tokens of log p(token), per sequence: Tensor[B], fp32, differentiable in logits.

    Args:
        logits: [B, K, V] in any float dtype (bf16/fp16/fp32), for the LAST K positions S-K .. S-1 of the
            input (K = S for a full forward, K < S with the model's ``logits_to_keep=K``). Logits at
            position t predict token t+1; the last position predicts nothing.
        input_ids: [B, S] token ids.
        loss_mask: [B, S] bool/0-1: loss_mask[b, t] says token t is a completion token. Token 0 has no
            prediction and is ignored; with K < S every completion token must lie in positions S-K+1 .. S-1.
        chunk_size: positions upcast to fp32 at a time; None = about 16 MiB of fp32 logits per chunk.

    Masked (prompt/padding) positions contribute exactly 0, whatever their logits hold.
    One host sync (the positions of the mask) per call.
    """
    batch, seq = input_ids.shape
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if logits.dim() != 3 or logits.shape[0] != batch or not 1 <= logits.shape[1] <= seq:
        raise ValueError(f"logits {tuple(logits.shape)} do not fit input_ids {tuple(input_ids.shape)}")
    keep = logits.shape[1]
    start = seq - keep + 1  # first token predicted by the kept logits
    mask = loss_mask.bool()
    if keep < seq and bool(mask[:, 1:start].any()):
        raise ValueError(
            f"logits cover the last {keep} positions but loss_mask marks tokens before position {start}; "
            "use completion_logits_to_keep(loss_mask)"
        )
    # Kept-logit index j predicts token start + j: shift the mask and targets, not the logits (no copy).
    rows, cols = mask[:, start:].nonzero(as_tuple=True)
    targets = input_ids[:, start:][rows, cols].long()
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _CompletionLogps.apply(logits, rows, cols, targets, batch, chunk_size)


def completion_logits_to_keep(loss_mask: torch.Tensor) -> int:
    """Smallest K (>= 1) such that the last K logit positions predict every completion token of the batch.

    Pass it as the model's ``logits_to_keep`` (where 0 would mean "all", hence the minimum of 1) and give
    the resulting [B, K, V] logits to :func:`sequence_logps`. Host sync: returns a python int.
    """
    seq = loss_mask.shape[1]
    predicted = loss_mask[:, 1:].bool().any(dim=0)  # predicted[t]: some row needs the logits at position t
    if seq < 2 or not bool(predicted.any()):
        return 1
    return seq - int(predicted.int().argmax())


def token_count(loss_mask: torch.Tensor) -> torch.Tensor:
    """Completion tokens per row that :func:`sequence_logps` sums over (token 0 is never predicted): [B]."""
    return loss_mask[:, 1:].bool().sum(dim=1)
