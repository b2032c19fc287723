"""Samples during evaluation (``eval.samples``) on 2 gloo processes, through ``train()``, under every plugin:
ddp fp32, low_level_zero ZeRO-2 bf16, hybrid_parallel ZeRO-2 bf16 (tp_size 1) and hybrid_parallel tp_size 2 fp32,
and under ddp with LoRA (the reference is the policy with its adapters off) and with a cached reference (no
reference model: rewards n/a).

Checked numbers, per plugin: TensorBoard's TEXT holds N samples at every evaluation (steps 0 and 2), their
prompts those of the eval rows the seeded choice names (the same rows under every plugin and in a second run);
at step 0 the reference's samples equal the policy's (same weights) and every reward is exactly 0; after
training each reward equals beta * (log pi(y|x) - log pi_ref(y|x)) recomputed with plain transformers from
final/ and the starting model on the run's own tokens; a second ddp run writes the same tables (seeded prompts,
deterministic greedy decoding); W&B (offline) gets the same rows as a table; the decoding time is logged.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import chat_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.distributed import run_distributed

N, NEW_TOKENS, SEED, BETA = 3, 6, 5, 0.1
PLUGINS: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "ddp_again": {"name": "ddp"},
    "low_level_zero": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero2": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "hybrid_tp2": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
    "lora": {"name": "ddp"},  # the reference: the policy with its adapters disabled
    "cached": {"name": "ddp"},  # no reference model: no rewards, no reference samples
    # a pad token added to the tokenizer, the model not resized: its id is past the embeddings (the batches pad
    # with EOS instead); the samples padded with it and the run died in its first evaluation (IndexError)
    "pad_past": {"name": "ddp"},
}
WITH_REFERENCE = [name for name in PLUGINS if name != "cached"]
REFUSAL = "I cannot help with that."


def _config(model_dir: str, root: Path, name: str) -> dict[str, Any]:
    config = {
        "model": {"path": model_dir},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "eval_files": [str(root / "eval.jsonl")],
            "prepared_dir": str(root / "prepared"),
            "max_length": 64,
        },
        "kto": {"beta": BETA},
        "train": {"micro_batch_size": 2, "max_steps": 2, "lr": 5e-2, "seed": 3},
        "plugin": PLUGINS[name],
        "output": {"dir": str(root / name)},
        "logging": {"tensorboard": True, "wandb": name == "ddp", "wandb_mode": "offline"},
        "eval": {"samples": N, "sample_max_new_tokens": NEW_TOKENS, "sample_seed": SEED},
    }
    if name == "lora":
        config["model"]["lora"] = {"rank": 4, "alpha": 8}
        config["output"]["merge_lora"] = True
    if name == "cached":
        config["kto"]["reference"] = "cached"
    if name == "pad_past":
        config["model"]["path"] = str(root / "pad_past_model")
        config["data"]["prepared_dir"] = str(root / "prepared_pad_past")
    return config


def _pad_past_embeddings(model_dir: Path, out: Path) -> None:
    """``model_dir`` with a pad token added to its tokenizer past the model's embedding rows (unused tokens fill
    the rows the tiny model has beyond its tokenizer), the model not resized."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    shutil.copytree(model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    rows = AutoConfig.from_pretrained(out).vocab_size
    tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(rows - len(tokenizer))])
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    tokenizer.save_pretrained(out)
    assert tokenizer.pad_token_id == rows


def _run(model_dir: str, root: str, name: str) -> dict[str, Any]:
    from coati_kto.config.schema import Config
    from coati_kto.train import train

    trainer = train(Config.model_validate(_config(model_dir, Path(root), name)))
    seconds = [r["eval/samples_seconds"] for r in trainer.history if "eval/samples_seconds" in r]
    last = trainer._samples.last if trainer.layout.is_main else {}
    ids = {who: [(s.prompt_ids, s.completion_ids) for s in samples] for who, samples in last.items()}
    return {"seconds": seconds, "ids": ids, "steps": trainer.global_step}


