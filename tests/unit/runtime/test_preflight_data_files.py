"""`coati-kto prepare` names every missing data file, not only the first of each list."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_config

from coati_kto.cli import main


def test_each_missing_data_file_is_named(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.jsonl").write_text("")
    config = write_config(
        tmp_path,
        f"model:\n  path: {tiny_model_dir}\ndata:\n  train_files: [nope1.jsonl, here.jsonl, nope2.jsonl]\n"
        f"  eval_files: [{tmp_path / 'nope3.jsonl'}, nope4.jsonl]\n  prepared_dir: prepared\n",
    )
    assert main(["prepare", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: data.train_files: nope1.jsonl: no such file or directory (read from {Path.cwd()})",
        f"data.train_files: nope2.jsonl: no such file or directory (read from {Path.cwd()})",
        f"data.eval_files: {tmp_path / 'nope3.jsonl'}: no such file or directory",
        f"data.eval_files: nope4.jsonl: no such file or directory (read from {Path.cwd()})",
    ]
    assert not (tmp_path / "prepared").exists()
