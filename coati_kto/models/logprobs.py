"""Sequence log-probs over completion tokens, in fp32, without an fp32 copy of the [B, S, V] logits.

A naive ``log_softmax(logits.float())`` holds a full fp32 copy of the logits (and autograd keeps it for the
backward pass): 8 x 512 x 32000 x 4 bytes = 0.5 GiB on top of the bf16 logits. Here only the positions the
loss mask selects are processed, a chunk of rows at a time, and a custom backward recomputes each chunk's
softmax from the saved logits and one fp32 log-sum-exp per position.

The trainer goes further where it can (:func:`head_token_logps`, through ``coati_kto.models.lm_head``): no
logits tensor at all, the completion positions' hidden states through the LM head a vocabulary chunk at a
time, forward and backward. :func:`sequence_logps` (and :func:`logits_token_logps` for packed rows) remains the path for
vocabulary-parallel heads (tensor parallelism) and for parameters not resident in the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from coati_kto.models.logit_means import record_head, record_logits, sum_per_row

# Default chunk: 2**22 fp32 elements (16 MiB; 131 positions at V=32000) of upcast logits at a time. On CPU
# 64-128 positions ran ~2x faster than 2048 (cache-resident chunks): benchmarks/logprobs_bench.py. On a GPU
# each chunk is a handful of kernel launches and Python ops for the host to issue, so chunks are 16x larger
# there (256 MiB of fp32): a micro-batch's completion positions take one to a few chunks.
_CHUNK_ELEMENTS = 1 << 22
_GPU_SCALE = 16


_AS_ACCELERATOR = [False]  # set by accelerator_chunks()


@contextlib.contextmanager
def accelerator_chunks() -> Iterator[None]:
    """Chunk as on an accelerator on every device: the kernel counter (``coati_kto.testing.kernels``) counts on a
    CPU what a GPU would launch, and the CPU's smaller chunks are more kernels."""
    before, _AS_ACCELERATOR[0] = _AS_ACCELERATOR[0], True
    try:
        yield
    finally:
        _AS_ACCELERATOR[0] = before


def _on_cpu(device: torch.device) -> bool:
    return device.type == "cpu" and not _AS_ACCELERATOR[0]


