"""Settings that would do nothing, refused at config load in one line each (only when the user set them), every
section's mistakes listed at once, and the one-line errors and displayed types of the keys that take two kinds of
value."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.discovery import schema_lines
from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError

OFFLOAD = (
    "plugin.cpu_offload needs ZeRO (plugin.zero_stage 1 or 2 on low_level_zero, or on hybrid_parallel in bf16 or "
    "fp16), and "
)


def _errors(path: Path, overrides: list[str]) -> list[str]:
    """The lines of the ConfigError that loading ``path`` with ``overrides`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["plugin.name=ddp"],
            "override plugin.cpu_offload=true, plugin.name=ddp: "
            f"{OFFLOAD}plugin.name ddp has none: set plugin.cpu_offload=false, or use low_level_zero",
        ),
        (
            ["plugin.precision=fp32"],
            "override plugin.cpu_offload=true, plugin.precision=fp32: "
            f"{OFFLOAD}hybrid_parallel in fp32 runs ZeRO 0: set plugin.cpu_offload=false, or set plugin.precision=bf16",
        ),
        (
            ["plugin.zero_stage=0"],
            "override plugin.cpu_offload=true, plugin.zero_stage=0: "
            f"{OFFLOAD}plugin.zero_stage is 0: set plugin.cpu_offload=false, or set plugin.zero_stage=1",
        ),
    ],
)
def test_cpu_offload_without_zero_is_refused(tmp_path: Path, overrides: list[str], line: str) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["plugin.cpu_offload=true", *overrides]) == [line]


def test_cpu_offload_with_zero_is_admitted(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    for plugin in ([], ["plugin.zero_stage=1"], ["plugin.name=low_level_zero"], ["plugin.precision=fp16"]):
        assert load_config(path, ["plugin.cpu_offload=true", *plugin]).plugin.cpu_offload is True
    # bf16 moments keep the offload: ZeRO holds the masters in host memory whatever optimizer steps them
    config = load_config(path, ["plugin.cpu_offload=true", "train.optimizer_state_dtype=bf16"])
    assert (config.plugin.zero_stage, config.train.optimizer_state_dtype) == (2, "bf16")


def test_one_sections_mistake_hides_no_other_sections(tmp_path: Path) -> None:
    """With no data.prepared_dir (derived from output.dir) a data mistake was raised alone, when the derived value
    was assigned: the plugin's mistake came only once the data one was fixed."""
    text = MINIMAL.replace("  prepared_dir: prepared\n", "  max_length: 64\n  max_prompt_length: 64\n")
    text += "plugin:\n  tp_size: 2\n  name: ddp\n"
    path = write_config(tmp_path, text)
    assert _errors(path, []) == [
        f"{path}:5 and {path}:6: data.max_prompt_length (64) must be smaller than data.max_length (64) to leave "
        "room for the completion",
        f"{path}:10: plugin.tp_size 2 needs hybrid_parallel, not ddp",
    ]
    assert (
        load_config(path, ["data.max_prompt_length=32", "plugin.tp_size=1"]).data.prepared_dir
        == "out/prepared"
    )


def test_model_attention_auto_hides_no_other_mistake(tmp_path: Path) -> None:
    """auto's resolved padding_free was assigned the same way, raising the data mistake alone."""
    path = write_config(tmp_path, MINIMAL)
    bad = ["data.max_length=64", "data.max_prompt_length=64", "plugin.name=ddp", "plugin.tp_size=2"]
    lines = _errors(path, ["model.attn_implementation=auto", *bad])
    assert [line.split(": ", 1)[1] for line in lines] == [
        "data.max_prompt_length (64) must be smaller than data.max_length (64) to leave room for the completion",
        "plugin.tp_size 2 needs hybrid_parallel, not ddp",
    ]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["output.merge_lora=true", "model.lora={rank: 4}"],
            "override output.merge_lora=true, output.save_final=false: output.merge_lora true with "
            "output.save_final false: training writes no final/, so it would do nothing; set "
            "output.save_final=true, or remove it and run `coati-kto export CONFIG output.merge_lora=true "
            "output.save_final=true` later (it writes merged/ from a checkpoint)",
        ),
        (
            ["output.export_dtype=fp32"],
            "override output.export_dtype=fp32, output.save_final=false: output.export_dtype fp32 with "
            "output.save_final false: training writes no final/, so it would do nothing; set "
            "output.save_final=true, or remove it and run `coati-kto export CONFIG output.export_dtype=fp32 "
            "output.save_final=true` later (it writes the fp32 weights from a checkpoint)",
        ),
    ],
)
def test_final_settings_without_final_are_refused(tmp_path: Path, overrides: list[str], line: str) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["output.save_final=false", *overrides]) == [line]
    assert load_config(path, overrides).output.save_final is True  # with final/ they shape it
    # set to their defaults they ask for nothing
    quiet = ["output.save_final=false", "output.merge_lora=false", "output.export_dtype=training"]
    assert load_config(path, quiet).output.save_final is False


