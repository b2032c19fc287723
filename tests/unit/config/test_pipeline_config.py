"""plugin.pp_size / pp_style / num_model_chunks at config load: each refusal one line naming the key and the fix,
all of a config's problems at once, before any process starts; what a valid pipeline-parallel config becomes; the
note for the pass layouts pp turns off; and the world size checked against tp x sp x pp before launch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.pipeline import check_pipeline_divides_world, pipeline_note, stage_note
from coati_kto.config.plugin import PluginSection
from coati_kto.errors import ConfigError

ADMITTED = (
    "LlamaForCausalLM (pp_size 2, 4), MistralForCausalLM (pp_size 2), Qwen2ForCausalLM (pp_size 2, 4), "
    "Qwen3ForCausalLM (pp_size 2), SmolLM3ForCausalLM (pp_size 2)"
)
PP = ["plugin.pp_size=2", "train.accumulation_steps=2"]


def _load(tmp_path: Path, model_dir: Path | str, *overrides: str):
    text = MINIMAL.replace("some/model", str(model_dir))
    return load_config(write_config(tmp_path, text), list(overrides))


def _problems(tmp_path: Path, model_dir: Path | str, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, model_dir, *overrides)
    return str(err.value).splitlines()


def test_a_valid_pp_config_defaults_zero_to_what_colossalai_allows(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The hybrid default ZeRO stage is 2, which ColossalAI refuses under pp: unset, it becomes 1 (bf16/fp16) or 0
    (fp32); an explicit 0 or 1 is kept; pp_size 1 keeps the usual default."""
    config = _load(tmp_path, tiny_model_dir, *PP)
    plugin = config.plugin
    assert (plugin.pp_size, plugin.pp_style, plugin.num_model_chunks, plugin.zero_stage) == (2, "1f1b", 1, 1)
    assert _load(tmp_path, tiny_model_dir, *PP, "plugin.precision=fp16").plugin.zero_stage == 1
    assert _load(tmp_path, tiny_model_dir, *PP, "plugin.precision=fp32").plugin.zero_stage == 0
    assert _load(tmp_path, tiny_model_dir, *PP, "plugin.zero_stage=0").plugin.zero_stage == 0
    assert _load(tmp_path, tiny_model_dir).plugin.zero_stage == 2
    assert PluginSection(name="low_level_zero").zero_stage == 2  # only hybrid_parallel's default moves
    # A saved config (every key written out) loads back as it was.
    assert PluginSection(**plugin.model_dump()) == plugin


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["plugin.name=low_level_zero", "plugin.zero_stage=1"],
            "plugin.pp_size 2 needs plugin.name hybrid_parallel, not low_level_zero (it has no pipeline stages)",
        ),
        (
            ["plugin.name=ddp", "plugin.precision=fp32"],
            "plugin.pp_size 2 needs plugin.name hybrid_parallel, not ddp (it has no pipeline stages)",
        ),
        (
            ["plugin.zero_stage=2"],
            "plugin.pp_size 2 with plugin.zero_stage 2: ColossalAI allows ZeRO stage 0 or 1 with pipeline "
            "parallelism (hybrid_parallel_plugin.py:1134): set plugin.zero_stage=1",
        ),
        (
            ["plugin.num_model_chunks=2"],
            "plugin.pp_style 1f1b holds one model chunk per stage (got plugin.num_model_chunks 2): set "
            "plugin.num_model_chunks=1, or plugin.pp_style=interleaved",
        ),
        (
            ["plugin.pp_style=interleaved"],
            "plugin.pp_style interleaved needs plugin.num_model_chunks >= 2 (each stage holds that many slices of "
            "the layers): set plugin.num_model_chunks=2, or plugin.pp_style=1f1b",
        ),
        (
            ["plugin.pp_size=1", "plugin.pp_style=interleaved"],
            "plugin.pp_style interleaved has no effect at plugin.pp_size 1 (pipeline parallelism is off at 1)",
        ),
        (
            ["plugin.pp_size=1", "plugin.num_model_chunks=2"],
            "plugin.num_model_chunks 2 has no effect at plugin.pp_size 1 (pipeline parallelism is off at 1)",
        ),
        (
            ["plugin.sp_size=2"],
            "plugin.pp_size 2 with plugin.sp_size 2 is not supported: set plugin.pp_size=1",
        ),
        (
            ["plugin.cpu_offload=true"],
            "plugin.pp_size 2 with plugin.cpu_offload is not supported: set plugin.pp_size=1",
        ),
        (
            ["train.accumulation_steps=1"],
            "plugin.pp_size 2 with plugin.pp_style 1f1b needs train.accumulation_steps >= 2 (got 1): each optimizer "
            "step's micro-batches fill the stages, one each at least (one_f_one_b.py:93-95)",
        ),
        (
            ["plugin.pp_style=interleaved", "plugin.num_model_chunks=2"],
            "plugin.pp_style interleaved is not proven: ColossalAI 0.5.0's interleaved schedule hung in the warm-up "
            "transfers of the run after the first (2 stages, 2 chunks, gloo); use plugin.pp_style=1f1b",
        ),
        (
            ["plugin.pp_size=8", "train.accumulation_steps=8"],
            "model.path {model}: LlamaForCausalLM is not proven at plugin.pp_size 8 (pipeline parallelism: "
            f"{ADMITTED})",
        ),
        (
            ["model.compile=true"],
            "plugin.pp_size 2 with model.compile (the compiled regions are unproven under the stage forward) is "
            "not supported: set plugin.pp_size=1",
        ),
        (
            ["eval.samples=2", "data.eval_fraction=0.1"],
            "plugin.pp_size 2 with eval.samples > 0 (decoding one token at a time through the stages is not "
            "written) is not supported: set plugin.pp_size=1",
        ),
        (
            ["kto.router_aux_loss_coef=0.01"],
            "plugin.pp_size 2 with kto.router_aux_loss_coef > 0 (the router logits stay on the stage of their "
            "layer) is not supported: set plugin.pp_size=1",
        ),
        (
            ["model.lora={rank: 4}", "output.merge_lora=true"],
            "plugin.pp_size 2 with output.merge_lora: each stage holds its own layers' weights, so no rank can "
            "fold the adapters in; set output.merge_lora=false (the adapter export is whole: merge it afterwards "
            "with peft's merge_and_unload)",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_each_refused_combination_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, overrides: list[str], line: str
) -> None:
    problems = _problems(tmp_path, tiny_model_dir, *PP, *overrides)
    expected = line.format(model=tiny_model_dir)
    assert any(p.endswith(expected) for p in problems), problems


