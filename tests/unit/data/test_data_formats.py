"""Record formats: every accepted shape normalises the same way; every bad record names file:line and field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from coati_kto.data.files import load_records
from coati_kto.data.formats import RecordError, normalize
from coati_kto.errors import DataError

SYSTEM = {"role": "system", "content": "You can call tools."}
USER = {"role": "user", "content": "Weather in Berlin?"}
ASSISTANT = {"role": "assistant", "content": "Calling search(weather Berlin)."}
CONVERSATION = [SYSTEM, USER, ASSISTANT]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversation_shapes(label: bool = True) -> dict[str, dict]:
    """The same conversation in every message-based shape the loader accepts."""
    sharegpt = [{"from": "system", "value": SYSTEM["content"]}, {"from": "human", "value": USER["content"]}]
    return {
        "messages": {"messages": CONVERSATION, "label": label},
        "conversations": {"conversations": CONVERSATION, "label": label},
        "sharegpt": {
            "conversations": [*sharegpt, {"from": "gpt", "value": ASSISTANT["content"]}],
            "label": label,
        },
        "prompt_completion_lists": {"prompt": [SYSTEM, USER], "completion": [ASSISTANT], "label": label},
        "colossalchat": {
            "prompt": [
                {"from": "system", "content": SYSTEM["content"]},
                {"from": "user", "content": USER["content"]},
            ],
            "completion": {"from": "assistant", "content": ASSISTANT["content"]},
            "label": int(label),
        },
    }


@pytest.mark.parametrize("shape", list(conversation_shapes()))
def test_message_shapes_normalise_identically(shape: str) -> None:
    (record,) = normalize(conversation_shapes()[shape], "f.jsonl:1")
    assert record.chat and record.label is True and record.source == "f.jsonl:1"
    assert record.prompt == [SYSTEM, USER]
    assert record.completion == [ASSISTANT]


def test_plain_and_pair_shapes() -> None:
    (plain,) = normalize({"prompt": "2+3=", "completion": " 5", "label": 0}, "f.jsonl:3")
    assert (plain.prompt, plain.completion, plain.label, plain.chat) == ("2+3=", " 5", False, False)
    chosen, rejected = normalize({"prompt": "2+3=", "chosen": " 5", "rejected": " 6"}, "f.jsonl:4")
    assert (chosen.completion, chosen.label, rejected.completion, rejected.label) == (" 5", True, " 6", False)
    # Without a prompt key, chosen/rejected are whole conversations sharing their prompt turns.
    bad_reply = {"role": "assistant", "content": "No idea."}
    c, r = normalize({"chosen": CONVERSATION, "rejected": [SYSTEM, USER, bad_reply]}, "f.jsonl:5")
    assert c.prompt == r.prompt == [SYSTEM, USER] and r.completion == [bad_reply] and c.label and not r.label
    # Tool calls without text are a valid assistant turn; extra keys reach the template.
    call = {"role": "assistant", "content": None, "tool_calls": [{"name": "search"}]}
    (tool,) = normalize({"messages": [USER, call], "label": True}, "f.jsonl:6")
    assert tool.completion == [{"role": "assistant", "content": "", "tool_calls": [{"name": "search"}]}]


BAD = [
    ('{"prompt": "a", "completion": "b", "label": tru}', "malformed JSON", "malformed_json"),
    ({"prompt": "a", "completion": "b"}, "field 'label': missing", "missing_label"),
    (
        {"prompt": "a", "completion": "b", "label": "yes"},
        "field 'label': expected true/false or 0/1",
        "bad_label",
    ),
    ({"prompt": "a", "completion": "b", "label": 2}, "field 'label'", "bad_label"),
    (
        {"prompt": "a", "completion": "b", "label": 0.5},
        "field 'label': expected true/false or 0/1",
        "bad_label",
    ),
    (
        '{"prompt": "a", "completion": "b", "label": NaN}',
        "field 'label': expected true/false or 0/1",
        "bad_label",
    ),
    (
        {"messages": [SYSTEM, USER], "label": True},
        "field 'messages': needs a final assistant turn",
        "no_final_assistant",
    ),
    (
        {"prompt": "a", "completion": "  ", "label": True},
        "field 'completion': empty completion",
        "empty_completion",
    ),
    (
        {"messages": [USER, {"role": "assistant", "content": ""}], "label": 1},
        "field 'messages'",
        "empty_completion",
    ),
    (
        {"messages": [USER, {"role": "assistant", "content": 5}], "label": True},
        "field 'messages[1].content': expected a string",
        "non_string_content",
    ),
    # TRL's vision-language format (content parts) was "expected a string, got [{...": now it says what it is.
    (
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
            ],
            "completion": [ASSISTANT],
            "label": True,
        },
        "field 'prompt[0].content': a list of content parts (image, text: TRL's vision-language format), read "
        "only for a vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5): give the content as one string",
        "non_string_content",
    ),
    # Images beside string contents: a text-only model trained on the text alone.
    (
        {"prompt": [USER], "completion": [ASSISTANT], "label": True, "images": ["cat.png"]},
        "field 'images': images are read only for a vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5), "
        "and this one reads text alone; drop the field to train on the text",
        "images_unread",
    ),
    ({"text": "hello", "label": True}, "unknown record format (keys: label, text)", "unknown_format"),
    # A missing completion was "unknown record format (keys: label, prompt)", where a missing label is named.
    (
        {"prompt": "a", "label": True},
        "field 'completion': missing (the record has a prompt)",
        "unknown_format",
    ),
    (
        {"completion": "b", "label": True},
        "field 'prompt': missing (the record has a completion)",
        "unknown_format",
    ),
    ({"prompt": "a", "completion": [ASSISTANT], "label": True}, "field 'completion'", "mixed"),
    ({"messages": [{"content": "hi"}, ASSISTANT], "label": True}, "field 'messages[0]'", "bad_message"),
    # A user turn inside a completion was trained on as the model's own output.
    (
        {"prompt": [USER], "completion": [ASSISTANT, USER, ASSISTANT], "label": True},
        "field 'completion': completion[1] is a 'user' turn: a completion holds assistant turns only",
        "non_assistant_completion",
    ),
    # An empty prompt list was reported as the chat template failing on field 'messages'.
    ({"prompt": [], "completion": [ASSISTANT], "label": True}, "field 'prompt': no messages", "empty_prompt"),
    (
        {"messages": [USER, ASSISTANT], "tools": "[{", "label": True},
        "field 'tools': not valid JSON",
        "bad_tools",
    ),
    (
        {"messages": [USER, ASSISTANT], "tools": [1], "label": True},
        "field 'tools': expected a list",
        "bad_tools",
    ),
    (
        {"prompt": "a", "completion": "b", "tools": [{"name": "f"}], "label": True},
        "field 'tools': plain-text prompts are used as given",
        "bad_tools",
    ),
]


@pytest.mark.parametrize(("row", "expected", "reason"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_record_names_file_line_and_field(tmp_path: Path, row, expected: str, reason: str) -> None:
    good = {"prompt": "a", "completion": "b", "label": True}
    path = write_jsonl(tmp_path / "train.jsonl", [good, good, row])
    with pytest.raises(DataError) as info:
        load_records([str(path)])
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")
    assert expected in message and "\n" not in message
    assert isinstance(info.value, RecordError) and info.value.reason == reason


def test_skip_counts_every_bad_record(tmp_path: Path) -> None:
    rows = [row for row, _, _ in BAD] + [{"prompt": "a", "completion": "b", "label": True}] * 3
    result = load_records([str(write_jsonl(tmp_path / "t.jsonl", rows))], on_bad_record="skip")
    assert len(result.records) == 3
    assert sorted(b.reason for b in result.skipped) == sorted(reason for _, _, reason in BAD)
    assert [b.source for b in result.skipped] == [
        f"{tmp_path / 't.jsonl'}:{i}" for i in range(1, len(BAD) + 1)
    ]


def test_file_kinds_and_directories(tmp_path: Path) -> None:
    rows = [conversation_shapes()["messages"], {"prompt": "x", "completion": "y", "label": False}]
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", rows)
    (data / "b.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list([conversation_shapes()["sharegpt"]] * 2).to_parquet(str(data / "c.parquet"))
    (data / "notes.txt").write_text("ignored")
    result = load_records([str(data)], cache_dir=str(tmp_path / "cache"))
    assert [r.source for r in result.records] == [
        f"{data}/a.jsonl:1",
        f"{data}/a.jsonl:2",
        f"{data}/b.json:row 1",  # rows count from 1, as lines do (they were 0-based, so row 7 was the 8th)
        f"{data}/b.json:row 2",
        f"{data}/c.parquet:row 1",
        f"{data}/c.parquet:row 2",
    ]
    assert result.records[4].prompt == [SYSTEM, USER] and result.records[4].completion == [ASSISTANT]

    saved = tmp_path / "saved"
    plain = [{"prompt": "x", "completion": "y", "label": bool(i % 2)} for i in range(2)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(plain)}).save_to_disk(str(saved))
    assert len(load_records([str(saved)]).records) == 2
    assert len(load_records([str(saved / "train")]).records) == 2

    # Inside a directory: a saved dataset is one input (its state.json is not data); a coati-kto prepared
    # dir and hidden folders are skipped (a hidden data file is an error: test_files_not_dropped.py).
    datasets.Dataset.from_list(plain).save_to_disk(str(data / "sub" / "saved"))
    (data / "prepared").mkdir()
    (data / "prepared" / "fingerprint.json").write_text("{}")
    (data / "prepared" / "stats.json").write_text("{}")
    (data / ".git").mkdir()
    (data / ".git" / "hidden.jsonl").write_text("not json")
    sources = [r.source for r in load_records([str(data)], cache_dir=str(tmp_path / "cache")).records]
    assert len(sources) == 8 and sources[-1] == f"{data}/sub/saved:row 2"
    # Data it does not read is an error, never a silent skip (a directory of 90 examples gave 30).
    for name in ("d.csv", "e.JSONL", "f.jsonl.gz"):
        (data / "sub" / name).write_text("x")
        with pytest.raises(DataError, match=rf"^{data}/sub/{name}: a data file this directory holds that"):
            load_records([str(data)], cache_dir=str(tmp_path / "cache"))
        (data / "sub" / name).unlink()

    with pytest.raises(DataError, match=r"data.train_files: .*missing.jsonl: no such file"):
        load_records([str(tmp_path / "missing.jsonl")])


def test_parquet_mixed_message_keys(tmp_path: Path) -> None:
    """Arrow gives every message every key seen in the column (absent ones None): still normalised."""
    rows = [conversation_shapes()["messages"], conversation_shapes()["sharegpt"]]
    rows = [{"conversations": r.get("messages", r.get("conversations")), "label": True} for r in rows]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "m.parquet"))
    records = load_records([str(tmp_path / "m.parquet")], cache_dir=str(tmp_path / "cache")).records
    assert records[0].prompt == records[1].prompt == [SYSTEM, USER]


def test_a_tables_tool_calls_and_tools_hold_only_their_own_keys(tmp_path: Path) -> None:
    """A table's structs hold the union of their rows' keys: a get_weather call came back with search's "query":
    null and "top_k": null in its arguments, and its tool's schema with the other tool's properties as null;
    the template rendered them and the model trained on argument names the tool never takes. A message's own
    absent keys stay None for normalize (content named "null" where it is needed)."""
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    search = {"name": "search", "arguments": {"query": "Monday", "top_k": 3}}
    schema = {"weather": {"city": {"type": "string"}}, "search": {"query": {"type": "string"}}}
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Use {name}."}],
            "completion": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}],
            "tools": [{"type": "function", "function": {"name": call["name"], "parameters": {"properties": schema[key]}}}],
            "label": True,
        }
        for key, name, call in (("weather", "get_weather", weather), ("search", "search", search))
    ]  # fmt: skip
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    records = load_records([str(tmp_path / "t.parquet")], cache_dir=str(tmp_path / "cache")).records
    for record, row in zip(records, rows, strict=True):
        assert record.completion[0]["tool_calls"] == row["completion"][0]["tool_calls"]
        assert record.tools == row["tools"]


def test_tool_call_arguments_given_as_a_json_string_are_the_object() -> None:
    """OpenAI's format gives ``function.arguments`` as a JSON string; templates render arguments with tojson, so
    the model trained on an escaped string ("{\\"city\\": ...}") where it emits an object."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    raw = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call, {**call, "function": {"name": "f", "arguments": "[1]"}}]},
        ],
        "label": True,
    }  # fmt: skip
    (record,) = normalize(raw, "d.jsonl:1")
    parsed, as_given = record.completion[0]["tool_calls"]
    assert parsed["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert as_given["function"]["arguments"] == "[1]"  # not an object: left as written
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the input is not changed in place


def test_cli_bad_record_is_one_line_exit_2(tmp_path: Path, tiny_model_dir: Path) -> None:
    good = {"prompt": "a", "completion": "b", "label": True}
    data = write_jsonl(tmp_path / "train.jsonl", [good, {"prompt": "a", "completion": "b", "label": "yes"}])
    cfg = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_files": [str(data)], "prepared_dir": str(tmp_path / "prepared")},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "coati_kto", "prepare", str(tmp_path / "cfg.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"error: {data}:2: field 'label'")
    assert not (tmp_path / "prepared").exists()


