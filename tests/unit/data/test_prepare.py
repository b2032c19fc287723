"""prepare / load_prepared / weights / inspect: numbers checked on the rows written to disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_data_formats import write_jsonl

from coati_kto.config.schema import Config
from coati_kto.data import store, tables
from coati_kto.data.collator import KTOCollator
from coati_kto.data.prepared import load_prepared, prepare
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.data.tokenize import encode, truncation
from coati_kto.data.weights import GUIDELINE, resolve_kto_weights
from coati_kto.errors import DataError

SYSTEM = "You can call the tool search(query). Answer briefly."


def chat_row(i: int, label: bool, prompt_id: int | None = None) -> dict:
    q = i if prompt_id is None else prompt_id
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Please add {q} and 3."},
            {
                "role": "assistant",
                "content": f"The answer is {q + 3}." if label else "I cannot help with that.",
            },
        ],
        "label": label,
    }


def rows(n_desirable: int, n_undesirable: int) -> list[dict]:
    out = [chat_row(i, True) for i in range(n_desirable)] + [chat_row(i, False) for i in range(n_undesirable)]
    return [out[i] for i in np.random.default_rng(0).permutation(len(out))]


def make_config(tmp_path: Path, model_dir: Path, train: list[str], **data) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_files": train, "prepared_dir": str(tmp_path / "prepared"), **data},
            "train": {"micro_batch_size": 4, "seed": 1},
            "output": {"dir": str(tmp_path / "out")},
        }
    )


def test_rows_masks_pairs_and_stats(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer) -> None:
    plain = [
        {"prompt": "Answer: ", "completion": "5", "label": True},  # BPE merges across this boundary
        {"prompt": "ca", "completion": "pital", "label": False},
    ]
    data = write_jsonl(tmp_path / "t.jsonl", rows(12, 6) + plain)
    out = prepare(make_config(tmp_path, tiny_model_dir, [str(data)], max_length=256, max_prompt_length=128))
    train, stats = out.train, out.stats
    assert out.eval is None and len(train) == 20
    assert {
        "input_ids",
        "completion_start",
        "label",
        "kl_input_ids",
        "kl_completion_start",
        "index",
        "kl_index",
    } <= set(train.column_names)
    assert stats["train"]["labels"] == {"desirable": 13, "undesirable": 7}
    assert stats["train"]["kl_pairs"]["self_pairs"] == 0 and stats["train"]["boundary_merges"] == 2
    assert set(stats) >= {"fingerprint", "settings", "files", "train", "eval", "bad_records", "imbalance"}

    records = {r["source"]: r for r in train}
    batch = KTOCollator(tiny_tokenizer.pad_token_id)(list(train))
    eos = tiny_tokenizer.eos_token
    for b, r in enumerate(train):
        assert r["index"] == b and r["kl_index"] != b and r["length"] == len(r["input_ids"])
        completion = tiny_tokenizer.decode(batch.example.input_ids[b][batch.example.loss_mask[b]])
        line = int(r["source"].rsplit(":", 1)[1])
        raw = json.loads(data.read_text().splitlines()[line - 1])
        expected = (
            raw["completion"] + eos if "completion" in raw else raw["messages"][-1]["content"] + eos + "\n"
        )
        assert completion == expected  # the loss mask covers exactly the completion, boundary merges included
        # KL sequence = this prompt + the completion of row kl_index (nothing truncated at this length).
        partner = train[r["kl_index"]]
        assert r["kl_input_ids"][: r["kl_completion_start"]] == r["input_ids"][: r["completion_start"]]
        assert (
            r["kl_input_ids"][r["kl_completion_start"] :]
            == partner["input_ids"][partner["completion_start"] :]
        )
    assert len(records) == 20


def test_duplicate_prompts_reported(tmp_path: Path, tiny_model_dir: Path) -> None:
    # 7 of 10 examples share one prompt: at least 2*7-10 = 4 pairs must share a prompt, and no more do.
    data = [chat_row(i, i % 2 == 0, prompt_id=0 if i < 7 else i) for i in range(10)]
    path = write_jsonl(tmp_path / "dup.jsonl", data)
    kl = prepare(make_config(tmp_path, tiny_model_dir, [str(path)])).stats["train"]["kl_pairs"]
    assert kl == {
        **kl,
        "self_pairs": 0,
        "same_prompt_pairs": 4,
        "min_same_prompt_pairs": 4,
        "distinct_prompts": 4,
    }


def test_truncation_is_counted(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer) -> None:
    long_prompt = [{"prompt": "word " * (40 + i), "completion": " ok", "label": i % 2 == 0} for i in range(6)]
    long_completion = [
        {"prompt": "Q:", "completion": " yes" * (30 + i), "label": i % 2 == 1} for i in range(6)
    ]
    short = [{"prompt": "Q:", "completion": " fine", "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", long_prompt + long_completion + short)
    out = prepare(make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24, max_prompt_length=16))
    lens = np.array(
        [
            [len(x) for x in encode(tiny_tokenizer, r["prompt"], r["completion"], False)]
            for r in long_prompt + long_completion + short
        ]
    )
    keep_p, keep_c = truncation(lens[:, 0], lens[:, 1], 24, 16)
    t = out.stats["train"]["truncated"]
    assert t["prompt"] == int((keep_p < lens[:, 0]).sum()) == 6
    assert t["completion"] == int((keep_c < lens[:, 1]).sum()) == 6
    assert t["prompt_tokens_cut"] == int((lens[:, 0] - keep_p).sum()) > 0
    assert out.stats["train"]["dropped"] == {} and len(out.train) == 16  # nothing silently dropped
    for r in out.train:
        assert r["length"] <= 24 and r["kl_length"] <= 24
        prompt = tiny_tokenizer.decode(r["input_ids"][: r["completion_start"]])
        completion = tiny_tokenizer.decode(r["input_ids"][r["completion_start"] :])
        if prompt.startswith("word") or prompt.endswith("word "):
            assert prompt.endswith("word ")  # the prompt keeps its END
        if "yes" in completion:
            assert completion.startswith(" yes yes")  # the completion keeps its START


def test_cache_reuse_and_invalidation(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer, capsys) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    marker = tmp_path / "prepared" / "fingerprint.json"
    prepare(cfg)
    first = marker.stat().st_mtime_ns
    capsys.readouterr()
    prepare(cfg)
    assert marker.stat().st_mtime_ns == first and "reusing" in capsys.readouterr().out

    def rebuilt(config: Config) -> bool:
        before = marker.stat().st_mtime_ns
        prepare(config)
        return marker.stat().st_mtime_ns != before

    assert rebuilt(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 512})}))
    assert not rebuilt(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 512})}))
    assert not rebuilt(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 512, "num_proc": 2})})
    )
    write_jsonl(path, rows(7, 4))
    assert rebuilt(cfg)
    other = tmp_path / "tok2"
    tiny_tokenizer.save_pretrained(other)
    assert not rebuilt(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"tokenizer": str(other)})})
    )
    cfg2 = cfg.model_copy(update={"model": cfg.model.model_copy(update={"tokenizer": str(other)})})
    config_json = other / "tokenizer_config.json"
    tc = json.loads(config_json.read_text())
    tc["chat_template"] = tc["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    config_json.write_text(json.dumps(tc))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    assert rebuilt(cfg2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_crash_never_leaves_a_valid_looking_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    prepare(cfg)
    good = json.loads((tmp_path / "prepared" / "fingerprint.json").read_text())

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "build_split", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 300})}))
    # The old cache is intact and still matches its own inputs; no half-built directory anywhere.
    assert json.loads((tmp_path / "prepared" / "fingerprint.json").read_text()) == good
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.undo()
    assert len(prepare(cfg).train) == 10


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(3, 3))
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        prepare(make_config(tmp_path, tiny_model_dir, [str(path)]))


def test_eval_fraction_is_stratified_and_seeded(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(40, 12))
    out = prepare(make_config(tmp_path, tiny_model_dir, [str(path)], eval_fraction=0.25))
    assert out.stats["train"]["labels"] == {"desirable": 30, "undesirable": 9}
    assert out.stats["eval"]["labels"] == {"desirable": 10, "undesirable": 3}
    assert set(out.train["source"]).isdisjoint(out.eval["source"])
    assert len(set(out.train["source"]) | set(out.eval["source"])) == 52
    assert out.stats["eval"]["kl_pairs"]["self_pairs"] == 0
    assert max(out.eval["kl_index"]) < len(out.eval)  # KL pairs built within each split
    again = prepare(make_config(tmp_path / "b", tiny_model_dir, [str(path)], eval_fraction=0.25))
    assert again.eval["source"] == out.eval["source"]


def test_eval_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    ev = write_jsonl(tmp_path / "e.jsonl", rows(2, 2))
    out = prepare(make_config(tmp_path, tiny_model_dir, [str(train)], eval_files=[str(ev)]))
    assert len(out.train) == 10 and len(out.eval) == 4 and out.stats["files"]["eval"] == [str(ev)]


def test_single_label_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(8, 0))
    with pytest.raises(DataError) as info:
        prepare(make_config(tmp_path, tiny_model_dir, [str(path)]))
    msg = str(info.value)
    assert "8 desirable and 0 undesirable" in msg and str(path) in msg and "KTO needs both labels" in msg


def test_skip_mode_counts_bad_records(tmp_path: Path, tiny_model_dir: Path) -> None:
    bad = ["{not json", {"prompt": "a", "completion": "b", "label": "yes"}, {"messages": [], "label": True}]
    path = write_jsonl(tmp_path / "t.jsonl", rows(5, 5) + bad)
    out = prepare(make_config(tmp_path, tiny_model_dir, [str(path)], on_bad_record="skip"))
    assert len(out.train) == 10
    assert out.stats["bad_records"]["skipped"] == 3
    assert out.stats["bad_records"]["by_reason"] == {
        "malformed_json": 1,
        "bad_label": 1,
        "no_final_assistant": 1,
    }
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert [ln.split("\t")[1].split(": ")[0] for ln in lines] == [f"{path}:{i}" for i in (11, 12, 13)]


def test_num_proc_gives_identical_rows(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(30, 20))
    one = prepare(make_config(tmp_path / "one", tiny_model_dir, [str(path)]))
    monkeypatch.setattr(tables, "MIN_ROWS_PER_PROC", 10)
    two = prepare(make_config(tmp_path / "two", tiny_model_dir, [str(path)], num_proc=2))
    assert one.train.to_dict() == two.train.to_dict()


@pytest.mark.parametrize(
    ("n_d", "n_u", "mbs", "replicas"),
    [
        (746, 254, 4, 1),
        (746, 254, 2, 8),
        (254, 746, 4, 2),
        (100, 100, 4, 1),
        (500, 10, 8, 1),
        (10, 500, 2, 4),
        (125, 100, 4, 1),
    ],
)
def test_auto_weights_land_in_guideline(tmp_path: Path, n_d: int, n_u: int, mbs: int, replicas: int) -> None:
    cfg = make_config(tmp_path, tmp_path, ["x.jsonl"])
    cfg.train.micro_batch_size = mbs
    cfg.kto.auto_weights = True
    stats = {"train": {"labels": {"desirable": n_d, "undesirable": n_u}}}
    w_d, w_u, report = resolve_kto_weights(cfg, stats, replicas)
    s = MixedLabelBatchSampler.compute_stats(n_d, n_u, mbs, replicas)
    ratio = w_d * s.effective_desirable / (w_u * s.effective_undesirable)
    assert GUIDELINE[0] <= ratio <= GUIDELINE[1] and max(w_d, w_u) == 1.0
    assert "inside" in report and not report.startswith("warning")

    cfg.kto.auto_weights = False
    w_d, w_u, report = resolve_kto_weights(cfg, stats, replicas)
    assert (w_d, w_u) == (1.0, 1.0)
    inside = GUIDELINE[0] <= s.effective_desirable / s.effective_undesirable <= GUIDELINE[1]
    assert report.startswith("warning") != inside


def test_inspect_shows_mixed_batches(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    from coati_kto.data.inspect import inspect_batches

    path = write_jsonl(tmp_path / "t.jsonl", rows(15, 5))
    inspect_batches(
        make_config(tmp_path, tiny_model_dir, [str(path)]), num_ranks=2, num_batches=2, num_examples=2
    )
    out = capsys.readouterr().out
    for rank in (0, 1):
        for b in (0, 1):
            assert f"rank {rank} batch {b}: [" in out
        assert f"rank {rank}: 2/2 micro-batches mixed (100.0%)" in out
    assert "SINGLE LABEL" not in out and "minority (undesirable) repeats 0" in out
    assert out.count("  KL completion | ") == 2


class FakeCollectives:
    """Stands in for a 2-rank process group in-process: records the collectives a rank enters."""

    def __init__(self, monkeypatch, rank: int, rank0_outcome=None) -> None:
        import torch.distributed as dist

        import coati_kto.parallel.distributed as cd

        self.calls: list[str] = []
        self.rank0_outcome = rank0_outcome
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(cd, "barrier", lambda: self.calls.append("barrier"))
        monkeypatch.setattr(cd, "broadcast_object", self.broadcast)

    def broadcast(self, obj, src: int = 0):
        self.calls.append("broadcast")
        return obj if self.rank0_outcome is None else self.rank0_outcome


def test_load_prepared_protocol(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """Every rank enters the same one collective (on_rank0's broadcast) whether rank 0 succeeds or fails."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    rank0 = FakeCollectives(monkeypatch, 0)
    assert len(load_prepared(cfg).train) == 10 and rank0.calls == ["broadcast"]
    digest = json.loads((tmp_path / "prepared" / "fingerprint.json").read_text())["digest"]

    rank1 = FakeCollectives(monkeypatch, 1, rank0_outcome=("ok", digest, None))
    assert len(load_prepared(cfg).train) == 10 and rank1.calls == ["broadcast"]

    # Rank 0 failed: every rank raises its one-line error after the same collectives.
    rank1 = FakeCollectives(
        monkeypatch, 1, rank0_outcome=("user", DataError, "t.jsonl:3: field 'label': ...")
    )
    with pytest.raises(DataError, match="t.jsonl:3: field 'label'"):
        load_prepared(cfg)
    assert rank1.calls == ["broadcast"]
    bad = make_config(tmp_path, tiny_model_dir, [str(write_jsonl(tmp_path / "one.jsonl", rows(4, 0)))])
    rank0 = FakeCollectives(monkeypatch, 0)
    with pytest.raises(DataError, match="KTO needs both labels"):
        load_prepared(bad)
    assert rank0.calls == ["broadcast"]

    # A rank that cannot see rank 0's build (prepared_dir not shared across nodes) says so.
    FakeCollectives(monkeypatch, 1, rank0_outcome=("ok", "0123456789abcdef", None))
    with pytest.raises(DataError, match="shared filesystem"):
        load_prepared(cfg)


def test_examples_that_cannot_fit_are_dropped_and_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Only reachable with max_prompt_length >= max_length (the schema forbids it): still counted, never silent."""
    rows_ = [{"prompt": "word " * 30, "completion": " ok", "label": i % 2 == 0} for i in range(3)]
    rows_ += [{"prompt": "Q:", "completion": " ok", "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", rows_)
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    # Bypass the schema (validate_assignment refuses it), as a config object built in code could.
    data = {**cfg.data.model_dump(), "max_length": 16, "max_prompt_length": 16}
    object.__setattr__(cfg, "data", cfg.data.model_construct(**data))
    out = prepare(cfg)
    assert out.stats["train"]["dropped"] == {"no_room_for_completion": 3} and len(out.train) == 4
    assert "dropped: {'no_room_for_completion': 3}" in store.summary(out.stats, cfg, True, "", 1.0)
    object.__setattr__(cfg, "data", cfg.data.model_construct(**{**data, "on_too_long": "error"}))
    with pytest.raises(DataError, match=rf"^{path}:1: prompt \(\d+ tokens\) leaves no room"):
        prepare(cfg)
