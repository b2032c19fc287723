"""Loading the families users fine-tune today through ``models.hf.load_causal_lm``: vision-language checkpoints
transformers maps to no causal-LM class (or to a text-only one), parameters the loader made trainable, and
router buffers the class keeps in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from coati_kto.config.schema import ModelSection
from coati_kto.models.hf import load_causal_lm

TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip


def _saved(model: torch.nn.Module, path: Path) -> str:
    model.save_pretrained(path)
    return str(path)


def _load(path: str) -> torch.nn.Module:
    return load_causal_lm(path, ModelSection(path=path), torch.float32)


def test_vision_language_checkpoints_load_whole(tmp_path: Path) -> None:
    """Qwen2.5-VL: "Unrecognized configuration class ... for AutoModelForCausalLM" (a 6 KB traceback at train
    start). Qwen 3.5: loaded as the text-only Qwen3_5ForCausalLM, its vision tower dropped from the export while
    the run's note said it was exported unchanged."""
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    qwen25 = tf.Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": mrope},
        vision_config={**VISION, "window_size": 28, "fullatt_block_indexes": [0]},
        image_token_id=127, video_token_id=126, vision_start_token_id=125, vision_end_token_id=124,
    )  # fmt: skip
    loaded = _load(_saved(tf.Qwen2_5_VLForConditionalGeneration(qwen25), tmp_path / "qwen25"))
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    linear = dict(
        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, head_dim=8,
        rope_parameters={**mrope, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    qwen35 = tf.Qwen3_5Config(
        text_config={**TEXT, **linear},
        vision_config={**VISION, "num_position_embeddings": 16},
        image_token_id=127, video_token_id=126, vision_start_token_id=125, vision_end_token_id=124,
        tie_word_embeddings=False,
    )  # fmt: skip
    original = tf.Qwen3_5ForConditionalGeneration(qwen35)
    loaded = _load(_saved(original, tmp_path / "qwen35"))
    assert type(loaded).__name__ == "Qwen3_5ForConditionalGeneration"
    assert set(loaded.state_dict()) == set(original.state_dict())  # the vision tower included


def test_parameters_the_class_freezes_stay_frozen(tmp_path: Path) -> None:
    """Ernie-4.5-MoE builds its router's e_score_correction_bias with requires_grad=False; transformers 5's loader
    made it trainable, so DDP waited for its gradient (step 2 crashed) and ZeRO could not save (KeyError)."""
    config = tf.Ernie4_5_MoeConfig(
        **TEXT, head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_interval=1,
    )  # fmt: skip
    model = tf.Ernie4_5_MoeForCausalLM(config)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any("e_score_correction_bias" in n for n in frozen)
    loaded = _load(_saved(model, tmp_path / "ernie"))
    assert {n for n, p in loaded.named_parameters() if not p.requires_grad} == frozen
    # A second load of the same class and config (the reference) reads the names the first rebuild found
    built: list[int] = []
    original_init = tf.Ernie4_5_MoeForCausalLM.__init__

    def counting_init(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        built.append(1)
        original_init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tf.Ernie4_5_MoeForCausalLM, "__init__", counting_init)
        again = _load(str(tmp_path / "ernie"))
    assert {n for n, p in again.named_parameters() if not p.requires_grad} == frozen
    assert len(built) == 1  # from_pretrained's own construction; no meta rebuild


def test_router_buffers_the_class_keeps_in_fp32_are_kept(tmp_path: Path) -> None:
    """DeepSeek-V3's router e_score_correction_bias (a persistent buffer the class keeps in fp32): the bf16 cast
    rounded it in training and in the export (8.08199 exported as 8.0625)."""
    from coati_kto.parallel.fp32_kept import fp32_kept

    config = tf.DeepseekV3Config(
        **{**TEXT, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
    )  # fmt: skip
    model = tf.DeepseekV3ForCausalLM(config)
    kept = {name for _, name, copy in fp32_kept(model, torch.bfloat16) if copy.dtype == torch.float32}
    assert "e_score_correction_bias" in kept


def test_vision_language_refusals_at_preflight(tmp_path: Path) -> None:
    """Preflight builds Qwen2.5-VL with its image-text class (AutoModelForCausalLM raised, and the LoRA check gave
    up): the default LoRA targets pass, in its language model only (issue 49); a Llama 4 vision-language checkpoint, loaded whole, fails on text batches in transformers 5.24:
    one line each before anything loads."""
    from coati_kto.config.schema import Config
    from coati_kto.families import vision_language_refusal
    from coati_kto.runtime.preflight import _lora_problems

    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    qwen25 = tf.Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": mrope},
        vision_config={**VISION, "window_size": 28, "fullatt_block_indexes": [0]},
    )
    qwen25.save_pretrained(tmp_path / "qwen25")
    config = Config.model_validate(
        {
            "model": {"path": str(tmp_path / "qwen25"), "lora": {"rank": 4}},
            "data": {"train_files": ["d.jsonl"], "prepared_dir": str(tmp_path / "p")},
            "output": {"dir": str(tmp_path / "o")},
        }
    )
    assert _lora_problems(config.model) == []  # the default targets: the language model's (a regex)
    tf.Llama4Config(text_config={**TEXT, "head_dim": 8}).save_pretrained(tmp_path / "llama4")
    assert vision_language_refusal(str(tmp_path / "llama4")) == (
        f"{tmp_path / 'llama4'} is a llama4 vision-language checkpoint: transformers' Llama4ForConditionalGeneration "
        "fails on text-only batches ('MoeCausalLMOutputWithPast' has no attribute 'image_outputs')"
    )
    assert vision_language_refusal(str(tmp_path / "qwen25")) is None
