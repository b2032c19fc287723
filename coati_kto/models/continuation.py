"""The KL pairs scored as a continuation of the examples' forward: the prompt is run once per step, not twice.

An example (x_i, y_i) and its KL pair (x_i, y_j) share the prompt x_i. The examples' padded forward fills a
transformers KV cache with every layer's keys and values; the KL pass then runs only [x_i's last token, y_j]
(``coati_kto.data.batch.KLContinuation``) at the positions continuing x_i, each token attending to the cached
prompt columns of its own row and to the KL tokens before it, never to y_i or padding:

    mask [B, 1, W, S + W]:  cached column c < |x_i| - 1,   or   new column S + u with u <= t (causal)

The log-probs are those of a separate pass over [x_i, y_j] (same positions, same visible keys; fp32
differences are summation order only). The policy's gradient pass fills the cache with gradient, the
continuation runs without (KTO's reference point is a constant), and the online reference takes the same path
(:func:`continued_logps` under no_grad), so the KL estimate is exactly 0 at step 0, as with separate passes.

Only where a cache and a 4D mask reproduce the separate pass (:func:`can_continue`): eager or sdpa attention
with no sliding window, linear or chunked attention, a forward that takes ``cache``, no recompute of
activations (checkpointing drops the cache), no compiled layers, and a family the continuation sweep found
exact (a wrong continuation would not show in training: policy and reference would share it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from coati_kto.data.batch import KLContinuation, TokenView
from coati_kto.families import MASK_POSITION_FAMILIES, packed_masks
from coati_kto.families.continuation import CONTINUATION_FAMILIES
from coati_kto.models.compile import compiled_layers
from coati_kto.models.last_mlp import recomputes
from coati_kto.models.lm_head import LMHead, forward_accepts, model_sequence_logps
from coati_kto.models.lora import base_module
from coati_kto.models.packing import padded_attention

CONTINUABLE_ATTENTION = ("eager", "sdpa")


def continuation_refusal(model: Any, check_family: bool = True) -> str | None:
    """Why ``model``'s KL pass cannot continue from its examples' KV cache and equal a separate pass (None: it
    can). ``check_family``: also require a family the continuation sweep proved
    (:data:`~coati_kto.families.continuation.CONTINUATION_FAMILIES`); the sweep itself checks without."""
    module = base_module(model)
    config = getattr(module, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in CONTINUABLE_ATTENTION:
        return f"attention {attention} (eager or sdpa)"
    if packed_masks(config) != {"": None}:
        return "layers with windows, chunks or linear attention"
    if config.model_type in MASK_POSITION_FAMILIES:
        return "positions read from the 2D mask"
    if check_family and config.model_type not in CONTINUATION_FAMILIES:
        return f"model_type {config.model_type} not proven (tests/distributed/continuation_sweep.py)"
    if not forward_accepts(module, "cache"):
        return "a forward without a cache argument"
    if recomputes(module):
        return "activation checkpointing (recomputed layers drop the cache)"
    if compiled_layers(module):
        return "compiled layers"
    return None


def can_continue(model: Any) -> bool:
    """Whether ``model``'s KL pass can continue from its examples' KV cache and equal a separate pass."""
    return continuation_refusal(model) is None


def continuation_mask(continuation: KLContinuation, cached: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, W, cached + W] additive mask of ``dtype`` (0: attend, the dtype's minimum: not) for the
    continuation over a cache of ``cached`` columns, built by broadcasts (nothing read back)."""
    visible = continuation.visible
    width = continuation.view.input_ids.shape[1]
    col = torch.arange(cached + width, device=visible.device)
    query = torch.arange(width, device=visible.device)
    allowed = torch.where(
        col[None, None, :] < cached,
        col[None, None, :] < visible[:, None, None],  # the row's prompt but its last token
        col[None, None, :] - cached <= query[None, :, None],  # the KL tokens, causally
    )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@functools.cache
def _kept_layer() -> type:
    """A transformers DynamicLayer whose first update keeps the forward's keys and values as they are (made once
    per process: transformers is imported on first use)."""
    from transformers.cache_utils import DynamicLayer

    class KeptLayer(DynamicLayer):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if self.is_initialized:
                return super().update(key_states, value_states, *args, **kwargs)
            self.device, self.keys, self.values = key_states.device, key_states, value_states
            self.is_initialized = True
            return key_states, value_states

    return KeptLayer


def _example_cache(config: Any) -> Any:
    """transformers' DynamicCache for ``config`` whose full-attention layers keep the first forward's keys and
    values as they are (:func:`_kept_layer`): its own layers first concatenate them to an empty tensor built with
    ``torch.tensor([], device=...)`` (a host-to-device copy per layer, a sync on CUDA, and a copy of every key and
    value); the continuation's update then concatenates as usual."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    cache.layers = [_kept_layer()() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def example_logps_with_cache(model: Any, example: TokenView, head: LMHead | None) -> tuple[torch.Tensor, Any]:
    """(example log-probs [B] fp32, the KV cache its padded forward filled): with gradient when grad is
    enabled. Call only where :func:`can_continue` holds."""
    cache = _example_cache(base_module(model).config)
    logps = model_sequence_logps(
        model,
        example.input_ids,
        padded_attention(model, example),
        example.loss_mask,
        head,
        example.keep,
        example.targets(),
        cache=cache,
    )
    return logps, cache


def _keep_columns(cache: Any, width: int) -> int:
    """Keep the first ``width`` cached positions of every layer (views, no copy); returns ``width``."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :width, :], layer.values[..., :width, :]
    return width


def continued_kl_logps(
    model: Any, cache: Any, cached: int, continuation: KLContinuation, head: LMHead | None
) -> torch.Tensor:
    """KL-pair log-probs [B] fp32 of ``model``, never with gradient: ``continuation`` run over ``cache``, which
    :func:`example_logps_with_cache` filled from ``cached`` columns (the example view's width) and which this
    extends (use it once)."""
    view = continuation.view
    module = base_module(model)
    dtype = head.weight.dtype if head is not None else module.get_input_embeddings().weight.dtype
    # No row sees a cached column past the longest prompt: the rest (completions, padding) leaves the cache,
    # so the continuation's attention reads only the prompts' columns.
    cached = _keep_columns(cache, min(cached, continuation.visible_width))
    with torch.no_grad():
        return model_sequence_logps(
            model,
            view.input_ids,
            continuation_mask(continuation, cached, dtype),
            view.loss_mask,
            head,
            view.keep,
            view.targets(),
            cache=cache,
            position_ids=continuation.position_ids,
        )


def continued_logps(
    model: Any, example: TokenView, continuation: KLContinuation, head: LMHead | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(example log-probs [B], KL-pair log-probs [B]) fp32 of ``model``: the examples' padded pass (with
    gradient when grad is enabled), then the KL pairs continuing from its cache, never with gradient. Call only
    where :func:`can_continue` holds and ``continuation`` was planned for ``example``'s rows."""
    logps, cache = example_logps_with_cache(model, example, head)
    return logps, continued_kl_logps(model, cache, example.input_ids.shape[1], continuation, head)
