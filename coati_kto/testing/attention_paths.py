"""Which attention kernel a model pass ran, as the kernel counter (coati_kto.testing.kernels) reports it per pass.

The paths, and what a GPU makes of them:

    sdpa dense mask      scaled_dot_product_attention with an explicit mask: a dense [.., L, L] tensor in memory,
                         which rules out the flash kernel (the memory-efficient one runs, reading the mask)
    sdpa causal no mask  is_causal and no mask: flash-capable (an unpadded row)
    sdpa no mask         no mask, not causal (bidirectional: no decoder pass here should report it)
    flex block mask      FlexAttention with a BlockMask: fused, blocks no document reaches skipped, no dense mask
    varlen               torch's varlen_attn (flash attention over packed sequences)
    eager                a softmax inside an attention module: q k^T materialized
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SDPA_DENSE, SDPA_CAUSAL, SDPA_PLAIN = "sdpa dense mask", "sdpa causal no mask", "sdpa no mask"
FLEX, VARLEN, EAGER = "flex block mask", "varlen", "eager"
# Paths that materialize no [L, L] mask: what a GPU's flash-capable kernels take.
FLASH_CAPABLE = (SDPA_CAUSAL, FLEX, VARLEN)


def function_path(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The path of a torch-level call (a TorchFunctionMode sees it): sdpa by its mask and ``is_causal``,
    varlen_attn; None for any other call."""
    name = getattr(func, "__name__", "")
    if name == "scaled_dot_product_attention":
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        return SDPA_DENSE if mask is not None else SDPA_CAUSAL if causal else SDPA_PLAIN
    if name == "varlen_attn":
        return VARLEN
    return None


def is_higher_order(func: Any) -> bool:
    """Whether a dispatched ``func`` is a higher-order operator (FlexAttention's forward and backward are)."""
    return isinstance(func, torch._ops.HigherOrderOperator)


def higher_order_path(func: Any) -> str | None:
    """The path of a higher-order operator reaching a dispatch mode: FlexAttention's forward; None otherwise
    (its backward is the same pass's second half)."""
    return FLEX if getattr(func, "_name", None) == "flex_attention" else None


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree`` (a higher-order operator's arguments or outputs)."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def flex_uncompiled() -> Iterator[None]:
    """FlexAttention's operator called as it is, not through its internal ``torch.compile(fullgraph=True)``,
    which finds no frame to compile under a dispatch mode and raises: the counter sees the operator itself."""
    from torch.nn.attention import flex_attention

    was = flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = was
