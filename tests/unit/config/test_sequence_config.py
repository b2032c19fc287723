"""plugin.sp_size / plugin.sp_mode at config load: each refusal one line naming the key and the fix, all of a
config's problems at once, before any process starts; and what a valid sequence-parallel config becomes."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CORPUS, MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.parallel.plan import ParallelPlan, check_tp_divides_world

# fp32 with ZeRO 0: the layout test_sequence_parallel_train.py runs (bf16 at ZeRO 0 is not proven under sp).
SP = ["plugin.sp_size=2", "data.padding_free=true", "model.attn_implementation=sdpa", "plugin.precision=fp32"]


def _load(tmp_path: Path, model_dir: Path, *overrides: str):
    text = MINIMAL.replace("some/model", str(model_dir))
    return load_config(write_config(tmp_path, text), list(overrides))


def _problems(tmp_path: Path, model_dir: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, model_dir, *overrides)
    return str(err.value).splitlines()


def test_a_valid_sp_config_gives_the_plan_its_size(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _load(tmp_path, tiny_model_dir, *SP)
    assert (config.plugin.sp_size, config.plugin.sp_mode) == (2, None)  # all_to_all, ColossalAI's default
    plan = ParallelPlan.from_config(config, dp_size=2)
    assert (plan.sp_size, plan.tp_size) == (2, 1)
    assert _load(tmp_path, tiny_model_dir, *SP, "plugin.sp_mode=all_to_all").plugin.sp_mode == "all_to_all"


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["plugin.name=low_level_zero", "plugin.zero_stage=2"],
            "plugin.sp_size 2 needs plugin.name hybrid_parallel, not low_level_zero (it has no sequence-parallel "
            "group)",
        ),
        (
            ["plugin.name=ddp", "plugin.precision=fp32"],
            "plugin.sp_size 2 needs plugin.name hybrid_parallel, not ddp (it has no sequence-parallel group)",
        ),
        (
            ["plugin.sp_size=1", "plugin.sp_mode=all_to_all"],
            "plugin.sp_mode all_to_all needs plugin.sp_size > 1 (sequence parallelism is off at 1)",
        ),
        (
            ["plugin.sp_mode=split_gather"],
            "plugin.sp_mode split_gather splits sequences over the tensor-parallel group: plugin.sp_size (2) must "
            "equal plugin.tp_size (1), which must be > 1",
        ),
        (
            ["plugin.sp_mode=ring_attn"],
            "plugin.sp_mode ring_attn needs flash-attention on CUDA and cannot express the KL pairs' visibility "
            "rule (its varlen ring attends causally within a document): use plugin.sp_mode all_to_all",
        ),
        (
            ["plugin.sp_mode=split_gather", "plugin.tp_size=2"],
            "plugin.sp_mode split_gather gathers the sequence inside the tensor-parallel projections, and "
            "transformers' attention reshapes their output to its input's (split) length: it needs ColossalAI's "
            "forwards, written for transformers 4.51; use plugin.sp_mode all_to_all",
        ),
        (
            ["data.padding_free=false"],
            "plugin.sp_size 2 with data.padding_free false: sequence parallelism splits the padding-free rows (set "
            "data.padding_free=true)",
        ),
        (
            ["model.attn_implementation=flex_attention"],
            "plugin.sp_size 2 with model.attn_implementation flex_attention: its attention wraps sdpa or eager only "
            "(a dense whole-row mask per rank's slice; set model.attn_implementation=sdpa)",
        ),
        (
            ["model.compile=true"],
            "plugin.sp_size 2 with model.compile is not supported: set plugin.sp_size=1",
        ),
        (
            ["kto.router_aux_loss_coef=0.01"],
            "plugin.sp_size 2 with kto.router_aux_loss_coef > 0 (the router loss is not summed over the "
            "sequence-parallel group) is not supported: set plugin.sp_size=1",
        ),
        (
            ["plugin.sp_size=8"],
            "model.path {model}: LlamaForCausalLM is not proven at plugin.sp_size 8 (sequence parallelism: "
            "LlamaForCausalLM (sp_size 2, 4), MistralForCausalLM (sp_size 2), Qwen2ForCausalLM (sp_size 2), "
            "Qwen3ForCausalLM (sp_size 2), Gemma3ForCausalLM (sp_size 2), SmolLM3ForCausalLM (sp_size 2))",
        ),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_each_unproven_combination_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, overrides: list[str], line: str
) -> None:
    problems = _problems(tmp_path, tiny_model_dir, *SP, *overrides)
    expected = line.format(model=tiny_model_dir)
    assert any(p.endswith(expected) for p in problems), problems


def test_every_problem_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Four mistakes, four lines (each naming where the value came from: the override). A section's own errors
    (plugin.sp_mode, unknown keys) come before the cross-section ones, as for every other key."""
    problems = _problems(
        tmp_path,
        tiny_model_dir,
        *SP,
        "data.padding_free=false",
        "kto.router_aux_loss_coef=0.01",
        "train.fused_optimizer=true",
        "model.compile=true",
    )
    found = [p for p in problems if "plugin.sp_size 2 with" in p]
    assert len(found) == 4, problems
    assert any("kto.router_aux_loss_coef" in p for p in found)