def test_pack_reference_with_a_cached_reference_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["kto.pack_reference=true", "kto.reference=cached"]) == [
        "override kto.pack_reference=true, kto.reference=cached: kto.pack_reference with kto.reference cached: no "
        "reference pass runs in training to pack (the cached log-probs are read, and precompute packs its pairs "
        "anyway); set kto.pack_reference=false, or kto.reference=online"
    ]
    assert load_config(path, ["kto.pack_reference=false", "kto.reference=cached"]).kto.reference == "cached"
    assert load_config(path, ["kto.pack_reference=true"]).kto.pack_reference is True  # online: it packs


def test_eval_interval_without_evaluation_data_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["train.eval_interval=5"]) == [
        "override train.eval_interval=5: train.eval_interval 5 needs evaluation data: set data.eval_files or "
        "data.eval_fraction, or train.eval_interval=0"
    ]
    assert load_config(path, ["train.eval_interval=0"]).train.eval_interval == 0  # the default: no problem
    for data in ("data.eval_files=[e.jsonl]", "data.eval_fraction=0.1"):
        assert load_config(path, ["train.eval_interval=5", data]).train.eval_interval == 5


def test_eval_micro_batch_size_without_evaluation_data_is_refused(tmp_path: Path) -> None:
    """Only the eval loader reads train.eval_micro_batch_size, and there is none without evaluation data: it was
    accepted and did nothing (TRL's --per_device_eval_batch_size translates to it)."""
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["train.eval_micro_batch_size=8"]) == [
        "override train.eval_micro_batch_size=8: train.eval_micro_batch_size 8 needs evaluation data: set "
        "data.eval_files or data.eval_fraction, or remove train.eval_micro_batch_size"
    ]
    assert load_config(path).train.eval_micro_batch_size is None  # unset (the default): no problem
    for data in ("data.eval_files=[e.jsonl]", "data.eval_fraction=0.1"):
        assert load_config(path, ["train.eval_micro_batch_size=8", data]).train.eval_micro_batch_size == 8
    # listed with the other evaluation settings, all at once
    lines = _errors(path, ["eval.samples=2", "train.eval_interval=5", "train.eval_micro_batch_size=8"])
    assert [line.split(": ", 1)[1].split(" ", 1)[0] for line in lines] == [
        "eval.samples",
        "train.eval_interval",
        "train.eval_micro_batch_size",
    ]


