"""Tools in records: a record's ``tools`` for the chat template, and the ``tool_calls`` of its assistant turns as
templates expect them."""

from __future__ import annotations

import json
from typing import Any

from coati_kto.data.record_error import RecordError, show_value


def record_tools(raw: dict[str, Any], source: str, chat: bool) -> list[dict[str, Any]] | None:
    """The record's ``tools`` (a list of tool objects, or that list as a JSON string, as some datasets store
    it), for the chat template to render; None when absent or empty. ``chat``: the record's examples are
    message records (plain-text prompts are used as given: they take none)."""
    value = raw.get("tools")
    if isinstance(value, str) and not value.strip():  # "" in a string column: no tools
        value = None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(source, "tools", f"not valid JSON ({err.msg})", "bad_tools") from None
    if hasattr(value, "tolist"):  # a numpy array from a table
        value = value.tolist()
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RecordError(
            source, "tools", f"expected a list of tool objects, got {show_value(value)}", "bad_tools"
        )
    if not chat:
        raise RecordError(
            source, "tools", "plain-text prompts are used as given: tools need message records", "bad_tools"
        )
    return value


def parsed_arguments(call: Any) -> Any:
    """OpenAI's tool call carries ``function.arguments`` as a JSON string; templates render arguments with
    ``tojson`` (Qwen2.5's, Llama 3.1's, Mistral's), which quoted it again: the model was trained on an escaped
    string where it emits an object. Parsed to the object it encodes; anything else is left as given."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call
