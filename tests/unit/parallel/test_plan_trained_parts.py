"""What the memory plan counts as trained, stepped and read: a vision-language model's frozen tower, a
``model.reference_path`` of another size, ``train.fused_optimizer``'s and ``plugin.cpu_offload``'s optimizer step,
and the load's cast under tensor and pipeline parallelism (``coati_kto.parallel.memory_plan``); byte for byte on
the tiny Llama (147,776 parameters: vocabulary 512, hidden 64, 2 layers, intermediate 128)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import PLAN_CONFIG

from coati_kto.parallel.activations import Workload
from coati_kto.parallel.memory_plan import (
    Layout,
    load_host_bytes,
    plan_memory,
    plan_stages,
    precompute_weight_bytes,
)
from coati_kto.parallel.model_shape import ModelShape, model_shape

TINY = 147_776
# A Llama reference of hidden 128, intermediate 256, 4 layers, vocabulary 512, untied: embedding and head
# 2 x 512 x 128 = 131,072; per layer q, k, v, o 4 x 128 x 128 and the MLP 3 x 128 x 256 = 163,840 (x 4 =
# 655,360); norms 2 x 128 per layer and the final one: 1,152.
REF = 131_072 + 655_360 + 1_152  # 787,584
WORK = Workload(micro_batch=2, length=8, device="cpu")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> ModelShape:
    return model_shape(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json only: the plan reads nothing else."""
    folder = tmp_path_factory.mktemp("reference")
    config = {
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_vision_language_model_trains_its_language_model_and_lora_adapts_its_decoder(
    tmp_path: Path,
) -> None:
    """Tiny Gemma 3 VL: 42,832 parameters, 28,352 trained once freeze_vision_tower froze the tower and projector;
    peft's default adapters (rank 8) on the decoder only: 3,584. The plan counted 42,832 and 4,352."""
    import peft

    from coati_kto.config.lora import LoraSection, peft_config
    from coati_kto.models.hf import freeze_vision_tower
    from coati_kto.testing.tiny import FAMILIES, build_family_model, build_tokenizer

    corpus = [f"hello world this is a test of the tokenizer {i}" for i in range(50)]
    tokenizer = build_tokenizer(corpus, vocab_size=300, style=FAMILIES["gemma3_vl"][0])
    model = build_family_model("gemma3_vl", tokenizer)
    model.config.save_pretrained(tmp_path)
    total = sum(p.numel() for p in model.parameters())
    freeze_vision_tower(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    section = LoraSection(rank=8)
    fresh = build_family_model("gemma3_vl", tokenizer)
    adapters = peft.get_peft_model(fresh, peft_config(section, fresh))
    adapted = sum(p.numel() for p in adapters.parameters() if p.requires_grad)
    assert (total, trained, adapted) == (42_832, 28_352, 3_584)

    shape = model_shape(str(tmp_path))
    assert (shape.params, shape.tower_params) == (42_832, 42_832 - 28_352)
    zero = Layout("low_level_zero", "bf16", 2)
    plan = plan_memory(shape, zero, WORK)
    assert (plan.params, plan.trainable, plan.masters, plan.moments) == (
        42_832,
        28_352,
        4 * 28_352,
        8 * 28_352,
    )
    assert plan_memory(shape, zero, Workload(2, 8, device="cpu", train_vision=True)).trainable == 42_832
    lora = Workload(2, 8, device="cpu", lora_rank=8, lora_targets=list(section.target_modules))
    assert (
        shape.lora_params(8, list(section.target_modules))
        == plan_memory(shape, zero, lora).trainable
        == 3_584
    )
    # the tower is replicated on every tensor-parallel rank and held by the first pipeline stage
    text = dataclasses.replace(shape, tower_params=0)
    assert shape.params_per_rank(2) == text.params_per_rank(2) + 14_480
    assert shape.stage_params(2, 1, True, False) == text.stage_params(2, 1, True, False) + 14_480
    assert shape.stage_params(2, 1, False, True) == text.stage_params(2, 1, False, True)


def test_the_reference_path_model_is_planned_at_its_own_size(tiny: ModelShape, reference_dir: Path) -> None:
    """A reference 5x the policy: the plan sized it as the policy (2 x 147,776 B) at every step."""
    ref = model_shape(str(reference_dir))
    assert ref.params == REF
    work = Workload(2, 8, device="cpu", reference_shape=ref)
    assert plan_memory(tiny, Layout("hybrid_parallel", "bf16", 0), work).reference == 2 * REF
    # tp 2: vocabulary rows 512 (a multiple of 64 x 2) split, 2 x 256 x 128 = 65,536; projections 327,680;
    # norms whole 1,152
    tp2 = plan_memory(tiny, Layout("hybrid_parallel", "bf16", 0, tp=2), work)
    assert tp2.reference == 2 * (65_536 + 327_680 + 1_152)
    # pp 2: each stage 2 of its 4 layers (327,680 + 512 of their norms); the embedding on stage 0, the head and
    # the final norm on stage 1
    staged = plan_stages(tiny, Layout("hybrid_parallel", "bf16", 1, pp=2), work)
    assert [p.reference for p in staged] == [2 * (65_536 + 327_680 + 512), 2 * (65_536 + 327_680 + 512 + 128)]
    assert precompute_weight_bytes(tiny, work, "bf16") == 2 * REF
    # read whole in fp32 before the policy: 4 x 787,584 B, more than the policy's 6 x 147,776 B cast
    assert load_host_bytes(tiny, work, cast_rounds=True) == 4 * REF


def test_plan_reads_the_reference_paths_config(
    tiny_model_dir: Path, reference_dir: Path, tmp_path: Path
) -> None:
    from coati_kto.config.load import load_config
    from coati_kto.recipe.plan import plan_lines

    text = PLAN_CONFIG.format(model=tiny_model_dir).replace(
        "model:\n", f"model:\n  reference_path: {reference_dir}\n"
    )
    (tmp_path / "cfg.yaml").write_text(text)
    config = load_config(tmp_path / "cfg.yaml", [])
    lines = plan_lines(config, 1, 80, 1)
    assert "  reference         1.50 MiB  online, bf16 (787,584 parameters)" in lines  # 2 x 787,584 B
    load = next(line for line in lines if line.startswith("host memory at load"))
    assert load.startswith("host memory at load: 3.00 MiB per rank (the most of the larger model")  # 4 x REF


def test_the_fused_optimizer_makes_no_fp32_gradient_copy(tiny: ModelShape) -> None:
    """ZeRO over 4 ranks owns 36,944 parameters each: fp32 copies 4 x 36,944 B; fused, the working-dtype
    partitions _fused_zero_step all-gathers, 2 x 36,944 B; one ZeRO rank and the AMP optimizer write the weights."""
    fused = Workload(2, 8, device="cpu", fused_optimizer=True)
    zero4 = Layout("low_level_zero", "bf16", 2, dp=4)
    assert plan_memory(tiny, zero4, WORK).step_copies == 4 * 36_944
    assert plan_memory(tiny, zero4, fused).step_copies == 2 * 36_944
    assert plan_memory(tiny, Layout("low_level_zero", "bf16", 1), fused).step_copies == 0
    assert plan_memory(tiny, Layout("hybrid_parallel", "bf16", 0, dp=2), fused).step_copies == 0
    assert plan_memory(tiny, Layout("hybrid_parallel", "bf16", 0, dp=2), WORK).step_copies == 4 * TINY


def test_cpu_offload_casts_the_step_gradients_in_host_memory(tiny: ModelShape) -> None:
    """Offloaded masters take the gradients cast to fp32 on the host: masters 4, moments 8, gradients 4 bytes per
    owned parameter (36,944 at ZeRO 2 over 4 ranks), none of it on the device."""
    plan = plan_memory(tiny, Layout("low_level_zero", "bf16", 2, dp=4, cpu_offload=True), WORK)
    assert (plan.step_copies, plan.masters, plan.moments, plan.host) == (0, 0, 0, 16 * 36_944)
    fp32 = plan_memory(tiny, Layout("low_level_zero", "fp32", 2, dp=4, cpu_offload=True), WORK)
    # fp32 gradients still copied to the host, beside the masters ZeRO clones from its share in fp32 too
    assert (fp32.step_copies, fp32.host) == (0, 16 * 36_944)


def test_the_cast_at_load_keeps_only_the_ranks_share(tiny: ModelShape) -> None:
    """Shardformer splits (tp) and stages (pp) the policy before the cast: the fp32 values kept beside the bf16
    copy are the rank's share (tp 2: 74,048 parameters, as the masters recorded on 2 ranks), not the model's."""
    assert tiny.params_per_rank(2) == 512 * 64 + 40_960 + 320 == 74_048
    one = load_host_bytes(tiny, WORK, cast_rounds=True)
    tp2 = load_host_bytes(tiny, WORK, True, Layout("hybrid_parallel", "bf16", 0, tp=2))
    pp2 = load_host_bytes(tiny, WORK, True, Layout("hybrid_parallel", "bf16", 1, pp=2))
    assert (one, tp2, pp2) == (6 * TINY, 4 * TINY, 4 * TINY)  # 6 x 74,048 and 6 x 73,920 are under 4 x TINY
    shape = model_shape(
        str(Path(__file__).resolve().parents[3] / "benchmarks" / "model_shapes" / "llama-3.1-8b")
    )
    tp8 = load_host_bytes(shape, WORK, True, Layout("hybrid_parallel", "bf16", 0, tp=8))
    assert tp8 == 4 * 8_030_261_248  # was 6 x: 16 GB more per rank, 128 GB more on a node of 8


def test_zero_in_fp32_keeps_a_copy_of_its_share(tiny: ModelShape) -> None:
    """low_level_zero in fp32 clones each rank's share of the weights for its step (ColossalAI's
    ``_create_master_param_current_rank`` with ``master_weights`` on, its default); the plan counted 0 master bytes
    for it. DDP in fp32 steps the weights themselves."""
    zero = plan_memory(tiny, Layout("low_level_zero", "fp32", 2, dp=4), WORK)
    assert zero.masters == 4 * 36_944 and zero.moments == 8 * 36_944
    assert plan_memory(tiny, Layout("ddp", "fp32", 0, dp=4), WORK).masters == 0
