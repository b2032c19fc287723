"""A key given twice at any depth of a JSON record is a bad record naming the key's path (``prompt[0].content``).

Before: only a top-level field given twice was refused; ``{"prompt": [{"role": "user", "content": "a",
"content": "b"}], ...}`` trained on "b" and dropped "a" in silence (JSON keeps the last of a repeated key), in JSON
lines and .json arrays alike, and a .json wrapper's second ``"data"`` list replaced its first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coati_kto.data.files import load_records
from coati_kto.data.formats import RecordError
from coati_kto.errors import DataError

NESTED = (
    '{"prompt": [{"role": "user", "content": "a", "content": "b"}], '
    '"completion": [{"role": "assistant", "content": "c"}], "label": true}'
)
DEEPER = (
    '{"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", '
    '"text": "c"}]}], "completion": "d", "label": false}'
)
GOOD = {  # the same key in several objects, and a key's quoted name inside a text: no repeat
    "prompt": [{"role": "system", "content": 'say "content"'}, {"role": "user", "content": "q"}],
    "completion": [{"role": "assistant", "content": "a"}],
    "label": False,
}


def test_a_nested_key_given_twice_in_json_lines_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(f"{NESTED}\n{json.dumps(GOOD)}\n{DEEPER}\n")
    with pytest.raises(RecordError, match=f"^{path}:1: field 'prompt\\[0\\].content': given twice$"):
        load_records([str(path)])
    kept = load_records([str(path)], on_bad_record="skip")
    assert [r.prompt for r in kept.records] == [GOOD["prompt"]]
    assert [(str(b), b.reason) for b in kept.skipped] == [
        (f"{path}:1: field 'prompt[0].content': given twice", "malformed_json"),
        (f"{path}:3: field 'prompt[0].content[1].text': given twice", "malformed_json"),
    ]


def test_a_nested_key_given_twice_in_a_json_array_is_a_bad_record(tmp_path: Path) -> None:
    for name, text in (("a.json", f"[{json.dumps(GOOD)},\n{NESTED}]"), ("d.json", f'{{"data": [{NESTED}]}}')):
        (tmp_path / name).write_text(text)
        kept = load_records([str(tmp_path / name)], on_bad_record="skip")
        row = 2 if name == "a.json" else 1
        assert [str(b) for b in kept.skipped] == [
            f"{tmp_path / name}:row {row}: field 'prompt[0].content': given twice"
        ]
        assert [r.prompt for r in kept.records] == ([GOOD["prompt"]] if name == "a.json" else [])
    (tmp_path / "one.json").write_text(DEEPER)  # one record, no array
    with pytest.raises(
        RecordError, match=r"one.json:row 1: field 'prompt\[0\].content\[1\].text': given twice"
    ):
        load_records([str(tmp_path / "one.json")])


def test_a_json_wrapper_giving_data_twice_is_refused(tmp_path: Path) -> None:
    """The first list under ``data`` was never read: its records left out without a word."""
    path = tmp_path / "d.json"
    path.write_text(f'{{"data": [{json.dumps(GOOD)}], "data": [{json.dumps(GOOD)}]}}')
    with pytest.raises(DataError, match=f"^{path}: key 'data' given twice in the object around the records"):
        load_records([str(path)], on_bad_record="skip")


def test_a_line_broken_after_a_key_given_twice_is_malformed(tmp_path: Path) -> None:
    """The parse stops at the repeated key's object; the line's later syntax error is still what it reports."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": [{"content": "a", "content": "b"}], "label": }\n' + json.dumps(GOOD) + "\n")
    kept = load_records([str(path)], on_bad_record="skip")
    assert [str(b) for b in kept.skipped] == [f"{path}:1: malformed JSON (Expecting value at column 57)"]
    assert len(kept.records) == 1
