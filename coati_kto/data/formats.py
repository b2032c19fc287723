"""Normalise feedback records in any supported shape each record to (prompt, completion, label).

Record shapes (one JSON object / table row each):

* ``{"prompt": str, "completion": str, "label": bool}``: plain text, tokenized as given.
* ``{"prompt": [messages], "completion": [messages], "label": bool}``: conversational.
* ``{"prompt": [messages], "completion": {message}, "label": bool}``: ColossalChat's KTO format.
* ``{"messages": [...], "label": bool}`` (or ``conversations``): the final assistant turn is the completion,
  every turn before it (system, user, assistant, tool) the prompt.
* ``{"prompt"?, "chosen", "rejected"}``: a preference pair becomes two records, chosen desirable and rejected
  undesirable. Without ``prompt``, chosen and rejected are whole conversations sharing their prompt turns.

Messages use ``role``/``content`` or ``from``/``value`` keys (``human`` -> user, ``gpt`` -> assistant); other
keys (``tool_calls``, ``name``, ...) are kept for the chat template. A completion holds assistant turns only. A
record's ``tools`` (tool definitions: a list, or a JSON string of one) go to the chat template with its
messages. Image records (TRL's vision-language format, read only when asked: :func:`normalize`'s ``images``)
give prompt messages content parts, ``{"type": "image"}`` and ``{"type": "text", "text": ...}``, and an
``images`` list, checked in :mod:`coati_kto.data.image_refs`; a completion's parts are text only. Labels are JSON booleans, the integers 0/1 or the floats 1.0/0.0. Text must be valid Unicode (a lone
surrogate, a string cut inside an emoji, is a bad record). Files are found and read in ``files``.

Every problem is a one-line :class:`RecordError` naming ``file:line`` (``file:row N`` for arrays and tables, N from
1) and the field (a field absent is "missing", one holding null "null"); :func:`coati_kto.data.files.load_records`
raises it or, with ``on_bad_record="skip"``, collects it by reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coati_kto.data.record_error import RecordError, show_value
from coati_kto.data.tools import parsed_arguments, record_tools

ROLE_ALIASES = {"human": "user", "gpt": "assistant"}
MESSAGE_LIST_KEYS = ("messages", "conversations")
SHAPES = "prompt/completion/label, messages/label, conversations/label or prompt/chosen/rejected"
SHAPE_FIELDS = (*MESSAGE_LIST_KEYS, "chosen", "rejected", "completion", "prompt")
HALVES = (("chosen", "rejected"), ("rejected", "chosen"), ("prompt", "completion"), ("completion", "prompt"))


def skipped_note(skipped: int | list[RecordError]) -> str:
    """How many bad records were skipped, with the commonest reason and its first record when known: where a
    split comes out short of a label, they may be why (every record failing alike, e.g. on the chat template)."""
    if isinstance(skipped, int) or not skipped:
        return f"{skipped if isinstance(skipped, int) else 0} bad records were skipped"
    by_reason: dict[str, int] = {}
    for bad in skipped:
        by_reason[bad.reason] = by_reason.get(bad.reason, 0) + 1
    top = max(by_reason, key=by_reason.__getitem__)
    first = str(next(b for b in skipped if b.reason == top))
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{len(skipped)} bad records were skipped, {by_reason[top]} of them for {top} (e.g. {first})"


@dataclass
class Record:
    """A validated example. ``chat``: prompt and completion are message lists, else plain strings."""

    prompt: str | list[dict[str, Any]]
    completion: str | list[dict[str, Any]]
    label: bool
    source: str
    chat: bool
    tools: list[dict[str, Any]] | None = None  # tool definitions the chat template renders (message records)
    images: list[bytes] = field(default_factory=list)  # one per image part of the prompt, in order


@dataclass
class LoadResult:
    records: list[Record]
    files: list[str]
    skipped: list[RecordError] = field(default_factory=list)
    unread_fields: dict[str, int] = field(default_factory=dict)  # field -> records holding it, not read


def _absent(key: str, nulls: set[str]) -> str:
    """How a field a record lacks is named: "null" when it holds null (a JSON null, a table's empty cell),
    "missing" when the record has no such field: the fix differs (fill the value, or add the field)."""
    return "null" if key in nulls else "missing"


def _label(raw: dict[str, Any], source: str, nulls: set[str]) -> bool:
    if "label" not in raw:
        problem = f"{_absent('label', nulls)} (expected true/false or 0/1)"
        raise RecordError(source, "label", problem, "missing_label")
    value = raw["label"]
    if hasattr(value, "item") and not isinstance(value, (list, dict)):  # numpy scalars from tables
        value = value.item()
    if isinstance(value, bool):
        return value
    # 1.0/0.0: what pandas writes for a bool column with a gap (the gap itself, NaN, stays an error).
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise RecordError(
        source, "label", f"expected true/false or 0/1 (1.0/0.0), got {show_value(value)}", "bad_label"
    )


def _parts(content: list[dict[str, Any]], source: str, where: str) -> list[dict[str, Any]]:
    """TRL's content parts, checked: ``{"type": "image"}`` or ``{"type": "text", "text": str}`` (the null keys a
    table adds dropped)."""
    out = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("image", "text") or (kind == "text" and not isinstance(part.get("text"), str)):
            raise RecordError(
                source,
                f"{where}[{i}]",
                f"expected {{'type': 'image'}} or {{'type': 'text', 'text': str}}, got {show_value(part)}",
                "bad_content_part",
            )
        out.append({"type": "image"} if kind == "image" else {"type": "text", "text": part["text"]})
    return out


def _message(raw: Any, source: str, where: str, parts: bool = False) -> dict[str, Any]:
    """Normalise one message to ``role``/``content`` (plus any extra keys the template may use); ``parts``:
    content parts are read (image records), else refused."""
    if not isinstance(raw, dict):
        raise RecordError(source, where, f"expected a message object, got {show_value(raw)}", "bad_message")
    # Tables (parquet, arrow) give every message all keys seen in the column, the absent ones as None.
    role = raw.get("role") if raw.get("role") is not None else raw.get("from")
    if not isinstance(role, str) or not role:
        raise RecordError(source, where, "message has no 'role' (or 'from') string", "bad_message")
    key = "content" if raw.get("content") is not None or "value" not in raw else "value"
    content = raw.get(key)
    # OpenAI-style tool calls carry no text; the template renders tool_calls instead.
    if content is None and raw.get("tool_calls"):
        content = ""
    is_parts = isinstance(content, list) and content
    if is_parts and all(isinstance(p, dict) and "type" in p for p in content):
        # TRL's vision format: {"type": "image"} / {"type": "text", "text": ...} parts, for vision-language models.
        if parts:
            content = _parts(content, source, f"{where}.{key}")
        else:
            kinds = ", ".join(sorted({str(p["type"]) for p in content}))
            raise RecordError(
                source,
                f"{where}.{key}",
                f"a list of content parts ({kinds}: TRL's vision-language format), read only for a "
                "vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5): give the content as one string",
                "non_string_content",
            )
    elif not isinstance(content, str):
        # A table gives a message every key of its column (absent ones as null): "null" is what it stores.
        absent = "null" if key in raw else "missing"
        problem = absent if content is None else f"expected a string, got {show_value(content)}"
        raise RecordError(source, f"{where}.{key}", problem, "non_string_content")
    extra = {k: v for k, v in raw.items() if k not in ("role", "from", "content", "value") and v is not None}
    if isinstance(extra.get("tool_calls"), list):
        extra["tool_calls"] = [parsed_arguments(call) for call in extra["tool_calls"]]
    return {"role": ROLE_ALIASES.get(role.lower(), role.lower()), "content": content, **extra}


def _messages(raw: Any, source: str, key: str, parts: bool = False) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RecordError(source, key, f"expected a list of messages, got {show_value(raw)}", "bad_message")
    return [_message(m, source, f"{key}[{i}]", parts) for i, m in enumerate(raw)]


def _completion_text(reply: list[dict[str, Any]], source: str, key: str, first: int = 0) -> None:
    """Content parts of completion turns become one string (``first``: the index of ``reply[0]`` in the
    record's field); an image part there is refused: KTO scores the completion's tokens, an image has none."""
    for i, message in enumerate(reply, start=first):
        content = message["content"]
        if isinstance(content, list):
            if any(p["type"] == "image" for p in content):
                raise RecordError(
                    source,
                    f"{key}[{i}].content",
                    "an image part in a completion: KTO scores the completion's tokens and an image has none; "
                    "put the images in the prompt",
                    "image_in_completion",
                )
            message["content"] = "".join(p["text"] for p in content)


def _split_conversation(messages: list[dict[str, Any]], source: str, key: str) -> tuple[list, list]:
    """Everything before the final assistant turn is the prompt; that turn is the completion."""
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "no messages"
        raise RecordError(
            source,
            key,
            f"needs a final assistant turn as the completion (last turn: {last})",
            "no_final_assistant",
        )
    return messages[:-1], messages[-1:]


def _check_completion(completion: str | list[dict[str, Any]], source: str, key: str) -> None:
    if isinstance(completion, str):
        empty = not completion.strip()
    else:
        empty = not any(m["content"].strip() or m.get("tool_calls") for m in completion)
    if empty:
        raise RecordError(source, key, "empty completion", "empty_completion")


def _prompt_and_completion(
    raw: dict[str, Any], key: str, source: str, parts: bool = False
) -> tuple[Any, Any, bool]:
    """``raw["prompt"]`` with ``raw[key]`` (completion, chosen or rejected): plain text or messages."""
    prompt, completion = raw["prompt"], raw[key]
    if isinstance(prompt, str) and isinstance(completion, str):
        _check_completion(completion, source, key)
        return prompt, completion, False
    if isinstance(prompt, str) or isinstance(completion, str):
        kinds = f"prompt is {type(prompt).__name__}, {key} is {type(completion).__name__}"
        raise RecordError(
            source, key, f"prompt and {key} must both be strings or messages ({kinds})", "mixed"
        )
    messages = _messages(prompt, source, "prompt", parts)
    if not messages:
        raise RecordError(source, "prompt", "no messages (an empty prompt)", "empty_prompt")
    if isinstance(completion, dict):  # ColossalChat: a single assistant message
        completion = [completion]
    reply = _messages(completion, source, key, parts)
    _completion_text(reply, source, key)
    if not reply or reply[-1]["role"] != "assistant":
        raise RecordError(
            source, key, "the completion must end with an assistant message", "no_final_assistant"
        )
    other = next(
        (f"{key}[{i}] is a {m['role']!r} turn" for i, m in enumerate(reply) if m["role"] != "assistant"), ""
    )
    if other:  # every completion token is trained on as the model's own output
        raise RecordError(
            source,
            key,
            f"{other}: a completion holds assistant turns only (earlier turns go in the prompt)",
            "non_assistant_completion",
        )
    _check_completion(reply, source, key)
    return messages, reply, True


def normalize(raw: Any, source: str, images: bool = False) -> list[Record]:
    """One raw record -> one Record (two for a preference pair), with its ``tools``; raises RecordError.

    ``images``: content parts are read (the ``images`` field is then read by
    :func:`coati_kto.data.image_refs.attach_images`); else they are refused."""
    if not isinstance(raw, dict):
        raise RecordError(source, None, f"expected a JSON object, got {show_value(raw)}", "unknown_format")
    if not images and _holds_images(raw.get("images")):
        # A text-only model would train on the text alone, without a word: the images are what was judged.
        raise RecordError(
            source,
            "images",
            "images are read only for a vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5), and this "
            "one reads text alone; drop the field to train on the text",
            "images_unread",
        )
    # A null field reads as absent (a table gives every row all its columns, a mixed table's other shapes' as
    # null), but is named "null", not "missing", where the record needs it: the fix is a value, not a field.
    nulls = {k for k, v in raw.items() if v is None}
    records = _normalize({k: v for k, v in raw.items() if v is not None}, source, images, nulls)
    if bad := next(filter(None, (_lone_surrogate(r.prompt, r.completion) for r in records)), None):
        raise RecordError(source, bad[0], bad[1], "bad_text")
    tools = record_tools(raw, source, all(r.chat for r in records))
    for record in records:
        record.tools = tools
    return records


def _holds_images(value: Any) -> bool:
    """Whether a record's ``images`` field names any image (an empty list or null names none)."""
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):  # numpy from a table
        value = value.tolist()
    return value is not None and value != [] and value != ""


