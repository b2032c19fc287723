"""JSON and JSON-lines feedback files: each record under its ``file:line`` (``file:row N`` for an array), and what
JSON itself would hide: a key given twice (JSON keeps the last in silence), a pretty-printed document that does not
parse (read as lines, every line of it would be a bad record), bytes that are not UTF-8."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coati_kto.data.formats import RecordError, show_value
from coati_kto.errors import DataError


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed object) per non-blank line; a malformed line yields a RecordError in its place."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a byte-order mark
            except UnicodeDecodeError as err:
                yield (
                    source,
                    RecordError(source, None, f"not UTF-8 text (byte {err.start + 1})", "malformed_json"),
                )
                continue
            if not line.strip():
                continue
            # Without its line end: an error at the end of the line (a trailing comma) would else be placed at
            # column 1 of the next "line", the newline itself.
            line = line.rstrip("\r\n")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield source, RecordError(source, None, malformed(err), "malformed_json")
                continue
            twice = _field_twice(line, record)
            yield (
                source,
                record if twice is None else RecordError(source, twice, "given twice", "malformed_json"),
            )


def _field_twice(line: str, record: Any) -> str | None:
    """A top-level field ``line`` gives twice (JSON keeps the last, in silence: a label given false then true
    trained as true), else None. Only a line holding a field's quoted name twice is parsed again."""
    if not isinstance(record, dict) or all(line.count(json.dumps(k)) < 2 for k in record):
        return None
    seen: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        seen.extend(k for k in set(keys) if keys.count(k) > 1)
        return dict(items)

    json.loads(line, object_pairs_hook=pairs)
    return next((k for k in record if k in seen), None)


def malformed(err: json.JSONDecodeError) -> str:
    """The reason a line or file is no JSON (``Invalid control character at`` ends in its own "at")."""
    return f"malformed JSON ({err.msg.removesuffix(' at')} at column {err.colno})"


def json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A .json file: an array of records, ``{"data": [...]}``, or JSON lines under a .json name."""
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        data = json.loads(text := raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        if one_document(raw.decode("utf-8", errors="replace")):
            line, line_start = raw.count(b"\n", 0, err.start) + 1, raw.rfind(b"\n", 0, err.start) + 1
            where = f"not UTF-8 text (byte {err.start - line_start + 1})"
            raise DataError(f"{path}:{line}: {where}; {ONE_DOCUMENT}") from None
        yield from jsonl_rows(path)  # the line numbers then point at the broken line
        return
    except json.JSONDecodeError as err:
        if one_document(text):
            raise DataError(f"{path}:{err.lineno}: {malformed(err)}; {ONE_DOCUMENT}") from None
        yield from jsonl_rows(path)
        return
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        beside = [
            k for k, v in data.items() if k != "data" and isinstance(v, list) and v and isinstance(v[0], dict)
        ]
        if beside:  # records under another key would be left unread
            raise DataError(
                f"{path}: records under {', '.join(repr(k) for k in beside)} beside 'data': a .json file's records "
                "are its array, or the list under 'data' alone; move them into 'data' or into a file of their own"
            )
        data = data["data"]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {show_value(data)}")
    twice = _rows_given_twice(text, data)
    for i, item in enumerate(data, start=1):  # 1-based, as JSON lines' line numbers
        source = f"{path}:row {i}"
        yield (
            source,
            item if i not in twice else RecordError(source, twice[i], "given twice", "malformed_json"),
        )


class _Pairs(dict):
    """A parsed JSON object that knows a key it was given twice (``twice``; JSON keeps the last in silence)."""

    twice: str | None = None

    @classmethod
    def of(cls, items: list[tuple[str, Any]]) -> _Pairs:
        parsed, keys = cls(items), [k for k, _ in items]
        parsed.twice = next((k for k in keys if keys.count(k) > 1), None)
        return parsed


def _rows_given_twice(text: str, records: list[Any]) -> dict[int, str]:
    """{row (from 1): a top-level field it gives twice} of a .json file's records (a label given false then true
    trained as true, as in JSON lines: ``_field_twice``). Parsed again only when some field's quoted name occurs
    more often in ``text`` than records hold it."""
    keys = {k for r in records if isinstance(r, dict) for k in r}
    if all(text.count(json.dumps(k)) <= sum(isinstance(r, dict) and k in r for r in records) for k in keys):
        return {}
    again = json.loads(text, object_pairs_hook=_Pairs.of)
    again = again["data"] if isinstance(again, dict) and isinstance(again.get("data"), list) else again
    again = [again] if isinstance(again, dict) else again
    return {i: r.twice for i, r in enumerate(again, start=1) if isinstance(r, _Pairs) and r.twice}


ONE_DOCUMENT = "the file is one JSON document, so none of it can be read until this is fixed"


def one_document(text: str) -> bool:
    """Whether a .json file that does not parse is one document (an array or object, often pretty-printed), whose
    parse error has the line: read as JSON lines, every line of it would be "malformed" (and with on_bad_record:
    skip the whole file dropped). False: JSON lines, to read so. It is one document when its first line is no
    JSON value on its own, and it opens an array or none of the next lines is a JSON object alone (JSON lines
    whose first line is broken)."""
    # JSON's lines end at "\n" alone (splitlines would also cut at U+2028, which a JSON string may hold raw)
    lines = [line for line in text.split("\n")[:64] if line.strip()]
    if not lines or _parses(lines[0]):
        return False
    first = lines[0].strip()
    if first.startswith("[") or (first.startswith("{") and first.endswith(("[", "{"))):  # opens an array or a
        return True  # wrapper ({"data": [): its records' lines may parse alone
    return not any(line.lstrip().startswith("{") and _parses(line) for line in lines[1:5])


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False
