"""LoRA targets refused in one line where the preflight cannot build the model (a Hub id, remote code) and in the
preflight itself: a target that names an embedding or the LM head by a dotted suffix (``model.embed_tokens``, which
peft matches: on a tied Qwen2 merged/ then differed from the adapters by 7.74 in log-probability), a target that
matches nothing (peft's NoMatchingPeftModuleError) and a module LoRA cannot wrap (peft's ValueError), which came
through as raw tracebacks on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.lora import LoraSection
from coati_kto.errors import ConfigError
from coati_kto.models.lora import enable_lora
from coati_kto.runtime.preflight import _lora_problems
from coati_kto.testing.tiny import random_causal_lm

SMALL = {"vocab_size": 200, "num_hidden_layers": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LLAMA_LINEAR = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"


class _PeftBooster:
    """What ``Booster.enable_lora`` does to a model before boosting: peft's get_peft_model with the config."""

    def enable_lora(self, model: Any, lora_config: Any) -> Any:
        return peft.get_peft_model(model, lora_config)


def _qwen2_tied() -> Any:
    return random_causal_lm(
        transformers.Qwen2ForCausalLM, transformers.Qwen2Config, tie_word_embeddings=True, **SMALL
    )


def _refusal(model: Any, targets: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        enable_lora(_PeftBooster(), model, LoraSection(target_modules=targets))
    assert not any(hasattr(m, "lora_A") for m in model.modules())  # refused before peft wrapped anything
    return str(err.value)


def test_a_dotted_embedding_target_is_refused_at_load() -> None:
    """The bare names (embed_tokens, lm_head...) are refused at config load; the dotted one matched by suffix."""
    assert _refusal(_qwen2_tied(), ["q_proj", "model.embed_tokens"]) == (
        "model.lora.target_modules: model.embed_tokens (model.embed_tokens: the input embeddings) of "
        f"Qwen2ForCausalLM: adapters on the embeddings or LM head are not supported; name linear layers: {LLAMA_LINEAR}"
    )


def test_a_dotted_embedding_target_is_refused_by_the_preflight(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    _qwen2_tied().config.save_pretrained(model_dir)
    text = MINIMAL.replace(
        "path: some/model", f"path: {model_dir}\n  lora: {{target_modules: [q_proj, model.embed_tokens]}}"
    )
    assert _lora_problems(load_config(write_config(tmp_path, text)).model) == [
        "model.lora.target_modules: model.embed_tokens (model.embed_tokens: the input embeddings) of "
        f"Qwen2ForCausalLM: adapters on the embeddings or LM head are not supported; name linear layers: {LLAMA_LINEAR}"
    ]


def test_any_embedding_module_is_refused() -> None:
    """Not only the input embeddings: every ``nn.Embedding`` (Gemma 3n's per-layer table, T5's relative bias...)."""
    model = random_causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig, **SMALL)
    model.model.layers[0].pos_table = torch.nn.Embedding(8, 4)
    assert _refusal(model, ["layers.0.pos_table"]) == (
        "model.lora.target_modules: layers.0.pos_table (model.layers.0.pos_table: an embedding) of LlamaForCausalLM: "
        f"adapters on the embeddings or LM head are not supported; name linear layers: {LLAMA_LINEAR}"
    )


def test_targets_that_match_nothing_are_one_line() -> None:
    model = random_causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig, **SMALL)
    assert _refusal(model, ["qproj", "attn.q_proj"]) == (
        "model.lora.target_modules: qproj, attn.q_proj match no module of LlamaForCausalLM; its linear layers: "
        f"{LLAMA_LINEAR}"
    )


@pytest.mark.parametrize("targets,kind", [(["mlp"], "LlamaMLP"), (["q_proj", "self_attn"], "LlamaAttention")])
def test_targets_lora_cannot_wrap_are_one_line(targets: list[str], kind: str) -> None:
    model = random_causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig, **SMALL)
    with pytest.raises(ConfigError) as err:
        enable_lora(_PeftBooster(), model, LoraSection(target_modules=targets))
    assert str(err.value) == (
        f"model.lora.target_modules: peft cannot put adapters on {kind} (not a linear layer) of LlamaForCausalLM; "
        f"its linear layers: {LLAMA_LINEAR}"
    )
