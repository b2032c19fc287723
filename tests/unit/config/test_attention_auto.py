"""model.attn_implementation auto: flex_attention with every pass padding-free on a GPU where the model packs at
tp_size 1 (no pass builds a dense mask), else the model's default kernel; one note line says which and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.models.packing import padding_free_note


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig

    dirs = {name: tmp_path / name for name in ("llama", "gemma3", "capped", "softcap_attention")}
    LlamaConfig(num_hidden_layers=2).save_pretrained(dirs["llama"])
    Gemma3TextConfig(num_hidden_layers=2, sliding_window=8).save_pretrained(dirs["gemma3"])
    Gemma3TextConfig(num_hidden_layers=2, final_logit_softcapping=30.0).save_pretrained(dirs["capped"])
    Gemma2Config(num_hidden_layers=2).save_pretrained(dirs["softcap_attention"])  # attn_logit_softcapping 50
    return dirs


def _load(tmp_path: Path, *overrides: str):
    return load_config(write_config(tmp_path, MINIMAL), ["model.attn_implementation=auto", *overrides])


def test_auto_on_a_gpu_is_flex_attention_padding_free(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("llama", "gemma3"):  # Gemma 3: sliding and full layers, a block mask per layer type
        config = _load(tmp_path, f"model.path={models[name]}")
        assert (config.model.attn_implementation, config.data.padding_free) == ("flex_attention", True), name
        assert "flex_attention, every pass padding-free" in config.attention_note()
        assert (
            config.model_dump()["model"]["attn_implementation"] == "flex_attention"
        )  # the run's saved config
    # Where flex padding-free is not proven: the default kernel, padding_free as written, and why.
    cases = {
        "plugin.tp_size 2": [
            f"model.path={models['llama']}",
            "plugin.name=hybrid_parallel",
            "plugin.tp_size=2",
        ],
        "model_type gemma3_text": [f"model.path={models['capped']}"],  # soft-capped logits: no chunked head
        "attention soft-capping": [f"model.path={models['softcap_attention']}"],  # eager computes it only
    }
    for why, overrides in cases.items():
        config = _load(tmp_path, *overrides)
        assert config.model.attn_implementation is None and not config.data.padding_free, why
        assert why in config.attention_note() and "\n" not in config.attention_note()


def test_auto_on_cpu_is_the_default_kernel(models: dict[str, Path], tmp_path: Path) -> None:
    """No FlexAttention backward on CPU (torch 2.13): the default kernel, padded passes unless asked."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's choice")
    config = _load(tmp_path, f"model.path={models['llama']}")
    assert config.model.attn_implementation is None and not config.data.padding_free
    assert "no GPU" in config.attention_note() and "FlexAttention backward" in config.attention_note()
    # train prints the attention note on rank 0, with no padding-free line after it
    assert padding_free_note(config.data, config.model, cuda=False) is None
    free = _load(tmp_path, f"model.path={models['llama']}", "data.padding_free=true")
    assert free.data.padding_free and free.model.attn_implementation is None  # bins under sdpa
    assert load_config(write_config(tmp_path, MINIMAL)).attention_note() is None
