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
                record = loads_once(line)
            except json.JSONDecodeError as err:
                yield source, RecordError(source, None, malformed(err), "malformed_json")
                continue
            except KeyTwiceError as twice:
                yield source, RecordError(source, twice_path(twice.marked), "given twice", "malformed_json")
                continue
            yield source, record


class KeyTwiceError(Exception):
    """A JSON text gives a key twice in one object; ``marked``: the text parsed so each such object knows its key
    (:func:`twice_path` finds it)."""

    def __init__(self, marked: Any) -> None:
        super().__init__("a key given twice")
        self.marked = marked


class _StopError(Exception):
    """Ends the fast parse at the first object that gives a key twice."""


def _one_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: the object, or _StopError when it gives a key twice."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise _StopError
    return obj


class _Marked(dict):
    """A parsed JSON object that knows the first key it was given twice (``twice``), else None."""

    twice: str | None = None

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> _Marked:
        parsed = cls(pairs)
        if len(parsed) < len(pairs):
            keys = [k for k, _ in pairs]
            parsed.twice = next(k for k in keys if keys.count(k) > 1)
        return parsed


def loads_once(text: str) -> Any:
    """``json.loads(text)``, where JSON would keep the last of a key given twice in silence (a label false then
    true trained as true; a message's second ``content`` replacing its first), at any depth: KeyTwiceError then.
    The hook costs about 0.3 us an object over plain json.loads (100k records of ten messages: +0.25 s; of three:
    faster than the top-level key counts it replaced); a text that gives a key twice is parsed again to say
    where. Raises json.JSONDecodeError for a text that is no JSON."""
    try:
        return json.loads(text, object_pairs_hook=_one_each)
    except _StopError:
        # The text may still break after that object: this parse's JSONDecodeError then says where.
        raise KeyTwiceError(json.loads(text, object_pairs_hook=_Marked.of)) from None


def twice_path(value: Any, at: str = "") -> str | None:
    """Where ``value`` (parsed by :func:`loads_once`'s second parse) first gives a key twice: ``label``,
    ``prompt[0].content``; None when nowhere."""
    if isinstance(value, _Marked) and value.twice is not None:
        return f"{at}.{value.twice}" if at else value.twice
    if isinstance(value, dict):
        inner = ((f"{at}.{k}" if at else k, v) for k, v in value.items())
    elif isinstance(value, list):
        inner = ((f"{at}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for where, v in inner if (found := twice_path(v, where)) is not None), None)


def malformed(err: json.JSONDecodeError) -> str:
    """The reason a line or file is no JSON (``Invalid control character at`` ends in its own "at")."""
    return f"malformed JSON ({err.msg.removesuffix(' at')} at column {err.colno})"


def json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A .json file: an array of records, ``{"data": [...]}``, or JSON lines under a .json name."""
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    marked = None  # the file parsed again, where it gives a key twice
    try:
        data = loads_once(text := raw.decode("utf-8"))
    except KeyTwiceError as err:
        data = marked = err.marked  # the second parse is the data too (its objects are dicts)
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
        # a key of the wrapper given twice: the first "data" list would go unread, in silence
        if isinstance(marked, _Marked) and marked.twice is not None:
            raise DataError(
                f"{path}: key {marked.twice!r} given twice in the object around the records (JSON keeps the last "
                "in silence); give it once"
            )
        marked = marked["data"] if marked is not None else None
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
        data, marked = [data], [marked]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {show_value(data)}")
    for i, item in enumerate(data, start=1):  # 1-based, as JSON lines' line numbers
        source = f"{path}:row {i}"
        twice = twice_path(marked[i - 1]) if marked is not None else None
        yield source, item if twice is None else RecordError(source, twice, "given twice", "malformed_json")


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
