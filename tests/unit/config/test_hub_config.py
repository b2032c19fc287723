"""The Hub in the config: ``hf://datasets/...`` entries of data.*_files and ``output.push_to_hub``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.hub import HubDataset, parse_hub_dataset
from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "key", "expected"),
    [
        (
            "hf://datasets/trl-lib/kto-mix-14k",
            "data.train_files",
            HubDataset("trl-lib/kto-mix-14k", None, "train", "main"),
        ),
        (
            "hf://datasets/trl-lib/kto-mix-14k",
            "data.eval_files",
            HubDataset("trl-lib/kto-mix-14k", None, "test", "main"),
        ),
        (
            "hf://datasets/o/n?config=en&split=train[:10%]+validation&revision=v1.0",
            "data.train_files",
            HubDataset("o/n", "en", "train[:10%]+validation", "v1.0"),
        ),
        (  # data_files' files are datasets' split "train", in eval files too
            "hf://datasets/o/n?data_files=en/*.parquet",
            "data.eval_files",
            HubDataset("o/n", None, "train", "main", "en/*.parquet"),
        ),
    ],
)
def test_a_hub_dataset_reads_as_load_dataset_arguments(value: str, key: str, expected: HubDataset) -> None:
    spec = parse_hub_dataset(value, key)
    assert spec == expected
    assert parse_hub_dataset(spec.source, key) == spec  # the written-back form reads the same
    assert spec.split_names == [part.split("[")[0] for part in expected.split.split("+")]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "hf://datasets/kto-mix-14k",
            "expected hf://datasets/OWNER/NAME, then ?config=...&data_files=...&split=...&revision=...",
        ),
        (
            "hf://datasets/o/n?name=en",
            "'name=en' is not one of config=..., data_files=..., split=..., revision=... (the config is config=, "
            "as TRL's --dataset_config)",
        ),
        (
            "hf://datasets/o/n?split=train&split=test",
            "'split=test' is not one of config=..., data_files=..., split=..., revision=...",
        ),
        (
            "hf://datasets/o/n?split=train[:5",
            "split 'train[:5' is no split expression (e.g. train, train[:1000], train+test)",
        ),
    ],
)
def test_a_malformed_hub_dataset_is_one_line_at_config_load(tmp_path: Path, value: str, message: str) -> None:
    path = write_config(tmp_path, MINIMAL.replace("train_files: data.jsonl", f"train_files: ['{value}']"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:4: data.train_files: {message} (got ['{value}'])"


def test_push_to_hub_takes_a_repo_id_or_a_section(tmp_path: Path) -> None:
    short = load_config(write_config(tmp_path, MINIMAL + "  push_to_hub: me/kto-model\n"))
    assert short.output.push_to_hub.model_dump() == {
        "repo_id": "me/kto-model",
        "private": True,
        "revision": "main",
        "checkpoints": False,
    }
    # No token key (it comes from HF_TOKEN or the token file): config.yaml cannot hold one.
    full = load_config(
        write_config(
            tmp_path,
            MINIMAL + "  push_to_hub: {repo_id: me/m, private: false, revision: dev, checkpoints: true}\n",
        )
    )
    assert full.output.push_to_hub.model_dump() == {
        "repo_id": "me/m",
        "private": False,
        "revision": "dev",
        "checkpoints": True,
    }
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, MINIMAL + "  push_to_hub: kto-model\n"))
    assert "output.push_to_hub.repo_id: 'kto-model' is no Hub repo id (OWNER/NAME)" in str(err.value)


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_names_the_variable_that_is_set(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With only TRANSFORMERS_OFFLINE=1 (huggingface_hub reads it too) the line said "HF_HUB_OFFLINE is set"."""
    from huggingface_hub import constants

    from coati_kto.config.hub import hub_offline, hub_problems, offline_variable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import: the environment below decides
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert offline_variable() is None and not hub_offline()
    monkeypatch.setenv(variable, "1")
    assert offline_variable() == variable and hub_offline()
    assert hub_problems("model.path", "org/not-cached-here") == [
        f"model.path: org/not-cached-here is not a local directory and not in the hub cache, and {variable} is set"
    ]
    # huggingface_hub reads TRANSFORMERS_OFFLINE only when HF_HUB_OFFLINE is unset or empty: HF_HUB_OFFLINE=0 wins.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert offline_variable() is None


def test_a_token_on_the_command_line_is_never_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an audit: TRL's ``--hub_token X`` and an ``output.hub_token=X`` override were refused with lines that
    printed X, into job logs. The value of a token-named flag or key, anything shaped like a Hub token and the
    token huggingface_hub holds are ``***`` in every error line."""
    from coati_kto.cli import main
    from coati_kto.errors import without_secrets

    held = "hf_" + "Q" * 34
    monkeypatch.setenv("HF_TOKEN", held)
    path = write_config(tmp_path, MINIMAL)
    for argv in (
        ["train", str(path), "--hub_token", "hf_Secret123"],
        ["config", str(path), "output.hub_token=hf_Secret123"],
        ["config", str(path), f"output.mirror={held}"],
    ):
        with pytest.raises(SystemExit) if argv[0] == "train" else contextlib.nullcontext():
            main(argv)
        err = capsys.readouterr().err
        assert "error:" in err and "Secret123" not in err and held not in err, err
    assert "--hub_token ***" in without_secrets("flags: --hub_token hf_Secret123 has no equivalent")
    assert without_secrets("output.hub_token=abc: unknown key") == "output.hub_token=***: unknown key"
    kept = "hub_token: unknown key; pad_token <pad>; hf_download; the token is never printed"
    assert without_secrets(kept) == kept  # names and words, no value