def test_pack_reference_without_a_reference_point_is_refused(tmp_path: Path) -> None:
    """apo_zero_unpaired scores no KL pair, so there is nothing to pack an example's reference pass with
    (ScoringRules.for_trainer: pack_reference needs needs_kl); it was accepted and did nothing."""
    path = write_config(tmp_path, MINIMAL)
    apo = "kto.loss_type=apo_zero_unpaired"
    assert _errors(path, ["kto.pack_reference=true", apo]) == [
        "override kto.pack_reference=true, kto.loss_type=apo_zero_unpaired: kto.pack_reference with kto.loss_type "
        "apo_zero_unpaired: the loss has no reference point, so no KL pair is scored to share a pass with its "
        "example (the reference scores the examples alone); set kto.pack_reference=false, or kto.loss_type=kto"
    ]
    assert load_config(path, ["kto.pack_reference=false", apo]).kto.loss_type == "apo_zero_unpaired"
    assert load_config(path, ["kto.pack_reference=true", "kto.loss_type=kto"]).kto.pack_reference is True
    # an explicit pack_policy packs nothing there either (auto is kept: it turns on where it could apply)
    assert _errors(path, ["kto.pack_policy=true", apo]) == [
        "override kto.pack_policy=true, kto.loss_type=apo_zero_unpaired: kto.pack_policy true with kto.loss_type "
        "apo_zero_unpaired: the loss has no reference point, so no KL pair is scored for the policy's examples to "
        "share a pass with; set kto.pack_policy=auto, or kto.loss_type=kto"
    ]
    for setting in ("auto", "false"):
        assert load_config(
            path, [f"kto.pack_policy={setting}", apo, "kto.reference=cached"]
        ).kto.loss_type == ("apo_zero_unpaired")
    # with a cached reference too: both lines at once
    lines = _errors(path, ["kto.pack_reference=true", apo, "kto.reference=cached"])
    assert [line.split(": ", 1)[1].split(" with ")[1].split(":")[0] for line in lines] == [
        "kto.reference cached",
        "kto.loss_type apo_zero_unpaired",
    ]


def test_settings_that_are_read_are_admitted(tmp_path: Path) -> None:
    """pad_to_multiple_of pads the padded passes that still run under padding_free (bins of one document, pp), and
    precompute reads precompute_batch_size whatever kto.reference says."""
    path = write_config(tmp_path, MINIMAL)
    assert load_config(path, ["data.padding_free=true", "data.pad_to_multiple_of=64"]).data.padding_free
    assert load_config(path, ["kto.precompute_batch_size=8"]).kto.precompute_batch_size == 8


@pytest.mark.parametrize("key", ["model.compile", "kto.pack_policy"])
def test_true_false_or_auto_is_one_line_with_one_rule(tmp_path: Path, key: str) -> None:
    """auto exactly, as every literal key; true/false as every bool key reads them."""
    path = write_config(tmp_path, MINIMAL)
    for word in ("AUTO", "Auto", "maybe"):
        assert _errors(path, [f"{key}={word}"]) == [
            f"override {key}={word}: must be true, false or auto (got {word!r})"
        ]
    section, name = key.split(".")
    for word, value in (("auto", "auto"), ("yes", True), ("False", False)):
        assert getattr(getattr(load_config(path, [f"{key}={word}"]), section), name) == value


def test_router_aux_loss_coef_takes_auto_as_every_literal_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["kto.router_aux_loss_coef=AUTO"]) == [
        "override kto.router_aux_loss_coef=AUTO: must be auto or a number >= 0 (0: off) (got 'AUTO')"
    ]


def test_schema_types_say_what_load_accepts(tmp_path: Path) -> None:
    lines = {line.split(":")[0]: line for line in schema_lines() if line}
    assert lines["data.train_files"].startswith("data.train_files: str | list[str] (required)")
    assert lines["data.eval_files"].startswith("data.eval_files: str | list[str] = []")
    assert lines["output.push_to_hub"].startswith("output.push_to_hub: str | mapping | null = null")
    path = write_config(tmp_path, MINIMAL + "  push_to_hub: me/m\n")
    config = load_config(path, ["data.eval_files=e.jsonl"])
    assert (config.data.train_files, config.data.eval_files) == (["data.jsonl"], ["e.jsonl"])
    assert config.output.push_to_hub.repo_id == "me/m"
