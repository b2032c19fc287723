"""A split holding records of both formats (plain prompt/completion strings and messages): each KL row joins a
prompt and a completion of the same format. Before, the derangement ignored the format, so about half the KL rows
joined a template-rendered prompt with a raw-text completion (ending with an appended EOS) or a raw-text prompt
with a template's assistant turn: sequences neither format produces, which z0 then averaged over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import chat_records, data_settings, preference_records
from test_prepare import make_config

from coati_kto.data.files import write_jsonl
from coati_kto.data.kl_pairs import derangement, derangement_by_kind, pair_stats
from coati_kto.data.prepared import prepare


def test_mixed_split_pairs_within_each_format(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer) -> None:
    records = chat_records(9, "I cannot help with that.") + preference_records(9, 0)
    data = write_jsonl(records, tmp_path / "mixed.jsonl")
    out = prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(data)])))
    rows = out.train.to_list()
    # a chat row's tokens open with the template's <|im_start|>; a plain row's are the text as given
    chat = {
        r["index"]: r["input_ids"][0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") for r in rows
    }
    assert sorted(chat.values()) == [False] * 9 + [True] * 9
    assert [r["index"] for r in rows if chat[r["index"]] != chat[r["kl_index"]]] == []
    for r in rows:  # the KL row is this prompt + the completion of a row of its own format
        kl = out.train[int(r["kl_index"])]
        prompt = r["input_ids"][: r["completion_start"]]
        assert r["kl_input_ids"] == prompt + kl["input_ids"][kl["completion_start"] :]
    kl_stats = out.stats["train"]["kl_pairs"]
    assert kl_stats["cross_format_pairs"] == 0 and kl_stats["self_pairs"] == 0


@pytest.mark.parametrize("seed", range(5))
def test_derangement_by_kind(seed: int) -> None:
    groups = np.array([0, 0, 1, 2, 3, 4, 5, 5, 6, 7])
    kinds = np.array([True] * 4 + [False] * 6)
    pi = derangement_by_kind(groups, kinds, [seed, 0])
    assert sorted(pi) == list(range(10)) and (pi != np.arange(10)).all()
    assert (kinds[pi] == kinds).all()
    stats = pair_stats(groups, pi, kinds)
    assert stats["cross_format_pairs"] == 0 and stats["same_prompt_pairs"] == stats["min_same_prompt_pairs"]
    # one format alone: exactly the pairs it always had (prepared data of one format does not change)
    same = np.zeros(10, bool)
    assert (derangement_by_kind(groups, same, [seed, 0]) == derangement(groups, [seed, 0])).all()
    # a format with one example has no partner of its own: it joins the other's cycle (2 pairs across)
    lone = np.array([True] + [False] * 9)
    pi = derangement_by_kind(groups, lone, [seed, 0])
    assert sorted(pi) == list(range(10)) and (pi != np.arange(10)).all()
    assert pair_stats(groups, pi, lone)["cross_format_pairs"] == 2
