"""prepare / load_prepared / weights / inspect: numbers checked on the rows written to disk."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import data_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_formats import write_jsonl
from test_tokenize import LLAMA2_TEMPLATE

from coati_kto.config.kto import KTOSection
from coati_kto.config.schema import Config
from coati_kto.data import splits, store, tables
from coati_kto.data.collator import KTOCollator
from coati_kto.data.prepared import load_prepared, prepare
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.data.summary import summary
from coati_kto.data.tokenize import encode, truncation
from coati_kto.data.weights import GUIDELINE, WeightSettings, resolve_kto_weights
from coati_kto.errors import ConfigError, DataError

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
    out = prepare(
        *data_settings(
            make_config(tmp_path, tiny_model_dir, [str(data)], max_length=256, max_prompt_length=128)
        )
    )
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
    assert stats["train"]["kl_pairs"]["self_pairs"] == 0 and stats["train"]["boundary_inside_token"] == 2
    assert set(stats) >= {"fingerprint", "settings", "files", "train", "eval", "bad_records", "imbalance"}

    records = {r["source"]: r for r in train}
    batch = KTOCollator(tiny_tokenizer.pad_token_id)(list(train))
    eos = tiny_tokenizer.eos_token
    for b, r in enumerate(train):
        assert r["index"] == b and r["kl_index"] != b and r["length"] == len(r["input_ids"])
        completion = tiny_tokenizer.decode(batch.example.input_ids[b][batch.example.loss_mask[b]])
        line = int(r["source"].rsplit(":", 1)[1])
        raw = json.loads(data.read_text().splitlines()[line - 1])
        straddled = {
            "5": " 5",
            "pital": "apital",
        }  # the token spanning the boundary belongs to the completion
        expected = (
            straddled[raw["completion"]] + eos
            if "completion" in raw
            else raw["messages"][-1]["content"] + eos + "\n"
        )
        assert completion == expected  # the loss mask covers exactly the completion (and a straddling token)
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
    kl = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)]))).stats["train"][
        "kl_pairs"
    ]
    assert kl == {
        **kl,
        "self_pairs": 0,
        "same_prompt_pairs": 4,
        "min_same_prompt_pairs": 4,
        "distinct_prompts": 4,
    }


def test_a_cut_chatml_prompt_keeps_no_turn_opener_as_its_bos(
    tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer
) -> None:
    """The tiny ChatML tokenizer (as `coati-kto tiny-model` builds it, and some hub ChatML tokenizers) names
    <|im_start|> its BOS, which it never puts before text: a cut prompt kept it, before text from inside a turn
    (`<|im_start|>ase<|im_end|>...`). Only a real BOS is kept (the tokenizer adds it, or the template renders it)."""
    from helpers import CORPUS

    from coati_kto.data.tables import kept_bos
    from coati_kto.testing.tiny import build_tokenizer

    assert tiny_tokenizer.bos_token == "<|im_start|>" and kept_bos(tiny_tokenizer) is None
    for style in ("llama3", "gemma", "mistral"):
        styled = build_tokenizer(CORPUS, 300, style=style)
        assert kept_bos(styled) == styled.bos_token_id, style
    records = [chat_row(i, i % 2 == 0) for i in range(8)]
    for record in records:
        record["messages"][1]["content"] = "please tell me the weather " * 6
    path = write_jsonl(tmp_path / "t.jsonl", records)
    out = prepare(
        *data_settings(
            make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24, max_prompt_length=12)
        )
    )
    opener = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert out.stats["train"]["truncated"]["prompt"] == 8
    for r in out.train:
        for ids in ("input_ids", "kl_input_ids"):
            assert r[ids][0] != opener, tiny_tokenizer.decode(r[ids])


def test_truncation_is_counted(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer) -> None:
    long_prompt = [{"prompt": "word " * (40 + i), "completion": " ok", "label": i % 2 == 0} for i in range(6)]
    long_completion = [
        {"prompt": "Q:", "completion": " yes" * (30 + i), "label": i % 2 == 1} for i in range(6)
    ]
    short = [{"prompt": "Q:", "completion": " fine", "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", long_prompt + long_completion + short)
    out = prepare(
        *data_settings(
            make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24, max_prompt_length=16)
        )
    )
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


# Digests of the two configs below (input files and tokenizer hash held fixed), computed by
# store.fingerprint(config, tokenizer) at dc21b1c, before the data package took PrepareSettings instead of the
# whole Config (issue 45 part 3): a digest that moves rebuilds every user's prepared data. Recomputed on purpose
# for PIPELINE_VERSION 5 and its "checkpoint_eos" part (rows numbered from 1, the checkpoint's EOS for a
# tokenizer without one): at 4 they were {"eval_fraction": "ab70f6b0333af7d6", "eval_files": "85913658aceda49c"}.
# Recomputed on purpose for PIPELINE_VERSION 6 (a cut prompt keeps no <|im_start|> a ChatML tokenizer names its
# BOS): at 5 they were {"eval_fraction": "31d6ac04ec36b434", "eval_files": "baad23c1b31ec9bf"}.
# Recomputed on purpose for PIPELINE_VERSION 7 (KL pairs within a record format): at 6 they were
# {"eval_fraction": "8ae3b2de716c2220", "eval_files": "09b5881959d7742b"}.
# Recomputed on purpose for PIPELINE_VERSION 8 (plain text ending with the template's end of turn gets no EOS; a
# dating template renders as of one day a build): at 7 they were
# {"eval_fraction": "bf2fc7bef34b443a", "eval_files": "3577eb748549fedb"}.
# Back at version 8's on purpose: d64be4b recomputed them for a PIPELINE_VERSION 9 (the image layout), which
# rebuilt every text-only build, unchanged, and dropped its reference caches; the image layout has its own marker
# (store.IMAGE_LAYOUT) and text-only builds are as version 8 wrote them (at 9 these were
# {"eval_fraction": "b4082d60b879eebd", "eval_files": "8c8afd60c178cbe1"}; the next version is 10).
FINGERPRINTS_BEFORE_SETTINGS = {"eval_fraction": "ff73d4db597f1f22", "eval_files": "500cf8dc9fd91711"}


def test_fingerprint_of_a_fixed_config_is_unchanged(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    data = {
        "train_files": ["/data/train.jsonl"],
        "prepared_dir": "/data/prepared",
        "max_length": 96,
        "max_prompt_length": 40,
        "on_bad_record": "skip",
        "on_too_long": "skip",
        "eval_fraction": 0.25,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    monkeypatch.setattr(store, "_file_entries", lambda paths, key: [[p, 123, "ab" * 32] for p in paths])
    monkeypatch.setattr(store, "tokenizer_hash", lambda tokenizer: "cd" * 32)
    digests = {}
    eval_files = {"eval_files": ["/data/eval.jsonl"], "eval_fraction": 0.0}  # with eval_files: no fraction
    for name, extra in (("eval_fraction", {}), ("eval_files", eval_files)):
        config = Config.model_validate(
            {"model": {"path": str(model)}, "data": {**data, **extra}, "train": {"seed": 3}}
        )
        fp = store.fingerprint(data_settings(config)[0], tokenizer=None)
        assert fp["generation_eos_ids"] == [2, 7] and fp["settings"]["seed"] == 3
        digests[name] = fp["digest"]
    assert digests == FINGERPRINTS_BEFORE_SETTINGS


def test_cache_reuse_and_invalidation(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer, capsys) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    marker = tmp_path / "prepared" / "fingerprint.json"
    prepare(*data_settings(cfg))
    first = marker.stat().st_mtime_ns
    capsys.readouterr()
    prepare(*data_settings(cfg))
    assert marker.stat().st_mtime_ns == first and "reusing" in capsys.readouterr().out

    def rebuilt(config: Config) -> bool:
        before = marker.stat().st_mtime_ns
        prepare(*data_settings(config))
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
    # transformers 5 saves the template to chat_template.jinja (4.x: inside tokenizer_config.json)
    jinja = other / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(jinja.read_text().replace("<|im_start|>", "<|im_start|> "))
    else:
        config_json = other / "tokenizer_config.json"
        tc = json.loads(config_json.read_text())
        tc["chat_template"] = tc["chat_template"].replace("<|im_start|>", "<|im_start|> ")
        config_json.write_text(json.dumps(tc))
    assert rebuilt(cfg2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_crash_never_leaves_a_valid_looking_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    prepare(*data_settings(cfg))
    good = json.loads((tmp_path / "prepared" / "fingerprint.json").read_text())

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "build_split", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(
            *data_settings(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 300})}))
        )
    # The old cache is intact and still matches its own inputs; no half-built directory anywhere.
    assert json.loads((tmp_path / "prepared" / "fingerprint.json").read_text()) == good
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.undo()
    assert len(prepare(*data_settings(cfg)).train) == 10


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(3, 3))
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))


def test_eval_fraction_is_stratified_and_seeded(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(40, 12))
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], eval_fraction=0.25)))
    assert out.stats["train"]["labels"] == {"desirable": 30, "undesirable": 9}
    assert out.stats["eval"]["labels"] == {"desirable": 10, "undesirable": 3}
    assert set(out.train["source"]).isdisjoint(out.eval["source"])
    assert len(set(out.train["source"]) | set(out.eval["source"])) == 52
    assert out.stats["eval"]["kl_pairs"]["self_pairs"] == 0
    assert max(out.eval["kl_index"]) < len(out.eval)  # KL pairs built within each split
    again = prepare(
        *data_settings(make_config(tmp_path / "b", tiny_model_dir, [str(path)], eval_fraction=0.25))
    )
    assert again.eval["source"] == out.eval["source"]


def test_eval_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    ev = write_jsonl(tmp_path / "e.jsonl", rows(2, 2))
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(train)], eval_files=[str(ev)])))
    assert len(out.train) == 10 and len(out.eval) == 4 and out.stats["files"]["eval"] == [str(ev)]


def test_single_label_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(8, 0))
    with pytest.raises(DataError) as info:
        prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    msg = str(info.value)
    assert "8 desirable and 0 undesirable" in msg and str(path) in msg and "KTO needs both labels" in msg


def test_skip_mode_counts_bad_records(tmp_path: Path, tiny_model_dir: Path) -> None:
    bad = ["{not json", {"prompt": "a", "completion": "b", "label": "yes"}, {"messages": [], "label": True}]
    path = write_jsonl(tmp_path / "t.jsonl", rows(5, 5) + bad)
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], on_bad_record="skip")))
    assert len(out.train) == 10
    assert out.stats["bad_records"]["skipped"] == 3
    assert out.stats["bad_records"]["by_reason"] == {
        "malformed_json": 1,
        "bad_label": 1,
        "no_final_assistant": 1,
    }
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert [ln.split("\t")[1].split(": ")[0] for ln in lines] == [f"{path}:{i}" for i in (11, 12, 13)]
    settings = make_config(tmp_path, tiny_model_dir, [str(path)], on_bad_record="skip").data
    assert "bad records skipped: 3 (malformed_json 1, bad_label 1, no_final_assistant 1; all in " in summary(
        out.stats, settings, True, "", 1.0
    )


def test_num_proc_gives_identical_rows(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(30, 20))
    one = prepare(*data_settings(make_config(tmp_path / "one", tiny_model_dir, [str(path)])))
    monkeypatch.setattr(tables, "MIN_ROWS_PER_PROC", 10)
    two = prepare(*data_settings(make_config(tmp_path / "two", tiny_model_dir, [str(path)], num_proc=2)))
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
    stats = {"train": {"labels": {"desirable": n_d, "undesirable": n_u}}}
    auto = WeightSettings(KTOSection(auto_weights=True), micro_batch_size=mbs)
    w_d, w_u, report = resolve_kto_weights(auto, stats, replicas, str(tmp_path))
    s = MixedLabelBatchSampler.compute_stats(n_d, n_u, mbs, replicas)
    ratio = w_d * s.effective_desirable / (w_u * s.effective_undesirable)
    assert GUIDELINE[0] <= ratio <= GUIDELINE[1] and max(w_d, w_u) == 1.0
    assert "inside" in report and not report.startswith("warning")

    configured = WeightSettings(KTOSection(auto_weights=False), micro_batch_size=mbs)
    w_d, w_u, report = resolve_kto_weights(configured, stats, replicas, str(tmp_path))
    assert (w_d, w_u) == (1.0, 1.0)
    inside = GUIDELINE[0] <= s.effective_desirable / s.effective_undesirable <= GUIDELINE[1]
    assert report.startswith("warning") != inside


def test_prepare_reports_a_layout_the_sampler_refuses_and_training_names_the_data(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """prepare never batches: fewer examples than one micro-batch is a line of its summary, not a stop (it raised
    the sampler's ConfigError after writing the build: imbalance caught ValueError only)."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(3, 3))
    config = make_config(tmp_path, tiny_model_dir, [str(path)])
    config.train.micro_batch_size = 8
    out = prepare(*data_settings(config))
    report = out.stats["imbalance"]["report"]
    assert report.startswith(
        "imbalance: cannot lay out micro-batches: the dataset has 6 examples, fewer than one"
    )
    settings = WeightSettings(KTOSection(), micro_batch_size=8)
    with pytest.raises(DataError, match=rf"^data.prepared_dir {tmp_path}: the dataset has 6 examples"):
        resolve_kto_weights(settings, out.stats, 1, str(tmp_path))


def test_inspect_shows_mixed_batches(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    from coati_kto.data.inspect import inspect_batches

    path = write_jsonl(tmp_path / "t.jsonl", rows(15, 5))
    inputs = data_settings(make_config(tmp_path, tiny_model_dir, [str(path)]))
    inspect_batches(*inputs, num_ranks=2, num_batches=2, num_examples=2)
    out = capsys.readouterr().out
    for rank in (0, 1):
        for b in (0, 1):
            assert f"rank {rank} batch {b}: [" in out
        assert f"rank {rank}: 2/2 micro-batches mixed (100.0%)" in out
    assert "SINGLE LABEL" not in out and "minority (undesirable) repeats 0" in out
    assert (
        "padding (rank 0's first 2 micro-batches, share of the tokens each pass processes): examples " in out
    )
    assert "one row (flex_attention) 0" in out
    assert out.count("  KL completion | ") == 2


def test_inspect_of_other_settings_leaves_the_prepared_data_alone(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    """``inspect`` with another seed rebuilt data.prepared_dir in place, dropping the build (and its reference
    caches) that a run used; it now prepares in a temporary directory, says so, and removes it."""
    from coati_kto.data.inspect import inspect_batches

    path = write_jsonl(tmp_path / "t.jsonl", rows(15, 5))
    config = make_config(tmp_path, tiny_model_dir, [str(path)])
    prepare(*data_settings(config))
    built = (tmp_path / "prepared" / "fingerprint.json").read_text()
    capsys.readouterr()
    config.train.seed = 7
    inspect_batches(*data_settings(config), num_ranks=2, num_batches=1, num_examples=0)
    out = capsys.readouterr().out
    note = f"data.prepared_dir {tmp_path / 'prepared'} does not hold this data (changed: seed): inspect prepares "
    assert out.startswith(note) and "seed 7, epoch 0" in out
    scratch = Path(out.split("prepares it in ")[1].split(" and removes")[0])
    assert not scratch.exists() and scratch.name == "prepared"
    assert (tmp_path / "prepared" / "fingerprint.json").read_text() == built
    config.train.seed = 1  # the build's own settings: inspected in place, no note
    inspect_batches(*data_settings(config), num_ranks=1, num_batches=1, num_examples=0)
    assert "does not hold" not in capsys.readouterr().out


class FakeCollectives:
    """Stands in for a 2-rank process group in-process: records the collectives a rank enters."""

    def __init__(self, monkeypatch, rank: int, rank0_outcome=None) -> None:
        import torch.distributed as dist

        import coati_kto.parallel.distributed as cd

        self.calls: list[str] = []
        self.rank0_outcome = rank0_outcome
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(cd, "from_rank0", self.broadcast)

    def broadcast(self, obj, what: str):
        self.calls.append("broadcast")
        return obj if self.rank0_outcome is None else self.rank0_outcome


def test_load_prepared_protocol(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """Every rank enters the same one collective (on_rank0's broadcast) whether rank 0 succeeds or fails."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    rank0 = FakeCollectives(monkeypatch, 0)
    assert len(load_prepared(*data_settings(cfg)).train) == 10 and rank0.calls == ["broadcast"]
    digest = json.loads((tmp_path / "prepared" / "fingerprint.json").read_text())["digest"]

    rank1 = FakeCollectives(monkeypatch, 1, rank0_outcome=("ok", digest, None))
    assert len(load_prepared(*data_settings(cfg)).train) == 10 and rank1.calls == ["broadcast"]

    # Rank 0 failed: every rank raises its one-line error after the same collectives (rank 0 sends the error
    # as on_rank0 does since 2d09d46: pickled by _portable; this test sent the bare class and failed since).
    from coati_kto.parallel.distributed import _portable

    message = "t.jsonl:3: field 'label': ..."
    rank1 = FakeCollectives(monkeypatch, 1, rank0_outcome=("user", _portable(DataError(message)), message))
    with pytest.raises(DataError, match="t.jsonl:3: field 'label'"):
        load_prepared(*data_settings(cfg))
    assert rank1.calls == ["broadcast"]
    bad = make_config(tmp_path, tiny_model_dir, [str(write_jsonl(tmp_path / "one.jsonl", rows(4, 0)))])
    rank0 = FakeCollectives(monkeypatch, 0)
    with pytest.raises(DataError, match="KTO needs both labels"):
        load_prepared(*data_settings(bad))
    assert rank0.calls == ["broadcast"]

    # A rank that cannot see rank 0's build (prepared_dir not shared across nodes) says so.
    FakeCollectives(monkeypatch, 1, rank0_outcome=("ok", "0123456789abcdef", None))
    with pytest.raises(DataError, match="shared filesystem; on one filesystem, another process replaced it"):
        load_prepared(*data_settings(cfg))
    # From a concurrency audit: rank 0 itself sees another build than it made (a prepare of other data settings
    # on the same data.prepared_dir swapped its build in meanwhile). It named the multi-node advice alone.
    import coati_kto.data.prepared as prepared

    FakeCollectives(monkeypatch, 0)
    monkeypatch.setattr(prepared, "read_fingerprint", lambda target: {"digest": "0123456789abcdef"})
    with pytest.raises(DataError) as err:
        load_prepared(*data_settings(cfg))
    assert str(err.value).endswith(
        "rank 0 built " + digest + ": another process replaced it meanwhile: a run or prepare of other data "
        "settings on the same data.prepared_dir (give each its own)"
    )


def test_examples_that_cannot_fit_are_dropped_and_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Only reachable with max_prompt_length >= max_length (the schema forbids it): still counted, never silent."""
    rows_ = [{"prompt": "word " * 30, "completion": " ok", "label": i % 2 == 0} for i in range(3)]
    rows_ += [{"prompt": "Q:", "completion": " ok", "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", rows_)
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    # Bypass the schema (validate_assignment refuses it), as a config object built in code could.
    data = {**cfg.data.model_dump(), "max_length": 16, "max_prompt_length": 16}
    object.__setattr__(cfg, "data", cfg.data.model_construct(**data))
    out = prepare(*data_settings(cfg))
    assert out.stats["train"]["dropped"] == {"no_room_for_completion": 3} and len(out.train) == 4
    assert "dropped: no_room_for_completion 3 (each named in skipped.txt);" in summary(
        out.stats, cfg.data, True, "", 1.0
    )


def test_on_too_long_truncates_skips_or_stops(tmp_path: Path, tiny_model_dir: Path) -> None:
    """data.on_too_long: "drop" and "error" could never fire (they applied only to examples with no room for a
    completion, which the schema rules out), so over-long examples were truncated whatever the config said."""
    rows_ = [{"prompt": "Q:", "completion": " ok" * 40, "label": i % 2 == 0} for i in range(3)]
    rows_ += [{"prompt": "Q:", "completion": " ok", "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", rows_)
    truncated = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24)))
    assert len(truncated.train) == 7 and truncated.stats["train"]["truncated"]["completion"] == 3
    assert max(len(r["input_ids"]) for r in truncated.train) == 24
    skipped = prepare(
        *data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24, on_too_long="skip"))
    )
    assert len(skipped.train) == 4 and skipped.stats["train"]["dropped"] == {"too_long": 3}
    assert skipped.stats["train"]["truncated"]["completion"] == 0
    # Each row dropped is named in skipped.txt, as a bad record is (it was counted only).
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"too_long\t{path}:1: ")
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in lines] == ["1", "2", "3"]
    assert lines[0].endswith(" completion tokens, longer than data.max_length 24")
    # KL rows still join one example's prompt with another's completion and are cut to fit: said in the summary
    # (it was in stats.json only, and the summary read "0 prompts, 0 completions")
    long_prompts = [{"prompt": "Q:" + " why" * 3, "completion": " ok", "label": i % 2 == 0} for i in range(3)]
    long_completions = [{"prompt": "Q:", "completion": " ok" * 6, "label": i % 2 == 1} for i in range(3)]
    kl_rows = write_jsonl(tmp_path / "kl.jsonl", long_prompts + long_completions)
    kl_config = make_config(tmp_path, tiny_model_dir, [str(kl_rows)], max_length=24, on_too_long="skip")
    cut = prepare(*data_settings(kl_config))
    n_cut = cut.stats["train"]["truncated"]["kl_completion"]
    assert len(cut.train) == 6 and n_cut > 0 and max(r["kl_length"] for r in cut.train) == 24
    n_prompts = cut.stats["train"]["truncated"]["kl_prompt"]
    printed = summary(cut.stats, kl_config.data, True, "", 1.0)
    assert f"KL rows cut to data.max_length 24: {n_prompts} prompts, {n_cut} completions" in printed
    with pytest.raises(
        DataError, match=rf"^{path}:1: \d+ prompt \+ \d+ completion tokens, longer than data.max"
    ):
        prepare(
            *data_settings(
                make_config(tmp_path, tiny_model_dir, [str(path)], max_length=24, on_too_long="error")
            )
        )
    # and with nothing too long it prepares everything (it raised KeyError: 'error' on every such run)
    fits = prepare(
        *data_settings(
            make_config(tmp_path, tiny_model_dir, [str(path)], max_length=256, on_too_long="error")
        )
    )
    assert len(fits.train) == 7 and fits.stats["train"]["dropped"] == {}
    with pytest.raises(Exception, match="on_too_long"):
        make_config(tmp_path, tiny_model_dir, [str(path)], on_too_long="drop")
    # Every undesirable example too long: the split is short of a label because of data.max_length, not of data
    # (it said only "add undesirable examples (label false)").
    one_sided = [
        {"prompt": "Q:", "completion": " ok" * (40 if i % 2 else 1), "label": i % 2 == 0} for i in range(6)
    ]
    one_path = write_jsonl(tmp_path / "one.jsonl", one_sided)
    with pytest.raises(DataError) as info:
        prepare(
            *data_settings(
                make_config(tmp_path, tiny_model_dir, [str(one_path)], max_length=24, on_too_long="skip")
            )
        )
    assert re.search(
        rf"; 3 examples were dropped to fit data.max_length \(e.g. {one_path}:2: \d+ prompt \+ \d+ completion tokens, "
        r"longer than data.max_length 24\): raise it, or add undesirable examples \(label false\)$",
        str(info.value),
    )


