"""Issue 32 on 2 real gloo ranks: with a Gemma-style tokenizer (EOS <eos>, the template ends a turn with
<end_of_turn>) a short run's train/kl (z0) stays at the scale of the answers' log-ratios, as with the same
tokenizer whose EOS is <end_of_turn>. Before, every completion ended "<end_of_turn>\\n<eos>": each desirable
example pushed that one shared token up, every KL pair ends with it too, and z0 measured it (several nats),
not the answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CORPUS, QUESTIONS, REFUSALS

from coati_kto.data.files import write_jsonl
from coati_kto.testing.distributed import run_distributed

STEPS = 8


def _train(raw: dict) -> list[dict]:
    from coati_kto.config.schema import Config
    from coati_kto.train import train

    return [h for h in train(Config.model_validate(raw)).history if "train/kl" in h]


def _records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        desirable = i % 3 != 2
        reply = answer if desirable else REFUSALS[i % len(REFUSALS)]
        messages = [{"role": "user", "content": f"{question} ({i})"}, {"role": "assistant", "content": reply}]
        out.append({"messages": messages, "label": desirable})
    return out


def _run(root: Path, eos_token: str | None) -> list[dict]:
    from coati_kto.testing.tiny import build_llama, build_tokenizer

    tok = build_tokenizer(CORPUS, 400, style="gemma", eos_token=eos_token)
    build_llama(tok, hidden_size=32, num_layers=1).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    raw = {
        "model": {"path": str(root / "model")},
        "data": {
            "train_files": [str(write_jsonl(_records(96), root / "train.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 64,
        },
        "train": {"micro_batch_size": 4, "max_steps": STEPS, "lr": 3e-3, "warmup_steps": 0, "seed": 0},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(root / "out")},
        "logging": {"tensorboard": False},
    }
    return run_distributed(_train, 2, raw)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return {
        "eos differs": _run(tmp_path_factory.mktemp("gemma"), None),
        "eos is the end of turn": _run(tmp_path_factory.mktemp("gemma_eot"), "<end_of_turn>"),
    }


def test_kl_stays_at_the_scale_of_the_answers_log_ratios(runs: dict[str, list[dict]]) -> None:
    differs, agrees = runs["eos differs"], runs["eos is the end of turn"]
    assert len(differs) == len(agrees) == STEPS
    beta = 0.1
    for a, b in zip(differs, agrees, strict=True):
        # The same rows (the template's rendering, nothing appended), so the same run. Before, the <eos> run's
        # z0 was higher by the shared token's log-ratio: 7.12 vs 5.98 at step 8, 3.41 vs 2.20 at step 12.
        assert a["train/kl"] == pytest.approx(b["train/kl"], rel=1e-5, abs=1e-7)
    last = differs[-1]
    answers = max(abs(last["train/rewards/chosen"]), abs(last["train/rewards/rejected"])) / beta
    assert answers > 0.5  # the run learnt something: the answers' log-ratios moved
    assert last["train/kl"] < answers, (last["train/kl"], answers)