def test_every_problem_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A plugin section's own problems and the cross-section ones come together, a line each (the cross-section
    ones waited for a valid plugin section: a file's mistakes came in rounds)."""
    plugin = _problems(
        tmp_path, tiny_model_dir, *PP, "plugin.zero_stage=2", "plugin.sp_size=2", "plugin.num_model_chunks=2"
    )
    assert len(plugin) == 5, plugin  # the section's three, then the cross-section ones
    assert "plugin.sp_size 2 with data.padding_free false" in plugin[3], plugin
    assert "is more than its num_hidden_layers 2" in plugin[4], plugin
    found = _problems(
        tmp_path,
        tiny_model_dir,
        *PP,
        "train.accumulation_steps=1",
        "model.compile=true",
        "kto.router_aux_loss_coef=0.01",
        "model.lora={rank: 4}",
        "output.merge_lora=true",
    )
    assert len([p for p in found if "plugin.pp_size 2 with" in p]) == 4, found


def test_a_model_class_outside_the_table_is_refused(tmp_path: Path, tiny_family_dir) -> None:
    phi3 = tiny_family_dir("phi3")
    problems = _problems(tmp_path, phi3, *PP)
    assert problems[-1].endswith(
        f"model.path {phi3}: Phi3ForCausalLM is not proven at plugin.pp_size 2 (pipeline parallelism: {ADMITTED})"
    ), problems
    # The reference is split into the same stages: checked too.
    both = _problems(tmp_path, phi3, *PP, f"model.reference_path={phi3}")
    assert sum("is not proven at plugin.pp_size 2" in p for p in both) == 2, both


def test_a_hub_id_is_left_to_the_plugin(tmp_path: Path) -> None:
    """No config.json to read (a hub id): neither the class nor the layer count is checked at load."""
    assert _load(tmp_path, "some/model", *PP).plugin.pp_size == 2


