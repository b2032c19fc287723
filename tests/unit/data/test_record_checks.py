"""Input that used to crash or mislead: lone surrogates, ClassLabel labels, a broken one-document .json, "" tools;
and config values that used to be refused or ignored (numeric names, negative seed, empty sections)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.data.files import load_records
from coati_kto.data.formats import RecordError
from coati_kto.errors import ConfigError, DataError
from coati_kto.runtime.preflight import _data_problems

ROWS = [{"prompt": f"q{i}", "completion": f"a{i}", "label": i % 2 == 0} for i in range(6)]


def test_lone_surrogate_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "a", "completion": "b", "label": true}\n'
        '{"prompt": "x \\ud800", "completion": "b", "label": false}\n'
    )
    with pytest.raises(RecordError, match=r"d.jsonl:2: field 'prompt': not valid Unicode"):
        load_records([str(path)])
    assert [b.reason for b in load_records([str(path)], on_bad_record="skip").skipped] == ["bad_text"]


def test_class_label_maps_by_name(tmp_path: Path) -> None:
    rows = [{**r, "label": "good" if r["label"] else "bad"} for r in ROWS]
    features = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "completion": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["good", "bad"]),
        }
    )
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    got = [r.label for r in load_records([str(tmp_path / "ds")]).records]
    assert got == [r["label"] for r in ROWS]
    # -1 is how datasets stores a missing ClassLabel: a missing label, never the last class. It was named "got -1",
    # then "null": neither says the dataset has no label there, nor what becomes of the row.
    empty = {"completion": None, "chosen": None, "rejected": None}
    gap = [
        {**empty, **ROWS[0], "label": -1},
        {**empty, **ROWS[1], "label": "bad"},
        {**empty, "prompt": "p", "chosen": "c", "rejected": "r", "label": -1},
    ]
    datasets.Dataset.from_list(
        gap,
        features=datasets.Features(
            {**features, "chosen": datasets.Value("string"), "rejected": datasets.Value("string")}
        ),
    ).save_to_disk(str(tmp_path / "gap"))
    with pytest.raises(RecordError) as err:
        load_records([str(tmp_path / "gap")])
    assert str(err.value) == (
        f"{tmp_path / 'gap'}:row 1: field 'label': -1, a ClassLabel's 'no label': the dataset has no label for "
        "this row (data.on_bad_record: skip skips such rows and counts them as missing_label; error stops at the "
        "first); label it, or filter them out"
    )
    skipped = load_records([str(tmp_path / "gap")], on_bad_record="skip")
    assert [(b.source, b.reason) for b in skipped.skipped] == [(f"{tmp_path / 'gap'}:row 1", "missing_label")]
    # Row 2 kept with its class's label, row 3's pair reads no label: both of its records kept.
    assert [(r.completion, r.label) for r in skipped.records] == [("a1", False), ("c", True), ("r", False)]
    features["label"] = datasets.ClassLabel(names=["x", "y"])
    datasets.Dataset.from_list([{**r, "label": 0} for r in ROWS], features=features).save_to_disk(
        str(tmp_path / "xy")
    )
    with pytest.raises(DataError, match="cannot tell which class is desirable"):
        load_records([str(tmp_path / "xy")])


def test_a_hub_id_given_as_a_path_gets_the_hub_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's --dataset_name org/name written in data.train_files was only "no such file or directory": a Hub
    dataset is read as hf://datasets/org/name, which the line now says (prepare's reading and the preflight's)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    hint = (
        "; a Hub dataset is read only as hf://datasets/trl-lib/kto-mix-14k (add ?config=C&split=S to choose)"
    )
    line = f"data.train_files: trl-lib/kto-mix-14k: no such file or directory (read from {tmp_path}){hint}"
    with pytest.raises(DataError) as err:
        load_records(["trl-lib/kto-mix-14k"])
    assert str(err.value) == line
    config = load_config(write_config(tmp_path, MINIMAL), ["data.train_files=[trl-lib/kto-mix-14k]"])
    assert _data_problems(config.data, ask_hub=False) == [line]
    # A path's shape gets no hint: a data file's suffix, a local first folder, more than one "/", no "/".
    for name in ("org/train.jsonl", "data/train", "a/b/c", "train"):
        with pytest.raises(DataError) as err:
            load_records([name])
        assert str(err.value) == f"data.train_files: {name}: no such file or directory (read from {tmp_path})"


def test_broken_pretty_json_names_its_line(tmp_path: Path) -> None:
    lines = json.dumps(ROWS, indent=2).splitlines()
    lines[4] = lines[4].replace('"label"', "label")
    (tmp_path / "d.json").write_text("\n".join(lines))
    for mode in ("error", "skip"):  # skip used to drop the whole file, one "bad record" per line
        with pytest.raises(DataError, match=r"d.json:5: malformed JSON"):
            load_records([str(tmp_path / "d.json")], on_bad_record=mode)


def test_a_field_given_twice_is_a_bad_record(tmp_path: Path) -> None:
    """JSON keeps a repeated key's last value: a label given false then true trained as desirable, in silence. A
    field's name inside a text (``"the \\"label\\" is"``) is no repeat."""
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "a", "completion": "c", "label": false, "label": true}\n'
        + json.dumps({"prompt": 'the "label" is', "completion": "c", "label": True})
        + "\n"
    )
    with pytest.raises(RecordError, match=f"^{path}:1: field 'label': given twice$"):
        load_records([str(path)])
    kept = load_records([str(path)], on_bad_record="skip")
    assert [r.prompt for r in kept.records] == ['the "label" is']
    assert [(str(b), b.reason) for b in kept.skipped] == [
        (f"{path}:1: field 'label': given twice", "malformed_json")
    ]


