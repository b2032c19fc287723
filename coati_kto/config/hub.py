"""Hub ids and local paths: the one rule for telling a Hugging Face Hub id from a path in a config value."""

from __future__ import annotations

import re
from pathlib import Path

# "name" or "org/name": letters, digits, "_", "." and "-", each part starting with a letter or digit.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(value: str) -> bool:
    """Whether ``value`` has the shape of a Hub id (whether or not it exists, locally or on the Hub)."""
    return HUB_ID.fullmatch(value) is not None


def hub_id(name: str | None) -> str | None:
    """``name`` when it reads as a Hub id and is no existing local path; else None."""
    if not name or Path(name).exists() or not looks_like_hub_id(name):
        return None
    return name
