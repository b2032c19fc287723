"""Config defaults that follow what the user wrote, and the parallel plan's checks at config load."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CORPUS, MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.schema import Config
from coati_kto.errors import ConfigError
from coati_kto.parallel.plan import ParallelPlan


def test_max_length_alone_sets_the_prompt_budget(tmp_path: Path) -> None:
    assert load_config(write_config(tmp_path, MINIMAL)).data.max_prompt_length == 512  # the default 1024 // 2
    path = write_config(
        tmp_path,
        MINIMAL.replace("  prepared_dir: prepared\n", "  prepared_dir: prepared\n  max_length: 64\n"),
    )
    data = load_config(path).data
    assert (data.max_length, data.max_prompt_length) == (64, 32)
    # A budget the user wrote is kept, and a combination the user wrote is still checked.
    assert load_config(path, ["data.max_prompt_length=50"]).data.max_prompt_length == 50
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(64\) must be smaller"):
        load_config(path, ["data.max_prompt_length=64"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], ("hybrid_parallel", 2, "bf16")),
        (["plugin.name=ddp"], ("ddp", 0, "fp32")),
        (["plugin.name=low_level_zero"], ("low_level_zero", 2, "bf16")),
        (["plugin.name=low_level_zero", "plugin.precision=fp32"], ("low_level_zero", 2, "fp32")),
        (["plugin.precision=fp32"], ("hybrid_parallel", 0, "fp32")),
        (["plugin.zero_stage=1"], ("hybrid_parallel", 1, "bf16")),
    ],
)
def test_plugin_defaults_follow_the_plugin(tmp_path: Path, overrides: list[str], expected: tuple) -> None:
    plugin = load_config(write_config(tmp_path, MINIMAL), overrides).plugin
    assert (plugin.name, plugin.zero_stage, plugin.precision) == expected


@pytest.mark.parametrize(
    "overrides, dp_size, running",
    [
        ([], 1, 0),  # hybrid ZeRO-2 on one data-parallel rank: nothing to shard
        ([], 2, 2),
        (["plugin.zero_stage=1"], 1, 0),
        (["plugin.tp_size=2"], 1, 0),  # 2 tensor-parallel ranks, one data-parallel rank
        (["plugin.cpu_offload=true"], 1, 2),  # offload needs ZeRO
        (["plugin.name=low_level_zero"], 1, 2),
        ([], None, 2),  # no layout given: as written
    ],
)
def test_zero_stage_that_runs(
    tmp_path: Path, overrides: list[str], dp_size: int | None, running: int
) -> None:
    from coati_kto.recipe.setup import zero_note

    config = load_config(write_config(tmp_path, MINIMAL), overrides)
    plan = ParallelPlan.from_config(config, dp_size=dp_size)
    assert plan.zero_stage == running
    note = zero_note(config.plugin, plan)
    assert (note is None) == (running == config.plugin.zero_stage)
    if note is not None:
        assert note.startswith(f"plugin.zero_stage {config.plugin.zero_stage} runs as 0 on one data-parallel")


def test_combinations_the_user_wrote_are_still_errors(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    for overrides, needle in [
        (["plugin.name=ddp", "plugin.precision=bf16"], "plugin.name ddp trains in fp32"),
        (["plugin.name=ddp", "plugin.zero_stage=1"], "plugin.name ddp has no ZeRO"),
        (["plugin.precision=fp32", "plugin.zero_stage=2"], "needs plugin.precision bf16 or fp16"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_config(path, overrides)


def test_gemini_is_refused_at_load_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, MINIMAL), ["plugin.name=gemini"])
    message = str(err.value)
    assert message.startswith("override plugin.name=gemini: plugin.name gemini is not supported")
    assert (
        "needs CUDA" in message
        and "placement assertion" in message
        and "enable_gradient_accumulation" in message
    )
    assert len(message.splitlines()) == 1


def test_output_is_needed_by_train_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    from helpers import data_settings

    from coati_kto.data.files import write_jsonl
    from coati_kto.data.prepared import prepare

    rows = [{"prompt": f"Question {i}?", "completion": f"Answer {i}.", "label": i % 2 == 0} for i in range(8)]
    config = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {
                "train_files": [str(write_jsonl(rows, tmp_path / "t.jsonl"))],
                "prepared_dir": str(tmp_path / "p"),
            },
        }
    )
    assert config.output is None
    assert len(prepare(*data_settings(config)).train) == 8  # prepare needs no output section
    with pytest.raises(ConfigError, match="output.dir: required key is missing"):
        config.training_output()


def test_hybrid_admits_every_family_at_tp1_and_only_the_proven_ones_above(tmp_path: Path) -> None:
    """hybrid_parallel admits every family at tp_size 1 (one policy that swaps nothing: the family sweep proves
    it), and a family at a tp_size above 1 only where the tp matrix proves it; anything else is one line at config
    load naming what tensor parallelism supports and that tp_size 1 runs every family. The other plugins take any
    causal LM."""
    from coati_kto.families.shardformer import policy_for
    from coati_kto.families.shardformer.unsharded import UnshardedPolicy
    from coati_kto.testing.tiny import save_tiny_family

    def load(model_dir: Path, *overrides: str) -> object:
        text = MINIMAL.replace("some/model", str(model_dir))
        return load_config(write_config(tmp_path, text), list(overrides))

    gemma = save_tiny_family(tmp_path / "gemma", "gemma", CORPUS[:20], vocab_size=280)
    assert load(gemma).plugin.name == "hybrid_parallel"  # the default plugin, tp_size 1
    assert isinstance(policy_for("GemmaForCausalLM"), UnshardedPolicy)
    assert isinstance(policy_for("Qwen3ForCausalLM", 1), UnshardedPolicy)  # one path at tp_size 1
    assert not isinstance(policy_for("Qwen3ForCausalLM", 2), UnshardedPolicy)
    with pytest.raises(ConfigError) as err:
        load(gemma, "plugin.tp_size=2", "plugin.zero_stage=0")
    message = str(err.value)
    assert "\n" not in message
    assert f"model.path {gemma}: GemmaForCausalLM has no tensor-parallel policy" in message
    assert "Qwen3ForCausalLM (tp_size 2)" in message and "Gemma3ForCausalLM (tp_size 2)" in message
    assert "plugin.tp_size 1 runs every family without a tensor-parallel policy" in message
    assert load(gemma, "plugin.name=low_level_zero").plugin.zero_stage == 2

    gemma3 = save_tiny_family(tmp_path / "gemma3", "gemma3", CORPUS[:20], vocab_size=280)
    assert load(gemma3, "plugin.tp_size=2", "plugin.zero_stage=0").plugin.tp_size == 2
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM is not supported at plugin.tp_size 4"):
        load(gemma3, "plugin.tp_size=4", "plugin.zero_stage=0")
    qwen3 = save_tiny_family(tmp_path / "qwen3", "qwen3", CORPUS[:20], vocab_size=280)
    assert load(qwen3, "plugin.tp_size=2", "plugin.zero_stage=0").plugin.tp_size == 2


def test_plan_answers() -> None:
    plan = ParallelPlan("hybrid_parallel", "bf16", 2, tp_size=2, max_grad_norm=1.0)
    assert not plan.backend.no_sync_accumulation and plan.max_grad_norm == 1.0
    assert ParallelPlan("low_level_zero", "bf16", 1).backend.no_sync_accumulation
    assert str(ParallelPlan("low_level_zero", "bf16", 1).dtype) == "torch.bfloat16"


def test_tp_size_must_split_whole_heads(tmp_path: Path) -> None:
    """A model whose query or key-value heads tp_size does not divide (Gemma 3 270M / 1B: 4 heads over 1
    key-value head; SmolLM2 135M: 9 over 3) is refused at config load in one line, not by a traceback per rank
    from the policy once the model is loaded and the data prepared."""
    from transformers import AutoConfig

    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    tokenizer = build_tokenizer(CORPUS[:20], vocab_size=280)
    model = build_family_model("gemma3", tokenizer)
    model.config.num_key_value_heads = 1  # gemma-3-1b's shape (config.json is all the check reads)
    model.save_pretrained(tmp_path / "gemma3_kv1")
    assert AutoConfig.from_pretrained(tmp_path / "gemma3_kv1").num_key_value_heads == 1

    def load(*overrides: str) -> Config:
        text = MINIMAL.replace("some/model", str(tmp_path / "gemma3_kv1"))
        return load_config(write_config(tmp_path, text), ["plugin.zero_stage=0", *overrides])

    assert load().plugin.tp_size == 1
    with pytest.raises(ConfigError) as err:
        load("plugin.tp_size=2")
    message = str(err.value)
    assert "\n" not in message
    assert "plugin.tp_size 2 must divide num_attention_heads 4 and num_key_value_heads 1" in message
    # ddp and low_level_zero do not split heads: no refusal there.
    assert load("plugin.name=low_level_zero", "plugin.zero_stage=2").plugin.name == "low_level_zero"


def test_tp_size_must_split_every_head_count_gemma4_and_qwen3_5_have() -> None:
    """Gemma 4's full layers (their own key-value heads when values are keys), its MoE variant, and Qwen 3.5's
    linear-attention heads are checked from config.json at load, in one line each."""
    from coati_kto.families.splits import tensor_parallel_shape_refusal

    gemma4 = {"num_attention_heads": 8, "num_key_value_heads": 4, "attention_k_eq_v": True}
    assert tensor_parallel_shape_refusal({**gemma4, "num_global_key_value_heads": 2}, 2) is None
    why = tensor_parallel_shape_refusal({"text_config": {**gemma4, "num_global_key_value_heads": 1}}, 2)
    assert why is not None and "num_global_key_value_heads 1" in why and "\n" not in why
    # transformers 5.24 writes the full layers' overrides as per_layer_config
    why = tensor_parallel_shape_refusal({**gemma4, "per_layer_config": {"5": {"num_key_value_heads": 1}}}, 2)
    assert why is not None and "layer 5's num_key_value_heads 1" in why
    why = tensor_parallel_shape_refusal({**gemma4, "enable_moe_block": True}, 2)
    assert why is not None and "enable_moe_block" in why
    assert tensor_parallel_shape_refusal({**gemma4, "enable_moe_block": True}, 1) is None
    qwen = {"num_attention_heads": 4, "num_key_value_heads": 2, "linear_num_key_heads": 2}
    assert tensor_parallel_shape_refusal({**qwen, "linear_num_value_heads": 4}, 2) is None
    why = tensor_parallel_shape_refusal({**qwen, "linear_num_value_heads": 3}, 2)
    assert why is not None and "linear_num_value_heads 3" in why


def test_gemma4s_pad_row_past_a_ranks_embedding_shard_is_refused() -> None:
    """Gemma 4's vision-language forward indexes the (vocabulary-parallel) embedding weight by pad_token_id: a
    pad id past a rank's rows (vocabulary padded to 64 x tp_size, then split) is one line at load."""
    from coati_kto.families.splits import tensor_parallel_shape_refusal

    raw = {"model_type": "gemma4", "vision_config": {}, "text_config": {"vocab_size": 478, "pad_token_id": 0}}
    assert tensor_parallel_shape_refusal(raw, 2) is None  # the hub's pad id 0: rank 0's row
    raw["text_config"]["pad_token_id"] = 255  # 478 padded to 512: 256 rows a rank
    assert tensor_parallel_shape_refusal(raw, 2) is None
    raw["text_config"]["pad_token_id"] = 256
    assert tensor_parallel_shape_refusal(raw, 2) == (
        "Gemma 4 vision-language with pad_token_id 256: its forward reads that row of the embedding directly, "
        "past the 256 rows each of plugin.tp_size 2 ranks holds: use plugin.tp_size 1"
    )
    assert tensor_parallel_shape_refusal(raw, 1) is None
    assert tensor_parallel_shape_refusal({**raw, "model_type": "gemma3"}, 2) is None


def test_fused_projections_resume_at_their_tp_size_only() -> None:
    """Phi-3's fused projections keep their optimizer moments rank after rank in a tp_size 2 checkpoint: resumed
    at another tp_size they would land on the wrong heads, silently; refused in one line instead."""
    from coati_kto.families.shardformer import tp_change_refusal

    why = tp_change_refusal("Phi3ForCausalLM", 2, 1)
    assert why is not None and "\n" not in why and "saved at plugin.tp_size 2" in why
    assert tp_change_refusal("Phi3ForCausalLM", 2, 2) is None
    assert tp_change_refusal("Phi3ForCausalLM", None, 2) is None  # a checkpoint from before meta had tp_size
    assert tp_change_refusal("LlamaForCausalLM", 2, 1) is None  # contiguous splits re-shard exactly
    # Qwen 3.5's linear-attention in_proj_qkv and conv1d are split part by part too (text and hub classes)
    assert tp_change_refusal("Qwen3_5ForCausalLM", 2, 1) is not None
    assert tp_change_refusal("Qwen3_5ForConditionalGeneration", 2, 1) is not None
