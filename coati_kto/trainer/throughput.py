"""Model FLOPs of the passes a step actually runs, and MFU against a per-device peak.

FLOPs per non-padding token: 2 N for a forward pass; for a forward + backward, 6 per parameter that takes a
gradient and 4 per frozen one it runs through (its input gradient only: LoRA's base, no weight gradient). The
usual dense-transformer estimate: attention's S^2 term is left out, gradient-checkpointing recomputation is not
counted (it is not model work). N counts the parameters a text token runs through: not the input embeddings (a
lookup, no multiply-adds; a head tied to them counts once), not a vision tower or projector (image tokens' work),
an MoE's experts at the share its router sends a token to (top-k of the experts), and with LoRA's adapters off
(the reference of a LoRA run) not the adapters, and the LM head at the config's vocabulary (not the rows a
plugin pads it to, 64 x tp). Passes that do not run (a cached reference) add nothing.

MFU = model FLOPs per second / (peak per device x devices). The peak comes from ``train.peak_flops`` or, for
bf16/fp16 training on a GPU listed in :data:`PEAK_FLOPS`, from the device name; otherwise MFU is not logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from coati_kto.models.lora import AdapterFreeReference, base_module
from coati_kto.parallel.model_shape import SHARED_EXPERTS

# The config keys of an MoE's expert count and of the experts each token is routed to, across families.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")

# Dense bf16/fp16 tensor-core peak per device, FLOP/s (vendor datasheets, no sparsity), matched as substrings
# of torch.cuda.get_device_name(), first match wins (more specific names first).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("RTX A6000", 155e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def table_peak_flops(device_name: str) -> float | None:
    """The table's dense bf16/fp16 peak for ``device_name`` (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    for key, peak in PEAK_FLOPS:
        if key in device_name:
            return peak
    return None


def resolve_peak_flops(configured: float | None, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it came from): ``train.peak_flops`` first, then the table.

    The table holds bf16/fp16 peaks, so fp32 training (and CPUs) get a peak only when the user sets one.
    """
    if configured:
        return configured, "train.peak_flops"
    if precision not in ("bf16", "fp16") or not torch.cuda.is_available():
        return None, f"unknown for {precision} on this device (set train.peak_flops)"
    name = torch.cuda.get_device_name()
    peak = table_peak_flops(name)
    return (peak, f"table: {name}") if peak else (None, f"unknown device {name!r} (set train.peak_flops)")


def peak_flops_line(peak_flops: float | None, source: str) -> str:
    """The one line rank 0 prints at setup: what train/mfu is measured against, or why it is not logged."""
    shown = (
        f"against {peak_flops:.4g} FLOP/s per device ({source})"
        if peak_flops
        else f"not logged: peak FLOP/s {source}"
    )
    return f"train/mfu {shown}"


@dataclass(frozen=True)
class FlopParams:
    """N of a model (module docstring), split by whether a parameter takes a gradient."""

    trainable: int
    frozen: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen

    def forward(self, tokens: int) -> float:
        """2 N per token of a forward pass (no gradient)."""
        return 2.0 * self.total * tokens

    def train(self, tokens: int) -> float:
        """Per token of a forward + backward pass: 6 per trained parameter, 4 per frozen one."""
        return (6.0 * self.trainable + 4.0 * self.frozen) * tokens


def flop_params(model: Any) -> FlopParams:
    """N of a (possibly boosted, possibly tensor-parallel, possibly LoRA) causal LM: the parameters of its decoder
    and LM head but the input embeddings, an MoE's experts scaled by top-k / experts, without the adapters for
    an :class:`AdapterFreeReference`. Tensor-parallel shards count at their global shape, so every rank gets the
    whole model's N (a pipeline stage its own: the stages sum them)."""
    inner = base_module(model)
    try:
        from colossalai.tensor.d_tensor import get_global_shape, is_distributed_tensor
    except ImportError:
        is_distributed_tensor = None
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    # The input embeddings are a lookup; tied to the head, their multiply-adds are the head's and count.
    skip = ({id(p) for p in embed.parameters()} if embed is not None else set()) - head_ids
    text = _text_modules(inner, head_ids)
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    routed, vocab = _routed_share(text_config), getattr(text_config, "vocab_size", None)
    experts = _routed_expert_ids(inner) if routed < 1.0 else set()
    adapters_off = isinstance(model, AdapterFreeReference)
    counts, seen = {True: 0.0, False: 0.0}, set()
    for name, p in inner.named_parameters():
        if id(p) in seen or id(p) in skip or (text is not None and id(p) not in text):
            continue
        seen.add(id(p))
        parts = name.split(".")
        if adapters_off and any(part.startswith("lora_") for part in parts):
            continue
        distributed = is_distributed_tensor is not None and is_distributed_tensor(p)
        shape = torch.Size(get_global_shape(p)) if distributed else p.shape
        numel = int(shape.numel())
        if (
            id(p) in head_ids and isinstance(vocab, int) and p.dim() == 2 and shape[0] > vocab
        ):  # shardformer's padded rows
            numel = numel // shape[0] * vocab
        counts[p.requires_grad] += numel * (routed if id(p) in experts else 1.0)
    return FlopParams(trainable=round(counts[True]), frozen=round(counts[False]))


def _text_modules(inner: Any, head_ids: set[int]) -> set[int] | None:
    """ids of the parameters a text token runs through (the decoder's and the LM head's ``head_ids``), or None
    (all of them) where the model names no decoder."""
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if decoder is None or decoder is inner:
        return None
    return {id(p) for p in decoder.parameters()} | head_ids


def _routed_expert_ids(inner: Any) -> set[int]:
    """ids of the routed experts' parameters: those of the children of an MoE block (a module with a ``router``
    or ``gate`` child) but the router and the always-on shared expert and its gate (names beginning with one of
    ``model_shape.SHARED_EXPERTS``), and those under a module named ``experts``. JetMoE's experts are ``input_linear`` / ``output_linear``; its bias, a parameter of the block
    itself, runs for every token, as a router does."""
    out: set[int] = set()
    for name, module in inner.named_modules():
        children = dict(module.named_children())
        if "router" in children or "gate" in children:
            for child_name, child in children.items():
                if child_name not in ("router", "gate") and not child_name.startswith(SHARED_EXPERTS):
                    out.update(id(p) for p in child.parameters())
        elif name.split(".")[-1] == "experts":
            out.update(id(p) for n, p in module.named_parameters() if "router" not in n.split("."))
    return out


def _routed_share(text: Any) -> float:
    """The share of an MoE's expert parameters a token runs through (top-k / experts), from its text config; 1
    for a dense model."""
    experts = next((getattr(text, k) for k in _EXPERTS if isinstance(getattr(text, k, None), int)), None)
    top_k = next((getattr(text, k) for k in _TOP_K if isinstance(getattr(text, k, None), int)), None)
    return top_k / experts if experts and top_k and 0 < top_k <= experts else 1.0


def mfu(flops_per_second: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a peak)."""
    if not peak_per_device:
        return None
    return flops_per_second / (peak_per_device * devices)
