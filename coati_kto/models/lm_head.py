"""A causal LM's output projection found through any wrapper (:class:`LMHead`), and a model's completion
log-probs on one batch (:func:`model_sequence_logps`): through the chunked head where it is exact, else through
the model's logits (``coati_kto.models.logprobs`` holds both computations).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from coati_kto.families import plain_head, text_vocab_size
from coati_kto.models.last_mlp import reading, skips_unread_mlp
from coati_kto.models.logprobs import completion_logits_to_keep, hidden_sequence_logps, sequence_logps
from coati_kto.models.lora import base_module


def _is_distributed(weight: torch.Tensor) -> bool:
    try:
        from colossalai.tensor.d_tensor import is_distributed_tensor
    except ImportError:  # colossalai absent: plain torch models only
        return False
    return is_distributed_tensor(weight)


def _real_rows(tensor: torch.Tensor, vocab: int) -> torch.Tensor:
    """``tensor``'s first ``vocab`` rows; the tensor itself when it has no others: a slice, even a whole one, has
    a backward that zero-fills a gradient of the full shape and copies into it (two passes over the head's size
    per gradient pass)."""
    return tensor if tensor.shape[0] == vocab else tensor[:vocab]


class LMHead:
    """The output projection of a causal LM, found through any ColossalAI wrapper, for the chunked path.

    ``weight`` is [V, H] restricted to the real vocabulary (shardformer's PaddingLMHead pads rows to a multiple
    of 64; those rows are not tokens). :meth:`capture` runs the model with the head fed zero positions and
    returns the hidden states it would have projected.
    """

    def __init__(self, module: torch.nn.Module, vocab: int) -> None:
        self.module, self.vocab = module, vocab

    @property
    def weight(self) -> torch.Tensor:
        return _real_rows(self.module.weight, self.vocab)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.module, "bias", None)
        return None if bias is None else _real_rows(bias, self.vocab)

    @property
    def compiled(self) -> bool:
        """Whether the chunks run compiled (``coati_kto.models.compile.compile_layers`` marks the head)."""
        return bool(getattr(self.module, "coati_compiled_chunks", False))

    @classmethod
    def find(cls, model: torch.nn.Module) -> LMHead | None:
        """The head when the chunked path is exact for ``model``; None (use logits) otherwise.

        None for: heads that are not plain (``coati_kto.families.plain_head``), a vocabulary-parallel head (tensor parallelism: each
        rank holds a slice), and parameters not resident (a backend that keeps them in chunks outside the forward).
        """
        inner = model.unwrap(unwrap_peft=False) if hasattr(model, "unwrap") else model
        config = getattr(inner, "config", None)
        if not plain_head(config):
            return None
        head = inner.get_output_embeddings()
        if hasattr(head, "base_layer"):
            return None  # a LoRA-adapted head: its weight alone is not the projection
        weight = getattr(head, "weight", None)
        vocab = int(getattr(head, "old_num_embeddings", None) or config.vocab_size)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < vocab:
            return None  # parameters released outside the forward (empty), or a vocabulary slice
        if _is_distributed(weight):
            return None  # tensor parallelism: each rank holds a vocabulary slice
        return cls(head, vocab)

    @staticmethod
    def vocab_parallel(model: torch.nn.Module) -> bool:
        """Whether ``model``'s head is plain but sliced over the vocabulary (tensor parallelism): the model's own
        logits (gathered whole on every rank: the plan builds the plugin with ``parallel_output=False``) are
        then exact where the chunked head cannot run."""
        inner = model.unwrap(unwrap_peft=False) if hasattr(model, "unwrap") else model
        if not plain_head(getattr(inner, "config", None)):
            return False
        weight = getattr(inner.get_output_embeddings(), "weight", None)
        return isinstance(weight, torch.Tensor) and _is_distributed(weight)

    def capture(self, model: Any, **inputs: Any) -> torch.Tensor:
        """Run ``model(**inputs)`` and return the head's input [B, K, H]; the head itself projects 0 positions."""
        captured: list[torch.Tensor] = []

        def hook(module, args):
            captured.append(args[0])
            return (args[0][..., :0, :], *args[1:])

        handle = self.module.register_forward_pre_hook(hook)
        try:
            model(**inputs)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise RuntimeError(f"the LM head ran {len(captured)} times in one forward (expected once)")
        return captured[0]