def test_encoding_problems_name_the_line(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "a", "completion": "b", "label": True}).encode()
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good[:-1] + b"\xff}\n")  # BOM fine; bad byte on line 2
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text"):
        load_records([str(path)])
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    assert len(load_records([str(path)]).records) == 1
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 nonsense")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read it with datasets"):
        load_records([str(tmp_path / "broken.parquet")], cache_dir=str(tmp_path / "cache"))


def test_float_labels_from_pandas_are_accepted(tmp_path: Path) -> None:
    """1.0/0.0 is what pandas writes for a bool column with a gap; accepted in JSONL and parquet float columns."""
    import datasets

    rows = [{"prompt": "a", "completion": "b", "label": v} for v in (1.0, 0.0, 1, 0, True)]
    records = load_records([str(write_jsonl(tmp_path / "t.jsonl", rows))]).records
    assert [r.label for r in records] == [True, False, True, False, True]
    table = datasets.Dataset.from_dict(
        {"prompt": ["a"] * 3, "completion": ["b"] * 3, "label": [1.0, 0.0, 1.0]}
    )
    assert table.features["label"].dtype == "float64"
    table.to_parquet(str(tmp_path / "f.parquet"))
    records = load_records([str(tmp_path / "f.parquet")], cache_dir=str(tmp_path / "cache")).records
    assert [r.label for r in records] == [True, False, True]
    # The gap itself (NaN in a float column) and any other float are one-line errors naming row and field.
    gap = datasets.Dataset.from_dict(
        {"prompt": ["a"] * 3, "completion": ["b"] * 3, "label": [1.0, float("nan"), 0.0]}
    )
    gap.to_parquet(str(tmp_path / "gap.parquet"))
    with pytest.raises(RecordError) as info:
        load_records([str(tmp_path / "gap.parquet")], cache_dir=str(tmp_path / "cache"))
    assert str(info.value) == (
        f"{tmp_path / 'gap.parquet'}:row 2: field 'label': expected true/false or 0/1 (1.0/0.0), got NaN"
    )


