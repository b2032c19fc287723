"""The memory plan's arithmetic, number by number, on the tiny Llama (vocabulary 512, hidden 64, 2 layers, 4 heads,
intermediate 128) and Llama 3.1 8B's shape (benchmarks/model_shapes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coati_kto.parallel.activations import Workload, activation_bytes, backward_bytes, layer_bytes
from coati_kto.parallel.layout_search import RULE, fitting_layouts, largest_micro_batch, usable_bytes
from coati_kto.parallel.memory_plan import GIB, Layout, plan_memory
from coati_kto.parallel.model_shape import ModelShape, model_shape

REPO = Path(__file__).resolve().parents[3]
# The tiny Llama by hand: embeddings and head 2 x 512 x 64; per layer q, k, v, o 4 x 64 x 64 and the MLP
# 3 x 64 x 128 (split), two norms of 64 (whole); the final norm 64.
TINY_VOCAB, TINY_SPLIT, TINY_WHOLE = 2 * 512 * 64, 2 * (4 * 64 * 64 + 3 * 64 * 128), 2 * 2 * 64 + 64
TINY = TINY_VOCAB + TINY_SPLIT + TINY_WHOLE  # 147,776


@pytest.fixture(scope="module")
def tiny_shape(tiny_model_dir: Path) -> ModelShape:
    return model_shape(str(tiny_model_dir))


def test_the_shape_counts_the_instantiated_models_parameters(
    tiny_model_dir: Path, tiny_shape: ModelShape
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tiny_shape.params == sum(p.numel() for p in model.parameters()) == TINY == 147_776
    assert (tiny_shape.vocab_params, tiny_shape.split_params, tiny_shape.whole_params) == (
        TINY_VOCAB,
        TINY_SPLIT,
        TINY_WHOLE,
    )
    assert (tiny_shape.hidden, tiny_shape.layers, tiny_shape.heads, tiny_shape.intermediate) == (
        64,
        2,
        4,
        128,
    )


def test_llama_8b_shape_is_its_published_parameter_count() -> None:
    shape = model_shape(str(REPO / "benchmarks" / "model_shapes" / "llama-3.1-8b"))
    assert shape.params == 8_030_261_248
    assert shape.vocab_params == 2 * 128256 * 4096
    assert shape.whole_params == 65 * 4096  # 32 layers x 2 norms + the final norm


def test_weights_are_the_parameter_count_times_the_dtype(tiny_shape: ModelShape) -> None:
    work = Workload(micro_batch=2, length=8, device="cpu")
    bf16 = plan_memory(tiny_shape, Layout("hybrid_parallel", "bf16", 0), work)
    fp32 = plan_memory(tiny_shape, Layout("ddp", "fp32", 0), work)
    assert (bf16.weights, fp32.weights) == (2 * TINY, 4 * TINY)
    # AMP at one rank: fp32 masters and moments whole, bf16 gradients, their fp32 copies at the step
    assert (bf16.masters, bf16.moments, bf16.gradients, bf16.step_copies) == (
        4 * TINY,
        8 * TINY,
        2 * TINY,
        4 * TINY,
    )
    assert (fp32.masters, fp32.moments, fp32.gradients, fp32.step_copies) == (0, 8 * TINY, 4 * TINY, 0)
    assert (bf16.reference, fp32.reference, bf16.communication, fp32.communication) == (
        2 * TINY,
        4 * TINY,
        0,
        0,
    )


def test_zero2_over_four_ranks_shards_masters_moments_and_gradients(tiny_shape: ModelShape) -> None:
    plan = plan_memory(tiny_shape, Layout("hybrid_parallel", "bf16", 2, dp=4), Workload(2, 8, device="cpu"))
    quarter = TINY // 4  # 36,944
    assert (plan.gradients, plan.masters, plan.moments, plan.step_copies) == (
        2 * quarter,
        4 * quarter,
        8 * quarter,
        4 * quarter,
    )
    assert (
        plan.communication == 2 * 2 * TINY
    )  # bucket and reduce-scatter output, the model under 12M elements
    zero1 = plan_memory(tiny_shape, Layout("hybrid_parallel", "bf16", 1, dp=4), Workload(2, 8, device="cpu"))
    assert (zero1.gradients, zero1.masters) == (2 * TINY, 4 * quarter)
    ddp = plan_memory(tiny_shape, Layout("ddp", "fp32", 0, dp=4), Workload(2, 8, device="cpu"))
    assert ddp.communication == 4 * TINY  # torch DDP's buckets: the gradients' size
    offload = plan_memory(
        tiny_shape, Layout("low_level_zero", "bf16", 2, dp=4, cpu_offload=True), Workload(2, 8, device="cpu")
    )
    # masters, moments and the step's fp32 gradients in host memory: 4 + 8 + 4 bytes per owned parameter
    assert (offload.masters, offload.moments, offload.host, offload.step_copies) == (0, 0, 16 * quarter, 0)


def test_tensor_parallelism_splits_projections_and_padded_vocabulary(tiny_shape: ModelShape) -> None:
    assert tiny_shape.params_per_rank(2) == TINY_VOCAB // 2 + TINY_SPLIT // 2 + TINY_WHOLE
    # a vocabulary of 500 is padded to 512 (a multiple of 64 x 2) before the split
    odd = dataclasses.replace(tiny_shape, vocab=500, vocab_params=2 * 500 * 64)
    assert odd.params_per_rank(1) == 2 * 500 * 64 + TINY_SPLIT + TINY_WHOLE
    assert odd.params_per_rank(2) == 2 * 256 * 64 + TINY_SPLIT // 2 + TINY_WHOLE


def test_lora_trains_the_adapters_and_its_reference_is_the_policy(
    tiny_model_dir: Path, tiny_shape: ModelShape
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from coati_kto.config.lora import LoraSection, peft_config

    section = LoraSection(rank=8)
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), peft_config(section))
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert tiny_shape.lora_params(8, section.target_modules) == trainable == 2 * 4 * 8 * (64 + 64)
    work = Workload(2, 8, lora_rank=8, lora_targets=section.target_modules, device="cpu")
    plan = plan_memory(tiny_shape, Layout("low_level_zero", "bf16", 2, dp=2), work)
    assert (plan.weights, plan.reference, plan.gradients, plan.moments) == (
        2 * TINY,
        0,
        trainable,
        4 * trainable,
    )
    cached = plan_memory(
        tiny_shape, Layout("ddp", "fp32", 0), Workload(2, 8, reference="cached", device="cpu")
    )
    assert cached.reference == 0


def test_activations_by_hand(tiny_shape: ModelShape) -> None:
    # per token and layer in bf16 (h 64, I 128, 4 heads of 16 over 4 key-value heads: q = kv = 64): each norm's
    # fp32 input, normalized and output, rsqrt 2 x (4 x 64 + 2 x 2 x 64 + 4) = 1032; q, k, v and the kernel's
    # output 2 x (2 x 64 + 2 x 64), the log-sum-exp 4 x 4, the MLP 4 x 2 x 128: 1552, split by tp
    assert layer_bytes(tiny_shape, 1, 1, 8, 2, eager=False) == 1032 + 1552
    assert layer_bytes(tiny_shape, 2, 1, 8, 2, eager=False) == 1032 + 776
    assert layer_bytes(tiny_shape, 1, 2, 8, 2, eager=False) == 1032 + 1552 + 2 * 64  # sp: o_proj's input too
    assert layer_bytes(tiny_shape, 1, 1, 8, 2, eager=True) == 1032 + 1552 + 2 * 2 * 4 * 8  # scores, probs
    # the fused norms keep their input and output in bf16 and the rsqrt: 2 x (2 x 2 x 64 + 4)
    assert layer_bytes(tiny_shape, 1, 1, 8, 2, eager=False, fused_norms=True) == 520 + 1552
    assert backward_bytes(tiny_shape, 1, 2, checkpointing=False) == 3 * 2 * 128
    work = Workload(micro_batch=2, length=8, device="cpu")  # 16 tokens, bf16
    decoder, head, _ = activation_bytes(tiny_shape, 1, 1, 2, work)
    assert decoder == 2 * 2584 * 16 + 768 * 16 + 2 * 64 * 16 * 2
    # the chunked head: hidden states, the kept fp32 logits (16 x 512 under 2**24), two fp32 blocks
    assert head == 16 * 64 * 2 + 4 * 16 * 512 + 2 * 4 * 16 * 512
    checkpointed, _, _ = activation_bytes(tiny_shape, 1, 1, 2, dataclasses.replace(work, checkpointing=True))
    assert checkpointed == 2 * 64 * 16 * 2 + 2584 * 16 + 2 * 2 * 128 * 16 + 2 * 64 * 16 * 2
    _, logits, _ = activation_bytes(tiny_shape, 2, 1, 2, work)  # tp 2: the logits path
    assert logits == 2 * 16 * 512 * 2 + 16 * 256 * 2 + 2 * 4 * 16 * 512


def test_the_peak_is_static_plus_the_larger_of_backward_and_step(tiny_shape: ModelShape) -> None:
    plan = plan_memory(tiny_shape, Layout("hybrid_parallel", "bf16", 2, dp=2), Workload(2, 64, device="cpu"))
    assert plan.static == plan.weights + plan.masters + plan.moments + plan.reference + plan.communication
    assert plan.peak == plan.static + max(plan.activations + plan.head, plan.gradients + plan.step_copies)
    accumulate = Workload(2, 64, accumulation_steps=2, device="cpu")
    many = plan_memory(tiny_shape, Layout("hybrid_parallel", "bf16", 2, dp=2), accumulate)
    assert many.peak == plan.static + plan.activations + plan.head + plan.gradients


def _llama_8b() -> ModelShape:
    """Llama 3.1 8B's shape by hand (no meta model: the search tests stay fast)."""
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    return ModelShape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, 2 * 128256 * 4096, 32 * layer, 65 * 4096, ()
    )


