"""A Hub id's shape checks: config load reads its config.json from the hub cache (as it already did for sequence
parallelism), and one not cached is checked when the model loads, in config load's line, before shardformer or
ColossalAI's stage manager fail on it with a traceback per rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, SMOLLM2, hub_cache_config, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.parallel.plan import ParallelPlan


def _problems(tmp_path: Path, model: str, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, MINIMAL.replace("some/model", model)), list(overrides))
    return str(err.value).splitlines()


def test_a_cached_hub_ids_shape_is_checked_at_config_load(tmp_path: Path, monkeypatch) -> None:
    """Before, a Hub id passed every config.json check (tp heads, pp layers, an encoder) and failed once loaded on
    every rank; from the hub cache's config.json each is one line at load."""
    monkeypatch.chdir(tmp_path)
    hub_cache_config(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M", SMOLLM2, monkeypatch)
    problems = _problems(tmp_path, "HuggingFaceTB/SmolLM2-135M", "plugin.zero_stage=0", "plugin.tp_size=2")
    assert len(problems) == 1 and problems[0].endswith(
        "cfg.yaml:2: model.path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 2 must divide num_attention_heads 9 "
        "and num_key_value_heads 3 (each tensor-parallel rank holds whole heads): use plugin.tp_size 1"
    ), problems

    two_layers = {**SMOLLM2, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    hub_cache_config(tmp_path / "hub2", "org/two-layers", two_layers, monkeypatch)
    problems = _problems(tmp_path, "org/two-layers", "plugin.pp_size=4", "train.accumulation_steps=4")
    assert problems[-1].endswith(
        ": model.path org/two-layers: plugin.pp_size 4 x plugin.num_model_chunks 1 = 4 is more than its "
        "num_hidden_layers 2 (each chunk of a stage holds at least one decoder layer)"
    ), problems

    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 300}
    hub_cache_config(tmp_path / "hub3", "org/bert", bert, monkeypatch)
    problems = _problems(tmp_path, "org/bert")
    assert len(problems) == 1 and "model.path org/bert: model_type bert without is_decoder" in problems[0]


def test_an_uncached_hub_ids_shape_is_refused_when_the_model_loads() -> None:
    """Not in the hub cache, the model's shape is first known when it loads: the backend refuses tp heads and pp
    layers there in config load's line (a ConfigError: exit 2), before the plugin wraps the model."""
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.testing.tiny import random_causal_lm

    booster = types.SimpleNamespace(plugin=types.SimpleNamespace())
    smol = random_causal_lm(
        LlamaForCausalLM, LlamaConfig, num_attention_heads=6, num_key_value_heads=3, hidden_size=48
    )
    smol.config.name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as from_pretrained sets it
    tp2 = ParallelPlan("hybrid_parallel", "bf16", 0, tp_size=2, dp_size=1).backend
    with pytest.raises(ConfigError) as err:
        tp2.prepare_policy(booster, smol)
    assert str(err.value) == (
        "model.path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 2 must divide num_attention_heads 6 and "
        "num_key_value_heads 3 (each "
        "tensor-parallel rank holds whole heads): use plugin.tp_size 1"
    )
    with pytest.raises(
        ConfigError, match=r"^model.reference_path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 2"
    ):
        tp2.place_reference(None, smol)

    pp4 = ParallelPlan("hybrid_parallel", "bf16", 1, pp_size=4, microbatches=4, dp_size=1).backend
    layers = smol.config.num_hidden_layers
    with pytest.raises(ConfigError) as err:
        pp4.prepare_policy(booster, smol)
    assert str(err.value) == (
        f"model.path HuggingFaceTB/SmolLM2-135M: plugin.pp_size 4 x plugin.num_model_chunks 1 = 4 is more than "
        f"its num_hidden_layers {layers} (each chunk of a stage holds at least one decoder layer)"
    )
    pp2 = ParallelPlan("hybrid_parallel", "bf16", 1, pp_size=2, microbatches=2, dp_size=1).backend
    pp2.prepare_policy(booster, smol)  # two layers fill two stages
    assert booster.plugin.custom_policy is not None
