"""What runs in fp32 after the plugins' bf16 cast is what ``from_pretrained(dtype=bf16)`` keeps in fp32
(coati_kto.parallel.fp32_kept): the reference the run builds (online, cached, or the base model under LoRA) gives
transformers' bf16 numbers, and the cached reference the online one's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from coati_kto.config.schema import ModelSection
from coati_kto.models.hf import load_causal_lm, load_reference
from coati_kto.parallel.fp32_kept import transformers_fp32_names
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.testing.tiny import FAMILIES as TINY_FAMILIES
from coati_kto.testing.tiny import save_tiny_family

TEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=128,
)  # fmt: skip


def _falcon_h1() -> torch.nn.Module:
    """Mamba mixers with MuP multipliers (a non-persistent ``mup_vector`` transformers builds in the load dtype)."""
    config = tf.FalconH1Config(
        **TEXT, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=16, ssm_multipliers=[0.3, 0.7, 1.3, 0.9, 1.7],
    )  # fmt: skip
    return tf.FalconH1ForCausalLM(config)


def _deepseek_v3() -> torch.nn.Module:
    """A router whose ``gate.weight`` and ``e_score_correction_bias`` are in ``_keep_in_fp32_modules_strict``."""
    config = tf.DeepseekV3Config(
        **TEXT, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1,
    )  # fmt: skip
    return tf.DeepseekV3ForCausalLM(config)


def _ernie_moe() -> torch.nn.Module:
    """Router ``gate.weight`` kept fp32; its ``e_score_correction_bias`` a frozen parameter, kept fp32 too."""
    config = tf.Ernie4_5_MoeConfig(
        **TEXT, head_dim=16, moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_interval=1,
    )  # fmt: skip
    return tf.Ernie4_5_MoeForCausalLM(config)


def _llama() -> torch.nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(**TEXT))


def _saved(build, path: Path) -> str:
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():  # routers far from uniform, so a rounding flips experts as a trained one would
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0, 0.5)
            elif "e_score_correction_bias" in name:
                tensor.normal_(0, 0.01)
    model.save_pretrained(path)
    return str(path)


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float().log_softmax(-1)


FAMILIES = {"falcon_h1": _falcon_h1, "deepseek_v3": _deepseek_v3, "ernie4_5_moe": _ernie_moe, "llama": _llama}
PLAN = ParallelPlan(plugin="low_level_zero", precision="bf16", zero_stage=2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_reference_is_transformers_bf16(tmp_path: Path, family: str) -> None:
    """The base model the run scores with (the online reference of a LoRA run: every parameter frozen) equals
    ``from_pretrained(dtype=bf16)``. Before, per token: Falcon-H1 2e-3 away (mup_vector put back in fp32), DeepSeek-V3
    2e-3 and Ernie-4.5-MoE 8e-3 (router weights rounded to bf16: experts flip)."""
    path = _saved(FAMILIES[family], tmp_path / family)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    # transformers' rotary (model.fused_rotary off: its rounding is tested against transformers' in test_rotary.py)
    section = ModelSection(path=path, fused_rotary=False)
    frozen = load_causal_lm(path, section, torch.float32).requires_grad_(False)
    run = _logprobs(PLAN.backend.build_reference(None, frozen), ids)
    hf = _logprobs(tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)
    assert (run - hf).abs().max().item() == 0.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_reference_is_the_online_reference(tmp_path: Path, family: str) -> None:
    """Trained in full, the router is trained in bf16 (ZeRO holds one dtype), so the online reference runs it in
    bf16: the cached reference (loaded by transformers in bf16) must too, or rewards are not 0 at step 0. Before,
    per token: 2e-3 for Falcon-H1 (mup_vector) and DeepSeek-V3, 8e-3 for Ernie-4.5-MoE (routers)."""
    path = _saved(FAMILIES[family], tmp_path / family)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    online = PLAN.backend.build_reference(None, load_causal_lm(path, ModelSection(path=path), torch.float32))
    cached = load_reference(ModelSection(path=path), PLAN.dtype)
    assert (_logprobs(online, ids) - _logprobs(cached, ids)).abs().max().item() == 0.0


@pytest.mark.parametrize("family", sorted(set(TINY_FAMILIES) | set(FAMILIES)))
def test_fp32_names_are_what_transformers_keeps(tmp_path: Path, family: str) -> None:
    """``transformers_fp32_names`` of the model loaded in fp32 is the set ``from_pretrained(dtype=bf16)`` leaves in
    fp32: rotary frequencies, the strict routers; not Falcon-H1's mup_vector, not Gemma's embed_scale, not a
    vision tower (built in its sub-config's dtype: fp32 in the fp32-loaded model's config)."""
    from helpers import CORPUS

    from coati_kto.families import auto_model_class

    if family in TINY_FAMILIES:
        path = str(save_tiny_family(tmp_path / family, family, CORPUS))
    else:
        path = _saved(FAMILIES[family], tmp_path / family)
    auto = auto_model_class(tf.AutoConfig.from_pretrained(path))
    hf = auto.from_pretrained(path, dtype=torch.bfloat16)
    expected = {n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.dtype == torch.float32}
    assert (
        transformers_fp32_names(auto.from_pretrained(path, dtype=torch.float32), torch.bfloat16) == expected
    )


def test_fp32_names_rebuild_a_class_and_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's call (same class, config and dtype as the policy's) takes the names the first found, as a
    set of its own; another dtype rebuilds."""
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = tf.LlamaForCausalLM(config)
    built: list[torch.device] = []
    original_init = tf.LlamaForCausalLM.__init__

    def counting_init(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        built.append(torch.empty(0).device)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(tf.LlamaForCausalLM, "__init__", counting_init)
    first = transformers_fp32_names(model, torch.bfloat16)
    assert first is not None and any("rotary_emb" in name for name in first)
    expected = set(first)
    first.add("changed by the caller")
    assert transformers_fp32_names(model, torch.bfloat16) == expected and built == [torch.device("meta")]
    transformers_fp32_names(model, torch.float16)
    assert len(built) == 2