def test_a_file_without_records_is_one_line(tmp_path: Path) -> None:
    """An empty file read as 0 desirable and 0 undesirable examples ("add desirable examples (label true)")."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=f"^data.eval_files: no records in {empty} \\(empty\\)$"):
        load_records([str(empty)], key="data.eval_files")


def test_empty_tools_string_is_no_tools(tmp_path: Path) -> None:
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "label": True,
    }
    (tmp_path / "d.jsonl").write_text(json.dumps({**row, "tools": ""}) + "\n")
    assert load_records([str(tmp_path / "d.jsonl")]).records[0].tools is None


def test_config_values(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL + "train:\nkto:\n")
    config = load_config(path, ["output.dir=20261125", "logging.wandb_project=2024"])
    assert config.output.dir == "20261125" and config.logging.wandb_project == "2024"
    assert config.train.seed == 42
    with pytest.raises(ConfigError, match="train.seed"):
        load_config(path, ["train.seed=-1"])
    with pytest.raises(ConfigError, match="eval_fraction 0.1 with data.eval_files"):
        load_config(path, ["data.eval_files=[e.jsonl]", "data.eval_fraction=0.1"])


def test_prepared_dir_that_is_a_file_is_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A data.prepared_dir that names a file was a NotADirectoryError traceback from the store."""
    from helpers import data_settings
    from test_prepare import make_config, rows

    from coati_kto.data.files import write_jsonl
    from coati_kto.data.prepared import prepare

    path = write_jsonl(rows(4, 2), tmp_path / "t.jsonl")
    (tmp_path / "prepared").write_text("not a directory")
    with pytest.raises(DataError) as info:
        prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(path)])))
    assert str(info.value) == f"data.prepared_dir {tmp_path / 'prepared'}: is a file, not a directory"


def test_malformed_json_names_the_line_and_its_column(tmp_path: Path) -> None:
    """A line ending in a trailing comma said "at column 1": the newline kept in the parsed line put the error on
    a second line of it."""
    good = json.dumps(ROWS[0])
    bad = json.dumps(ROWS[1])[:-1] + ","
    for end in ("\n", "\r\n"):
        path = tmp_path / "d.jsonl"
        path.write_text(end.join([good, good, good, bad, good]) + end, newline="")
        with pytest.raises(RecordError) as info:
            load_records([str(path)])
        assert str(info.value) == (
            f"{path}:4: malformed JSON (Expecting property name enclosed in double quotes at column {len(bad) + 1})"
        )


def test_a_pretty_printed_json_file_with_a_bad_byte_is_one_line_at_its_line(tmp_path: Path) -> None:
    """From an audit: a .json array (indent=2) with one invalid UTF-8 byte was read as JSON lines: "d.json:1:
    malformed JSON (Expecting value...)", and with on_bad_record: skip each of its 42 lines counted a bad record
    (8 records)."""
    path = tmp_path / "d.json"
    text = json.dumps(ROWS, indent=2).encode()
    broken = text.replace(
        b'"a3"', b'"a\xff3"'
    )  # line 19: the 4th record's completion (5 lines each, after "[")
    path.write_bytes(b"\xef\xbb\xbf" + broken)  # behind a byte-order mark: lines and bytes still count right
    line = broken[: broken.index(b"\xff")].count(b"\n") + 1
    column = broken.index(b"\xff") - broken.rfind(b"\n", 0, broken.index(b"\xff"))
    for on_bad_record in ("error", "skip"):
        with pytest.raises(DataError) as info:
            load_records([str(path)], on_bad_record=on_bad_record)
        assert str(info.value) == (
            f"{path}:{line}: not UTF-8 text (byte {column}); the file is one JSON document, so none of it can be "
            "read until this is fixed"
        )
    assert line == 19


