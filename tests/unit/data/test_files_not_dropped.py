"""What a data directory or file holds is read, or refused in one line, or counted: never left out in silence.
Each case was left out without a word before (an audit of what prepare drops)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coati_kto.data.files import load_records
from coati_kto.data.summary import unread_line
from coati_kto.errors import DataError

ROW = {"prompt": "2 + 2?", "completion": "4", "label": True}


def lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ndjson_and_jsonlines_files_in_a_directory_are_read(tmp_path: Path) -> None:
    lines(tmp_path / "a.jsonl", [ROW] * 2)
    lines(tmp_path / "b.ndjson", [ROW] * 2)
    lines(tmp_path / "c.jsonlines", [ROW])
    sources = [r.source for r in load_records([str(tmp_path)]).records]
    assert sources == [f"{tmp_path}/a.jsonl:1", f"{tmp_path}/a.jsonl:2", f"{tmp_path}/b.ndjson:1"] + [
        f"{tmp_path}/b.ndjson:2",
        f"{tmp_path}/c.jsonlines:1",
    ]
    assert len(load_records([str(tmp_path / "b.ndjson")]).records) == 2  # named on its own too


def test_a_hidden_data_file_is_one_line_and_a_hidden_folder_is_skipped(tmp_path: Path) -> None:
    lines(tmp_path / "a.jsonl", [ROW] * 2)
    (tmp_path / ".cache").mkdir()
    lines(tmp_path / ".cache" / "old.jsonl", [ROW])  # a tool's folder: not the user's data
    assert len(load_records([str(tmp_path)]).records) == 2
    lines(tmp_path / "._a.jsonl", [ROW])  # macOS's AppleDouble copy, or a data file hidden by its name
    with pytest.raises(DataError) as err:
        load_records([str(tmp_path)])
    assert str(err.value) == (
        f"{tmp_path}/._a.jsonl: a hidden data file (its name starts with '.'): coati-kto reads none; name it in "
        f"the config's data files, or rename or remove it from {tmp_path}"
    )


def test_records_beside_data_in_a_json_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"version": 2, "data": [ROW, ROW]}))  # metadata beside data: fine
    assert len(load_records([str(path)]).records) == 2
    path.write_text(json.dumps({"data": [ROW, ROW], "extra": [ROW]}))
    with pytest.raises(DataError) as err:
        load_records([str(path)])
    assert str(err.value) == (
        f"{path}: records under 'extra' beside 'data': a .json file's records are its array, or the list under "
        "'data' alone; move them into 'data' or into a file of their own"
    )


def test_content_part_keys_left_out_are_counted(tmp_path: Path) -> None:
    part = {"type": "text", "text": "2 + 2?", "cache_control": {"type": "ephemeral"}, "image": None}
    row = {
        "prompt": [{"role": "user", "content": [part]}],
        "completion": [{"role": "assistant", "content": "4"}],
        "label": True,
    }
    result = load_records([str(lines(tmp_path / "a.jsonl", [row, ROW]))], images=True)
    assert result.records[0].prompt == [{"role": "user", "content": [{"type": "text", "text": "2 + 2?"}]}]
    assert result.unread_fields == {"prompt[].content[].cache_control": 1}  # the null "image" is no data


def test_the_summary_says_how_many_unread_fields_it_did_not_name() -> None:
    line = unread_line({f"f{i}": 1 for i in range(11)})
    assert "f7 (1 records), and 3 more (stats.json's unread_fields lists them all); only prompt" in line
    assert "f8" not in line


def test_a_label_given_twice_in_a_json_array_is_refused(tmp_path: Path) -> None:
    """A .json array (or its ``data`` list) kept the last of two ``label`` keys in silence, false then true
    trained as true; JSON lines refused it already."""
    record = '{"prompt": "p", "completion": "c", "label": false, "label": true}'
    good = '{"prompt": "q", "completion": "c", "label": false}'
    for name, text in (("a.json", f"[{good},\n{record}]"), ("d.json", f'{{"data": [{good}, {record}]}}')):
        (tmp_path / name).write_text(text)
        result = load_records([str(tmp_path / name)], on_bad_record="skip")
        assert [r.prompt for r in result.records] == ["q"]
        assert [str(bad) for bad in result.skipped] == [
            f"{tmp_path / name}:row 2: field 'label': given twice"
        ]


def test_a_json_lines_file_named_json_may_hold_u2028(tmp_path: Path) -> None:
    """Its first line with a raw U+2028 in a string (json.dumps(..., ensure_ascii=False) writes one) was cut there
    by str.splitlines, so the file was judged one broken document and refused whole."""
    rows = [
        {"prompt": "a\u2028b", "completion": "c", "label": True},
        {"prompt": "q", "completion": "c", "label": False},
    ]
    path = tmp_path / "lines.json"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert [r.prompt for r in load_records([str(path)]).records] == ["a\u2028b", "q"]


@pytest.mark.parametrize(
    ("files", "said"),
    [
        (
            ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"],
            "train: data/train-00000-of-00001.parquet; test: data/test-00000-of-00001.parquet",
        ),
        (["train.jsonl", "eval.jsonl"], "train: train.jsonl; test: eval.jsonl"),
    ],
)
def test_a_directory_of_a_datasets_splits_is_refused(tmp_path: Path, files: list[str], said: str) -> None:
    """The folder ``hf download --local-dir`` writes (data/train-*.parquet beside data/test-*.parquet), or
    train.jsonl beside eval.jsonl, was read whole: the held-out split trained on, where TRL's load_dataset(dir)
    trains on train alone. A folder of files named for no split is read whole, as before."""
    import datasets

    rows = [{"prompt": f"p{i}", "completion": "c", "label": i % 2 == 0} for i in range(4)]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / name))
        else:
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as info:
        load_records([str(tmp_path)], cache_dir=str(tmp_path / ".cache"))
    assert str(info.value).startswith(
        f"data.train_files: {tmp_path}: the directory holds a dataset's splits ({said})"
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("part-a.jsonl", "part-b.jsonl"):
        (plain / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_records([str(plain)]).records) == 8