# ------------------------------------------------------------------------------------------- issue 17


def sp_model_dir(tmp_path: Path, style: str) -> Path:
    """A directory holding only a SentencePiece-style tokenizer (prepare needs no weights)."""
    from test_tokenize import sentencepiece_tokenizer

    out = tmp_path / f"tok-{style}"
    sentencepiece_tokenizer(style).save_pretrained(out)
    return out


def qa_row(i: int, label: bool) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Please add {i} and 3."},
            {"role": "assistant", "content": f"The answer is {i + 3}." if label else "I cannot help."},
        ],
        "label": label,
    }


def test_sentencepiece_rows_are_the_conversation_tokenized_whole(tmp_path: Path) -> None:
    """Issue 17: a Gemma-style tokenizer's stored rows decoded to "model\\n answer" on every row."""
    from transformers import AutoTokenizer

    model_dir = sp_model_dir(tmp_path, "metaspace-first")
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = [qa_row(i, i % 3 != 0) for i in range(60)]
    path = write_jsonl(tmp_path / "t.jsonl", data)
    out = prepare(
        *data_settings(make_config(tmp_path, model_dir, [str(path)], max_length=512, max_prompt_length=256))
    )
    assert out.stats["train"]["boundary_inside_token"] == 0 and len(out.train) == 60
    for r in out.train:
        raw = data[int(r["source"].rsplit(":", 1)[1]) - 1]
        text = tok.apply_chat_template(raw["messages"], tokenize=False)
        assert tok.decode(r["input_ids"]) == text  # no "model\n " anywhere; no <eos> after <end_of_turn>
        assert r["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(r["input_ids"][r["completion_start"] :]) == raw["messages"][-1]["content"] + (
            "<end_of_turn>\n"
        )
    assert out.stats["completion_end"] == "completions end with the template's `<end_of_turn>`; no EOS added"

    # Truncation on the same rows: the prompt keeps its BOS and its END, the completion its START, its end of
    # turn only if it fits. (Before: the cut removed the BOS, and a Gemma model read every truncated row without it.)
    cut = prepare(
        *data_settings(
            make_config(tmp_path / "cut", model_dir, [str(path)], max_length=16, max_prompt_length=8)
        )
    )
    whole = {r["source"]: r for r in out.train}
    for rows, ids in ((cut.train, "input_ids"), (cut.train, "kl_input_ids")):
        for r in rows:
            full = whole[r["source"]] if ids == "input_ids" else out.train[r["index"]]
            p = full["input_ids"][: full["completion_start"]]
            c = out.train[r["kl_index"]] if ids == "kl_input_ids" else full
            c = c["input_ids"][c["completion_start"] :]
            keep_p, keep_c = truncation(len(p), len(c), 16, 8)
            assert p[0] == tok.bos_token_id and r[ids][0] == tok.bos_token_id
            assert r[ids] == p[:1] + p[len(p) - int(keep_p) + 1 :] + c[: int(keep_c)]
            assert r["length" if ids == "input_ids" else "kl_length"] <= 16
        assert all(r["completion_start"] == 8 for r in rows)
    assert cut.stats["train"]["truncated"]["prompt"] == 60