def _budget(elements: int, device: torch.device) -> int:
    """``elements`` on CPU, :data:`_GPU_SCALE` times it on an accelerator."""
    return elements if _on_cpu(device) else elements * _GPU_SCALE


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits[rows[n], cols[n]])[targets[n]] per position n: fp32 [N], differentiable in logits."""

    @staticmethod
    def forward(ctx, logits, rows, cols, targets, chunk_size: int):
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(token_logps)
        for s in range(0, rows.numel(), chunk_size):
            e = s + chunk_size
            chunk = logits[rows[s:e], cols[s:e]].float()  # [n, V]: the only fp32 copy alive
            lse[s:e] = torch.logsumexp(chunk, dim=-1)
            token_logps[s:e] = chunk.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
        ctx.save_for_backward(logits, rows, cols, targets, lse)
        ctx.chunk_size = chunk_size
        return token_logps

    @staticmethod
    def backward(ctx, grad_out):
        logits, rows, cols, targets, lse = ctx.saved_tensors
        # Unselected positions get exactly 0, even where their logits are inf/NaN (no 0 * NaN).
        grad_logits = torch.zeros_like(logits)
        g = grad_out.float()  # [N]
        for s in range(0, rows.numel(), ctx.chunk_size):
            e = s + ctx.chunk_size
            # d/dlogits (logit[target] - lse) = onehot(target) - softmax(logits)
            chunk = logits[rows[s:e], cols[s:e]].float()
            grad = chunk.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])
            grad.scatter_add_(1, targets[s:e, None], g[s:e, None])
            grad_logits[rows[s:e], cols[s:e]] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None


def logits_token_logps(
    logits: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(targets[n]) at logits[rows[n], cols[n]] (logits [R, K, V], any float dtype): fp32 [N].

    ``chunk_size`` positions are upcast to fp32 at a time (None: about 16 MiB of fp32 logits per chunk, x16 on
    an accelerator); the backward recomputes each chunk's softmax from the saved logits.
    """
    if chunk_size is None:
        chunk_size = max(1, _budget(_CHUNK_ELEMENTS, logits.device) // max(1, logits.shape[-1]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _TokenLogps.apply(logits, rows, cols, targets.long(), chunk_size)


def sequence_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    chunk_size: int | None = None,
    targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    compiled: bool = False,
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
    One host sync (the positions of the mask) per call, none when ``targets`` gives them: the (row, column)
    of every completion token among the K kept positions, planned on the host (``TokenView.planned``).
    """
    batch, seq = input_ids.shape
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if logits.dim() != 3 or logits.shape[0] != batch or not 1 <= logits.shape[1] <= seq:
        raise ValueError(f"logits {tuple(logits.shape)} do not fit input_ids {tuple(input_ids.shape)}")
    keep = logits.shape[1]
    start = seq - keep + 1  # first token predicted by the kept logits
    rows, cols = targets if targets is not None else _completion_positions(loss_mask, keep, "logits")
    token_logps = logits_token_logps(logits, rows, cols, input_ids[:, start:][rows, cols], chunk_size)
    record_logits(logits, (rows, cols), rows, (batch, keep))  # the trainer's logits/ metrics, if recording
    # Scatter into [B, K] and sum rows, rather than index_add_: deterministic on every device.
    return sum_per_row(token_logps, rows, cols, (batch, keep))


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


def _completion_positions(loss_mask: torch.Tensor, keep: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the completion tokens among the last ``keep`` positions, read from the mask on its
    device (a host sync on a GPU: the collator plans them on the host instead). Kept index j predicts token
    start + j: the mask and targets shift, not the logits (no copy)."""
    seq = loss_mask.shape[1]
    start = seq - keep + 1
    mask = loss_mask.bool()
    if keep < seq and bool(mask[:, 1:start].any()):
        raise ValueError(
            f"{what} cover the last {keep} positions but loss_mask marks tokens before position {start}; "
            "use completion_logits_to_keep(loss_mask)"
        )
    return mask[:, start:].nonzero(as_tuple=True)


# ------------------------------------------------------------------------------------------------------------
# No [B, S, V] logits at all: log-probs from the last hidden states through the LM head, a vocabulary chunk at
# a time. Forward keeps a running log-sum-exp per position; backward recomputes each chunk's logits from the
# saved hidden states and weight, so nothing of size positions x vocabulary outlives one chunk.

# Elements of one [positions, vocabulary-chunk] fp32 logits block (a few live at once). CPU: 2**23 (32 MiB).
# Cache-sized 2 MiB blocks had won while every larger block was page-faulted in afresh; with freed memory kept
# (runtime/host_memory.py, as train runs), 32 MiB ran the head's forward 4-19% faster than 2 MiB and its
# forward + backward from as fast (within the machine's 5% noise) to 17% faster, from 816 x 256 x 8192 (one
# chunk) to 8192 x 256 x 8192 and 3000 x 512 x 32000 (positions x hidden x vocabulary, one thread;
# benchmarks/logprobs_bench.py --head-chunks).
# An accelerator: 2**26 (256 MiB): few chunks, so few kernel launches.
_HEAD_CHUNK_ELEMENTS_CPU = 1 << 23
_HEAD_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26
# Up to this many [positions x vocabulary] elements, the forward keeps its logits for the backward instead of
# recomputing them (the recompute is a quarter of the head's FLOPs in a gradient pass); a constant bound
# (64 MiB in fp32 on CPU, x16 on a GPU), so peak memory still does not grow with vocabulary x sequence.
_KEEP_LOGITS_ELEMENTS = 1 << 24
_MIN_VOCAB_CHUNK = 128


def _vocab_chunk(positions: int, vocab: int, chunk: int | None, device: torch.device) -> int:
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"vocab_chunk must be >= 1, got {chunk}")
        return min(chunk, vocab)
    elements = _HEAD_CHUNK_ELEMENTS_CPU if _on_cpu(device) else _HEAD_CHUNK_ELEMENTS_ACCELERATOR
    return min(vocab, max(_MIN_VOCAB_CHUNK, elements // max(1, positions)))


def _chunk_logps(hidden, weight, bias, targets, v0: int, vocab: int, running_max, running_sum, target_logit):
    """One vocabulary chunk (rows v0.. of the head) of the online log-softmax: its logits (weight dtype), and
    the running max, sum of exponentials and target logit (fp32 [N]) updated with it. The first chunk takes
    None for the three (nothing to rescale yet: the same values as updating from -inf, 0 and 0)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    v1 = v0 + weight.shape[0]
    chunk = logits.float()
    if running_max is None:
        new_max = chunk.amax(dim=1)
        running_sum = (chunk - new_max[:, None]).exp().sum(1)
    else:
        new_max = torch.maximum(running_max, chunk.amax(dim=1))
        running_sum = running_sum * (running_max - new_max).exp() + (chunk - new_max[:, None]).exp().sum(1)
    if v0 == 0 and v1 == vocab:  # one chunk holds every target: no range test
        return logits, new_max, running_sum, chunk.gather(1, targets[:, None]).squeeze(1)
    inside = (targets >= v0) & (targets < v1)
    local = (targets - v0).clamp(0, v1 - v0 - 1)
    picked = chunk.gather(1, local[:, None]).squeeze(1)
    target_logit = torch.where(inside, picked, 0.0 if target_logit is None else target_logit)
    return logits, new_max, running_sum, target_logit


def _chunk_grad(logits, lse, g, targets, v0: int, vocab: int, dtype: torch.dtype):
    """d/dlogits (logit[target] - lse) = onehot(target) - softmax(logits), times the upstream gradient ``g``,
    for one chunk's logits; in ``dtype`` (what autograd feeds the head's matmuls on the logits path). Out of
    place: a kept fp32 block must survive a second backward with retain_graph."""
    v1 = v0 + logits.shape[1]
    grad = logits.float().sub(lse[:, None]).exp_().mul_(-g[:, None])
    if v0 == 0 and v1 == vocab:  # one chunk holds every target
        grad.scatter_add_(1, targets[:, None], g[:, None])
        return grad.to(dtype)
    inside = (targets >= v0) & (targets < v1)
    local = (targets - v0).clamp(0, v1 - v0 - 1)
    grad.scatter_add_(1, local[:, None], torch.where(inside, g, 0.0)[:, None])
    return grad.to(dtype)


def _whole_log_softmax(hidden, weight, bias) -> torch.Tensor:
    """fp32 log-probs [N, V] over a whole vocabulary: the logits (weight dtype) through torch's log-softmax, one
    pass over them (the online chunks' max, shift, exp and sum are four)."""
    return torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), dim=1, dtype=torch.float32)


