"""Hub datasets under HF_HUB_OFFLINE, read from the hub cache as ``hf download --repo-type dataset`` fills it
(blobs/, refs/main, snapshots/<sha>/ linking into blobs/; written here by the CLI's own call against the stand-in
Hub on the loopback), with no ``datasets`` cache: a branch, a pinned sha, a named config (README), data_files,
jsonl/parquet/csv; and the three ways it can fail (not in the cache, no such dataset, no network), one line each.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import preference_records
from huggingface_hub import constants

from coati_kto.config.hub import parse_hub_dataset
from coati_kto.data.hub import check, open_split
from coati_kto.errors import DataError
from coati_kto.testing.hub import StandInHub, hf_download

KEY = "data.train_files"
CARD = b"""---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train-*.jsonl
  - split: test
    path: en/test.jsonl
- config_name: fr
  data_files:
  - split: train
    path: fr/*.jsonl
---
# feedback in two languages
"""


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def parquet(records: list[dict]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), out)
    return out.getvalue()


def csv(records: list[dict]) -> bytes:
    rows = [f'"{r["prompt"]}","{r["completion"]}",{r["label"]}' for r in records]
    return ("prompt,completion,label\n" + "\n".join(rows) + "\n").encode()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHub]:
    """The stand-in Hub; huggingface_hub's cache and datasets' cache under tmp_path (the latter not made)."""
    import datasets

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with StandInHub(token="hf_standin") as server:
        yield server
    assert server.unhandled == []


def offline(hub: StandInHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1, with the Hub still answering at the endpoint: any request would be recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)


def read(value: str) -> tuple[str, list[dict]]:
    """(commit sha, rows) of one entry, as prepare reads it: check, then open_split at that sha."""
    spec = parse_hub_dataset(value, KEY)
    sha = check(spec, KEY)
    return sha, [dict(row) for row in open_split(spec, sha)]


def refused(value: str) -> str:
    with pytest.raises(DataError) as err:
        check(parse_hub_dataset(value, KEY), KEY)
    return str(err.value)


def test_a_dataset_from_hf_download_is_read_offline_at_a_branch_or_a_pinned_sha(
    hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "revision main is not in the Hugging Face cache and HF_HUB_OFFLINE is set", though refs/main was
    there: only a split ``datasets`` had prepared online (HF_HOME/datasets) was read offline."""
    train, test, newer = preference_records(12, 0), preference_records(5, 50), preference_records(7, 100)
    first = hub.commit(
        "dataset", "org/feedback", {"data/train.jsonl": jsonl(train), "data/test.jsonl": jsonl(test)}
    )
    second = hub.commit("dataset", "org/feedback", {"data/train.jsonl": jsonl(newer)})
    cache = tmp_path / "hub"
    hf_download(hub, "org/feedback", cache)  # main, then a pinned older commit
    hf_download(hub, "org/feedback", cache, revision=first)
    repo = cache / "datasets--org--feedback"
    assert (repo / "refs" / "main").read_text() == second
    assert (
        repo / "snapshots" / first / "data" / "train.jsonl"
    ).is_symlink()  # into blobs/, as hf download links
    assert not (tmp_path / "datasets").exists()

    offline(hub, monkeypatch)
    asked = len(hub.requests)
    assert read("hf://datasets/org/feedback") == (second, newer)
    assert read("hf://datasets/org/feedback?split=test") == (second, test)
    assert read(f"hf://datasets/org/feedback?revision={first}") == (first, train)
    assert len(hub.requests) == asked  # not one request


def test_a_named_config_and_data_files_are_read_offline_in_each_format(
    hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's configs and data_files= (csv) inside the repo, and a parquet repo in the Hub's layout, read
    from the snapshot as ``datasets`` reads the repo online; a partial download reads what it holds and names
    what it lacks. (``datasets`` reads one format per repo's configs, so the parquet is a repo of its own.)"""
    en, en_test = preference_records(6, 0) + preference_records(4, 10), preference_records(3, 20)
    fr, extra, table = preference_records(5, 30), preference_records(4, 40), preference_records(8, 60)
    files = {
        "README.md": CARD,
        "en/train-0.jsonl": jsonl(en[:6]),
        "en/train-1.jsonl": jsonl(en[6:]),
        "en/test.jsonl": jsonl(en_test),
        "fr/part-0.jsonl": jsonl(fr),
        "extra/rows.csv": csv(extra),
    }
    sha = hub.commit("dataset", "org/multi", files)
    tables = hub.commit("dataset", "org/tables", {"data/train-00000-of-00001.parquet": parquet(table)})
    hf_download(hub, "org/multi", tmp_path / "hub")
    hf_download(hub, "org/tables", tmp_path / "hub")
    # `hf download --include "en/*" --include README.md` into a cache of its own: a partial snapshot.
    hf_download(hub, "org/multi", tmp_path / "hub-en", include=["en/*", "README.md"])
    offline(hub, monkeypatch)
    assert read("hf://datasets/org/tables") == (tables, table)
    assert read("hf://datasets/org/multi?config=en") == (sha, en)
    assert read("hf://datasets/org/multi?config=en&split=test") == (sha, en_test)
    assert read("hf://datasets/org/multi?config=fr") == (sha, fr)
    assert read("hf://datasets/org/multi?data_files=extra/rows.csv") == (sha, extra)
    where = f"{KEY}: hf://datasets/org/multi"
    assert refused("hf://datasets/org/multi") == (
        f"{where}?split=train&revision=main: the dataset has several configs (en, fr): name one with config=..."
    )
    assert refused("hf://datasets/org/multi?config=de") == (
        f"{where}?config=de&split=train&revision=main: BuilderConfig 'de' not found. Available: ['en', 'fr']"
    )
    assert refused("hf://datasets/org/multi?config=fr&split=test") == (
        f"{where}?config=fr&split=test&revision=main: no split test (its splits: train)"
    )
    assert refused("hf://datasets/org/multi?data_files=extra/*.tsv") == (
        f"{where}?data_files=extra/*.tsv&split=train&revision=main: no file of the dataset at {sha[:12]} matches "
        "data_files=extra/*.tsv"
    )

    # The partial snapshot: config en reads; fr names the file it lacks.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-en"))
    assert read("hf://datasets/org/multi?config=en") == (sha, en)
    assert refused("hf://datasets/org/multi?config=fr") == (
        f"{where}?config=fr&split=train&revision=main: the cached snapshot {sha[:12]} of revision main lacks files "
        "(fr/part-0.jsonl) and HF_HUB_OFFLINE is set: `hf download --repo-type dataset org/multi` completes it "
        "where the Hub can be reached"
    )


def test_not_in_the_cache_no_such_dataset_and_no_network_are_three_lines(
    hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: offline, a dataset downloaded with hf download and one that exists nowhere had the same line; the
    unreachable Hub's line said a dataset loaded before is read offline, whether or not the cache held it."""
    hub.commit("dataset", "org/feedback", {"data/train.jsonl": jsonl(preference_records(6, 0))})
    hf_download(hub, "org/feedback", tmp_path / "hub")
    cache, where = tmp_path / "hub", f"{KEY}: hf://datasets/org"

    offline(hub, monkeypatch)
    assert refused("hf://datasets/org/nowhere") == (
        f"{where}/nowhere?split=train&revision=main: not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
        "set: fill it with `hf download --repo-type dataset org/nowhere` where the Hub can be reached"
    )
    assert refused("hf://datasets/org/feedback?revision=v2") == (
        f"{where}/feedback?split=train&revision=v2: revision v2 is not in the Hugging Face cache ({cache} holds "
        "main) and HF_HUB_OFFLINE is set: fill it with `hf download --repo-type dataset org/feedback --revision "
        "v2` where the Hub can be reached"
    )

    monkeypatch.delenv("HF_HUB_OFFLINE")  # online, with a token: the Hub answers 404 for a missing dataset
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    assert refused("hf://datasets/org/nowhere") == (
        f"{where}/nowhere?split=train&revision=main: no such dataset on the Hub ({hub.url}), or your token cannot "
        "read it"
    )

    with StandInHub() as gone:  # a loopback port that no longer answers: the Hub cannot be reached
        pass
    monkeypatch.setattr(constants, "ENDPOINT", gone.url)
    assert refused("hf://datasets/org/feedback") == (
        f"{where}/feedback?split=train&revision=main: the Hub ({gone.url}) cannot be reached (ConnectError); the "
        "Hugging Face cache holds it: set HF_HUB_OFFLINE=1 to read it from there"
    )
    assert refused("hf://datasets/org/nowhere") == (
        f"{where}/nowhere?split=train&revision=main: the Hub ({gone.url}) cannot be reached (ConnectError) and the "
        "Hugging Face cache holds no copy of it: fill the cache with `hf download --repo-type dataset org/nowhere` "
        "where the Hub can be reached, then set HF_HUB_OFFLINE=1"
    )
