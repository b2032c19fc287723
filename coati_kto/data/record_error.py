"""One unusable record, and how a bad value is shown in its message."""

from __future__ import annotations

import json
from typing import Any

from coati_kto.errors import DataError


class RecordError(DataError):
    """One unusable record; ``reason`` is a short key for counting skipped records."""

    def __init__(self, source: str, field_name: str | None, problem: str, reason: str) -> None:
        where = f"{source}: field {field_name!r}" if field_name else source
        super().__init__(f"{where}: {problem}")
        self.reason = reason
        self.source = source

    @classmethod
    def restore(cls, message: str, reason: str, source: str) -> RecordError:
        """Rebuild one from its message (records checked in ``datasets.map`` workers come back as text)."""
        bad = cls(source, None, "", reason)
        bad.args = (message,)
        return bad


def show_value(value: Any, limit: int = 60) -> str:
    """A short one-line rendering of a bad value for error messages."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
