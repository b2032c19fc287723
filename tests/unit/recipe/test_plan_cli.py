"""``coati-kto plan``: the report's lines, every shipped config, and bad input as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import PLAN_CONFIG

from coati_kto.cli import main
from coati_kto.errors import USER_ERROR_EXIT_CODE
from coati_kto.recipe.plan import predicted_peak_line

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def config(tmp_path: Path, tiny_model_dir: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(PLAN_CONFIG.format(model=tiny_model_dir))
    return path


def test_plan_prints_the_parts_of_the_configured_layout(config: Path, tiny_model_dir: Path, capsys) -> None:
    """The tiny Llama (147,776 parameters) at ZeRO-2 over 2 ranks: bf16 weights 2 x 147,776 B = 0.28 MiB, the
    masters and moments 12 x 73,888 B = 0.85 MiB."""
    assert main(["plan", str(config), "--gpus", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"model: {tiny_model_dir} (llama, 147,776 parameters, 2 layers, hidden 64, vocabulary 512; read from "
        "config.json only)"
    )
    assert lines[1] == "layout: hybrid_parallel bf16, tp 1 x dp 2, ZeRO-2, on 2 GPU(s), 1 node(s)"
    assert lines[3] == "  weights           0.28 MiB  bf16, 147,776 parameters per tensor-parallel rank"
    assert lines[4] == "  gradients         0.14 MiB  bf16, every parameter (147,776), / 2 ranks (ZeRO-2)"
    assert lines[5] == "  optimizer         0.85 MiB  fp32 masters + fp32 moments, / 2 ranks"
    assert lines[7] == "  reference         0.28 MiB  online, bf16"
    assert lines[9] == "  LM head           1.53 MiB  chunked: no [B, S, V] logits"
    assert lines[11] == "  peak              4.77 MiB  fits in 90% of 80 GiB"
    # stored in fp32 (its config.json's dtype), trained in bf16: 4 + 2 bytes per parameter at load
    assert lines[12] == (
        "host memory at load: 0.85 MiB per rank (the most of the whole model in fp32 and the policy in bf16 "
        "beside its trained fp32 values; every rank reads it), 1.69 MiB for a node's 2 rank(s): free host memory "
        "each node needs"
    )
    assert lines[13].startswith("layouts that fit on 2 x 80 GiB (best first: fewest ranks per replica")
    assert lines[14].startswith("  hybrid_parallel bf16, tp 1 x dp 2, ZeRO-0")


# Hub ids of the shipped configs whose shapes benchmarks/model_shapes holds (the others plan the tiny model).
SHAPES = {"Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b"}


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_plan_runs_on_every_shipped_config(path: Path, tiny_model_dir: Path, capsys) -> None:
    """Each shipped config's own layout on 16 GPUs, with the model's shape where benchmarks/model_shapes holds it,
    else the tiny model's config.json (the Hub ids and the directories a recipe builds first)."""
    hub_id = yaml.safe_load(path.read_text())["model"]["path"]
    shape = REPO / "benchmarks" / "model_shapes" / SHAPES[hub_id] if hub_id in SHAPES else tiny_model_dir
    assert main(["plan", str(path), f"model.path={shape}", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "  peak  " in out and "layouts that fit on 16 x 80 GiB" in out


def test_plan_takes_the_three_documented_shapes(tiny_model_dir: Path, capsys) -> None:
    """70B in full with an online reference on 16 x 80 GiB does not fit at ZeRO-2 (issue 48's arithmetic)."""
    shape = REPO / "benchmarks" / "model_shapes" / "llama-3.1-70b"
    args = ["plan", str(REPO / "configs" / "multinode_zero2.yaml"), f"model.path={shape}", "--gpus", "16"]
    assert main([*args, "--nodes", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"model: {shape} (llama, 70,553,706,496 parameters, 80 layers")
    assert lines[11].endswith("does NOT fit in 90% of 80 GiB")
    # stored in bf16 (torch_dtype): the whole model in fp32 on each of a node's 8 ranks, 263 GiB each
    assert lines[12] == (
        "host memory at load: 262.83 GiB per rank (the whole model in fp32; every rank reads it), 2102.66 GiB for "
        "a node's 8 rank(s): free host memory each node needs"
    )


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_bad_input_is_one_line(config: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    empty = tmp_path / "empty"
    assert _error(["plan", str(config), f"model.path={empty}"], capsys) == (
        f"error: model.path: {empty} has no config.json (the plan reads the model's shape from it)"
    )
    assert _error(["plan", str(config), "plugin.tp_size=2", "--gpus", "3"], capsys) == (
        "error: --gpus 3 is not a multiple of plugin.tp_size 2 = 2"
    )
    assert _error(["plan", str(config), "--gpus", "4", "--nodes", "3"], capsys) == (
        "error: --gpus 4 is not a multiple of --nodes 3 (the same GPUs on every node)"
    )
    assert (
        _error(["plan", str(config), "--gpu-memory", "0"], capsys)
        == "error: --gpu-memory must be > 0 GiB, got 0"
    )
    assert _error(["plan", str(config), "--gpus", "0"], capsys) == (
        "error: --gpus and --nodes must be >= 1, got --gpus 0 --nodes 1"
    )
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "nosuchmodel"}')
    assert _error(["plan", str(config), f"model.path={unknown}"], capsys) == (
        f"error: model.path: {unknown}: model_type 'nosuchmodel' is not one this transformers knows"
    )
    (unknown / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}'
    )
    assert _error(["plan", str(config), f"model.path={unknown}"], capsys) == (
        f"error: model.path: {unknown}: transformers cannot build its config.json (Class validation error for "
        "validator 'validate_architecture': ValueError: The hidden size (64) is not a multiple of the number of "
        "attention heads (5).)"
    )
    missing = tmp_path / "nowhere" / "model"
    assert _error(["plan", str(config), f"model.path={missing}"], capsys) == (
        f"error: model.path: {missing} does not exist (a local directory, or a hub id like org/name)"
    )


def test_train_line_says_the_peak_and_warns_when_over_the_device(config: Path) -> None:
    from coati_kto.config.load import load_config

    loaded = load_config(config)
    assert predicted_peak_line(loaded, 2, None) == (
        "predicted peak per rank: 4.77 MiB (`coati-kto plan CONFIG` shows its parts); CPU: no device-memory check "
        "(the ranks share host memory)"
    )
    assert predicted_peak_line(loaded, 2, 80 << 30) == (
        "predicted peak per rank: 4.77 MiB (`coati-kto plan CONFIG` shows its parts), within 90% of this device's "
        "80.00 GiB"
    )
    assert predicted_peak_line(loaded, 2, 2 << 20) == (
        "warning: predicted peak per rank 4.77 MiB is over 90% of this device's 2.00 MiB: this layout may run out of "
        "memory (coati-kto plan CONFIG --gpus N lists the layouts that fit)"
    )


def test_a_hub_id_is_read_from_the_hub_cache_only(
    config: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A Hub id's config.json comes from the hub cache (no download); not there, one line saying how to get it."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(config), "model.path=org/tiny", "--gpus", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("model: org/tiny (llama, 147,776 parameters")
    assert _error(["plan", str(config), "model.path=org/absent"], capsys) == (
        "error: model.path: org/absent is not in the hub cache (the plan reads only config.json: download it with "
        "`hf download org/absent config.json`, or set model.path to a directory holding it)"
    )


def test_the_configured_layout_shards_zero_over_data_and_sequence_ranks(config: Path, capsys) -> None:
    """ZeRO's group is dp x sp (recipe/setup.py's plan): sp 2 on 2 GPUs keeps ZeRO-2; tp 2 on 2 GPUs runs it as 0."""
    from coati_kto.config.load import load_config
    from coati_kto.recipe.plan import configured_layout

    padded = ["data.padding_free=true", "model.attn_implementation=sdpa"]
    sp = load_config(config, ["plugin.sp_size=2", *padded]).plugin
    assert configured_layout(sp, 2).describe() == "hybrid_parallel bf16, tp 1 x sp 2 x dp 1, ZeRO-2"
    tp = load_config(config, ["plugin.tp_size=2"]).plugin
    assert configured_layout(tp, 2).describe() == "hybrid_parallel bf16, tp 2 x dp 1, ZeRO-0"
    # the layouts listed are the ones config load admits: Llama's proven sp sizes 2 and 4, not 8 (32 heads), its
    # proven tp size 2, not 8, and tp 2 x sp 2, not tp 2 x sp 4 (8 key-value heads would split, but it never ran)
    from coati_kto.recipe.plan import _admitted

    admits = _admitted(str(REPO / "benchmarks" / "model_shapes" / "llama-3.1-8b"))
    sizes = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (8, 1)]
    assert [admits(tp, sp) for tp, sp in sizes] == [True, True, False, True, False, False]


def test_a_config_json_without_a_shape_field_is_refused_naming_it(
    config: Path, tmp_path: Path, capsys
) -> None:
    """Llama 3.1 70B's config.json without hidden_size is not planned at LlamaConfig's default 4096: one line
    names the file and the field (gpt2's as it spells them: n_embd); fields a family computes (head_dim) or leaves
    optional (gpt2's n_inner) are not asked for."""
    raw = json.loads((REPO / "benchmarks" / "model_shapes" / "llama-3.1-70b" / "config.json").read_text())
    del raw["hidden_size"], raw["vocab_size"]
    folder = tmp_path / "no_hidden"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    assert _error(["plan", str(config), f"model.path={folder}"], capsys) == (
        f"error: model.path: {folder / 'config.json'} has no hidden_size, vocab_size (transformers would take "
        "LlamaConfig's defaults: another model's shape)"
    )
    gpt2 = {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 512,
        "n_positions": 64,
    }
    (folder / "config.json").write_text(json.dumps(gpt2))
    assert main(["plan", str(config), f"model.path={folder}", "--gpus", "2"]) == 0
    assert "(gpt2, " in capsys.readouterr().out.splitlines()[0]
    (folder / "config.json").write_text(json.dumps({k: v for k, v in gpt2.items() if k != "n_embd"}))
    assert _error(["plan", str(config), f"model.path={folder}"], capsys).endswith(
        "config.json has no n_embd (transformers would take GPT2Config's defaults: another model's shape)"
    )


def test_a_nested_text_config_takes_the_defaults_it_omits(config: Path, tmp_path: Path, capsys) -> None:
    """Gemma 3 4B's hub config.json nests its text model under text_config without its heads and vocabulary
    (transformers wrote it as a diff against Gemma3TextConfig's defaults): planned, and the model line says so."""
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
    }
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    folder = tmp_path / "gemma3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    assert main(["plan", str(config), f"model.path={folder}", "--gpus", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        first.startswith(f"model: {folder} (gemma3_text, ")
        and "34 layers, hidden 2560, vocabulary 262208" in first
    )
    assert first.endswith(
        "its text_config leaves vocab_size, num_attention_heads, num_key_value_heads to the family's defaults)"
    )


def test_a_tensor_parallel_size_across_nodes_is_a_note(config: Path, capsys) -> None:
    """tp 2 on 2 nodes of 1 GPU: train runs it (every layer's collectives over the network), the search lists tp
    within a node only; the report says so under the layout."""
    assert main(["plan", str(config), "plugin.tp_size=2", "--gpus", "2", "--nodes", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == (
        "note: plugin.tp_size 2 spans nodes (1 GPU(s) per node): every layer's tensor-parallel collectives cross "
        "the network; the layouts below keep tp within a node (a divisor of the GPUs per node)"
    )
    assert all(" tp 1 " in line for line in lines if line.startswith("  hybrid_parallel"))
    assert main(["plan", str(config), "plugin.tp_size=2", "--gpus", "2", "--nodes", "1"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]


def test_the_layouts_offer_sp_only_where_config_load_admits_it(config: Path, capsys) -> None:
    """low_level_zero (and ddp) have no sequence-parallel group and bf16 runs sp at ZeRO 2 only: the plan listed
    sp 2 and 4 for a low_level_zero config, and hybrid bf16 sp layouts at ZeRO 0 and 1, which config load refuses."""
    padded = ["data.padding_free=true", "model.attn_implementation=sdpa"]
    assert main(["plan", str(config), *padded, "plugin.name=low_level_zero", "--gpus", "4"]) == 0
    listed = capsys.readouterr().out.split("layouts that fit")[1].splitlines()[1:]
    assert listed and not [line for line in listed if " x sp " in line], listed
    assert main(["plan", str(config), *padded, "--gpus", "4"]) == 0
    listed = capsys.readouterr().out.split("layouts that fit")[1].splitlines()[1:]
    with_sp = [line.split("micro-batch")[0].strip() for line in listed if " x sp " in line]
    assert sorted(with_sp) == [
        "hybrid_parallel bf16, tp 1 x sp 2 x dp 2, ZeRO-2",
        "hybrid_parallel bf16, tp 1 x sp 4 x dp 1, ZeRO-2",
        "hybrid_parallel bf16, tp 2 x sp 2 x dp 1, ZeRO-2",
    ], listed


def test_no_sp_layout_is_offered_with_a_feature_sp_refuses(config: Path, capsys) -> None:
    """The plan offered sp layouts whenever rows were padding-free, also with model.compile or
    train.fused_optimizer, which config load refuses under sp."""
    padded = ["data.padding_free=true", "model.attn_implementation=sdpa"]
    for feature in ("model.compile=true", "train.fused_optimizer=true"):
        assert main(["plan", str(config), *padded, feature, "--gpus", "4"]) == 0
        listed = capsys.readouterr().out.split("layouts that fit")[1].splitlines()[1:]
        assert listed and not [line for line in listed if " x sp " in line], (feature, listed)