def test_the_layouts_that_fit_come_best_first_at_their_largest_micro_batch() -> None:
    shape, budget = _llama_8b(), usable_bytes(80)
    work = Workload(micro_batch=4, length=2048, checkpointing=True)
    fits = fitting_layouts(shape, Layout("hybrid_parallel", "bf16", 2), work, 8, 8, budget, sp_axis=False)
    # without accumulation ZeRO 1 and 2 peak alike (the gradients come and go with the backward): the lower first
    assert [(f.layout.tp, f.layout.dp, f.layout.zero_stage, f.micro_batch) for f in fits][:3] == [
        (1, 8, 1, 29),
        (1, 8, 2, 29),
        (2, 4, 1, 21),
    ]
    assert RULE.startswith("best first: fewest ranks per replica")
    for fit in fits:
        assert fit.plan.peak <= budget
        bigger = dataclasses.replace(work, micro_batch=fit.micro_batch + 1)
        assert fit.micro_batch == 64 or plan_memory(shape, fit.layout, bigger).peak > budget
    keys = [(f.layout.tp * f.layout.sp, -f.micro_batch, f.layout.zero_stage) for f in fits]
    assert keys == sorted(keys)
    # one rank at ZeRO 0: 8B in full does not fit 80 GiB at any micro-batch
    assert largest_micro_batch(shape, Layout("hybrid_parallel", "bf16", 0), work, budget) is None
    assert budget == int(0.9 * 80 * GIB)