def test_no_pad_token_is_one_line_then_pads_with_eos(tmp_path: Path, capsys) -> None:
    model_dir = sp_model_dir(tmp_path, "legacy-prepend")  # Llama-2 style: no pad token
    path = write_jsonl(tmp_path / "t.jsonl", [qa_row(i, i % 2 == 0) for i in range(8)])
    out = prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    printed = capsys.readouterr().out
    eos = out.stats["padding"]["pad_id"]
    assert f"  {out.stats['padding']['note']}" in printed.splitlines()
    assert printed.count("no pad token") == 1 and f"padding with EOS '</s>' (id {eos})" in printed
    batch = KTOCollator(eos)(list(out.train))
    assert (batch.example.input_ids[batch.example.attention_mask == 0] == eos).all()
    load_prepared(
        *data_settings(make_config(tmp_path, model_dir, [str(path)]))
    )  # what train's rank 0 runs: reused, said once
    assert capsys.readouterr().out == out.stats["padding"]["note"] + "\n"


def test_summary_says_lengths_before_and_after_truncation(tmp_path: Path, tiny_model_dir: Path) -> None:
    long = [{"prompt": "Q:", "completion": " yes" * (20 + i), "label": i % 2 == 0} for i in range(4)]
    path = write_jsonl(tmp_path / "t.jsonl", long)
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)], max_length=16, max_prompt_length=8)
    out = prepare(*data_settings(cfg))
    before = out.stats["train"]["lengths"]["total"]
    assert before["max"] > 16 and out.stats["train"]["lengths_truncated"]["total"]["max"] == 16
    text = summary(out.stats, cfg.data, True, "x", 1.0)
    assert (
        f"tokens per example before truncation p50 {before['p50']:.0f}, p99 {before['p99']:.0f}, max "
        f"{before['max']}; after p50 16, p99 16, max 16" in text
    )