def test_a_null_field_is_named_null_not_missing(tmp_path: Path) -> None:
    """A table stores a record's empty cell as null: `completion: null` in parquet or a saved dataset was
    "field 'completion': missing (the record has a prompt)", as if the column were absent."""
    rows = [
        {"prompt": "a", "completion": "b", "label": True},
        {"prompt": "c", "completion": None, "label": False},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "n.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("n.parquet", "saved"):
        with pytest.raises(RecordError) as info:
            load_records([str(tmp_path / name)], cache_dir=str(tmp_path / "cache"))
        assert (
            str(info.value) == f"{tmp_path / name}:row 2: field 'completion': null (the record has a prompt)"
        )
    null_label = [{"prompt": "a", "completion": "b", "label": None}]
    datasets.Dataset.from_list([*rows[:1], *null_label]).to_parquet(str(tmp_path / "l.parquet"))
    with pytest.raises(RecordError) as info:
        load_records([str(tmp_path / "l.parquet")], cache_dir=str(tmp_path / "cache"))
    assert (
        str(info.value) == f"{tmp_path / 'l.parquet'}:row 2: field 'label': null (expected true/false or 0/1)"
    )


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            {"prompt": "a", "completion": None, "label": True},
            "field 'completion': null (the record has a prompt)",
        ),
        ({"prompt": "a", "label": True}, "field 'completion': missing (the record has a prompt)"),
        (
            {"prompt": "a", "completion": "b", "label": None},
            "field 'label': null (expected true/false or 0/1)",
        ),
        ({"prompt": "a", "completion": "b"}, "field 'label': missing (expected true/false or 0/1)"),
        (
            {"prompt": "a", "chosen": "b", "rejected": None},
            "field 'rejected': null (the record has a chosen)",
        ),
        ({"prompt": "a", "chosen": "b"}, "field 'rejected': missing (the record has a chosen)"),
        (
            {"messages": [USER, {"role": "assistant", "content": None}], "label": True},
            "field 'messages[1].content': null",
        ),
        ({"messages": [USER, {"role": "assistant"}], "label": True}, "field 'messages[1].content': missing"),
        (
            {"messages": None, "label": True},
            "field 'messages': null (the record has no other field to read: prompt/completion/label, messages/label, "
            "conversations/label or prompt/chosen/rejected)",
        ),
    ],
)
def test_json_null_and_missing_fields_read_apart(row: dict, expected: str) -> None:
    with pytest.raises(RecordError) as info:
        normalize(row, "f.jsonl:1")
    assert str(info.value) == f"f.jsonl:1: {expected}"


def test_null_columns_of_other_shapes_are_not_unread_fields(tmp_path: Path) -> None:
    """A mixed table gives a messages row null prompt/completion cells: still a messages record, nothing unread."""
    rows = [
        {"messages": CONVERSATION, "prompt": None, "completion": None, "label": True},
        {"messages": None, "prompt": "a", "completion": "b", "label": False},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "mixed.parquet"))
    result = load_records([str(tmp_path / "mixed.parquet")], cache_dir=str(tmp_path / "cache"))
    assert [r.chat for r in result.records] == [True, False] and result.unread_fields == {}
