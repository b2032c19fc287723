"""Greedy decoding with the boosted policy or the reference, under every plugin (the evaluation's samples).

Decoding runs the Hugging Face model inside the ColossalAI wrapper (``base_module``): transformers' own generate
loop with its KV cache, never the wrapper's forward (DDP's enters a collective). Under ZeRO without tensor
parallelism (tp_size 1) the working parameters are whole on every rank, so each rank decodes its own
prompts. Under tensor parallelism the model's sharded layers hold collectives of their tensor-parallel group
(the vocabulary-parallel embedding's all-reduce, the row-parallel projections', the LM head's all-gather that
gives every rank the whole vocabulary's logits), so the ranks of a group must run the same forwards in the same
order: they decode the same prompts, their logits are equal and so are their greedy tokens; ``synced`` also keeps
every rank decoding until the last of the world is done (transformers' ``synced_gpus``: one all-reduce of a
flag per token), so no rank leaves the loop while a peer still needs it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from coati_kto.models.lora import AdapterFreeReference, base_module
from coati_kto.models.vision import vision_family


@dataclass(frozen=True)
class PromptImages:
    """The images of the prompts to decode (issue 49): every prompt's images in prompt order as the model's image
    processor gives them, the image (soft) token id, and the processor's other outputs the family's forward
    reads (Gemma 4's ``image_position_ids``, Qwen 3.5's ``image_grid_thw``)."""

    pixel_values: torch.Tensor
    image_token_id: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def _decoder(model: Any) -> tuple[Any, contextlib.AbstractContextManager]:
    """(the Hugging Face model that decodes, the context it decodes in): a LoRA run's reference is the policy
    with its adapters disabled."""
    if isinstance(model, AdapterFreeReference):
        return base_module(model.policy), model.peft.disable_adapter()
    return base_module(model), contextlib.nullcontext()


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the model's generation config's EOS (an end-of-turn token for chat
    models, e.g. ``<|im_end|>``) and the tokenizer's."""
    hf, _ = _decoder(model)
    config = getattr(hf, "generation_config", None)
    found = getattr(config, "eos_token_id", None)
    ids = list(found) if isinstance(found, list | tuple) else [found]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return sorted({int(i) for i in ids if i is not None})


def greedy_generate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos: list[int],
    device: torch.device,
    synced: bool,
    images: PromptImages | None = None,
) -> list[list[int]]:
    """The greedy completion of each prompt: token ids up to and including the first of ``eos``, at most
    ``max_new_tokens`` (at least one token).

    Prompts are left-padded into one batch. The ranks of a tensor-parallel group call with the same prompts;
    with ``synced`` every rank of the world calls once (any prompts). The model's dropout must be off (the
    trainer sets every dropout to 0) and its mode is left as found.
    """
    if not prompts:
        raise ValueError("greedy_generate: no prompts")
    hf, context = _decoder(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        mask[b, width - len(prompt) :] = 1
    vision = _vision_keywords(hf.config, images, ids, mask, device) if images is not None else {}
    if images is not None:  # an image token in a completion has no image to fill it: scoring it would raise
        vision["suppress_tokens"] = [images.image_token_id]
    with torch.no_grad(), context:
        out = hf.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
            eos_token_id=eos,
            synced_gpus=synced,
            **vision,
        )
    return [_until_eos(row, eos) for row in out[:, width:].tolist()]


def _vision_keywords(
    config: Any, images: PromptImages, ids: torch.Tensor, mask: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    """``generate``'s image keywords for left-padded ``ids``: the pixels, the family's extras and token types."""
    family = vision_family(config)
    types = ((ids == images.image_token_id) & mask.bool()).long()
    extras = {k: v for k, v in images.extras.items() if k in family.tower_keys + family.text_keys}
    keywords = {"pixel_values": images.pixel_values, family.token_types: types, **extras}
    return {k: v.to(device) for k, v in keywords.items()}


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """``tokens`` cut after the first EOS (generate pads a finished row, possibly with an EOS id)."""
    for k, token in enumerate(tokens):
        if token in eos:
            return tokens[: k + 1]
    return tokens