def test_exact_duplicates_are_counted_and_kept(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    data = rows(5, 5)
    path = write_jsonl(tmp_path / "t.jsonl", data + [data[0], data[0], data[3]])
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    assert len(out.train) == 13  # kept: the user may mean them
    assert out.stats["duplicates"] == {
        "records": 3,
        "examples": [f"{path}:11 = {path}:1", f"{path}:12 = {path}:1", f"{path}:13 = {path}:4"],
    }
    assert (
        f"  duplicates: 3 records repeat an earlier one exactly (same prompt, completion and label; e.g. "
        f"{path}:11 = {path}:1); kept: remove them if you did not mean them"
        in capsys.readouterr().out.splitlines()
    )
    # A different label is no duplicate (KTO data often holds both judgements of one completion).
    flipped = {**data[0], "label": not data[0]["label"]}
    path2 = write_jsonl(tmp_path / "u.jsonl", [*data, flipped])
    assert (
        prepare(*data_settings(make_config(tmp_path / "u", tiny_model_dir, [str(path2)]))).stats[
            "duplicates"
        ]["records"]
        == 0
    )


def test_eval_fraction_keeps_each_prompt_on_one_side(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 17: the two halves of a prompt/chosen/rejected pair, and duplicates, landed on both sides."""
    pairs = [
        {"prompt": f"Please add {i} and 3.", "chosen": f" {i + 3}", "rejected": " I cannot."}
        for i in range(20)
    ]
    path = write_jsonl(tmp_path / "p.jsonl", pairs + pairs[:3])  # 3 duplicated pairs
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], eval_fraction=0.25)))

    def prompts(ds) -> set[tuple[int, ...]]:
        return {tuple(r["input_ids"][: r["completion_start"]]) for r in ds}

    assert prompts(out.train).isdisjoint(prompts(out.eval))
    assert len(out.train) + len(out.eval) == 46 and len(out.eval) >= 2
    assert out.stats["eval"]["labels"]["desirable"] == out.stats["eval"]["labels"]["undesirable"]


def test_content_change_with_same_size_and_mtime_rebuilds(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    """Issue 17: cp -p / rsync -t keep size and mtime; the fingerprint hashes the content."""
    path = write_jsonl(tmp_path / "t.jsonl", [{**r, "label": int(r["label"])} for r in rows(6, 4)])
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    first = prepare(*data_settings(cfg))
    st = path.stat()
    flipped = path.read_text().translate(str.maketrans({"0": "1", "1": "0"}))  # labels (and numbers) flipped
    path.write_text(flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    capsys.readouterr()
    again = prepare(*data_settings(cfg))
    assert f"(changed: train_files (content of {path.name}))" in capsys.readouterr().out
    assert again.stats["train"]["labels"] == {"desirable": 4, "undesirable": 6}
    assert first.stats["train"]["labels"] == {"desirable": 6, "undesirable": 4}


def test_empty_prompt_is_refused_or_counted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The tiny tokenizer adds no BOS: nothing would predict an empty prompt's first completion token."""
    path = write_jsonl(
        tmp_path / "t.jsonl", [*rows(3, 3), {"prompt": "", "completion": " yes", "label": True}]
    )
    with pytest.raises(DataError) as info:
        prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    assert str(info.value).startswith(f"{path}:7: field 'prompt': no prompt tokens (the prompt is empty")
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)], on_bad_record="skip")))
    assert len(out.train) == 6 and out.stats["bad_records"]["by_reason"] == {"no_prompt_tokens": 1}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 15), st.booleans()), min_size=4, max_size=80),
    st.sampled_from([0.1, 0.25, 0.5]),
    st.integers(0, 3),
)
def test_group_split_never_puts_a_prompt_on_both_sides(records, fraction: float, seed: int) -> None:
    groups = np.array([f"prompt {g}" for g, _ in records], dtype=object)
    labels = np.array([label for _, label in records])
    try:
        train, held = splits.group_split(groups, labels, fraction, seed)
    except DataError as err:  # allowed only when no such split exists or a label has < 2 records
        assert "data.eval_fraction" in str(err) and "\n" not in str(err)
        return
    assert sorted([*train, *held]) == list(range(len(records)))  # every record on exactly one side
    assert set(groups[train]).isdisjoint(groups[held])
    for side in (train, held):
        assert labels[side].any() and (~labels[side]).any()  # both labels on both sides
    for value in (True, False):  # never more than the target of either label held out
        n = int((labels == value).sum())
        assert (labels[held] == value).sum() <= min(max(1, round(fraction * n)), n - 1)
    again = splits.group_split(groups[::-1], labels[::-1], fraction, seed)[1]
    assert sorted(len(records) - 1 - again) == sorted(held)  # deterministic by seed, whatever the order


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and not thinking %}no think\n{% endif %}{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if not thinking %}no think\n{% endif %}"
    "{% endif %}"
)


