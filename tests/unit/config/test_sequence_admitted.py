"""What config load admits under sequence parallelism is what tests/distributed proves, and nothing else: the recipe
in fp32 with ZeRO 0 (test_sequence_parallel_train.py, LoRA included) and in bf16 with ZeRO 2 (sp 2 x dp 2 in
test_sequence_parallel_layouts_4.py) at tp 1, and tp 2 x sp 2 for Llama in bf16 with ZeRO 2 (the same file). Each
other layout is one line naming the key and what to set; a Hub id's heads are read from the hub cache, or refused
when the model is loaded, before any forward."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from helpers import MINIMAL, SMOLLM2, hub_cache_config, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError

SP = ["plugin.sp_size=2", "data.padding_free=true", "model.attn_implementation=sdpa"]
FP32 = ["plugin.precision=fp32", "plugin.zero_stage=0"]
BF16 = ["plugin.precision=bf16", "plugin.zero_stage=2"]


def _load(tmp_path: Path, model: Path | str, *overrides: str):
    return load_config(write_config(tmp_path, MINIMAL.replace("some/model", str(model))), list(overrides))


def _problems(tmp_path: Path, model: Path | str, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, model, *overrides)
    return str(err.value).splitlines()


# name (the test that proves it) -> overrides on SP and the tiny Llama (4 query and 4 key-value heads)
ADMITTED = {
    "fp32-zero0 (test_sp2_weights_equal_sp1_within_fp32_rounding)": FP32,
    "fp32-zero0-lora (test_sp2_lora_adapters_equal_sp1)": [*FP32, "model.lora.rank=4"],
    "bf16-zero2 (test_sequence_parallel_layouts_4: sp2_dp2)": BF16,
    "tp2-sp2-bf16-zero2 (test_sequence_parallel_layouts_4: tp2_sp2)": [*BF16, "plugin.tp_size=2"],
    "sp4 (test_sp4_packed_logps_equal_one_process)": [*BF16, "plugin.sp_size=4"],
}


@pytest.mark.parametrize("overrides", ADMITTED.values(), ids=ADMITTED.keys())
def test_the_proven_layouts_load(tmp_path: Path, tiny_model_dir: Path, overrides: list[str]) -> None:
    config = _load(tmp_path, tiny_model_dir, *SP, *overrides)
    assert config.plugin.sp_size > 1


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["plugin.precision=fp16", "plugin.zero_stage=2"],
            "plugin.sp_size 2 with plugin.precision fp16 and plugin.zero_stage 2 is not proven (sequence "
            "parallelism is proven in bf16 with ZeRO 2 and in fp32 with ZeRO 0): set plugin.precision=bf16 and "
            "plugin.zero_stage=2",
        ),
        (
            ["plugin.precision=bf16", "plugin.zero_stage=1"],
            "plugin.sp_size 2 with plugin.precision bf16 and plugin.zero_stage 1 is not proven (sequence "
            "parallelism is proven in bf16 with ZeRO 2 and in fp32 with ZeRO 0): set plugin.precision=bf16 and "
            "plugin.zero_stage=2",
        ),
        (
            ["plugin.precision=bf16", "plugin.zero_stage=0"],
            "plugin.sp_size 2 with plugin.precision bf16 and plugin.zero_stage 0 is not proven (sequence "
            "parallelism is proven in bf16 with ZeRO 2 and in fp32 with ZeRO 0): set plugin.precision=bf16 and "
            "plugin.zero_stage=2",
        ),
        (
            ["plugin.precision=fp16", "plugin.zero_stage=1", "model.lora.rank=4"],
            "plugin.sp_size 2 with plugin.precision fp16 and plugin.zero_stage 1 is not proven (sequence "
            "parallelism is proven in bf16 with ZeRO 2 and in fp32 with ZeRO 0): set plugin.precision=fp32 and "
            "plugin.zero_stage=0",
        ),
        (
            [*BF16, "plugin.cpu_offload=true"],
            "plugin.sp_size 2 with plugin.cpu_offload is not proven: set plugin.cpu_offload=false",
        ),
        (
            [*BF16, "model.lora.rank=4"],
            "plugin.sp_size 2 with model.lora is proven in fp32 with ZeRO 0 only: set plugin.precision=fp32 and "
            "plugin.zero_stage=0, or plugin.sp_size=1",
        ),
        (
            [*FP32, "plugin.tp_size=2"],
            "plugin.tp_size 2 x plugin.sp_size 2 is proven in bf16 with ZeRO 2 only: set plugin.precision=bf16 "
            "and plugin.zero_stage=2, or plugin.tp_size=1",
        ),
        (
            [*BF16, "plugin.tp_size=2", "plugin.sp_size=4"],
            "model.path {model}: LlamaForCausalLM is not proven at plugin.tp_size 2 x plugin.sp_size 4 (tensor "
            "with sequence parallelism: LlamaForCausalLM (tp_size 2 x sp_size 2)): set plugin.tp_size=1",
        ),
    ],
    ids=["fp16", "bf16-zero1", "bf16-zero0", "fp16-lora", "offload", "lora-bf16", "tp2-fp32", "tp2-sp4"],
)
def test_each_unproven_layout_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, overrides: list[str], line: str
) -> None:
    problems = _problems(tmp_path, tiny_model_dir, *SP, *overrides)
    found = [p for p in problems if "plugin.sp_size" in p]
    assert len(found) == 1 and found[0].endswith(line.format(model=tiny_model_dir)), problems


def test_tp2_sp2_is_refused_for_a_family_other_than_llama(tmp_path: Path) -> None:
    """Qwen3 is admitted at sp 2 (tp 1) and at tp 2, but its tensor-parallel policy never ran under the wrapper."""
    model = tmp_path / "qwen3"
    model.mkdir()
    heads = {"num_attention_heads": 8, "num_key_value_heads": 4}
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **heads}
    (model / "config.json").write_text(json.dumps(raw))
    assert _load(tmp_path, model, *SP, *BF16).plugin.sp_size == 2
    problems = _problems(tmp_path, model, *SP, *BF16, "plugin.tp_size=2")
    assert len(problems) == 1 and problems[0].endswith(
        f"model.path {model}: Qwen3ForCausalLM is not proven at plugin.tp_size 2 x plugin.sp_size 2 (tensor with "
        "sequence parallelism: LlamaForCausalLM (tp_size 2 x sp_size 2)): set plugin.tp_size=1"
    ), problems


def test_a_cached_hub_ids_heads_are_refused_at_config_load(tmp_path: Path, monkeypatch) -> None:
    """SmolLM2-135M at sp 2 passed config load (its class unknown from a Hub id) and failed at the first forward
    with a traceback on every rank; from the hub cache's config.json it is one line at load."""
    hub_cache_config(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M", SMOLLM2, monkeypatch)
    monkeypatch.chdir(tmp_path)
    problems = _problems(tmp_path, "HuggingFaceTB/SmolLM2-135M", *SP, *BF16)
    assert len(problems) == 1 and problems[0].endswith(
        ": model.path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 1 x plugin.sp_size 2 must divide "
        "num_attention_heads 9 and num_key_value_heads 3 (all_to_all gives each rank whole heads)"
    ), problems
    hub_cache_config(tmp_path / "hub3", "org/sp3", {**SMOLLM2, "num_attention_heads": 6}, monkeypatch)
    problems = _problems(tmp_path, "org/sp3", *SP, *BF16, "plugin.sp_size=3")
    assert problems[-1].endswith(
        ": model.path org/sp3: LlamaForCausalLM is not proven at plugin.sp_size 3 (sequence parallelism: "
        "LlamaForCausalLM (sp_size 2, 4), MistralForCausalLM (sp_size 2), Qwen2ForCausalLM (sp_size 2), "
        "Qwen3ForCausalLM (sp_size 2), Gemma3ForCausalLM (sp_size 2), SmolLM3ForCausalLM (sp_size 2))"
    )


def test_an_uncached_hub_ids_heads_are_refused_when_the_model_loads() -> None:
    """Not in the hub cache, the model's config is first read when it loads: the backend refuses its heads there
    in config load's line (a ConfigError: exit 2, one line), before the attention wrapper or any forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.testing.tiny import random_causal_lm

    backend = ParallelPlan("hybrid_parallel", "bf16", 2, sp_size=2, dp_size=2).backend
    booster = types.SimpleNamespace(plugin=types.SimpleNamespace())
    smol = random_causal_lm(
        LlamaForCausalLM, LlamaConfig, hidden_size=36, num_attention_heads=9, num_key_value_heads=3
    )
    smol.config._attn_implementation = "sdpa"
    smol.config.name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as from_pretrained sets it
    with pytest.raises(ConfigError) as err:
        backend.prepare_policy(booster, smol)
    assert str(err.value) == (
        "model.path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 1 x plugin.sp_size 2 must divide "
        "num_attention_heads 9 and num_key_value_heads 3 (all_to_all gives each rank whole heads)"
    )
    assert smol.config._attn_implementation == "sdpa"  # refused before the wrapper went in
    with pytest.raises(
        ConfigError, match=r"^model.reference_path HuggingFaceTB/SmolLM2-135M: plugin.tp_size 1"
    ):
        backend.place_reference(None, smol)
    llama = random_causal_lm(LlamaForCausalLM, LlamaConfig)  # 4 over 2 heads: sp 2 splits them
    llama.config._attn_implementation = "sdpa"
    backend.prepare_policy(booster, llama)
    assert llama.config._attn_implementation == "coati_sp|sdpa"


def test_a_class_only_loading_tells_is_refused_at_tp_times_sp_by_the_same_table() -> None:
    from coati_kto.families.splits import refuse_unadmitted

    llama, qwen3 = "transformers.models.llama.modeling_llama.LlamaForCausalLM", "Qwen3ForCausalLM"
    refuse_unadmitted(llama, 2, "model.path: ", 2)
    with pytest.raises(
        ConfigError, match=r"^model.path: LlamaForCausalLM is not proven at plugin.tp_size 2 x "
    ):
        refuse_unadmitted(llama, 2, "model.path: ", 4)
    with pytest.raises(
        ConfigError, match=r"^model.path: Qwen3ForCausalLM is not proven at plugin.tp_size 2 x "
    ):
        refuse_unadmitted(qwen3, 2, "model.path: ", 2)


def test_what_sp_would_refuse_is_asked_of_a_config_at_sp_1(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``sequence_run_problems``: the refusals no layout changes, for ``coati-kto plan`` to ask before it offers
    any sp layout for a config that runs at sp 1."""
    from coati_kto.config.sequence import sequence_run_problems

    padded = ["data.padding_free=true", "model.attn_implementation=sdpa"]
    assert sequence_run_problems(_load(tmp_path, tiny_model_dir, *padded), 2) == []
    config = _load(tmp_path, tiny_model_dir, *padded, "train.fused_optimizer=true", "model.compile=true")
    assert sequence_run_problems(config, 2) == [
        "plugin.sp_size 2 with model.compile is not supported: set plugin.sp_size=1",
        "plugin.sp_size 2 with train.fused_optimizer is not supported: set plugin.sp_size=1",
    ]