def _normalize(raw: dict[str, Any], source: str, parts: bool, nulls: set[str]) -> list[Record]:
    """The shape of ``raw`` (its null fields left out; their names: ``nulls``) and its records."""
    if "chosen" in raw and "rejected" in raw:
        out = []
        for key, label in (("chosen", True), ("rejected", False)):
            where = f"{source} ({key})"
            if "prompt" in raw:
                prompt, completion, chat = _prompt_and_completion(raw, key, source, parts)
            else:
                prompt, completion = _split_conversation(_messages(raw[key], source, key, parts), source, key)
                _completion_text(completion, source, key, len(prompt))
                _check_completion(completion, source, key)
                chat = True
            out.append(Record(prompt, completion, label, where, chat))
        return out
    for key in MESSAGE_LIST_KEYS:
        if key in raw:
            label = _label(raw, source, nulls)
            prompt, completion = _split_conversation(_messages(raw[key], source, key, parts), source, key)
            _completion_text(completion, source, key, len(prompt))
            _check_completion(completion, source, key)
            return [Record(prompt, completion, label, source, True)]
    if "prompt" in raw and "completion" in raw:
        label = _label(raw, source, nulls)
        prompt, completion, chat = _prompt_and_completion(raw, "completion", source, parts)
        return [Record(prompt, completion, label, source, chat)]
    # Half of a pair or of prompt/completion (a pair's half first: its prompt is no half of prompt/completion).
    for present, other in HALVES:
        if present in raw and other not in raw:
            problem = f"{_absent(other, nulls)} (the record has a {present})"
            raise RecordError(source, other, problem, "unknown_format")
    if null := next((k for k in SHAPE_FIELDS if k in nulls), None):  # {"messages": null, "label": true}
        raise RecordError(
            source, null, f"null (the record has no other field to read: {SHAPES})", "unknown_format"
        )
    keys = ", ".join(sorted(map(str, raw))) or "none"
    raise RecordError(
        source,
        None,
        f"unknown record format (keys: {keys}); expected {SHAPES}",
        "unknown_format",
    )


def _lone_surrogate(prompt: Any, completion: Any) -> tuple[str, str] | None:
    """(field, problem) for the first string holding a lone UTF-16 surrogate (JSON admits ``"\\ud800"``, a
    string cut inside an emoji; no tokenizer or arrow column takes it), else None."""
    for key, value in (("prompt", prompt), ("completion", completion)):
        texts = (
            [(key, value)]
            if isinstance(value, str)
            else [(f"{key}[{i}].content", m.get("content")) for i, m in enumerate(value)]
        )
        for where, text in texts:
            if isinstance(text, list):  # content parts: their text
                text = "".join(p.get("text", "") for p in text)
            if not isinstance(text, str):  # a tool-call turn's null content
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                return where, (
                    f"not valid Unicode: a lone surrogate {text[err.start]!r} at character {err.start} "
                    "(a string cut inside a UTF-16 pair)"
                )
    return None
