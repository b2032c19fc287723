"""Sequence parallelism, all_to_all (Ulysses) style: the collectives and the attention wrapper every run at
``plugin.sp_size`` > 1 runs on (the hybrid-parallel backend installs the wrapper and sets its group; the passes sum
the log-probs with :func:`sp_sum`). docs/sequence_parallelism.md; the plan: docs/sequence_parallelism_plan.md §2a, §2c.

Each rank of a sequence-parallel (sp) group holds a contiguous slice of every row: columns
``[rank * L / sp, (rank + 1) * L / sp)``. The layers before and after attention act per token, so they run on the
slice as they are. Attention needs whole rows: :func:`sp_attention_forward` all_to_alls q/k/v from [B, H, S/sp, D]
(every head, the local slice) to [B, H/sp, S, D] (a slice of the heads, the whole row), runs the inner kernel
with the whole row's mask, and all_to_alls its output back. :func:`sp_sum` reduces per-row partial sums (the
log-probs of each rank's tokens) over the group.

ColossalAI's own sequence parallelism lives in forwards written for transformers 4.51 (the plan's §0), so the
model side is here: a transformers attention function registered as ``coati_sp|<inner>``
(:func:`sp_attention_name`). Model code holds no distributed code: the wrapper takes its group from
:data:`SEQUENCE_GROUP`, which the caller that builds the process groups sets (the parallel backend once the
plugin exists, plan step 2; tests through :meth:`SequenceGroup.using`).

Every function here is a collective: every rank of the sp group calls it, on tensors of the same shape and
dtype, in the same order (the model's layers run in the same order on every rank, forward and backward).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

SP_ATTENTION_PREFIX = "coati_sp|"
SP_INNER_KERNELS = ("sdpa", "eager")  # kernels that take a dense 4D mask; flex's BlockMask is not proven yet


class SequenceGroup:
    """The process's sp group, read by the attention wrapper at call time (a process belongs to one sp group).

    Set by whoever builds the process groups, before the first forward that runs the wrapper, and cleared
    when the groups are destroyed. The model never sets it.
    """

    def __init__(self) -> None:
        self._group: ProcessGroup | None = None

    def set(self, group: ProcessGroup | None) -> None:
        """Make ``group`` the sp group (None: no sp group)."""
        self._group = group

    def get(self) -> ProcessGroup:
        """The sp group; RuntimeError when none was set (the wrapper ran outside a sequence-parallel run)."""
        if self._group is None:
            raise RuntimeError(
                "sequence-parallel attention ran with no sp group set (coati_kto.parallel.sequence.SEQUENCE_GROUP)"
            )
        return self._group

    @contextlib.contextmanager
    def using(self, group: ProcessGroup) -> Iterator[None]:
        """Within: ``group`` is the sp group; the previous one comes back after."""
        before, self._group = self._group, group
        try:
            yield
        finally:
            self._group = before


SEQUENCE_GROUP = SequenceGroup()


def _all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into sp equal chunks along ``scatter_dim``, send chunk j to rank j, and join the chunks
    received along ``gather_dim`` in rank order. One ``all_to_all_single`` (equal splits: gloo and NCCL)."""
    sp = dist.get_world_size(group)
    if sp == 1:
        return x
    if x.shape[scatter_dim] % sp:
        raise ValueError(
            f"sp_all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} does not divide by the sp size {sp}"
        )
    moved = x.movedim(scatter_dim, 0)  # the scattered dim first: chunk j is a contiguous block
    send = moved.reshape(sp, moved.shape[0] // sp, *moved.shape[1:]).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # The gathered dim's index in ``moved`` (dims before the scattered one shift right by one).
    g = gather_dim + 1 if gather_dim < scatter_dim else gather_dim
    # received [sp, *moved_chunk]: put the sender's index just before the gathered dim and merge the two.
    return received.movedim(0, g).flatten(g, g + 1).movedim(0, scatter_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None  # the inverse exchange


def sp_all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all_to_all over ``group``: ``x`` split into sp chunks along ``scatter_dim`` (chunk j to rank
    j), the received chunks joined along ``gather_dim`` in rank order. Backward is the inverse all_to_all.

    Shape: dim ``scatter_dim`` shrinks sp-fold, dim ``gather_dim`` grows sp-fold; the dtype is kept (any dtype the
    backend moves). ``x.shape[scatter_dim]`` must divide by sp (ValueError otherwise, on every rank alike). The
    attention's uses: q/k/v [B, H, S/sp, D] -> [B, H/sp, S, D] with (1, 2); its output [B, S, H/sp, D] ->
    [B, S/sp, H, D] with (1, 2) as well. Every rank of ``group`` calls it with the same shape, in the same order.
    """
    ndim = x.dim()
    return _AllToAll.apply(x, group, scatter_dim % ndim, gather_dim % ndim)


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        total = x.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.grad_scale, None, None


def sp_sum(x: torch.Tensor, group: ProcessGroup, grad_scale: float) -> torch.Tensor:
    """Forward: ``x`` summed over ``group`` (all-reduce SUM), the same shape and dtype, the same value on every
    rank. Backward: the incoming gradient times ``grad_scale``, with no communication.

    Every rank's loss is built from the same sum, so the loss is one value held sp times: the gradient of that
    one loss with respect to this rank's ``x`` is the incoming gradient itself (``grad_scale`` 1). Under
    all_to_all, DDP and ZeRO average gradients over dp x sp ranks (ColossalAI's mixed dp group), so the caller
    passes ``grad_scale`` = sp to undo the extra 1/sp, as ColossalAI's ``gather_sp_output`` does (plan §2c);
    split_gather, which averages over dp only, passes 1. Used on per-row sums [B] (fp32), once per pass. Every
    rank of ``group`` calls it with the same shape, in the same order.
    """
    return _Sum.apply(x, group, grad_scale)


def sp_head_refusal(attention_heads: int, key_value_heads: int, sp: int) -> str | None:
    """Why all_to_all over ``sp`` ranks cannot split these head counts (those one attention module holds: the
    per-tensor-parallel-rank counts under tp), or None where it can. Each rank takes 1/sp of the query heads
    and 1/sp of the key-value heads, so grouped-query attention keeps its ratio (``num_key_value_groups``)."""
    if attention_heads % sp == 0 and key_value_heads % sp == 0:
        return None
    return (
        f"all_to_all sequence parallelism splits the attention heads over sp_size={sp} ranks: "
        f"num_attention_heads ({attention_heads}) and num_key_value_heads ({key_value_heads}) per tensor-parallel "
        f"rank must both be multiples of it"
    )


def sp_attention_name(inner: str) -> str:
    """``coati_sp|<inner>``, registered in transformers' ``AttentionInterface`` (once per process): the name to
    put in ``config._attn_implementation`` so that every attention layer runs :func:`sp_attention_forward`
    around ``inner`` (one of :data:`SP_INNER_KERNELS`)."""
    if inner not in SP_INNER_KERNELS:
        raise ValueError(f"sequence-parallel attention wraps one of {SP_INNER_KERNELS}, not {inner!r}")
    _register(inner)
    return SP_ATTENTION_PREFIX + inner


def install_attention(model: torch.nn.Module) -> str:
    """Make every attention layer of ``model`` (a transformers model, before the plugin wraps it) run the
    ``coati_sp|`` wrapper around its kernel, persistently (activation-checkpoint recompute runs it too); returns
    the wrapper's name. ValueError when the kernel is not one of :data:`SP_INNER_KERNELS`. Idempotent. The name
    is not saved: transformers leaves ``_attn_implementation`` out of config.json."""
    config = model.config
    inner = inner_attention(getattr(config, "_attn_implementation", None))
    if inner not in SP_INNER_KERNELS:
        raise ValueError(
            f"sequence parallelism wraps the attention kernels {SP_INNER_KERNELS}; {type(model).__name__} runs "
            f"{inner!r} (set model.attn_implementation sdpa or eager)"
        )
    config._attn_implementation = sp_attention_name(inner)
    return config._attn_implementation


def inner_attention(name: str | None) -> str | None:
    """The kernel under a ``coati_sp|`` name, any other name unchanged: what code that asks "which kernel runs"
    (masks, packing) reads instead of ``config._attn_implementation``."""
    return name.removeprefix(SP_ATTENTION_PREFIX) if name is not None else None


@functools.cache
def _register(inner: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(
        SP_ATTENTION_PREFIX + inner, functools.partial(sp_attention_forward, inner=inner)
    )


def _inner_kernel(module: torch.nn.Module, inner: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The function transformers would call for ``inner`` in ``module``'s model: sdpa from the interface, eager
    from the module's own modeling file (each family defines its own: soft-capping, sinks)."""
    if inner == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}'s module defines no eager_attention_forward to wrap")
    return eager


def _check_inputs(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: Any, sp: int, inner: str
) -> None:
    """ValueError, before any collective, for head counts sp does not divide or a mask that is not the whole
    row's 4D mask (None only around sdpa, whose own causal attention then runs on the whole rows: the caller's
    rows are plain causal documents); every rank sees the same shapes, so every rank raises alike."""
    refusal = sp_head_refusal(query.shape[1], key.shape[1], sp)
    if refusal is not None:
        raise ValueError(f"{type(module).__name__}: {refusal}")
    if mask is None and inner == "sdpa":
        return
    length = query.shape[2] * sp
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (length, length):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"sequence-parallel attention needs the whole row's 4D mask [B, 1, {length}, {length}] (the caller "
            f"builds it: a 2D mask or none would be rebuilt at the slice's length), got {got}"
        )


def sp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    inner: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function over the sp group in :data:`SEQUENCE_GROUP`.

    In (transformers 5's layout, after rotary on the slice's own positions): ``query`` [B, H, S/sp, D], ``key``
    and ``value`` [B, KV, S/sp, D] of this rank's column slice; ``attention_mask`` the whole row's 4D mask
    [B, 1, S, S] (additive in the model dtype, or bool), which transformers hands over unchanged, or None around
    sdpa for rows that are plain causal documents (sdpa's ``is_causal`` over the whole rows: no mask tensor). Out:
    [B, S/sp, H, D] for the slice (what the layer reshapes to its input length) and no attention weights.
    In between, the ``inner`` kernel sees [B, H/sp, S, D] and [B, KV/sp, S, D]: exactly sp=1's attention for
    its heads. Every rank of the group runs every layer in the same order (activation-checkpoint recompute
    included, as it replays the same layers).
    """
    group = SEQUENCE_GROUP.get()
    sp = dist.get_world_size(group)
    _check_inputs(module, query, key, attention_mask, sp, inner)
    whole = [sp_all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value)]
    output, _ = _inner_kernel(module, inner)(module, *whole, attention_mask, **kwargs)  # [B, S, H/sp, D]
    return sp_all_to_all(output, group, scatter_dim=1, gather_dim=2), None