def _whole_grad(logp, g, targets, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_chunk_grad` from the fp32 log-probs of the whole vocabulary: (onehot(target) - exp(logp)) x g.
    Out of place: kept log-probs must survive a second backward with retain_graph."""
    grad = logp.exp().mul_(-g[:, None])
    grad.scatter_add_(1, targets[:, None], g[:, None])
    return grad.to(dtype)


def _whole_backward(ctx, hidden, weight, bias, targets, g) -> tuple:
    """(grad hidden, grad weight, grad bias) of the one-chunk head (``ctx.whole``), each None where not needed.

    The logits' gradient is formed in fp32 from the kept log-probs (or the same values again) and rounded once
    to the weight's dtype; both matmuls then run in that dtype, as the model's own head backward does (fp32
    accumulation inside the matmul): no fp32 copies of the gradient or the weight, no fp32 accumulator. A hidden
    state of another dtype than the weight still gets its gradient from fp32 operands."""
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    logp = ctx.kept[0] if ctx.kept else _whole_log_softmax(hidden, weight, bias)
    grad = _whole_grad(logp, g, targets, weight.dtype)
    grad_hidden = grad_weight = grad_bias = None
    if need_hidden and hidden.dtype == weight.dtype:
        grad_hidden = grad @ weight
    elif need_hidden:
        grad_hidden = (grad.float() @ weight.float()).to(hidden.dtype)
    if need_weight:
        grad_weight = grad.t() @ hidden.to(weight.dtype)
    if need_bias and bias is not None:
        grad_bias = grad.float().sum(0).to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _chunk_functions(compiled: bool) -> tuple:
    """(chunk log-probs, chunk gradient): eager, or compiled with torch.compile (model.compile; regions of
    ``coati_kto.models.compile``, each a few fused kernels instead of a dozen per chunk)."""
    if not compiled:
        return _chunk_logps, _chunk_grad
    from coati_kto.models.compile import compiled_head_chunks

    return compiled_head_chunks(_chunk_logps, _chunk_grad)


class _HeadTokenLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T + bias)[n, targets[n]] per position n, fp32 [N]; grads for hidden, weight, bias.

    Logits are computed in the weight's dtype (as the model's own head does) and upcast per chunk. Backward
    recomputes each chunk's logits, or reuses the forward's when they fit :data:`_KEEP_LOGITS_ELEMENTS`
    (the same values either way: the same matmul on the same operands).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, vocab_chunk: int, compiled: bool):
        n, vocab = hidden.shape[0], weight.shape[0]
        running_max = running_sum = target_logit = None  # the first chunk starts them
        keep = any(ctx.needs_input_grad[:3]) and n * vocab <= _budget(_KEEP_LOGITS_ELEMENTS, hidden.device)
        ctx.vocab_chunk, ctx.compiled = vocab_chunk, compiled
        # One chunk holds the vocabulary (most micro-batches on a GPU): torch's log-softmax, compiled or not (one
        # kernel already; the compiled chunk adds the lse arithmetic and an fp32 accumulator: 28 vs 26 kernels).
        ctx.whole = vocab_chunk >= vocab
        if ctx.whole:
            logp = _whole_log_softmax(hidden, weight, bias)
            ctx.kept = [logp] if keep else []
            ctx.save_for_backward(hidden, weight, bias, targets, None)
            return logp.gather(1, targets[:, None]).squeeze(1)
        ctx.kept = []
        chunk_logps, _ = _chunk_functions(compiled)
        for v0 in range(0, vocab, vocab_chunk):
            v1 = min(vocab, v0 + vocab_chunk)
            logits, running_max, running_sum, target_logit = chunk_logps(
                hidden, weight[v0:v1], None if bias is None else bias[v0:v1], targets, v0, vocab,
                running_max, running_sum, target_logit,
            )  # fmt: skip
            if keep:
                ctx.kept.append(logits)
        lse = running_max + running_sum.log()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        g = grad_out.float()
        if ctx.whole:
            return (*_whole_backward(ctx, hidden, weight, bias, targets, g), None, None, None)
        vocab = weight.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        )
        # Every row block of the weight's (and bias') gradient is written once below: no zero fill.
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias and bias is not None else None
        hidden_w = hidden.to(weight.dtype) if need_weight else None
        _, chunk_grad = _chunk_functions(ctx.compiled)
        for i, v0 in enumerate(range(0, vocab, ctx.vocab_chunk)):
            v1 = min(vocab, v0 + ctx.vocab_chunk)
            w = weight[v0:v1]
            b = None if bias is None else bias[v0:v1]
            logits = ctx.kept[i] if ctx.kept else torch.nn.functional.linear(hidden, w, b)
            grad = chunk_grad(logits, lse, g, targets, v0, vocab, weight.dtype)
            if grad_hidden is not None:
                grad_hidden.add_(grad.float() @ w.float() if w.dtype != torch.float32 else grad @ w)
            if grad_weight is not None:  # one matmul per row block, into it (a contiguous row slice): exact
                torch.mm(grad.t(), hidden_w, out=grad_weight[v0:v1])
            if grad_bias is not None:
                grad_bias[v0:v1] = grad.float().sum(0).to(bias.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def head_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_chunk: int | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-position log p(target) fp32 [N] from hidden [N, H] and an LM head weight [V, H] (bias [V] or None);
    ``compiled`` (model.compile): each vocabulary chunk's work a compiled function.

    Differentiable in hidden, weight and bias; peak extra memory is one [N, vocab_chunk] fp32 block
    (32 MiB by default on CPU, 256 MiB on an accelerator) plus an fp32 [N, H] gradient buffer in backward.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit")
    chunk = _vocab_chunk(hidden.shape[0], weight.shape[0], vocab_chunk, hidden.device)
    return _HeadTokenLogps.apply(hidden, weight, bias, targets.long(), chunk, compiled)


def hidden_sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    vocab_chunk: int | None = None,
    targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """:func:`sequence_logps` from the last hidden states [B, K, H] (the last K positions) and the LM head.

    Same contract as :func:`sequence_logps` with ``hidden`` in place of the logits: the logits of the kept
    completion positions are computed a vocabulary chunk at a time and never held whole.
    """
    batch, seq = input_ids.shape
    if hidden.dim() != 3 or hidden.shape[0] != batch or not 1 <= hidden.shape[1] <= seq:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit input_ids {tuple(input_ids.shape)}")
    keep = hidden.shape[1]
    start = seq - keep + 1
    rows, cols = targets if targets is not None else _completion_positions(loss_mask, keep, "hidden states")
    scored, targets = hidden[rows, cols], input_ids[:, start:][rows, cols]
    # The trainer's logits/ metrics, while it records (coati_kto.models.logit_means).
    record_head(scored, weight, bias, rows, cols, (batch, keep))
    token_logps = head_token_logps(scored, weight, bias, targets, vocab_chunk, compiled)
    return sum_per_row(token_logps, rows, cols, (batch, keep))
