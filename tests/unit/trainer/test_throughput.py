"""Model FLOPs parameter count and the MFU peak table (the per-step counts are checked in test_trainer)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coati_kto.testing.tiny import random_causal_lm
from coati_kto.trainer.throughput import flop_params, mfu, resolve_peak_flops, table_peak_flops


def _llama(tied: bool) -> LlamaForCausalLM:
    return random_causal_lm(
        LlamaForCausalLM,
        LlamaConfig,
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_flop_params_leave_out_the_embedding_lookup_only(tied):
    model = _llama(tied)
    total = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    embed = 100 * 16
    # Untied: the lookup table is not multiply-adds. Tied: the one matrix is the head's, and counts.
    assert flop_params(model) == (total if tied else total - embed)


def test_peak_table_and_config():
    assert table_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert table_peak_flops("NVIDIA L40S") == 362e12 and table_peak_flops("NVIDIA L4") == 121e12
    assert table_peak_flops("Some CPU") is None
    assert resolve_peak_flops(5e12, "fp32") == (5e12, "train.peak_flops")
    if not torch.cuda.is_available():
        assert resolve_peak_flops(None, "bf16")[0] is None  # CPU: only when the user sets it
    assert mfu(50.0, 100.0, 2) == 0.25 and mfu(50.0, None, 2) is None