def model_sequence_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: Any,
    loss_mask: torch.Tensor,
    head: LMHead | None,
    keep: int | None = None,
    targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    vision: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Completion log-probs [B] fp32 of ``model`` on one batch: through ``head`` when given, else the logits.

    ``attention_mask``: what the model takes, the 2D [B, S] mask or prepared 4D masks (a mapping per layer type
    where layers mix windows; ``coati_kto.models.packing.padded_attention``) or None (no padding).

    ``keep`` and ``targets``: the completion positions planned on the host for ``loss_mask``
    (``TokenView.planned``); without them they are read from the mask on its device (host syncs on a GPU).

    ``cache``: a transformers KV cache the forward continues from and fills (``coati_kto.models.continuation``),
    with ``position_ids`` [B, S] where the rows do not start at 0. Without it, no cache is kept.

    ``vision``: the view's image keywords, added to the forward's (``coati_kto.models.vision.vision_keywords``: the
    shared features, the token types; or ``pixel_values`` and the like, which run the tower in this forward).

    Either way only the positions from the first completion token on are projected (``logits_to_keep``).
    Shardformer's tensor-parallel forwards ignore or refuse ``logits_to_keep`` and return all S positions; both
    paths read K from the shape they get.
    """

    module = base_module(model)  # under a LoRA PeftModel too (ColossalAI's unwrap() has no forward there)
    inputs = forward_inputs(module.config, input_ids=input_ids, attention_mask=attention_mask)
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if vision is not None:
        inputs.update(vision)
    if cache is not None:
        inputs.update(cache=cache, use_cache=True)
    # Shardformer's tensor-parallel forwards swallow logits_to_keep (Llama) or refuse it (Qwen2, Mistral).
    if forward_accepts(module, "logits_to_keep"):
        inputs["logits_to_keep"] = keep if keep is not None else completion_logits_to_keep(loss_mask)
    read = contextlib.nullcontext()
    if keep is not None and targets is not None and skips_unread_mlp(module):
        read = reading(*targets, tuple(input_ids.shape), keep)
    with causal_sdpa_without_checks(module.config, attention_mask), read:
        if head is None:
            return _logits_logps(model, module, inputs, input_ids, loss_mask, keep, targets)
        hidden = head.capture(model, **inputs)
    planned = targets if hidden.shape[1] == keep else None
    return hidden_sequence_logps(
        hidden, head.weight, head.bias, input_ids, loss_mask, targets=planned, compiled=head.compiled
    )


def _logits_logps(
    model: Any,
    module: Any,
    inputs: dict[str, Any],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    keep: int | None,
    targets: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """:func:`model_sequence_logps` through the model's logits (no chunked head)."""
    # Log-probs normalise over the real vocabulary only: a shardformer policy that returns the padding columns of
    # a padded vocabulary as logits (ColossalAI's Qwen2 policy did: coati_kto.families.policies) would shift every
    # log-prob and train the padding rows. A no-op view when the logits are unpadded.
    logits = model(**inputs).logits[..., : text_vocab_size(module.config)]
    planned = targets if logits.shape[1] == keep else None  # a forward that ignored logits_to_keep: all S
    return sequence_logps(logits, input_ids, loss_mask, targets=planned)


# sdpa under another name, which transformers' mask builder does not know: with no mask given it then hands the
# layers none (sdpa's is_causal) without first reading the device (see causal_sdpa_without_checks).
CAUSAL_SDPA = "coati_causal_sdpa"


@functools.cache
def _register_causal_sdpa() -> None:
    """:data:`CAUSAL_SDPA` in transformers' attention functions, once per process."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


@contextlib.contextmanager
def causal_sdpa_without_checks(config: Any, attention_mask: Any) -> Iterator[None]:
    """Within: an sdpa model given no attention mask runs sdpa's causal kernel with no host sync.

    transformers 5, given no mask, looks for packed sequences in the position ids (``(mask[:, -1] == 0).all()``,
    a host sync per forward on a GPU) and, given a 2D mask, asks whether it is all ones (another). Its mask
    builder skips both for an attention implementation it has no mask function for: the same
    ``sdpa_attention_forward``, registered as :data:`CAUSAL_SDPA`, with no mask is sdpa with ``is_causal``, as
    "sdpa" with no mask is. Layers that recompute under activation checkpointing read "sdpa" again: the same
    kernel on the same (absent) mask. Anything else (a mask given, another kernel) runs unchanged.
    """
    if attention_mask is not None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register_causal_sdpa()
    config._attn_implementation = CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def forward_inputs(config: Any, **inputs: Any) -> dict[str, Any]:
    """The keywords of a log-prob forward: ``inputs``, no KV cache, and no router logits where an MoE config asks
    for them (transformers' load-balancing loss reads a 2D mask and fails on the passes' 4D ones): the policy's
    gradient pass records them itself and adds that loss over the examples' tokens (``coati_kto.models.router``)."""
    inputs["use_cache"] = False
    if getattr(config, "output_router_logits", False):
        inputs["output_router_logits"] = False
    return inputs


def forward_accepts(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module.forward`` names keyword ``name`` in its signature.

    A ``**kwargs`` catch-all does not count: transformers 5's forwards take ``**kwargs`` and hand them on to the
    attention, so a forward that does not name ``logits_to_keep`` would not slice (or would fail deeper down).
    """
    params = inspect.signature(module.forward).parameters
    return name in params and params[name].kind is not inspect.Parameter.VAR_POSITIONAL
