"""``model.attn_implementation: auto``: the attention kernel and pass layout proven on this device, chosen at
config load (every rank loads the config on its own node, so each decides for the device it trains on).

On a GPU, where the model packs (coati_kto.families.packing_refusal), at tensor-parallel size 1 and with no
attention only the eager kernel computes, without pipeline stages (they run padded rows): ``flex_attention`` with every pass padding-free (``data.padding_free``
on): each pass one row of documents under a flex BlockMask built from the collator's per-token vectors, the
shared-prompt rows included, so no pass materializes a dense [L, L] mask (coati_kto.models.packing). Elsewhere
the model's default kernel (sdpa: unpadded rows run its causal kernel with no mask, padded rows a 4D bool mask):
torch has no FlexAttention backward on CPU, and flex under tensor parallelism is unproven (on CPU its inductor
kernel failed to compile at tp_size 2). One note line says which and why; train prints it on rank 0.
"""

from __future__ import annotations

from typing import Any

from coati_kto.families import eager_attention_reason, packing_refusal

AUTO = "auto"


def flex_refusal(
    model_dirs: list[str], tp_size: int, cuda: bool, sp_size: int = 1, pp_size: int = 1
) -> str | None:
    """Why ``auto`` does not run flex_attention padding-free here (None when it does)."""
    if not cuda:
        import torch

        return f"no GPU: torch {torch.__version__} has no FlexAttention backward on CPU"
    if tp_size > 1:
        return f"plugin.tp_size {tp_size}: flex attention under tensor parallelism is unproven"
    if sp_size > 1:  # the sequence-parallel attention wraps kernels that take a dense 4D mask
        return f"plugin.sp_size {sp_size}: flex attention under sequence parallelism is unproven"
    if (
        pp_size > 1
    ):  # the schedule splits a batch along its rows: no padding-free pass runs (config/pipeline.py)
        return f"plugin.pp_size {pp_size}: the pipeline stages run padded rows, not padding-free passes"
    for model_dir in model_dirs:
        if (reason := eager_attention_reason(model_dir)) is not None:
            return f"the model at {model_dir}: {reason}"
    return packing_refusal(model_dirs, "flex_attention")


def resolve_attention(
    model: Any, data: Any, tp_size: int, cuda: bool, sp_size: int = 1, pp_size: int = 1
) -> tuple[str | None, bool, str | None]:
    """(``model.attn_implementation``, ``data.padding_free``, a note) for the ``model`` and ``data`` sections:
    as given unless the kernel is ``auto``, which becomes flex_attention with padding-free passes where
    :func:`flex_refusal` has no reason, else None (the model's default) with ``data.padding_free`` as given."""
    if model.attn_implementation != AUTO:
        return model.attn_implementation, data.padding_free, None
    why = flex_refusal([p for p in (model.path, model.reference_path) if p], tp_size, cuda, sp_size, pp_size)
    if why is None:
        note = (
            "flex_attention, every pass padding-free (a block mask over one row of documents: no dense mask)"
        )
        return "flex_attention", True, f"model.attn_implementation auto: {note}"
    return None, data.padding_free, f"model.attn_implementation auto: the model's default kernel ({why})"
