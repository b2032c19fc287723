"""What a record holds that no shape reads: counted per field name (prepare's "fields not read" line and stats.json's
``unread_fields``), never left out in silence."""

from __future__ import annotations

from typing import Any

from coati_kto.data.formats import MESSAGE_LIST_KEYS


def unread_fields(raw: dict[str, Any], images: bool = False) -> set[str]:
    """The fields of a record (normalised without error) that its shape does not read, as ``_normalize`` picks
    the shape: ids, a ``system`` field, and the prompt/completion of a record that also holds messages; ``images``
    unless read (:func:`normalize`'s ``images``). Null fields are none of them (no data is left unread)."""
    raw = {k: v for k, v in raw.items() if v is not None}
    if "chosen" in raw and "rejected" in raw:
        read = {"prompt", "chosen", "rejected"}
    else:
        key = next((k for k in MESSAGE_LIST_KEYS if k in raw), None)
        read = {key, "label"} if key else {"prompt", "completion", "label"}
    parts = {f"{k}[].content[].{name}" for k in read & set(raw) for name in _unread_part_keys(raw[k])}
    return (set(raw) - read - {"tools"} - ({"images"} if images else set())) | parts


def _unread_part_keys(messages: Any) -> set[str]:
    """The keys of ``messages``' content parts that :func:`_parts` does not keep (all but type and text; a
    table's null keys are none of them): ``cache_control``, an inline ``image``."""
    found: set[str] = set()
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict):
                found |= {k for k, v in part.items() if v is not None and k not in ("type", "text")}
    return found