def test_json_lines_under_a_json_name_with_a_broken_first_line_skip_that_line(tmp_path: Path) -> None:
    """From an audit: a first line ending in a trailing comma made the file "one JSON document" (refused whole,
    at line 2), where a broken line 4 is skipped and counted, as under a .jsonl name."""
    path = tmp_path / "d.json"
    lines = [json.dumps(r) for r in ROWS]
    path.write_text("\n".join([lines[0][:-1] + ",", *lines[1:]]) + "\n")
    read = load_records([str(path)], on_bad_record="skip")
    assert len(read.records) == 5 and [str(e).split(": ")[0] for e in read.skipped] == [f"{path}:1"]
    with pytest.raises(RecordError, match=rf"^{path}:1: malformed JSON"):
        load_records([str(path)])


def test_a_wrapped_json_file_with_one_record_a_line_is_one_document(tmp_path: Path) -> None:
    """From the review of the rule above: {"data": [ with a record a line: the last record parses alone, and a
    syntax error elsewhere read the file as JSON lines, one record of three trained under skip."""
    path = tmp_path / "d.json"
    lines = [json.dumps(r) for r in ROWS[:3]]
    path.write_text(
        '{"data": [\n' + lines[0].replace(", ", " ", 1) + ",\n" + ",\n".join(lines[1:]) + "\n]}\n"
    )
    with pytest.raises(DataError, match=rf"^{path}:2: malformed JSON .*; the file is one JSON document"):
        load_records([str(path)], on_bad_record="skip")


def test_a_control_character_is_named_once(tmp_path: Path) -> None:
    """ "Invalid control character at at column 34": Python's message ends in its own "at"."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a\x00b", "completion": "c", "label": true}\n')
    with pytest.raises(RecordError) as info:
        load_records([str(path)])
    assert str(info.value) == f"{path}:1: malformed JSON (Invalid control character at column 14)"


def test_array_and_table_rows_count_from_1(tmp_path: Path) -> None:
    """Rows were 0-based ("row 7" for the 8th record) where JSON lines' line numbers count from 1."""
    (tmp_path / "a.json").write_text(json.dumps([*ROWS, ROWS[0], {**ROWS[1], "label": "maybe"}]))
    with pytest.raises(RecordError) as info:
        load_records([str(tmp_path / "a.json")])
    assert str(info.value) == (
        f"{tmp_path / 'a.json'}:row 8: field 'label': expected true/false or 0/1 (1.0/0.0), got \"maybe\""
    )
    datasets.Dataset.from_list([*ROWS, ROWS[0], {**ROWS[1], "completion": None}]).save_to_disk(
        str(tmp_path / "ds")
    )
    with pytest.raises(RecordError) as info:
        load_records([str(tmp_path / "ds")])
    assert str(info.value) == f"{tmp_path / 'ds'}:row 8: field 'completion': null (the record has a prompt)"


def test_a_split_short_of_a_label_after_skips_names_them() -> None:
    """Every record skipped for one reason (a template failing on each) ended in "(48 bad records skipped) ...
    add desirable examples (label true)", pointing away from the cause."""
    from coati_kto.data.splits import require_both_labels

    skipped = [
        RecordError(f"c.jsonl:{i}", "messages", "the chat template failed: boom", "chat_template")
        for i in (1, 2)
    ]
    skipped.append(RecordError("c.jsonl:3", "label", "missing (expected true/false or 0/1)", "missing_label"))
    head = (
        "the train split (c.jsonl): 0 desirable and 0 undesirable usable examples: KTO needs both labels, since it "
        "pushes desirable completions above the reference point and undesirable ones below it; "
    )
    with pytest.raises(DataError) as info:
        require_both_labels({"desirable": 0, "undesirable": 0}, ["c.jsonl"], "the train split", skipped)
    assert str(info.value) == head + (
        "3 bad records were skipped, 2 of them for chat_template (e.g. c.jsonl:1: field 'messages': the chat "
        "template failed: boom): fix them, or add desirable examples (label true)"
    )
    with pytest.raises(DataError) as info:
        require_both_labels({"desirable": 0, "undesirable": 0}, ["c.jsonl"], "the train split", 3)
    assert (
        str(info.value)
        == head + "3 bad records were skipped: fix them, or add desirable examples (label true)"
    )
    with pytest.raises(DataError) as info:
        require_both_labels({"desirable": 0, "undesirable": 0}, ["c.jsonl"], "the train split", [])
    assert str(info.value) == head + "add desirable examples (label true)"