def test_heads_that_tp_times_sp_does_not_divide_are_refused(tmp_path: Path) -> None:
    """all_to_all gives each rank tp x sp's share of the query and key-value heads: a model with one key-value
    head cannot run at sp 2 (refused from config.json, before any weight loads)."""
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    model = build_family_model("qwen3", build_tokenizer(CORPUS[:20], vocab_size=280))
    model.config.num_key_value_heads = 1
    model.save_pretrained(tmp_path / "kv1")
    problems = _problems(tmp_path, tmp_path / "kv1", *SP)
    assert problems[-1].endswith(
        f"model.path {tmp_path / 'kv1'}: plugin.tp_size 1 x plugin.sp_size 2 must divide num_attention_heads 4 and "
        "num_key_value_heads 1 (all_to_all gives each rank whole heads)"
    ), problems


def test_auto_attention_under_sp_is_the_models_default_kernel(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _load(
        tmp_path,
        tiny_model_dir,
        "plugin.sp_size=2",
        "data.padding_free=true",
        "model.attn_implementation=auto",
    )
    assert config.model.attn_implementation is None
    note = config.attention_note()
    assert "model's default kernel" in note and ("sp_size 2" in note or "no GPU" in note), note


def test_the_world_must_divide_into_tp_times_sp_groups() -> None:
    check_tp_divides_world(2, 8, 2)
    with pytest.raises(ConfigError) as err:
        check_tp_divides_world(1, 3, 2)
    assert str(err.value) == (
        "plugin.tp_size 1 x plugin.sp_size 2 = 2 must divide the number of processes, 3: launch a multiple of 2"
    )
    with pytest.raises(ConfigError, match="plugin.tp_size 2 must divide the number of processes, 3"):
        check_tp_divides_world(2, 3)


def test_auto_attention_on_a_gpu_stays_dense_under_sp() -> None:
    """On a GPU ``auto`` would pick flex attention; under sp it keeps the model's default kernel, and says why."""
    from coati_kto.config.attention import flex_refusal

    assert flex_refusal([], 1, cuda=True) is None
    assert flex_refusal([], 1, cuda=True, sp_size=2) == (
        "plugin.sp_size 2: flex attention under sequence parallelism is unproven"
    )


def test_train_says_which_pass_layouts_sp_turns_off(tmp_path: Path, tiny_model_dir: Path) -> None:
    from coati_kto.config.sequence import sequence_note

    assert sequence_note(_load(tmp_path, tiny_model_dir, "plugin.zero_stage=0")) is None  # no sp
    config = _load(tmp_path, tiny_model_dir, *SP, "kto.pack_reference=true")
    assert sequence_note(config) == (
        "note: plugin.sp_size 2: every pass runs on its own sliced rows, so kto.pack_policy, kto.pack_reference, "
        "kto.kl_continuation do not run (the examples and the KL pairs each take a pass; equal within rounding)"
    )
    quiet = _load(tmp_path, tiny_model_dir, *SP, "kto.kl_continuation=false", "kto.pack_policy=false")
    assert sequence_note(quiet) is None
    kl_only = _load(tmp_path, tiny_model_dir, *SP, "kto.pack_policy=false")
    assert "so kto.kl_continuation does not run (the examples" in sequence_note(kl_only)
    # apo_zero_unpaired runs no KL pass: nothing of it is turned off (the note was said there too)
    assert sequence_note(_load(tmp_path, tiny_model_dir, *SP, "kto.loss_type=apo_zero_unpaired")) is None


def test_a_class_only_loading_tells_is_refused_at_boost_by_the_same_table() -> None:
    """A hub id's class is known once loaded: the backend refuses it with the table config load uses."""
    from coati_kto.families.splits import refuse_unadmitted

    refuse_unadmitted("transformers.models.llama.modeling_llama.LlamaForCausalLM", 1, "model.path: ", 4)
    with pytest.raises(ConfigError) as err:
        refuse_unadmitted("transformers.models.phi3.modeling_phi3.Phi3ForCausalLM", 1, "model.path: ", 2)
    assert str(err.value).startswith("model.path: Phi3ForCausalLM is not proven at plugin.sp_size 2 (")