def test_record_tools_and_template_variables_reach_the_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A record's tools key was dropped (the prompt rendered without the tool definitions its tool-call answer
    needs), and no template variable (Qwen3's enable_thinking) could be set. Both reach every template call: the
    rows are the template's rendering with them, records with different tools rendered each with their own."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model_dir)
    (model_dir / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    tools = [[{"name": "search"}], [{"name": "weather"}, {"name": "add"}], None]
    records = [
        {
            "messages": [
                {"role": "user", "content": f"Find {i}."},
                {"role": "assistant", "content": "Paris."},
            ],
            "label": i % 3 != 0,
            **({"tools": tools[i % 3]} if tools[i % 3] else {}),
        }
        for i in range(12)
    ]
    records[1]["tools"] = json.dumps(records[1]["tools"])  # as some datasets store it: a JSON string
    path = write_jsonl(tmp_path / "t.jsonl", records)
    out = prepare(
        *data_settings(
            make_config(tmp_path, model_dir, [str(path)], chat_template_kwargs={"thinking": False})
        )
    )
    assert len(out.train) == 12
    for r in out.train:
        i = int(r["source"].rsplit(":", 1)[1]) - 1
        messages = records[i]["messages"]
        prompt = tok.apply_chat_template(
            messages[:1], tools=tools[i % 3], add_generation_prompt=True, tokenize=False, thinking=False
        )
        assert tok.decode(r["input_ids"][: r["completion_start"]]) == prompt
        assert prompt.endswith("assistant\nno think\n") and ("tools: " in prompt) == (
            tools[i % 3] is not None
        )
        assert tok.decode(r["input_ids"][r["completion_start"] :]) == "Paris.<|im_end|>\n"
    thinking = prepare(
        *data_settings(
            make_config(tmp_path / "t", model_dir, [str(path)], chat_template_kwargs={"thinking": True})
        )
    )
    assert "no think" not in tok.decode(thinking.train[0]["input_ids"])


def test_a_prompt_the_template_rewrites_names_where_it_differs(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A template that changes earlier turns once the conversation ends with an assistant turn (Mistral v0.3
    drops the system prompt, DeepSeek-R1 strips the <think> its generation prompt opens): one line showing where
    the prompt and the conversation part."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (
        "{% for message in messages %}{% if message['role'] != 'system' or not messages[-1]['role'] == "
        "'assistant' %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(model_dir)
    (model_dir / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    system = {"role": "system", "content": "Be brief."}
    record = {
        "messages": [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    }
    path = write_jsonl(tmp_path / "t.jsonl", [{**record, "label": True}, {**record, "label": False}])
    with pytest.raises(DataError) as info:
        prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    message = str(info.value)
    assert (
        message.startswith(f"{path}:1: field 'messages': the chat template renders the prompt")
        and "\n" not in message
    )
    assert "at character 12 the prompt has 'system\\nBe brief.<|im_end|>\\n<|im_start|>u'" in message
    assert "the conversation 'user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'" in message


def test_a_sentencepiece_model_file_alone_prepares(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A checkpoint with only a SentencePiece tokenizer.model (no tokenizer.json: older Llama 2 / Mistral repos)
    loads through the sentencepiece package the install now carries (without it: a raw ImportError traceback),
    and its rows are the template's rendering tokenized whole, the completion split exactly."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(f"Please add {i} and 3. The answer is {i + 3}. I cannot help." for i in range(200))
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(model_dir / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    (model_dir / "tokenizer.vocab").unlink()
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": LLAMA2_TEMPLATE,
            }
        )
    )
    (model_dir / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = [qa_row(i, i % 2 == 0) for i in range(8)]
    out = prepare(
        *data_settings(make_config(tmp_path, model_dir, [str(write_jsonl(tmp_path / "t.jsonl", data))]))
    )
    assert len(out.train) == 8
    for r in out.train:
        messages = data[int(r["source"].rsplit(":", 1)[1]) - 1]["messages"]
        whole = tok.apply_chat_template(messages, tokenize=False)
        assert r["input_ids"] == tok(whole, add_special_tokens=False)["input_ids"]
        assert (
            tok.decode(r["input_ids"][r["completion_start"] :]).strip() == messages[-1]["content"] + " </s>"
        )


def test_a_tokenizer_backend_missing_is_one_line(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    from coati_kto.data.tokenize import load_tokenizer

    def missing(*args, **kwargs):
        raise ImportError(
            "\nSentencePieceBackend requires the SentencePiece library but it was not found.\nmore"
        )

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", missing)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(make_config(tmp_path, tiny_model_dir, ["t.jsonl"]).model)
    assert str(info.value) == (
        f"model.tokenizer / model.path {tiny_model_dir}: cannot load a tokenizer (SentencePieceBackend requires "
        "the SentencePiece library but it was not found.)"
    )


def test_a_model_dir_without_tokenizer_files_names_what_it_holds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Without tokenizer.json the error was "cannot load a tokenizer (Couldn't instantiate the backend tokenizer
    from one of: )", naming nothing."""
    import shutil

    from coati_kto.data.tokenize import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    held = ", ".join(sorted(p.name for p in model.iterdir()))
    with pytest.raises(ConfigError) as info:
        load_tokenizer(make_config(tmp_path, model, ["t.jsonl"]).model)
    assert str(info.value) == (
        f"model.path {model}: cannot load a tokenizer: the directory holds none of tokenizer.json, tokenizer.model, "
        f"spiece.model, vocab.json, vocab.txt, tekken.json (it holds {held}); copy the tokenizer's files there, or "
        "set model.tokenizer to a directory that has them"
    )


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_a_tokenizer_without_a_chat_template_is_one_line_up_front(
    tmp_path: Path, tiny_model_dir: Path, on_bad_record: str
) -> None:
    """Conversational records with a tokenizer that has no chat template failed as "data/conv.jsonl:1: field
    'messages': the chat template failed: Cannot use chat template functions ...", blamed on the first record;
    skipped, all 48 went and the error said "add desirable examples (label true)"."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "conv.jsonl", rows(4, 4))
    with pytest.raises(ConfigError) as info:
        prepare(*data_settings(make_config(tmp_path, model, [str(data)], on_bad_record=on_bad_record)))
    assert str(info.value) == (
        f"model.path {model}: its tokenizer has no chat template; conversational records need one ({data}:1 is "
        f"one): put the model's chat_template.jinja (or a chat_template entry in tokenizer_config.json) in {model}, "
        "set model.tokenizer to a tokenizer that has one, or give the records as plain prompt/completion strings"
    )
    # Plain text needs no template: used as given.
    plain = [{"prompt": f"Add {i} and 3.", "completion": " 5", "label": i % 2 == 0} for i in range(8)]
    out = prepare(
        *data_settings(
            make_config(tmp_path / "plain", model, [str(write_jsonl(tmp_path / "p.jsonl", plain))])
        )
    )
    assert len(out.train) == 8


def test_token_ids_past_the_model_vocabulary_are_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A tokenizer with tokens the model has no embedding for (special tokens added, embeddings not resized): an
    index error on every rank on CPU, a device-side assert on a GPU. One line on opening the data instead."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 3))
    out = prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    top = out.stats["train"]["max_token_id"]
    assert (
        top == max(max(r["input_ids"] + r["kl_input_ids"]) for r in out.train) and top < config["vocab_size"]
    )
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": top}))
    with pytest.raises(ConfigError) as info:
        prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    assert str(info.value) == (
        f"model.path {model_dir} has {top} token embeddings, but the prepared data holds token id {top}: the "
        "tokenizer has tokens the model cannot embed (resize its embeddings to the tokenizer with "
        "model.resize_token_embeddings(len(tokenizer)) and save it, or use the model's own tokenizer)"
    )


def test_rows_past_a_learned_position_table_are_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A GPT-2 style model (learned positions, ``n_positions``) given rows longer than its table: an index error
    at step 1 after the models loaded (a device-side assert on a GPU). One line on opening the data instead;
    rotary models are not limited."""
    import shutil

    from transformers import GPT2Config

    from coati_kto.data.prepared import _longest

    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 3))
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    max_length = make_config(tmp_path, tiny_model_dir, [str(path)]).data.max_length
    longest = max(len(r[key]) for r in out.train for key in ("input_ids", "kl_input_ids"))
    assert longest <= _longest(max_length, out) <= max_length
    model_dir = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir, model_dir)
    GPT2Config(n_positions=_longest(max_length, out) - 1, vocab_size=1000).save_pretrained(model_dir)
    with pytest.raises(ConfigError) as info:
        prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    assert str(info.value) == (
        f"model.path {model_dir} has {_longest(max_length, out) - 1} learned positions, but the prepared rows reach "
        f"{_longest(max_length, out)} tokens: set data.max_length to at most {_longest(max_length, out) - 1}"
    )
    GPT2Config(n_positions=_longest(max_length, out), vocab_size=1000).save_pretrained(model_dir)
    prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))
    rotary = json.loads((tiny_model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**rotary, "max_position_embeddings": 4}))
    prepare(*data_settings(make_config(tmp_path, model_dir, [str(path)])))