def test_candidates_follow_what_the_plugins_admit() -> None:
    from coati_kto.parallel.layout_search import candidates

    shape, hybrid = _llama_8b(), Layout("hybrid_parallel", "bf16", 2)
    layouts = candidates(hybrid, shape, 16, 8, sp_axis=False)
    assert sorted({(x.tp, x.dp) for x in layouts}) == [(1, 16), (2, 8), (4, 4), (8, 2)]  # tp within a node
    assert {x.tp for x in candidates(hybrid, shape, 16, 8, sp_axis=False, lora=True)} == {
        1
    }  # LoRA: tp 1 only
    # one data-parallel rank runs ZeRO as 0 (the AMP optimizer); fp32 hybrid has no ZeRO; ddp none
    assert {x.zero_stage for x in candidates(hybrid, shape, 8, 8, sp_axis=False) if x.dp == 1} == {0}
    fp32 = candidates(Layout("hybrid_parallel", "fp32", 0), shape, 8, 8, sp_axis=False)
    assert {x.zero_stage for x in fp32} == {0}
    assert candidates(Layout("ddp", "fp32", 0), shape, 8, 8, sp_axis=False) == [
        Layout("ddp", "fp32", 0, 1, 8)
    ]
    low = candidates(Layout("low_level_zero", "bf16", 2), shape, 8, 8, sp_axis=False)
    assert [(x.tp, x.zero_stage) for x in low] == [(1, 1), (1, 2)]
    with_sp = candidates(hybrid, shape, 8, 8, sp_axis=True)
    assert (1, 2, 4) in {(x.tp, x.sp, x.dp) for x in with_sp}


