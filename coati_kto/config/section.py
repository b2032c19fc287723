"""The base of every config section: unknown keys are errors, numbers given for strings are kept as text, and
NaN/inf are refused (``coati_kto.config.schema`` holds the sections)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )
