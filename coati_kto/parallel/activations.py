"""Activation bytes per rank of KTO's gradient pass, and of the LM head that turns it into log-probs.

The gradient pass runs ``train.micro_batch_size`` rows of up to ``data.max_length`` tokens (the bound: every
example at the longest; ``data.padding_free`` runs the same tokens as one row, so the same bound). Per token
and decoder layer autograd keeps, in the working dtype (Llama-style layer: RMSNorm, attention, gated MLP):

- the two norms' inputs and outputs: 4 x hidden, whole on every tensor-parallel rank;
- q, k and v after the rotary embedding, the attention output and its reshaped copy: (3 q + 2 kv) / tp, where
  q = heads x head_dim and kv = kv_heads x head_dim; eager attention also its scores and probabilities,
  2 x heads / tp x length per token;
- the MLP's gate and up projections, the activation and the product: 4 x intermediate / tp.

With ``model.gradient_checkpointing`` only each layer's input (hidden) is kept, and one layer's activations
are alive again while it is recomputed. Sequence parallelism (sp ranks) divides the tokens.

Padding-free rows under a dense-mask kernel (sdpa, eager: ``coati_kto.models.packing``) also hold the additive
mask [R, 1, L, L] in the working dtype for the whole pass (one per window where layers mix windows: counted once here); the bound is R =
micro-batch rows of L = ``data.max_length``. Sequence parallelism does not divide it: the attention sees whole
rows on every sp rank. It is a bound: rows of one document each (every example at the longest) need no mask
(``coati_kto.models.packing``), and flex_attention (a block mask) holds no such tensor.

The LM head: no [B, S, V] logits where the chunked head runs (``coati_kto.models.logprobs``: tp 1 and a plain
head): the completion positions' hidden states, the logits kept for the backward while positions x vocabulary
is under 2**24 fp32 elements (x16 on a GPU), and two fp32 blocks of 2**23 elements (2**26 on a GPU). Above
tp 1 the logits path: the [B, S, V] logits (each rank gathers the whole vocabulary row), their gradient, the
rank's vocabulary slice, and two fp32 chunks of 2**22 elements (2**26 on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEAD_BLOCK = {"cpu": 1 << 23, "gpu": 1 << 26}  # coati_kto.models.logprobs._HEAD_CHUNK_ELEMENTS_*
HEAD_KEEP = {"cpu": 1 << 24, "gpu": 1 << 28}  # _KEEP_LOGITS_ELEMENTS (x _GPU_SCALE on a GPU)
LOGITS_CHUNK = {"cpu": 1 << 22, "gpu": 1 << 26}  # _CHUNK_ELEMENTS (x _GPU_SCALE on a GPU)


@dataclass(frozen=True)
class Workload:
    """What a step runs, as the config says: lengths, micro-batch, checkpointing, attention, reference, LoRA."""

    micro_batch: int
    length: int
    checkpointing: bool = False
    eager_attention: bool = False
    plain_head: bool = True  # the family's logits are exactly lm_head(hidden): the chunked head may run
    reference: str = "online"
    lora_rank: int = 0
    lora_targets: list[str] = field(default_factory=list)
    state_dtype: str = "fp32"
    accumulation_steps: int = 1
    device: str = "gpu"  # the head's chunk sizes: "cpu" or "gpu"
    dense_mask: bool = False  # padding-free rows with sdpa or eager: the [R, 1, L, L] mask (module docstring)

    @classmethod
    def from_config(cls, config: Any, model_type: str, device: str = "gpu") -> Workload:
        """The workload of a validated ``Config`` whose model is of ``model_type``."""
        from coati_kto.families import HEAD_FAMILIES

        lora = config.model.lora
        return cls(
            micro_batch=config.train.micro_batch_size,
            length=config.data.max_length,
            checkpointing=config.model.gradient_checkpointing,
            eager_attention=config.model.attn_implementation == "eager",
            plain_head=model_type in HEAD_FAMILIES,
            reference=config.kto.reference,
            lora_rank=lora.rank if lora is not None else 0,
            lora_targets=list(lora.target_modules) if lora is not None else [],
            state_dtype=config.train.optimizer_state_dtype,
            accumulation_steps=config.train.accumulation_steps,
            device=device,
            dense_mask=config.data.padding_free and config.model.attn_implementation != "flex_attention",
        )


def layer_elements(shape: Any, tp: int, length: int, eager: bool) -> int:
    """Elements autograd keeps per token in one decoder layer (module docstring)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    split = 3 * q + 2 * kv + 4 * shape.intermediate + (2 * shape.heads * length if eager else 0)
    return 4 * shape.hidden + -(-split // tp)


def activation_bytes(
    shape: Any, tp: int, sp: int, working: int, work: Workload
) -> tuple[int, int, list[str]]:
    """(decoder activations, LM head bytes, notes) per rank for ``work``'s gradient pass."""
    tokens = -(-work.micro_batch * work.length // sp)
    per_layer = layer_elements(shape, tp, work.length, work.eager_attention) * tokens * working
    if work.checkpointing:
        decoder = shape.layers * shape.hidden * tokens * working + per_layer
    else:
        decoder = shape.layers * per_layer
    decoder += 2 * shape.hidden * tokens * working  # the final norm's input and output
    notes = []
    if work.dense_mask:  # whole rows on every sp rank: not divided by sp
        decoder += work.micro_batch * work.length * work.length * working
        notes.append(
            f"up to a dense [{work.micro_batch}, 1, {work.length}, {work.length}] mask (padding-free rows that pack "
            "several documents; none where each row is one document)"
        )
    head, note = _head_bytes(shape, tp, tokens, working, work)
    return decoder, head, [note, *notes]


def _head_bytes(shape: Any, tp: int, tokens: int, working: int, work: Workload) -> tuple[int, str]:
    vocab = shape.vocab
    if tp == 1 and work.plain_head:
        kept = 4 * tokens * vocab if tokens * vocab <= HEAD_KEEP[work.device] else 0
        blocks = 2 * 4 * min(tokens * vocab, HEAD_BLOCK[work.device])
        return tokens * shape.hidden * working + kept + blocks, "chunked: no [B, S, V] logits"
    chunks = 2 * 4 * min(tokens * vocab, LOGITS_CHUNK[work.device])
    logits = 2 * tokens * vocab * working + tokens * -(-vocab // tp) * working
    return logits + chunks, "the [B, S, V] logits (tensor parallelism gathers the vocabulary)"