def test_padding_free_dense_kernels_hold_the_whole_row_mask_on_every_sp_rank(tiny_shape: ModelShape) -> None:
    """Padding-free rows under sdpa or eager hold the [R, 1, L, L] mask in the working dtype: 2 x 16 x 16 x 4 B
    here, added whole at sp 1 and at sp 2 alike (the attention sees whole rows), while the tokens' share halves."""
    work = Workload(micro_batch=2, length=16, device="cpu")
    masked = dataclasses.replace(work, dense_mask=True)
    for sp in (1, 2):
        plain, _, _ = activation_bytes(tiny_shape, 1, sp, 4, work)
        with_mask, _, notes = activation_bytes(tiny_shape, 1, sp, 4, masked)
        assert with_mask - plain == 2 * 16 * 16 * 4
        assert notes[-1].startswith("up to a dense [2, 1, 16, 16] mask (padding-free rows that pack")


# Mixtral 8x7B's config.json: Llama 3 8B's layer but for 8 experts of intermediate 14336, 2 of them per token.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def _shape_of(tmp_path: Path, raw: dict) -> ModelShape:
    folder = tmp_path / raw["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return model_shape(str(folder))


def test_moe_activations_run_each_token_through_its_top_k_experts(tmp_path: Path) -> None:
    """transformers 5's grouped experts keep a token's gate, up, activation and product for each of its top-k
    experts, and each routed expert's copy of its input and weighted output (2 b h, two int64 indices): Mixtral
    8x7B at micro-batch 2 x 2048 in bf16 keeps 39.24 GiB, not Llama 3 8B's 20.91 (one dense MLP of 14336)."""
    shape = _shape_of(tmp_path, MIXTRAL_8X7B)
    assert (shape.intermediate, shape.mlp_intermediate, shape.routed_experts) == (14336, 2 * 14336, 2)
    dense = dataclasses.replace(shape, mlp_intermediate=0, routed_experts=0)
    assert layer_bytes(shape, 1, 1, 2048, 2, eager=False) - layer_bytes(
        dense, 1, 1, 2048, 2, eager=False
    ) == (4 * 2 * 14336 + 2 * (2 * 2 * 4096 + 16))
    # at tp 2 the experts' intermediates split, the routed copies stay whole
    assert layer_bytes(shape, 2, 1, 2048, 2, eager=False) - layer_bytes(
        dense, 2, 1, 2048, 2, eager=False
    ) == (4 * 2 * 14336 // 2 + 2 * (2 * 2 * 4096 + 16))
    assert backward_bytes(shape, 1, 2, checkpointing=False) == 3 * 2 * 2 * 14336
    work = Workload(micro_batch=2, length=2048, fused_norms=True)  # bf16, no checkpointing
    plan = plan_memory(shape, Layout("hybrid_parallel", "bf16", 2, dp=8), work)
    assert round(plan.activations / GIB, 2) == 39.24
    assert (
        round(plan_memory(dense, Layout("hybrid_parallel", "bf16", 2, dp=8), work).activations / GIB, 2)
        == 20.91
    )


def test_moe_widths_add_a_shared_expert_and_read_the_experts_own_size(tmp_path: Path) -> None:
    """Qwen3-MoE: top-k x moe_intermediate_size (not the dense intermediate_size); Qwen2-MoE adds its shared
    expert; a layer without experts (mlp_only_layers) is as wide as intermediate_size. Either name of the
    experts' count Qwen3-MoE's attribute_map relates is a config.json's (transformers 5 writes num_local_experts)."""
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    sizes |= {"head_dim": 16, "vocab_size": 512, "num_experts": 8, "num_experts_per_tok": 4}
    qwen3 = {"model_type": "qwen3_moe", "intermediate_size": 96, "moe_intermediate_size": 32, **sizes}
    local = {k: v for k, v in qwen3.items() if k != "num_experts"} | {"num_local_experts": 8}
    shape = _shape_of(tmp_path, local)
    assert (shape.intermediate, shape.mlp_intermediate, shape.routed_experts) == (96, 4 * 32, 4)
    qwen2 = {"model_type": "qwen2_moe", "intermediate_size": 96, "moe_intermediate_size": 32, **sizes}
    shape = _shape_of(tmp_path, {**qwen2, "shared_expert_intermediate_size": 48})
    assert (shape.mlp_intermediate, shape.routed_experts) == (4 * 32 + 48, 4)
    (tmp_path / "qwen3_moe" / "config.json").write_text(json.dumps({**qwen3, "mlp_only_layers": [0]}))
    assert model_shape(str(tmp_path / "qwen3_moe")).mlp_intermediate == 4 * 32  # the wider MoE layer
    (tmp_path / "qwen3_moe" / "config.json").write_text(
        json.dumps({**qwen3, "mlp_only_layers": [0], "intermediate_size": 256})
    )
    assert model_shape(str(tmp_path / "qwen3_moe")).mlp_intermediate == 256  # the wider dense layer
    assert (_llama_8b().mlp_intermediate, _llama_8b().routed_experts) == (0, 0)  # dense: intermediate


def test_the_logits_path_at_tp_1_gathers_nothing(tiny_shape: ModelShape) -> None:
    """A family without a plain head (not HEAD_FAMILIES: qwen3_moe, gpt2) at tp 1: the [B, S, V] logits and their
    gradient, no third [B, S, V] of a vocabulary slice; above tp 1 the gathered logits, their gradient, the slice."""
    work = Workload(micro_batch=2, length=8, plain_head=False, device="cpu")  # 16 tokens, bf16
    _, head, notes = activation_bytes(tiny_shape, 1, 1, 2, work)
    assert head == 2 * 16 * 512 * 2 + 2 * 4 * 16 * 512
    assert notes[0] == "the [B, S, V] logits and their gradient (not a plain head)"
    _, head, notes = activation_bytes(tiny_shape, 2, 1, 2, work)
    assert head == 2 * 16 * 512 * 2 + 16 * 256 * 2 + 2 * 4 * 16 * 512
    assert notes[0] == "the [B, S, V] logits (tensor parallelism gathers the vocabulary)"


def test_lora_params_match_dotted_targets_as_peft_does(tiny_model_dir: Path, tiny_shape: ModelShape) -> None:
    """``self_attn.q_proj`` names every layer's q_proj for peft (a suffix after a dot): the plan counted 0."""
    import peft
    from transformers import AutoModelForCausalLM

    targets = ["self_attn.q_proj", "layers.1.self_attn.v_proj", "mlp.down_proj"]
    config = peft.LoraConfig(r=8, target_modules=targets)
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    # q_proj in both layers, v_proj in layer 1, down_proj (intermediate 128 -> 64) in both
    assert tiny_shape.lora_params(8, targets) == trainable == 8 * (2 * 128 + 128 + 2 * (128 + 64))
    assert (
        tiny_shape.lora_params(8, ["attn.q_proj", "q"]) == 0
    )  # a suffix counts only after a dot, as in peft
