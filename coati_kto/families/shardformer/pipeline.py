"""What the project's shardformer policies add under pipeline parallelism (``plugin.pp_size`` > 1).

Each rank holds one stage of a transformers 5 decoder-only causal LM: the first stage the embedding, the last the
final norm and the LM head, every stage a contiguous slice of the decoder layers (ColossalAI's
``PipelineStageManager.distribute_layers``: the remainder goes to the middle stages) and the rotary embedding (a
buffer, no parameter). ColossalAI's stage forwards are written for transformers 4.51 and do not import under 5.24
(docs/pipeline_parallelism_plan.md §2): ``stage_forward`` is transformers 5's ``LlamaModel.forward`` loop
restricted to a slice, for the families whose decoder is that loop (``PIPELINE_PARALLEL_FAMILIES``).

Shardformer asks a policy which modules the rank keeps (``get_held_layers``: it frees every other parameter and
buffer), which parameters two stages share (``get_shared_params``: the tied embedding and LM head, whose
gradients the plugin sums over their two stages), and swaps the causal LM's forward for ``stage_forward`` through
a method replacement; the last stage's criterion scores its hidden states (``coati_kto.models.pipeline_stage``).
Without a stage manager none of this runs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from colossalai.shardformer.policies.base_policy import ModulePolicyDescription
from torch import nn


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``...ForCausalLM`` of ``model``, under a LoRA PeftModel too."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder(model: nn.Module) -> nn.Module:
    """The bare decoder of a ``...ForCausalLM`` (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``), under a
    LoRA PeftModel too (its LoRA layers are the decoder's own modules, so running them applies the adapters)."""
    return causal_lm(model).model


def stage_ranges(stage_manager: Any, num_layers: int) -> list[tuple[int, int]]:
    """[start, end) of the decoder layers this rank holds, one range per model chunk (one under 1F1B)."""
    per_stage = stage_manager.distribute_layers(num_layers)
    ranges = stage_manager.get_stage_index(per_stage)
    if stage_manager.is_interleave:
        return [(int(a), int(b)) for a, b in ranges]
    return [(int(ranges[0]), int(ranges[1]))]


def held_modules(model: nn.Module, stage_manager: Any) -> list[nn.Module]:
    """The modules this rank keeps (shardformer frees every other parameter and buffer): the rotary embedding
    everywhere, the embedding on the first stage, its layers, the norm and the LM head on the last stage."""
    body = decoder(model)
    held: list[nn.Module] = [body.rotary_emb]
    if stage_manager.is_first_stage(ignore_chunk=True):
        held.append(body.embed_tokens)
    for start, end in stage_ranges(stage_manager, len(body.layers)):
        held.extend(body.layers[start:end])
    if stage_manager.is_last_stage(ignore_chunk=True):
        held += [body.norm, causal_lm(model).lm_head]
    return held


def tied_pairs(model: nn.Module, stage_manager: Any) -> list[dict[int, torch.Tensor]]:
    """A tied embedding and LM head live on the first and the last stage: the plugin keeps their gradients
    equal (summed over the two stages) so both copies take the same update. A frozen tie (LoRA's base) has no
    gradient to sum, and both copies stay as loaded."""
    embedding, head = decoder(model).embed_tokens.weight, causal_lm(model).lm_head.weight
    if stage_manager.num_stages < 2 or head is not embedding or not embedding.requires_grad:
        return []
    return [{0: embedding, stage_manager.num_stages - 1: head}]


def stage_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    *,
    stage_manager: Any,
    stage_index: Any = None,
    **_batch: Any,
) -> dict[str, torch.Tensor]:
    """This stage's layers over right-padded rows; installed as the causal LM's forward by the policy.

    Every stage receives the whole micro-batch (``input_ids``, ``attention_mask`` [mb, S] long, and the batch's
    other fields, unused here) and, past the first stage, the previous stage's ``hidden_states`` [mb, S, H].
    Returns ``{"hidden_states"}`` [mb, S, H]: on the last stage after the final norm, for the pipeline's
    criterion to score with the LM head (``coati_kto.models.pipeline_stage.stage_logps``).
    """
    body = decoder(self)
    if stage_manager.is_first_stage():
        hidden_states = body.embed_tokens(input_ids)
    seq = hidden_states.shape[1]
    position_ids = torch.arange(seq, device=hidden_states.device)[None]
    masks = _layer_masks(body.config, hidden_states, attention_mask, position_ids)
    rotary = body.rotary_emb(hidden_states, position_ids=position_ids)
    start, end = stage_index if stage_index is not None else stage_ranges(stage_manager, len(body.layers))[0]
    for index in range(start, end):
        hidden_states = body.layers[index](
            hidden_states,
            attention_mask=masks(index),
            position_embeddings=rotary,
            position_ids=position_ids,
            use_cache=False,
        )
    if stage_manager.is_last_stage():
        hidden_states = body.norm(hidden_states)  # the pipeline's criterion applies the LM head
    return {"hidden_states": hidden_states}


def _layer_masks(config: Any, hidden: torch.Tensor, attention_mask: Any, position_ids: torch.Tensor) -> Any:
    """Layer index -> its attention mask, as the family's own decoder builds them: per layer type where the config
    lists types (Qwen2, Qwen3, SmolLM3: full or sliding), a sliding window for every layer where the config has one
    and no types (Mistral), else causal (Llama)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    inputs = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": attention_mask,
        "cache": None,
        "position_ids": position_ids,
    }
    types = getattr(config, "layer_types", None)
    if types is None:
        windowed = getattr(config, "sliding_window", None) is not None
        mask = (create_sliding_window_causal_mask if windowed else create_causal_mask)(**inputs)
        return lambda _index: mask
    built = {"full_attention": create_causal_mask(**inputs)}
    if "sliding_attention" in types:
        built["sliding_attention"] = create_sliding_window_causal_mask(**inputs)
    return lambda index: built[types[index]]


class PipelineStages:
    """Mixed into a shardformer ``Policy`` (which sets ``model`` and ``shard_config``)."""

    model: nn.Module
    pipeline_stage_manager: Any

    def with_stage_forward(self, policy: dict[Any, ModulePolicyDescription], lm_class: Any) -> dict:
        """``policy`` with ``lm_class``'s forward replaced by this rank's stage forward (under a stage manager).

        1F1B: the forward gets its layer range here. Interleaved: the schedule passes ``stage_index`` (the
        chunk's range) at every call, from the stage manager's ``stage_indices`` set here.
        """
        stages = self.pipeline_stage_manager
        if stages is None:
            return policy
        forward = partial(stage_forward, stage_manager=stages)
        if stages.is_interleave:
            stages.stage_indices = stage_ranges(stages, len(decoder(self.model).layers))
        else:
            forward = partial(forward, stage_index=stage_ranges(stages, len(decoder(self.model).layers))[0])
        self.append_or_create_method_replacement({"forward": forward}, policy, lm_class)  # type: ignore[attr-defined]
        return policy

    def get_held_layers(self) -> list[nn.Module]:
        if self.pipeline_stage_manager is None:
            return [self.model]
        return held_modules(self.model, self.pipeline_stage_manager)

    def get_shared_params(self) -> list[dict[int, Any]]:
        if self.pipeline_stage_manager is None:
            return []
        return tied_pairs(self.model, self.pipeline_stage_manager)
