"""hybrid_parallel at tp_size 1 trains every family low_level_zero trains (tests/distributed/family_sweep.py).

In the normal suite: a representative subset (Qwen 3.5 with its linear-attention layers and vision tower, Gemma 4
and an MoE, Qwen3-MoE), each through the whole lifecycle on both plugins. Under ``sweep`` (``make test-all``; also ``slow``): every
causal-LM type transformers builds tiny. docs/family_sweep.md is that sweep's table: it must cover every type.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from family_sweep import PLUGINS, _agree, probe, sweep, verdict
from helpers import CORPUS, chat_records

REPRESENTATIVE = ["qwen3_5", "gemma4_text", "qwen3_moe"]
REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "family_sweep.md"


def _tokenizer():
    from coati_kto.testing.tiny import build_tokenizer

    return build_tokenizer(CORPUS, vocab_size=300)


def test_representative_families_train_on_both_plugins(tmp_path: Path) -> None:
    results = sweep(REPRESENTATIVE, tmp_path, _tokenizer())
    print(results)
    expected = {t: dict.fromkeys(PLUGINS, "trained") for t in REPRESENTATIVE}
    expected["qwen3_moe"] = dict.fromkeys(PLUGINS, "trained (aux loss added)")  # train/aux_loss > 0 checked
    assert results == expected


@pytest.mark.parametrize("model_type", [*REPRESENTATIVE, "gemma4"])
def test_tiny_models_stay_tiny(model_type: str) -> None:
    """Every size a default config holds is shrunk: Gemma 3n/4's per-layer embedding table (262,144 x 256 per
    layer by default) once made the Gemma 4 tiny model 134M parameters, 537 MB per save, 12 GB per suite run."""
    import torch

    from coati_kto.families import auto_model_class
    from coati_kto.testing.tiny_types import tiny_config

    config = tiny_config(model_type, _tokenizer())
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_a_cell_is_trained_only_when_its_numbers_hold() -> None:
    good = {
        "step1": {"rewards/chosen": 0.0, "kl_raw": 0.0},
        "resume_diff": 0.0,
        "resumed_step": 2,
        "export": None,
    }
    assert verdict([good, good]) == "trained"
    assert verdict([good, {**good, "step1": {"rewards/chosen": 1e-6, "kl_raw": 0.0}}]).startswith(
        "fails: step-1"
    )
    assert verdict([{**good, "resume_diff": 2**-9}, good]).startswith("fails: resume not bit-exact")
    assert (
        verdict([{**good, "export": "exported log-probs differ"}, good]) == "fails: exported log-probs differ"
    )
    assert verdict([{"error": "RuntimeError: x (a.py:3)"}, good]) == "fails: RuntimeError: x (a.py:3)"
    assert verdict([good, good], moe=True).startswith("fails: MoE router load-balancing loss not added")
    assert verdict([{**good, "aux_loss": 0.0}] * 2, moe=True).startswith("fails: MoE router")
    assert verdict([{**good, "aux_loss": 0.02}] * 2, moe=True) == "trained (aux loss added)"


def test_a_set_goes_on_only_while_its_ranks_end_each_cell_alike(tmp_path: Path) -> None:
    """One set of processes runs many cells: past a cell both ranks passed or failed with the same error, never
    past one a rank failed alone (or differently, or never finished: hung), where the collectives may disagree."""
    import json

    lines = [{"a/p": {"error": "RuntimeError: x (m.py:3)"}}, {"b/p": {"resume_diff": 0.0}}]
    (tmp_path / "cells-1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _agree(str(tmp_path), 0, "a/p", {"error": "RuntimeError: x (m.py:3)"})
    assert not _agree(str(tmp_path), 0, "a/p", {"error": "RuntimeError: y (m.py:3)"})
    assert not _agree(str(tmp_path), 0, "a/p", {"resume_diff": 0.0})
    assert _agree(str(tmp_path), 0, "b/p", {"resume_diff": 0.0})
    assert not _agree(str(tmp_path), 0, "b/p", {"error": "hung: the cell ran past 600 s"})
    assert not _agree(str(tmp_path), 0, "c/p", {"resume_diff": 0.0}, wait_s=0.3)


def test_probe_classifies_encoders_and_moes_in_process(tmp_path: Path) -> None:
    """BERT's causal-LM class without is_decoder attends both ways: recorded ``not causal`` without spawning a
    process (it "trained" before: KTO on log-probs that see the tokens they score); Llama is causal; a Qwen3-MoE
    has the Switch loss, its saved config then asks for router logits."""
    import json

    from coati_kto.testing.tiny_types import save_tiny_type

    dirs = {t: str(save_tiny_type(t, tmp_path / t, _tokenizer())) for t in ("bert", "llama", "qwen3_moe")}
    why, moe = probe(dirs["bert"])
    assert why is not None and why.startswith("not causal: its logits move by") and not moe
    assert probe(dirs["llama"]) == (None, False)
    assert probe(dirs["qwen3_moe"]) == (None, True)
    assert json.loads((Path(dirs["qwen3_moe"]) / "config.json").read_text())["output_router_logits"] is True


def test_a_type_refused_at_load_is_recorded_with_its_line_when_not_built(tmp_path: Path) -> None:
    """MusicGen cannot be built tiny (two text configs); config load refuses it from its model_type: the cell is
    that refusal (what a user gets), not ``not built tiny``; a type neither built nor refused stays the latter."""
    from family_sweep import admitted_cells

    verdicts, cells = admitted_cells(["musicgen"], tmp_path, _tokenizer())
    assert cells == []
    for cell in verdicts["musicgen"].values():
        assert cell.startswith("refused: model.path ") and "model_type musicgen is not supported: " in cell


def test_the_committed_table_covers_every_causal_lm_type() -> None:
    """docs/family_sweep.md was generated by the sweep: one row per type transformers maps, and a date."""
    from coati_kto.testing.tiny_types import causal_lm_types

    text = TABLE.read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| ([\w.-]+) \|", text, re.MULTILINE)} - {"model", "---"}
    assert rows == set(causal_lm_types())
    assert re.search(r"on \d{4}-\d{2}-\d{2} \(transformers", text)
    # A type the sweep found failing is refused at config load (coati_kto/families/unproven.py), not admitted.
    failing = {m.group(1) for m in re.finditer(r"^\| ([\w.-]+) \|.*\| fails", text, re.MULTILINE)}
    assert failing == set(), failing
    # Nor is a type the sweep could not build admitted unproven: each is refused (its cells the refusal line).
    unbuilt = {m.group(1) for m in re.finditer(r"^\| ([\w.-]+) \| not built", text, re.MULTILINE)}
    assert unbuilt == set(), unbuilt


@pytest.mark.slow
@pytest.mark.sweep
def test_every_family_low_level_zero_trains_trains_under_hybrid_tp1(tmp_path: Path) -> None:
    from coati_kto.testing.tiny_types import causal_lm_types

    results = sweep(causal_lm_types(), tmp_path, _tokenizer())
    trained = {p: {t for t, cells in results.items() if cells[p].startswith("trained")} for p in PLUGINS}
    # Every type low_level_zero trains, hybrid trains (it also trains the ones whose unused parameters break
    # low_level_zero's optimizer save: docs/family_sweep.md).
    assert trained["low_level_zero"] <= trained["hybrid_parallel tp1"], results
    assert len(trained["low_level_zero"]) >= 100


def _shipped(config_file: str, model_dir: str, root: str, *extra: str) -> dict[str, Any]:
    """``configs/<config_file>`` with only model.path changed, and what a CPU run of 2 steps must change besides
    (data files, no eval set, output dir, step count, batch size, tokenization processes); its plugin section as shipped."""
    from coati_kto.config.load import load_config
    from coati_kto.train import train

    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{root}/train.jsonl]",
        f"data.prepared_dir={root}/prepared",
        "data.num_proc=1",
        "data.eval_files=[]",
        "data.eval_fraction=0",
        "train.eval_interval=0",  # no evaluation data: an interval would do nothing (refused)
        f"output.dir={root}/out",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.accumulation_steps=1",
        "logging.tensorboard=false",
        *extra,
    ]
    config = load_config(REPO / "configs" / config_file, overrides)
    first = train(config).history[0]
    return {
        "plugin": config.plugin.model_dump(),
        "step1": [first["train/rewards/chosen"], first["train/rewards/rejected"], first["train/kl_raw"]],
    }


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma4"])
def test_shipped_configs_train_qwen3_5_and_gemma4(tmp_path: Path, model_type: str) -> None:
    """configs/single_gpu.yaml (1 process: hybrid_parallel runs ZeRO stage 0 there) and node_8gpu_zero2.yaml
    (ZeRO-2 over 2 processes here; flash-attn absent on CPU, so sdpa) admit and train Qwen 3.5 and Gemma 4."""
    from family_sweep import REFUSAL

    from coati_kto.data.files import write_jsonl
    from coati_kto.testing.distributed import run_distributed
    from coati_kto.testing.tiny_types import save_tiny_type

    model_dir = str(save_tiny_type(model_type, tmp_path / "model", _tokenizer()))
    for name in ("single", "node"):
        write_jsonl(chat_records(12, REFUSAL), tmp_path / name / "train.jsonl")
    single = run_distributed(_shipped, 1, "single_gpu.yaml", model_dir, str(tmp_path / "single"))
    node = run_distributed(
        _shipped,
        2,
        "node_8gpu_zero2.yaml",
        model_dir,
        str(tmp_path / "node"),
        "model.attn_implementation=sdpa",
    )
    for run in single + node:
        assert run["plugin"]["name"] == "hybrid_parallel" and run["plugin"]["tp_size"] == 1
        assert run["plugin"]["zero_stage"] == 2 and run["plugin"]["precision"] == "bf16"
        assert run["step1"] == [0.0, 0.0, 0.0], run
