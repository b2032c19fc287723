"""The base of every config section: unknown keys are errors, numbers given for strings are kept as text, and
NaN/inf are refused (``coati_kto.config.schema`` holds the sections); the sections without cross-key checks
(``output``, ``logging``) and the parsing of an ``auto``-or-number key."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )


def auto_or_number(value: Any) -> float | str:
    """``auto``, or ``value`` as a finite float >= 0; one ValueError message for both (pydantic would report
    each member of the union on its own line)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = math.nan if isinstance(value, bool) else float(text)
    except ValueError:
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError("must be auto or a number >= 0 (0: off)")
    return number