def test_the_backend_table_check_takes_pp_size() -> None:
    """A class only loading tells (a hub id) is refused at boost by the table config load uses; the callers that
    pass no pp_size keep working."""
    from coati_kto.families.splits import refuse_unadmitted

    llama = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    refuse_unadmitted(llama, 1, "model.path: ", 1, 2)
    refuse_unadmitted(llama, 2, "model.path: ", 2)
    with pytest.raises(ConfigError) as err:
        refuse_unadmitted("transformers.models.phi3.modeling_phi3.Phi3ForCausalLM", 1, "model.path: ", 1, 2)
    assert str(err.value) == (
        f"model.path: Phi3ForCausalLM is not proven at plugin.pp_size 2 (pipeline parallelism: {ADMITTED})"
    )


def test_padded_rows_instead_of_packed_ones_is_a_note(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Padding-free rows, packing and the KL continuation are not refused under pp: the trainer runs padded rows,
    and one line says which of the config's layouts do not run."""
    asked = ["data.padding_free=true", "kto.pack_reference=true", "model.attn_implementation=sdpa"]
    config = _load(tmp_path, tiny_model_dir, *PP, *asked)
    assert pipeline_note(config) == (
        "note: plugin.pp_size 2: the pipeline schedule splits a batch along its rows, so data.padding_free, "
        "kto.pack_policy, kto.pack_reference, kto.kl_continuation do not run (every pass runs on padded rows, the "
        "examples and the KL pairs each take one; equal within rounding)"
    )
    assert pipeline_note(_load(tmp_path, tiny_model_dir, *asked)) is None  # no pp
    quiet = _load(tmp_path, tiny_model_dir, *PP, "kto.kl_continuation=false", "kto.pack_policy=false")
    assert pipeline_note(quiet) is None
    kl_only = _load(tmp_path, tiny_model_dir, *PP)
    assert "so kto.kl_continuation does not run" in pipeline_note(kl_only)
    # apo_zero_unpaired runs no KL pass: only its padding-free rows are turned off (kto.pack_reference and an
    # explicit kto.pack_policy are refused there at load: no KL pair to pack)
    unpaired = [a for a in asked if not a.startswith(("kto.pack_reference", "kto.pack_policy"))]
    apo = _load(tmp_path, tiny_model_dir, *PP, *unpaired, "kto.loss_type=apo_zero_unpaired")
    assert "so data.padding_free does not run (" in pipeline_note(apo)
    assert pipeline_note(_load(tmp_path, tiny_model_dir, *PP, "kto.loss_type=apo_zero_unpaired")) is None


def test_the_world_must_divide_into_tp_times_sp_times_pp_groups() -> None:
    check_pipeline_divides_world(PluginSection(pp_size=2, tp_size=2), 8)
    check_pipeline_divides_world(PluginSection(), 3)  # pp_size 1: check_tp_divides_world's
    with pytest.raises(ConfigError) as err:
        check_pipeline_divides_world(PluginSection(pp_size=2, tp_size=2), 6)
    assert str(err.value) == (
        "plugin.tp_size 2 x plugin.pp_size 2 = 4 must divide the number of processes, 6: launch a multiple of 4 "
        "(e.g. --nproc-per-node 4)"
    )
    with pytest.raises(ConfigError) as err:
        check_pipeline_divides_world(PluginSection.model_construct(tp_size=1, sp_size=2, pp_size=2), 2)
    assert str(err.value).startswith("plugin.tp_size 1 x plugin.sp_size 2 x plugin.pp_size 2 = 4 must divide")


def test_train_checks_the_world_before_launch(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``coati-kto train --nproc-per-node 3`` with pp_size 2: one line from the launcher, before torchrun."""
    from coati_kto.cli import _check_before_launch

    path = write_config(tmp_path, MINIMAL.replace("some/model", str(tiny_model_dir)))
    args = argparse.Namespace(command="train", config=path, overrides=PP, nproc_per_node=3)
    with pytest.raises(ConfigError) as err:
        _check_before_launch(args)
    assert str(err.value) == (
        "plugin.tp_size 1 x plugin.pp_size 2 = 2 must divide the number of processes, 3: launch a multiple of 2 "
        "(e.g. --nproc-per-node 2)"
    )


def test_each_rank_checks_the_world_before_loading(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' own check (``setup._start_processes``), for launchers other than ``coati-kto train``."""
    from coati_kto.recipe import setup

    monkeypatch.setattr(setup, "init_distributed", lambda timeout_s, file_wait_timeout_s: None)
    monkeypatch.setattr(setup.dist, "get_world_size", lambda: 3)
    with pytest.raises(
        ConfigError, match=r"^plugin.tp_size 1 x plugin.pp_size 2 = 2 must divide the number of "
    ):
        setup._start_processes(_load(tmp_path, tiny_model_dir, *PP))


def test_the_stage_split_is_said(tmp_path: Path, tiny_family_dir) -> None:
    """ColossalAI's split (PipelineStageManager.distribute_layers): the remainder on the middle stages, said when
    uneven; nothing at pp_size 1 or for a hub id (no config.json)."""
    from coati_kto.families.splits import distribute_layers

    assert distribute_layers(3, 2) == [1, 2]
    assert distribute_layers(10, 4) == [2, 3, 3, 2]
    assert distribute_layers(64, 4) == [16, 16, 16, 16]
    model = tiny_family_dir("qwen3")  # 1 layer: pp 2 is refused, so only the note's arithmetic here
    config = _load(tmp_path, model)
    assert stage_note(config) is None
    hub = _load(tmp_path, "some/model", *PP)
    assert stage_note(hub) is None


def test_the_stage_split_note_of_an_uneven_model(tmp_path: Path, built_root: Path) -> None:
    from helpers import CORPUS

    from coati_kto.testing.built import built
    from coati_kto.testing.tiny import save_tiny_model

    model = built(
        built_root,
        "tiny_llama_tied_3",
        lambda out: save_tiny_model(out, CORPUS, num_layers=3, tie_word_embeddings=True),
        {"corpus": CORPUS, "num_layers": 3, "tie_word_embeddings": True},
    )
    assert stage_note(_load(tmp_path, model, *PP)) == (
        "note: plugin.pp_size 2: the 3 decoder layers split into stages of [1, 2] (uneven: the remainder on the "
        "middle stages); the first stage also holds the embedding, the last the final norm and the LM head"
    )


def test_a_files_mistakes_come_at_once_each_naming_its_lines(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A file with pp_size 2 beside zero_stage 2, eval.samples and output.merge_lora: the zero_stage line came
    first, alone (the plugin section's check stopped the config's), then the others after a fix; and each pair
    named pp_size's line only."""
    path = write_config(
        tmp_path,
        MINIMAL.replace("some/model", str(tiny_model_dir)).replace(
            "  dir: out\n", "  dir: out\n  merge_lora: true\n"
        )
        + "plugin:\n  pp_size: 2\n  zero_stage: 2\neval:\n  samples: 2\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        f"{path}:10 and {path}:11",  # pp_size with zero_stage
        f"{path}:8",  # merge_lora without model.lora
        f"{path}:13",  # eval.samples without evaluation data
        f"{path}:10",  # the schedule: train.accumulation_steps is not in the file
        f"{path}:10 and {path}:13",  # pp_size with eval.samples
        f"{path}:8 and {path}:10",  # pp_size with output.merge_lora
    ], lines


def test_auto_attention_on_a_gpu_keeps_the_default_kernel_under_pp(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """On a GPU, auto chose flex_attention with every pass padding-free, and its note said so; the pipeline stages
    run padded rows (a path flex was never proven on): under pp auto keeps the model's default kernel."""
    import types

    from coati_kto.config.attention import flex_refusal, resolve_attention

    assert flex_refusal([str(tiny_model_dir)], 1, cuda=True) is None  # flex where nothing refuses it
    assert flex_refusal([str(tiny_model_dir)], 1, cuda=True, pp_size=2) == (
        "plugin.pp_size 2: the pipeline stages run padded rows, not padding-free passes"
    )
    model = types.SimpleNamespace(attn_implementation="auto", path=str(tiny_model_dir), reference_path=None)
    data = types.SimpleNamespace(padding_free=False)
    assert resolve_attention(model, data, 1, True, 1, 2) == (
        None,
        False,
        "model.attn_implementation auto: the model's default kernel (plugin.pp_size 2: the pipeline stages run "
        "padded rows, not padding-free passes)",
    )
