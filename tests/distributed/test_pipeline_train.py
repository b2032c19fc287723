"""Pipeline parallelism (plugin.pp_size 2, 1F1B) through the whole ``coati-kto train`` recipe on 2 gloo processes,
against the same run at pp_size 1 on one process (fp32, ZeRO 0, SGD: a wrong gradient scale shows in the
weights, where Adam would divide it out).

The model is a tiny Llama of 3 decoder layers with tied embeddings: the stages hold [1, 2] layers (ColossalAI
puts the remainder on the middle stage), the first stage the embedding and the last the norm and the LM head,
which is the embedding (one gradient, summed over the two stages). Both runs read the same micro-batches (dp is
1 in both), so after 3 steps the weights agree within fp32 summation order (the issue's bound: 2e-5 of each
tensor's update), every logged train/ and eval/ metric agrees within 1e-5 relative, and the online reference gives
rewards and KL of exactly 0 at step 1. A pp 2 checkpoint resumes at pp 2 bit for bit and at pp 1 within the bound;
the export of the pp 2 run is one Hugging Face model; its checkpoint exports on one process as the run saved it.
LoRA at pp 2: the adapters (every stage's, in one export) equal pp 1's within the bound, and resume bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import CORPUS, preference_records
from safetensors.torch import load_file
from same_seed_runs import (
    STEPS,
    UPDATE_BOUND,
    assert_same_metrics,
    assert_step1_rewards_and_kl_zero,
    final_weights,
    sgd_train,
    update_error,
)

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli


@pytest.fixture(scope="module")
def tied_model_dir(built_root: Path) -> Path:
    """A tiny Llama of 3 layers with tied input and output embeddings (and its tokenizer)."""
    from coati_kto.testing.built import built
    from coati_kto.testing.tiny import save_tiny_model

    settings = {"num_layers": 3, "tie_word_embeddings": True}
    return built(
        built_root,
        "tiny_llama_tied_3",
        lambda out: save_tiny_model(out, CORPUS, **settings),
        {"corpus": CORPUS, **settings},
    )


def _config(root: Path, model_dir: Path, pp: int, out: str, **sections: dict[str, Any]) -> Path:
    config = {
        "model": {"path": str(model_dir), "attn_implementation": "sdpa", **sections.get("model", {})},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(preference_records(6, 50), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
        },
        "kto": {"beta": 0.5, **sections.get("kto", {})},
        "train": {
            "seed": 3,
            "micro_batch_size": 4,
            "accumulation_steps": 2,
            "max_steps": STEPS,
            "lr": 1.0,
            "warmup_steps": 0,
            "max_grad_norm": 0.0,
            "eval_interval": 2,
            **sections.get("train", {}),
        },
        "plugin": {
            "name": "hybrid_parallel",
            "precision": "fp32",
            "zero_stage": 0,
            "pp_size": pp,
            **sections.get("plugin", {}),
        },
        "output": {"dir": str(root / out), "save_interval": 1, "keep_last": STEPS},
    }
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, world: int) -> None:
    proc = run_cli(["train", str(config)], world, command=sgd_train)
    assert proc.returncode == 0, proc.ranks[-1].stdout[-3000:] + proc.ranks[-1].stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp_train")
    _train(_config(root, tied_model_dir, 1, "pp1"), 1)
    _train(_config(root, tied_model_dir, 2, "pp2"), 2)
    step1 = str(root / "pp2" / "checkpoints" / "step-1")
    _train(_config(root, tied_model_dir, 2, "pp2_resumed", train={"resume": step1}), 2)
    _train(_config(root, tied_model_dir, 1, "pp1_from_pp2", train={"resume": step1}), 1)
    checkpointing = {"gradient_checkpointing": True}
    _train(_config(root, tied_model_dir, 2, "pp2_checkpointing", model=checkpointing), 2)
    cached = {"reference": "cached"}  # the first run scores the cache, the second reads it (no reference run)
    _train(_config(root, tied_model_dir, 1, "pp1_cached", kto=cached), 1)
    _train(_config(root, tied_model_dir, 2, "pp2_cached", kto=cached), 2)
    lora = {"lora": {"rank": 4}}  # the online reference is the policy with its adapters off
    _train(_config(root, tied_model_dir, 1, "pp1_lora", model=lora), 1)
    _train(_config(root, tied_model_dir, 2, "pp2_lora", model=lora), 2)
    lora_step1 = str(root / "pp2_lora" / "checkpoints" / "step-1")
    _train(_config(root, tied_model_dir, 2, "pp2_lora_resumed", model=lora, train={"resume": lora_step1}), 2)
    # `coati-kto export` of the pp 2 run's last checkpoint on one process (its own layout: pp_size 1)
    export = run_cli(["export", str(root / "pp2.yaml"), "plugin.pp_size=1", "--out", str(root / "pp_export")])
    assert export.returncode == 0, export.ranks[0].stderr[-3000:]
    return {path.name: path for path in root.iterdir() if path.is_dir() and path.name.startswith("pp")}


@pytest.mark.parametrize(
    "run, reference",
    [("pp2", "pp1"), ("pp2_checkpointing", "pp1"), ("pp2_cached", "pp1_cached")],
    ids=["online", "activation-checkpointing", "cached-reference"],
)
def test_pp2_weights_equal_pp1_within_fp32_rounding(
    runs: dict[str, Path], tied_model_dir: Path, run: str, reference: str
) -> None:
    error = update_error(runs[run], runs[reference], tied_model_dir)
    assert error < UPDATE_BOUND, error


def test_the_pp2_export_is_one_model_with_its_tie(runs: dict[str, Path]) -> None:
    """Every stage's tensors in one file, the tied head stored once (under the embedding's name), as pp 1's."""
    got, want = final_weights(runs["pp2"]), final_weights(runs["pp1"])
    assert sorted(got) == sorted(want)
    assert "model.embed_tokens.weight" in got and "lm_head.weight" not in got
    assert sum(k.startswith("model.layers.") for k in got) == 3 * 9  # 3 layers x 9 tensors each