def test_fields_no_record_shape_reads_are_counted_and_said(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    """A ``system`` field next to prompt/completion/label was dropped in silence (the system prompt never
    reached the chat template). Now every field no record shape reads is counted, in the stats and the summary."""
    data = [{**r, "system": "Be brief.", **({"id": i} if i % 2 else {})} for i, r in enumerate(rows(5, 5))]
    path = write_jsonl(tmp_path / "t.jsonl", data)
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    assert out.stats["unread_fields"] == {"id": 5, "system": 10}
    assert (
        "  fields not read: id (5 records), system (10 records); only prompt, completion, label, "
        "messages/conversations, chosen/rejected and tools are (a system prompt goes in as a system message)"
        in capsys.readouterr().out.splitlines()
    )
    both = [
        {
            "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
            "prompt": "Unused?",
            "completion": "Unused.",
            "label": i % 2 == 0,
        }
        for i in range(4)
    ]
    path = write_jsonl(tmp_path / "m.jsonl", both)
    out = prepare(*data_settings(make_config(tmp_path / "m", tiny_model_dir, [str(path)])))
    assert out.stats["unread_fields"] == {"completion": 4, "prompt": 4}  # messages wins: said, not silent
    capsys.readouterr()
    clean = write_jsonl(tmp_path / "u.jsonl", rows(5, 5))
    out = prepare(*data_settings(make_config(tmp_path / "u", tiny_model_dir, [str(clean)])))
    assert out.stats["unread_fields"] == {}
    assert "fields not read" not in capsys.readouterr().out


_STOPPED_PREPARE = """
import json, os, signal, sys, time
from pathlib import Path
from coati_kto.config.schema import Config
from coati_kto.data.prepared import prepare
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.weights import WeightSettings
from coati_kto.runtime.signals import STOP

config = Config.model_validate(json.loads(sys.argv[1]))
real_rename, real_replace, sent = Path.rename, os.replace, []

def stop_at_first(rename):  # a SIGTERM just as the old build is renamed aside
    def wrapped(*args, **kwargs):
        out = rename(*args, **kwargs)
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        return out
    return wrapped

Path.rename, os.replace = stop_at_first(real_rename), stop_at_first(real_replace)
STOP.quit_on_stop("precompute")
STOP.stoppable(lambda: prepare(PrepareSettings(config.data, config.model, 1), WeightSettings(config.kto, 4)))
"""


def test_a_stop_between_the_swaps_renames_loses_no_build_and_leaves_nothing_aside(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """precompute prepares first; a stop (STOP.quit_on_stop) between the rename of the old build aside and the new
    one's rename in left no data.prepared_dir and the old build under `.prepared.old-*`, which nothing removed:
    the next run rebuilt. That build, complete, is now put back and reused, and nothing is left aside."""
    import subprocess
    import sys

    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    cfg = make_config(tmp_path, tiny_model_dir, [str(path)])
    prepare(*data_settings(cfg))
    good = json.loads((tmp_path / "prepared" / "fingerprint.json").read_text())
    changed = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_files": [str(path)], "prepared_dir": str(tmp_path / "prepared"), "max_length": 300},
        "output": {"dir": str(tmp_path / "out")},
    }
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run(
        [sys.executable, "-c", _STOPPED_PREPARE, json.dumps(changed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 143, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == "precompute stopped by SIGTERM: nothing written"
    capsys.readouterr()
    assert len(prepare(*data_settings(cfg)).train) == 10
    assert "reusing" in capsys.readouterr().out  # the old build, put back, not a rebuild
    assert json.loads((tmp_path / "prepared" / "fingerprint.json").read_text()) == good
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_build_with_files_deleted_since_is_built_again_and_one_cut_short_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """From a failure-injection audit: a prepared dir whose train/*.arrow, train/state.json or stats.json was
    deleted since (its fingerprint.json still there) was taken as complete, and the read failed with a
    traceback (FileNotFoundError, "neither a Dataset directory"); an arrow file cut short with ArrowInvalid."""
    from helpers import data_settings

    from coati_kto.data.files import write_jsonl
    from coati_kto.data.prepared import prepare
    from coati_kto.errors import DataError

    path = write_jsonl(rows(8, 4), tmp_path / "t.jsonl")
    settings = data_settings(make_config(tmp_path, tiny_model_dir, [str(path)]))
    first = prepare(*settings)
    target = tmp_path / "prepared"
    (arrow,) = (target / "train").glob("*.arrow")
    for lost in (arrow, target / "train" / "state.json", target / "stats.json"):
        lost.unlink()
        capsys.readouterr()
        again = prepare(*settings)
        assert f"(damaged: {lost.relative_to(target)} is missing)" in capsys.readouterr().out
        assert len(again.train) == len(first.train)
    (arrow,) = (target / "train").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:200])
    with pytest.raises(DataError, match=rf"^data.prepared_dir {target}: the prepared data cannot be read \("):
        prepare(*settings)
