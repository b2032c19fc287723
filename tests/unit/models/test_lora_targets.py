"""LoRA targets checked on the loaded model: peft fails only when no target matches, so the default q/k/v/o on a
Phi-3 (fused qkv_proj) loaded by Hub id, where the preflight cannot build it, trained o_proj alone in silence."""

from __future__ import annotations

from typing import Any

import peft
import pytest
import transformers

from coati_kto.config.lora import LoraSection, peft_config
from coati_kto.errors import ConfigError
from coati_kto.models.lora import enable_lora, unmatched_targets
from coati_kto.testing.tiny import random_causal_lm

SMALL = {"vocab_size": 200, "num_hidden_layers": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


class _PeftBooster:
    """What ``Booster.enable_lora`` does to a model before boosting: peft's get_peft_model with the config."""

    def enable_lora(self, model: Any, lora_config: Any) -> Any:
        return peft.get_peft_model(model, lora_config)


def test_default_targets_on_phi3_are_refused_in_one_line() -> None:
    model = random_causal_lm(transformers.Phi3ForCausalLM, transformers.Phi3Config, **SMALL)
    with pytest.raises(ConfigError) as err:
        enable_lora(_PeftBooster(), model, LoraSection())
    assert str(err.value) == (
        "model.lora.target_modules: q_proj, k_proj, v_proj match no module of Phi3ForCausalLM; its linear layers: "
        "down_proj, gate_up_proj, o_proj, qkv_proj"
    )


def test_targets_that_all_match_or_that_peft_renames_pass() -> None:
    llama = random_causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig, **SMALL)
    section = LoraSection()
    config = peft_config(section, llama)
    assert unmatched_targets(section, config, peft.get_peft_model(llama, config)) == []
    phi3 = random_causal_lm(transformers.Phi3ForCausalLM, transformers.Phi3Config, **SMALL)
    fused = LoraSection(target_modules=["qkv_proj", "o_proj"])
    assert enable_lora(_PeftBooster(), phi3, fused) is not None