def test_pp2_logs_the_pp1_metrics(runs: dict[str, Path]) -> None:
    expected = {"train/loss", "train/grad_norm", "eval/loss", "train/kl", "train/logits/chosen"}
    assert_same_metrics(runs["pp2"], runs["pp1"], expected)


def test_pp2_step1_rewards_and_kl_are_exactly_zero(runs: dict[str, Path]) -> None:
    assert_step1_rewards_and_kl_zero(runs["pp2"])


def test_pp2_resume_is_bit_exact(runs: dict[str, Path]) -> None:
    resumed, whole = final_weights(runs["pp2_resumed"]), final_weights(runs["pp2"])
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_pp2_checkpoint_resumes_at_pp1(runs: dict[str, Path], tied_model_dir: Path) -> None:
    error = update_error(runs["pp1_from_pp2"], runs["pp1"], tied_model_dir)
    assert error < UPDATE_BOUND, error


def test_a_pp2_checkpoint_exports_on_one_process_as_the_run_saved_it(runs: dict[str, Path]) -> None:
    exported = load_file(runs["pp_export"] / "model.safetensors")
    final = final_weights(runs["pp2"])
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_the_pp2_export_reloads_and_scores_as_pp1s(runs: dict[str, Path]) -> None:
    """final/ of each run loads with transformers alone (config, tokenizer, tied head) and the two score the same
    text's completion log-probs within fp32 rounding of their 2.7e-7-apart weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scores = []
    for run in ("pp1", "pp2"):
        final = runs[run] / "final"
        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives the merge
        ids = AutoTokenizer.from_pretrained(final)(CORPUS[0], return_tensors="pt").input_ids
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        scores.append(logps.gather(1, ids[0, 1:, None]).sum())
    assert abs(scores[0] - scores[1]) <= 1e-5 * abs(scores[0]), scores


ADAPTER = Path("final") / "adapter" / "adapter_model.safetensors"


def test_pp2_lora_adapters_equal_pp1(runs: dict[str, Path]) -> None:
    """LoRA at pp 2: every stage's adapters in the one export (B starts at 0, so each is its own update), equal to
    pp 1's within the bound; the reference is the policy with its adapters off, through the same stages."""
    got, want = load_file(runs["pp2_lora"] / ADAPTER), load_file(runs["pp1_lora"] / ADAPTER)
    assert sorted(got) == sorted(want) and len(want) == 24  # q, k, v, o (A and B each) of 3 layers
    scale = max(w.abs().max().item() for k, w in want.items() if "lora_B" in k)
    assert scale > 1e-3
    errors = {k: (got[k] - w).abs().max().item() / w.abs().max().item() for k, w in want.items()}
    assert max(errors.values()) < UPDATE_BOUND, errors
    assert_step1_rewards_and_kl_zero(runs["pp2_lora"])


def test_pp2_lora_resume_is_bit_exact(runs: dict[str, Path]) -> None:
    got, want = load_file(runs["pp2_lora_resumed"] / ADAPTER), load_file(runs["pp2_lora"] / ADAPTER)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
