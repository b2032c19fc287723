"""Fast checks of the recipes' data makers and task metric (applications/); nothing here runs a pipeline."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

APPS = Path(__file__).resolve().parents[2] / "applications"
# Appended, not prepended: quickstart/evaluate.py must not shadow an installed `evaluate` package elsewhere.
sys.path.append(str(APPS / "quickstart"))


def load(path: Path, name: str) -> ModuleType:
    """Import a recipe script by path under a unique name (both recipes have a make_data.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


qs_data = load(APPS / "quickstart" / "make_data.py", "qs_make_data")
qs_eval = load(APPS / "quickstart" / "evaluate.py", "qs_evaluate")
qs_sft = load(APPS / "quickstart" / "sft.py", "qs_sft")
tool_data = load(APPS / "chatml_tool_use" / "make_data.py", "tool_make_data")


def user(record: dict) -> str:
    return record["messages"][0]["content"]


def answer(record: dict) -> str:
    return record["messages"][-1]["content"]


def successor_by_hand(prompt: str) -> tuple[str, str]:
    """Independent oracle for the quickstart task: (successor, predecessor) of the prompt's item."""
    item = prompt.rstrip("?.").split()[-1]
    for seq, _ in qs_data.SEQUENCES.values():
        if item in seq:
            i = seq.index(item)
            return seq[(i + 1) % len(seq)], seq[i - 1]
    raise AssertionError(f"no item in {prompt!r}")


# ---------------------------------------------------------------------------------------------- quickstart


@pytest.fixture(scope="module")
def qs() -> dict[str, list[dict]]:
    return qs_data.make_data(seed=0)


def test_quickstart_labels_are_3_to_1_and_checkable(qs: dict[str, list[dict]]) -> None:
    train = qs["kto_train"]
    assert len(train) == 1000 and sum(r["label"] for r in train) == 750
    for r in train + qs["kto_eval"]:
        good, bad = successor_by_hand(user(r))
        assert answer(r) == (good if r["label"] else bad)


def test_quickstart_sft_is_50_50_per_prompt(qs: dict[str, list[dict]]) -> None:
    answers: dict[str, list[str]] = {}
    for r in qs["sft"]:
        answers.setdefault(user(r), []).append(answer(r))
    assert all(sorted(a) == sorted(successor_by_hand(p)) for p, a in answers.items())


def test_quickstart_eval_phrasings_are_unseen(qs: dict[str, list[dict]]) -> None:
    seen = {user(r) for name in ("sft", "kto_train") for r in qs[name]}
    assert not seen & {r["prompt"] for r in qs["eval_prompts"]}
    assert {(r["correct"], r["wrong"]) for r in qs["eval_prompts"]} == {
        successor_by_hand(r["prompt"]) for r in qs["eval_prompts"]
    }


def test_quickstart_data_is_deterministic(qs: dict[str, list[dict]]) -> None:
    assert qs_data.make_data(seed=0) == qs
    assert qs_data.make_data(seed=1)["kto_train"] != qs["kto_train"]


def test_grade_and_scores_on_hand_made_outputs() -> None:
    rows = [
        {"correct": c, "wrong": w} for c, w in [("c", "a"), ("Tuesday", "Sunday"), ("m", "k"), ("e", "c")]
    ]
    answers = [" c\n", "tuesday.", "k", "zebra"]
    assert [qs_eval.grade(a, r["correct"], r["wrong"]) for a, r in zip(answers, rows, strict=True)] == [
        "correct",
        "correct",
        "wrong",
        "other",
    ]
    s = qs_eval.score_rows(rows, answers, margins=[2.0, 1.0, -1.0, 0.0])
    assert (s.accuracy, s.wrong_rate, s.other_rate, s.margin, s.n) == (0.5, 0.25, 0.25, 0.5, 4)
    assert "| after | 50.0% | 25.0% | 25.0% | +0.50 |" in qs_eval.table({"after": s})


def test_sft_scores_the_same_completion_tokens_as_coati_kto(qs: dict[str, list[dict]]) -> None:
    from coati_kto.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(qs_data.corpus(qs) + qs_sft.ROLES, vocab_size=512)
    ids, n_prompt = qs_sft.encode(tokenizer, qs["kto_train"][0]["messages"])
    assert tokenizer.decode(ids[n_prompt:]) == answer(qs["kto_train"][0]) + "<|im_end|>\n"
    assert ids[:n_prompt] == tokenizer.apply_chat_template(
        qs["kto_train"][0]["messages"][:1], add_generation_prompt=True, return_dict=False
    )


def test_sft_loop_lowers_the_loss(qs: dict[str, list[dict]]) -> None:
    from coati_kto.testing.tiny import build_llama, build_tokenizer

    tokenizer = build_tokenizer(qs_data.corpus(qs) + qs_sft.ROLES, vocab_size=512)
    model = build_llama(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=64)
    losses = qs_sft.sft(model, tokenizer, qs["sft"][:256], steps=15, batch_size=16, lr=3e-3)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


def test_quickstart_uses_this_interpreters_launchers() -> None:
    run = load(APPS / "quickstart" / "run.py", "qs_run")
    assert Path(sys.executable).parent == run.BIN
    assert run.kto_env()["PATH"].split(":")[0] == str(run.BIN)
    assert run.kto_env()["OMP_NUM_THREADS"] == "1" and run.kto_env(2)["OMP_NUM_THREADS"] == "2"


def scores(accuracy: float, other: float, margin: float) -> object:
    return qs_eval.Scores(accuracy, 1 - accuracy - other, margin, other, 172)


def test_quickstart_check_fails_unless_kto_clearly_worked() -> None:
    run = load(APPS / "quickstart" / "run.py", "qs_run")
    sft = scores(0.45, 0.02, 0.01)  # what the SFT model scores: a coin flip between the two answers
    # Below the band's floor (docs/quickstart.md, seeds 0-4 x 1-2 threads) still passes; KTO doing nothing fails.
    assert run.check(sft, scores(0.90, 0.05, 2.0)) == []
    assert run.check(sft, sft) == ["accuracy 45.0% < 85%", "accuracy gain +0.0% < 15%", "margin +0.01 < +1.5"]
    # Each threshold on its own: accuracy, gain over before, answers off-task, margin.
    assert run.check(sft, scores(0.84, 0.0, 3.0)) == ["accuracy 84.0% < 85%"]
    assert run.check(scores(0.76, 0.0, 1.0), scores(0.90, 0.0, 3.0)) == ["accuracy gain +14.0% < 15%"]
    # The run that prompted this (another machine, old recipe): 82.0% with 18% other answers.
    assert run.check(scores(0.465, 0.0, 0.0), scores(0.82, 0.18, 2.24)) == [
        "accuracy 82.0% < 85%",
        "other answers 18.0% > 5%",
    ]
    assert run.check(sft, scores(0.95, 0.0, 1.4)) == ["margin +1.40 < +1.5"]


def test_sweep_table_prints_the_band_over_runs() -> None:
    sweep = load(APPS / "quickstart" / "sweep.py", "qs_sweep")
    runs = [
        {"seed": 0, "threads": 1, "wall_s": 100.0, sweep.BEFORE: vars(scores(0.4, 0.0, 0.0))}
        | {sweep.AFTER: vars(scores(0.97, 0.01, 2.5))},
        {"seed": 0, "threads": 2, "wall_s": 120.0, sweep.BEFORE: vars(scores(0.6, 0.02, 0.1))}
        | {sweep.AFTER: vars(scores(1.0, 0.0, 3.0))},
    ]
    text = sweep.table(runs)
    assert "| 0 | 2 | 60.0% | 100.0% | 0.0% | 0.0% | +0.10 | +3.00 | 120s |" in text
    assert "accuracy 40.0% to 60.0% before KTO -> 97.0% to 100.0% after" in text
    assert "other answers after 0.0% to 1.0%; margin +0.00 to +0.10 -> +2.50 to +3.00" in text


# ---------------------------------------------------------------------------------------------- tool use


@pytest.fixture(scope="module")
def tool_records() -> list[dict]:
    return tool_data.make_records(seed=0)


def test_tool_use_shape_and_imbalance(tool_records: list[dict]) -> None:
    assert len(tool_records) == 1000 and sum(r["label"] for r in tool_records) == 746
    for r in tool_records:
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert r["messages"][2]["content"].startswith("tool_call: ")
        json.loads(r["messages"][3]["content"])
    assert len(tool_records[0]["messages"][0]["content"]) > 2000  # long tool-use instructions
    labels = [r["label"] for r in tool_records]
    assert any(a == b for a, b in zip(labels, labels[1:], strict=False)), (
        "not interleaved: the sampler does the mixing"
    )


def test_tool_use_undesirable_is_wrong_in_a_checkable_way() -> None:
    for seed in range(200):
        good = tool_data.conversation(random.Random(seed), desirable=True)
        bad = tool_data.conversation(random.Random(seed), desirable=False)
        assert good[1] == bad[1]  # the same request
        failed = not json.loads(bad[3]["content"])["success"]
        if failed:  # right call, error result, success claimed
            assert bad[2] == good[2] and not bad[4]["content"].startswith("That failed")
        else:  # a wrong call, reported
            assert bad[2] != good[2] and bad[4]["content"] == tool_data.report(bad[2]["content"])
        if not json.loads(good[3]["content"])["success"]:
            assert good[4]["content"].startswith("That failed")


def test_tool_use_records_load_in_coati_kto(tmp_path: Path, tool_records: list[dict]) -> None:
    from coati_kto.data.files import load_records

    tool_data.write_jsonl(tool_records[:50], tmp_path / "train.jsonl")
    loaded = load_records([str(tmp_path / "train.jsonl")]).records
    assert [r.label for r in loaded] == [r["label"] for r in tool_records[:50]]
    assert loaded[0].completion == tool_records[0]["messages"][-1:]
    assert loaded[0].prompt == tool_records[0]["messages"][:-1]


def test_tool_use_data_is_deterministic(tool_records: list[dict]) -> None:
    assert tool_data.make_records(seed=0) == tool_records
