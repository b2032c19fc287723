"""The base of every config section: unknown keys are errors, numbers given for strings are kept as text,
true/false given for numbers and NaN/inf are refused (``coati_kto.config.schema`` holds the sections); the sections without cross-key checks
(``output``, ``logging``) and the parsing of the keys that take ``auto`` or a number, or ``auto`` or true/false."""

from __future__ import annotations

import math
import types
import typing
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# The validation context under which a section keeps its cross-key problems for the whole config to list with its
# own (coati_kto.config.load): raised from the section, they stopped the config's checks, so a file's mistakes
# came in rounds.
DEFER_SECTION_PROBLEMS = "defer_section_problems"
_BOOL = TypeAdapter(bool)


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )
    _deferred: list[str] = PrivateAttr(default_factory=list)

    def _problems(self) -> list[str]:
        """This section's cross-key problems, one line each (a section that has some says so)."""
        return []

    @model_validator(mode="after")
    def _section_problems(self, info: ValidationInfo) -> Section:
        problems = self._problems()
        if problems and (info.context or {}).get(DEFER_SECTION_PROBLEMS):
            self._deferred = problems  # Config lists them with its own (deferred_problems)
        elif problems:
            raise ValueError("\n".join(problems))
        return self

    def derive(self, **values: Any) -> None:
        """Set fields the config resolves from other keys (``data.prepared_dir`` from ``output.dir``, what
        ``model.attn_implementation: auto`` became) without validating the section again: with
        ``validate_assignment`` an assignment re-ran its cross-key checks outside the deferring context, raising
        them alone, so one section's mistake hid every other section's (config load lists them all at once)."""
        for name, value in values.items():
            self.__dict__[name] = value
            self.__pydantic_fields_set__.add(name)

    def own_deferred_problems(self) -> list[str]:
        """The problems this section kept under the deferring context, with those of its sections."""
        return self._deferred + self.deferred_problems()

    def deferred_problems(self) -> list[str]:
        """The problems its sections kept under the deferring context (every section field of this one)."""
        sections = [getattr(self, name) for name in type(self).model_fields]
        return [p for section in sections if isinstance(section, Section) for p in section._deferred]

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 for an int or float field: ``max_steps: yes`` trained one step."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _numeric(field.annotation):
            raise ValueError("must be a number, not a boolean")
        return value


def _numeric(annotation: Any) -> bool:
    """Whether a field typed ``annotation`` takes an int or a float and no bool (``int | None``, ``float``...)."""
    if annotation is bool:
        return False
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        return bool not in members and any(_numeric(m) for m in members)
    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric(typing.get_args(annotation)[0])
    return False


def bool_or_auto(value: Any) -> bool | str:
    """A ``bool | Literal["auto"]`` key in one ValueError message (pydantic reports each member of the union on its
    own line, naming its internals). The project's rule for each part: true/false as every bool key reads them
    (pydantic's words, any case: yes, off, 1...), ``auto`` as every literal key: exactly, in lower case."""
    if value == "auto":
        return "auto"
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise ValueError("must be true, false or auto") from None


def auto_or_number(value: Any) -> float | str:
    """``auto``, or ``value`` as a finite float >= 0; one ValueError message for both (pydantic would report
    each member of the union on its own line). ``auto`` exactly, as every literal key (``bool_or_auto``)."""
    if value == "auto":
        return "auto"
    try:
        number = math.nan if isinstance(value, bool) else float(str(value).strip())
    except ValueError:
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError("must be auto or a number >= 0 (0: off)")
    return number
