"""``model.compile``: regional ``torch.compile`` of each decoder layer (the torchtitan way) and of the LM head's
vocabulary chunk (``coati_kto.models.logprobs``), policy and reference alike.

Each decoder layer's ``forward`` is replaced, on the instance, by a :class:`CompiledForward` that calls
``torch.compile(forward, dynamic=True)``: the module, its hooks, its state-dict keys and activation
checkpointing (which wraps the layer's ``__call__``) are untouched, and every length and batch size runs one
graph (a new length, a new micro-batch shape: no recompile; batch 1 compiles its own once; the count is shown
on the progress line, ``compiled graphs N``). Called after activation checkpointing is enabled and before
boosting (shardformer and ZeRO wrap the model around it). The reference is compiled the same way, so at step 0 policy and
reference run the same kernels on the same inputs and the log-ratios stay exactly 0.

The kernel counter (``coati_kto.testing.kernels``) sees inside a compiled region through ``REGION_HOOKS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from coati_kto.parallel.compiled import REGION_HOOKS, CompiledForward

# REGION_HOOKS and CompiledForward live one layer down, shared with the optimizer step; importable from here too.
__all__ = ["REGION_HOOKS", "CompiledForward", "compile_layers", "maybe_compile"]

_HEAD_CHUNKS: dict[Callable[..., Any], CompiledForward] = {}


def compiled_head_chunks(*functions: Callable[..., Any]) -> tuple[CompiledForward, ...]:
    """The LM head's chunk functions (``coati_kto.models.logprobs``), compiled once per process."""
    return tuple(_HEAD_CHUNKS.setdefault(f, CompiledForward(f, "head")) for f in functions)


def wants_compile(setting: bool | str) -> bool:
    """``model.compile``: true, false, or auto (on where the device is CUDA; the CPU measurement said off)."""
    if setting == "auto":
        return torch.cuda.is_available()
    return bool(setting)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM: modules of the classes its ``_no_split_modules`` names
    (e.g. LlamaDecoderLayer), outermost first; [] when the model names none."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: nn.Module) -> int:
    """Replace each decoder layer's ``forward`` with its compiled twin; returns how many. Every rank calls, on
    the fp32 model as loaded, after activation checkpointing is enabled and before boosting."""
    layers = decoder_layers(model)
    # One graph per (grad mode, frozen or not, train or eval) shared by every layer: a few; dynamo's default
    # limit of 8 per function would silently run the rest eager (policy and reference then round apart).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if not layers:
        raise ValueError(f"model.compile: {type(model).__name__} names no decoder layer (_no_split_modules)")
    for layer in layers:
        if not isinstance(layer.forward, CompiledForward):
            layer.forward = CompiledForward(layer.forward)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:  # the chunked LM head (coati_kto.models.lm_head.LMHead.compiled)
        head.coati_compiled_chunks = True
    return len(layers)


def compiled_layers(model: nn.Module) -> int:
    """How many modules under ``model`` run a compiled forward (a boosted model's wrapper keeps them)."""
    return sum(isinstance(m.__dict__.get("forward"), CompiledForward) for m in model.modules())


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (constant once every pass has run once: no recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def maybe_compile(model: nn.Module, setting: bool | str) -> nn.Module:
    """``model`` with its decoder layers compiled when ``model.compile`` (``setting``) says so; every rank."""
    if wants_compile(setting):
        compile_layers(model)
    return model


def compile_metrics(model: nn.Module) -> dict[str, float]:
    """``compiled_graphs`` (shown on the progress line; a count that grows means recompiles) when ``model``
    runs compiled layers, else {}."""
    return {"compiled_graphs": float(compiled_graphs())} if compiled_layers(model) else {}
