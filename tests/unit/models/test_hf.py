"""GPU-only model options fail as one clear config line where their package is missing (any machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from coati_kto.config.schema import ModelSection
from coati_kto.errors import ConfigError
from coati_kto.models.hf import load_causal_lm


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_2_without_flash_attn_is_a_config_error(tiny_model_dir: Path) -> None:
    """Before: transformers' multi-line ImportError (a traceback from the CLI), seen on an H100 without flash-attn."""
    section = ModelSection(path=str(tiny_model_dir), attn_implementation="flash_attention_2")
    with pytest.raises(
        ConfigError, match=r"^model\.attn_implementation flash_attention_2 needs the flash-attn"
    ):
        load_causal_lm(section.path, section, torch.float32)


def test_softcapped_attention_loads_eager_unless_told(tmp_path: Path) -> None:
    """Gemma 2's attention soft-capping runs in the eager kernel only: under transformers' default (sdpa) the
    model's log-probs were silently those of another function (issue 17: only transformers' warning said so)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM

    from coati_kto.models.hf import attention_implementation

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attn_logit_softcapping=0.5,  # small: the cap bites on random weights
        query_pre_attn_scalar=8,
        initializer_range=0.5,  # large attention logits, so the cap changes them
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    # Rotary as transformers computes it (model.fused_rotary off): the loaded model must equal eager bit for bit.
    section = ModelSection(path=str(tmp_path / "gemma2"), fused_rotary=False)
    kernel, note = attention_implementation(section.path, section)
    assert kernel == "eager" and note == (
        f"model.attn_implementation: eager for {section.path} (its attention soft-capping "
        "(attn_logit_softcapping 0.5) runs in the eager kernel only; sdpa would skip it silently)"
    )
    ids = torch.randint(0, 64, (2, 12))
    loaded = load_causal_lm(section.path, section, torch.float32).eval()
    eager = AutoModelForCausalLM.from_pretrained(section.path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, eager(ids).logits)
    try:  # transformers 4.51 runs it under sdpa without the cap; transformers 5 refuses sdpa for Gemma 2
        sdpa = AutoModelForCausalLM.from_pretrained(section.path, attn_implementation="sdpa").eval()
    except ValueError:
        return
    with torch.no_grad():
        assert (eager(ids).logits - sdpa(ids).logits).abs().max() > 1e-3
    told = ModelSection(path=section.path, attn_implementation="sdpa")
    assert attention_implementation(told.path, told) == ("sdpa", None)


def test_models_without_softcapping_keep_the_default(tiny_model_dir: Path) -> None:
    from coati_kto.models.hf import attention_implementation

    section = ModelSection(path=str(tiny_model_dir))
    assert attention_implementation(section.path, section) == (None, None)
