"""Activation bytes per rank of KTO's gradient pass, and of the LM head that turns it into log-probs.

The gradient pass runs ``train.micro_batch_size`` rows of up to ``data.max_length`` tokens (the bound: every
example at the longest; ``data.padding_free`` runs the same tokens as one row, so the same bound). Per token
and decoder layer autograd keeps what :func:`layer_bytes` lists (the norms whole on every tensor-parallel
rank, attention and MLP split by tp), and one layer's backward holds its MLP's gradients on top
(:func:`backward_bytes`).
A pipeline stage keeps what its own layers keep for each micro-batch in flight (``activation_bytes``'s
``layers`` and ``in_flight``); only the last stage runs the final norm and the head.

With ``model.gradient_checkpointing`` only each layer's input (hidden) is kept, and one layer's activations
are alive again while it is recomputed. Sequence parallelism (sp ranks) divides the tokens.

Padding-free rows under a dense-mask kernel (sdpa, eager: ``coati_kto.models.packing``) also hold the additive
mask [R, 1, L, L] in the working dtype for the whole pass (one per window where layers mix windows: counted
once here); the bound is R = micro-batch rows of L = ``data.max_length``. Sequence parallelism does not divide it: the attention sees whole
rows on every sp rank. It is a bound: rows of one document each (every example at the longest) need no mask
(``coati_kto.models.packing``), and flex_attention (a block mask) holds no such tensor.

Padded rows under sdpa (``data.padding_free`` off, and every pipeline stage) get transformers' boolean padding
mask [R, 1, L, L] where a micro-batch's rows differ in length; sdpa turns it into the working dtype in every
layer and keeps that copy for the backward, with the grouped key-value heads repeated (measured on the CPU: per
layer, R L^2 working bytes more than the same rows unpadded). Under checkpointing only the recomputed layer keeps
one. The bound is every example at the longest but one (a micro-batch holds at least 2 rows). Eager attention
adds the mask without keeping it, flash attention and flex_attention build none.

The LM head: no [B, S, V] logits where the chunked head runs (``coati_kto.models.logprobs``: tp 1 and a plain
head): the completion positions' hidden states, the logits kept for the backward while positions x vocabulary
is under 2**24 fp32 elements (x16 on a GPU), and two fp32 blocks of 2**23 elements (2**26 on a GPU). Above
tp 1 the logits path: the [B, S, V] logits (each rank gathers the whole vocabulary row), their gradient, the
rank's vocabulary slice, and two fp32 chunks of 2**22 elements (2**26 on a GPU). At tp 1 a model whose head is
not plain (``coati_kto.families.plain_head`` of its config, the runtime's test) takes the logits path with nothing
gathered: the logits, their gradient and the two chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coati_kto.parallel.model_shape import ModelShape

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
    padded_mask: bool = False  # padded rows under sdpa: a [R, 1, L, L] mask per layer (module docstring)
    fused_norms: bool = False  # model.fused_norms: the RMSNorms keep less (layer_bytes)
    train_vision: bool = False  # model.train_vision: a vision-language model's tower trains too
    fused_optimizer: bool = False  # train.fused_optimizer: MixedAdamW's step makes no fp32 gradient copy
    reference_shape: ModelShape | None = None  # model.reference_path's; None: the policy's model

    @classmethod
    def from_config(cls, config: Any, device: str = "gpu") -> Workload:
        """The workload of a validated ``Config``. Whether its head is plain is read from ``model.path``'s
        config.json (``model_shape.head_is_plain``): the model type alone cannot tell (Gemma 3's depends on its
        soft-capping, a LLaVA's text model is a Llama); ``model.reference_path``'s shape from its config.json
        (ConfigError one line where it cannot be read)."""
        from coati_kto.parallel.model_shape import head_is_plain, model_shape

        lora, attention = config.model.lora, config.model.attn_implementation
        ref = config.model.reference_path
        return cls(
            micro_batch=config.train.micro_batch_size,
            length=config.data.max_length,
            checkpointing=config.model.gradient_checkpointing,
            eager_attention=config.model.attn_implementation == "eager",
            plain_head=head_is_plain(config.model.path),
            reference=config.kto.reference,
            lora_rank=lora.rank if lora is not None else 0,
            lora_targets=list(lora.target_modules) if lora is not None else [],
            state_dtype=config.train.optimizer_state_dtype,
            accumulation_steps=config.train.accumulation_steps,
            device=device,
            dense_mask=config.data.padding_free and attention != "flex_attention",
            # pipeline stages run padded rows whatever data.padding_free says
            padded_mask=attention == "sdpa" and (not config.data.padding_free or config.plugin.pp_size > 1),
            fused_norms=config.model.fused_norms,
            train_vision=config.model.train_vision,
            fused_optimizer=config.train.fused_optimizer,
            reference_shape=model_shape(ref, "model.reference_path") if ref else None,
        )


def layer_bytes(
    shape: Any,
    tp: int,
    sp: int,
    length: int,
    working: int,
    eager: bool,
    repeat_kv: bool = False,
    fused_norms: bool = False,
) -> int:
    """Bytes per token that autograd keeps in one decoder layer, per rank (a Llama-style layer under transformers
    5; checked to the byte in fp32 on the CPU by benchmarks/sp_memory_bench.py):

    - each RMSNorm, whole on every tensor-parallel rank: its input in fp32 (4 h: the input itself, or an fp32
      copy), the normalized and the output in the working dtype (2 b h), its rsqrt (4); ``fused_norms``
      (``model.fused_norms``: one kernel, coati_kto.models.norms) its input and output in the working dtype and
      the rsqrt (2 b h + 4);
    - attention, per tensor-parallel rank: q and k after rotary and v as the kernel gets them (b (q + 2 kv);
      ``repeat_kv``, eager, or sdpa with a dense mask, repeats grouped key-value heads: kv = q), the kernel's output (b q), its log-sum-exp (4 per head); under sp one
      more b q (the all_to_all's output o_proj keeps); eager also its scores and probabilities (2 b heads length);
    - the MLP: gate, up, the activation and the product (4 b intermediate / tp); a mixture of experts (transformers
      5's grouped experts) keeps them for each of a token's top-k experts and its shared expert (4 b x
      :func:`mlp_width` / tp) and, whole, each routed expert's copy of the token's input and its
      weighted output with their two int64 indices (top-k x (2 b h + 16); not counted: the router's scores, a
      gated shared expert's output).
    """
    h, b = shape.hidden, working
    q = shape.heads * shape.head_dim
    kv = q if eager or repeat_kv else shape.kv_heads * shape.head_dim
    norms = 2 * (2 * b * h + 4 if fused_norms else 4 * h + 2 * b * h + 4)
    routed = getattr(shape, "routed_experts", 0) * (2 * b * h + 16)  # MoE: whole on every rank
    mlp = 4 * b * mlp_width(shape)
    split = b * ((3 if sp > 1 else 2) * q + 2 * kv) + 4 * shape.heads + mlp
    if eager:
        split += 2 * b * shape.heads * length
    return norms + routed + -(-split // tp)


def backward_bytes(shape: Any, tp: int, working: int, checkpointing: bool) -> int:
    """Bytes per token one layer's backward holds on top (its MLP's gradients: 3 b intermediate, 2 b with
    checkpointing; measured, benchmarks/sp_memory_bench.py's "rest" column). A mixture of experts: of every
    expert the token runs through at once (:func:`mlp_width`: the grouped experts' backward)."""
    return (2 if checkpointing else 3) * working * -(-mlp_width(shape) // tp)


def mlp_width(shape: Any) -> int:
    """The intermediate width a token's MLP runs: ``ModelShape.mlp_intermediate`` (a mixture of experts: top-k x
    the expert's + a shared expert's), else ``intermediate`` (a dense model, benchmarks/sp_memory_bench.py's)."""
    return getattr(shape, "mlp_intermediate", 0) or shape.intermediate


def activation_bytes(
    shape: Any,
    tp: int,
    sp: int,
    working: int,
    work: Workload,
    layers: int | None = None,
    in_flight: int = 1,
    last: bool = True,
) -> tuple[int, int, list[str]]:
    """(decoder activations, LM head bytes, notes) per rank for ``work``'s gradient pass: ``layers`` decoder
    layers (default: all), their kept activations for ``in_flight`` micro-batches at once (a pipeline stage,
    ``coati_kto.parallel.stages.in_flight``), the final norm and the head where ``last``."""
    layers = shape.layers if layers is None else layers
    tokens = -(-work.micro_batch * work.length // sp)
    eager = work.eager_attention
    repeat_kv = work.dense_mask or work.padded_mask
    per_layer = layer_bytes(shape, tp, sp, work.length, working, eager, repeat_kv, work.fused_norms) * tokens
    kept = shape.hidden * tokens * working if work.checkpointing else per_layer
    decoder = in_flight * layers * kept + (per_layer if work.checkpointing else 0)  # + one layer recomputed
    decoder += backward_bytes(shape, tp, working, work.checkpointing) * tokens
    if last:
        decoder += 2 * shape.hidden * tokens * working  # the final norm's input and output
    notes = []
    if work.dense_mask:  # whole rows on every sp rank: not divided by sp
        decoder += in_flight * work.micro_batch * work.length * work.length * working
        notes.append(
            f"up to a dense [{work.micro_batch}, 1, {work.length}, {work.length}] mask (padding-free rows that pack "
            "several documents; none where each row is one document)"
        )
    if work.padded_mask:  # each layer's own copy; under checkpointing only the recomputed layer keeps one
        masks = 1 if work.checkpointing else in_flight * layers
        decoder += masks * work.micro_batch * work.length * work.length * working
        notes.append(
            f"up to {masks} [{work.micro_batch}, 1, {work.length}, {work.length}] padding mask{'s' * (masks > 1)} "
            "(sdpa keeps one per layer in the working dtype where a micro-batch's rows differ in length)"
        )
    if not last:
        return decoder, 0, ["none on this stage (the last stage holds it)", *notes]
    head, note = _head_bytes(shape, tp, tokens, working, work)
    return decoder, head, [note, *notes]


def _head_bytes(shape: Any, tp: int, tokens: int, working: int, work: Workload) -> tuple[int, str]:
    vocab = shape.vocab
    if tp == 1 and work.plain_head:
        kept = 4 * tokens * vocab if tokens * vocab <= HEAD_KEEP[work.device] else 0
        blocks = 2 * 4 * min(tokens * vocab, HEAD_BLOCK[work.device])
        return tokens * shape.hidden * working + kept + blocks, "chunked: no [B, S, V] logits"
    chunks = 2 * 4 * min(tokens * vocab, LOGITS_CHUNK[work.device])
    if tp == 1:  # a head that is not lm_head(hidden) alone: the model's logits, nothing gathered
        return (
            2 * tokens * vocab * working + chunks,
            "the [B, S, V] logits and their gradient (not a plain head)",
        )
    logits = 2 * tokens * vocab * working + tokens * -(-vocab // tp) * working
    return logits + chunks, "the [B, S, V] logits (tensor parallelism gathers the vocabulary)"
