"""What the exported config.json and folders say of themselves: the stored dtype in every sub-config, no peft
template card beside the adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig, LlamaForCausalLM

from coati_kto.models.lora import write_lora
from coati_kto.trainer.export import write_hf

TEXT = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def dtypes(folder: Path) -> list[str | None]:
    config = json.loads((folder / "config.json").read_text())
    return [config.get("dtype"), config["text_config"].get("dtype"), config["vision_config"].get("dtype")]


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32"])
def test_a_vision_language_export_names_the_stored_dtype_in_every_sub_config(
    tmp_path: Path, fp32: bool
) -> None:
    """Loaded in fp32 (as training loads the policy) and cast to bf16: save_pretrained rewrote the top-level dtype
    only, so text_config and vision_config said float32 of bf16 weights."""
    config = Gemma3Config(
        text_config={**TEXT, **HEADS},
        vision_config={**VISION, "image_size": 28, "patch_size": 14},
        image_token_index=5,
        mm_tokens_per_image=4,
    )
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "base")
    model = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = model.to(torch.bfloat16)
    state = {k: v.float() for k, v in model.state_dict().items()} if fp32 else model.state_dict()
    write_hf(model, state, None, tmp_path / "final", fp32=fp32)
    want = "float32" if fp32 else "bfloat16"
    assert dtypes(tmp_path / "final") == [want] * 3


def test_lora_folders_hold_no_peft_template_card_and_merged_names_its_dtype(tmp_path: Path) -> None:
    base = LlamaForCausalLM(LlamaConfig(**TEXT, **HEADS)).to(torch.bfloat16)
    base.config.dtype = torch.float32  # as from_pretrained in fp32 leaves it before the plugin's cast
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    write_lora(model, None, None, tmp_path / "final", merge=True)
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "final" / "adapter" / "README.md").exists()
    merged = json.loads((tmp_path / "final" / "merged" / "config.json").read_text())
    assert merged["dtype"] == "bfloat16"