def _all_runs(model_dir: str, root: str) -> dict[str, Any]:
    """Every plugin's run in turn, in one set of processes; a failure ends the series (the ranks may no longer
    agree on their collectives)."""
    out: dict[str, Any] = {}
    for name in PLUGINS:
        if any("error" in r for r in out.values()):
            out[name] = {"error": "not run: an earlier run failed"}
            continue
        try:
            out[name] = _run(model_dir, root, name)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("eval_samples")
    write_jsonl(chat_records(24, REFUSAL), root / "train.jsonl")
    write_jsonl(chat_records(9, REFUSAL, offset=100), root / "eval.jsonl")
    _pad_past_embeddings(tiny_model_dir, root / "pad_past_model")
    started = time.perf_counter()
    ranks = run_distributed(_all_runs, 2, str(tiny_model_dir), str(root), timeout_s=1200)
    print(f"\neval samples: {len(PLUGINS)} runs in {time.perf_counter() - started:.1f} s")
    for name, result in ranks[0].items():
        assert "error" not in result, f"{name}: {result['error']}"
    return {"root": root, "model_dir": tiny_model_dir, "rank0": ranks[0], "rank1": ranks[1]}


def _expected_prompts(runs: dict[str, Any]) -> list[str]:
    """The prompts of the rows the seeded choice names: the first N of a permutation of the eval rows."""
    from helpers import data_settings
    from transformers import AutoTokenizer

    from coati_kto.config.schema import Config
    from coati_kto.data.prepared import load_prepared

    config = Config.model_validate(_config(str(runs["model_dir"]), runs["root"], "ddp"))
    rows = load_prepared(*data_settings(config)).eval
    tokenizer = AutoTokenizer.from_pretrained(runs["model_dir"])
    chosen = np.random.default_rng(SEED).permutation(len(rows))[:N]
    return [tokenizer.decode(rows[int(i)]["input_ids"][: rows[int(i)]["completion_start"]]) for i in chosen]


def _samples(runs: dict[str, Any], name: str) -> dict[str, dict[int, list[dict[str, str]]]]:
    from coati_kto.testing.tensorboard import read_samples

    return read_samples(runs["root"] / name / "tensorboard")


@pytest.mark.parametrize("name", list(PLUGINS))
def test_every_evaluation_writes_the_seeded_prompts(runs: dict[str, Any], name: str) -> None:
    from transformers import AutoTokenizer

    samples = _samples(runs, name)
    expected = _expected_prompts(runs)
    assert sorted(samples["policy"]) == [0, 2]  # eval at start and at the run's last step
    # the reference decodes at step 0 only, and not at all when none is loaded
    assert sorted(samples.get("reference", {})) == ([] if name == "cached" else [0])
    for step, rows in samples["policy"].items():
        assert [r["sample"] for r in rows] == [str(k) for k in range(N)], step
        assert [r["prompt"] for r in rows] == expected, step
        assert {r["label"] for r in rows} <= {"desirable", "undesirable"}
    # The last evaluation's tokens (kept by the trainer): 1 to NEW_TOKENS new tokens, the table their text.
    tokenizer = AutoTokenizer.from_pretrained(runs["model_dir"])
    last = runs["rank0"][name]["ids"]["policy"]
    assert [1 <= len(completion) <= NEW_TOKENS for _, completion in last] == [True] * N
    assert [tokenizer.decode(p) for p, _ in last] == expected
    assert [tokenizer.decode(c) for _, c in last] == [r["completion"] for r in samples["policy"][2]]
    seconds = runs["rank0"][name]["seconds"]
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_the_reference_decodes_like_the_policy_at_step_0(runs: dict[str, Any], name: str) -> None:
    samples = _samples(runs, name)
    policy, reference = samples["policy"][0], samples["reference"][0]
    assert [(r["prompt"], r["completion"]) for r in reference] == [
        (r["prompt"], r["completion"]) for r in policy
    ]
    assert [float(r["reward"]) for r in policy + reference] == [0.0] * (2 * N)


def test_seeded_prompts_and_greedy_decoding_repeat_in_a_second_run(runs: dict[str, Any]) -> None:
    assert _samples(runs, "ddp") == _samples(runs, "ddp_again")
    assert runs["rank0"]["ddp"]["ids"] == runs["rank0"]["ddp_again"]["ids"]


@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_rewards_equal_a_recomputation(runs: dict[str, Any], name: str) -> None:
    """beta * (log pi(y|x) - log pi_ref(y|x)) on the run's tokens, with final/ and the starting model loaded by
    transformers in the run's dtype (with the run's fused norms and rotary), log-probs in fp32: the run's reward within
    rounding of its dtype."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if PLUGINS[name].get("precision") == "bf16" else torch.float32
    final = runs["root"] / name / "final" / ("merged" if name == "lora" else "")
    from coati_kto.models.norms import fuse_rms_norms
    from coati_kto.models.rotary import fuse_rotary

    policy = AutoModelForCausalLM.from_pretrained(final, dtype=dtype).eval()
    reference = AutoModelForCausalLM.from_pretrained(runs["model_dir"], dtype=dtype).eval()
    for model in (policy, reference):  # the run's norms and rotary (on by default): bf16 rounds alike
        fuse_rms_norms(model)
        fuse_rotary(model)
    rows = _samples(runs, name)["policy"][2]
    recomputed = [
        BETA * (_logp(policy, prompt, completion) - _logp(reference, prompt, completion))
        for prompt, completion in runs["rank0"][name]["ids"]["policy"]
    ]
    logged = [float(r["reward"]) for r in rows]
    assert any(abs(r) > 1e-3 for r in recomputed), recomputed  # trained: the rewards moved off 0
    tolerance = 2e-3 if dtype == torch.bfloat16 else 1e-5
    assert logged == pytest.approx(recomputed, rel=1e-5, abs=tolerance)


def _logp(model: Any, prompt: tuple[int, ...], completion: tuple[int, ...]) -> float:
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).sum())


def test_without_a_reference_model_the_rewards_say_so(runs: dict[str, Any]) -> None:
    """kto.reference cached loads no reference model: the samples are decoded, their reward is n/a."""
    samples = _samples(runs, "cached")
    assert [r["reward"] for step in (0, 2) for r in samples["policy"][step]] == ["n/a"] * (2 * N)


def test_wandb_gets_the_rows_as_a_table(runs: dict[str, Any]) -> None:
    tables = sorted((runs["root"] / "ddp" / "wandb").glob("offline-run-*/files/media/table/**/*.table.json"))
    by_model: dict[str, list[Any]] = {}
    for path in tables:
        by_model.setdefault("reference" if "reference" in path.name else "policy", []).append(
            json.loads(path.read_text())
        )
    assert len(by_model["policy"]) == 2 and len(by_model["reference"]) == 1, tables
    written = _samples(runs, "ddp")["policy"][0]
    first = min(by_model["policy"], key=lambda t: [row[2] for row in t["data"]] != [0.0] * N)
    assert first["columns"] == ["sample", "label", "reward", "prompt", "completion"]
    assert [[row[0], row[1], row[3], row[4]] for row in first["data"]] == [
        [int(r["sample"]), r["label"], r["prompt"], r["completion"]] for r in written
    ]


def test_a_pad_token_past_the_embeddings_is_recorded_as_the_id_the_run_pads_with(
    runs: dict[str, Any],
) -> None:
    """prepare's stats.json said the tokenizer's pad (512, one the model cannot embed) and prepare printed no note,
    while the run padded with EOS."""
    stats = json.loads((runs["root"] / "prepared_pad_past" / "stats.json").read_text())
    assert stats["padding"]["pad_id"] == 2
    assert stats["padding"]["note"].startswith(
        "note: the tokenizer's pad token '<|pad|>' (id 512) is past the model"
    )
