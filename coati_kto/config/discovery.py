"""Config discovery: every key of coati_kto.config with its type, default and help; "did you mean" for typos.

Read from the pydantic schema itself (the ``Field`` descriptions in config.py), so it cannot drift from it.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from coati_kto.config.schema import Config
from coati_kto.config.trl_flags import SCRIPT_FLAGS, TRAINER_NAMES, trl_hint


def _type_name(annotation: Any) -> str:
    """``Literal["a", "b"]`` -> ``a | b``; ``int | None`` -> ``int | null``; ``list[str]`` -> ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a constrained type (a non-empty str): its base type
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(str(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"  # a nested section (model.lora): its keys are listed below it
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(field: Any) -> str:
    """The type ``config --schema`` shows for ``field``: what load accepts. A field whose validator takes more than
    its annotation (one path for ``list[str]``, OWNER/NAME for a section) names that in its ``accepts``."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return str(extra.get("accepts") or _type_name(field.annotation))


def _default_text(field: Any) -> str:
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    return "= " + yaml_text(value)


def yaml_text(value: Any) -> str:
    """``value`` as a YAML config spells it, on one line (``null``, ``true``, ``some/model``, ``[a, b]``): what a
    user writes to set it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    return text.strip().removesuffix("\n...").strip()


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (``OutputSection | None`` -> OutputSection); None for a plain value."""
    for a in typing.get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """Each section's name and model; an optional section (``output: OutputSection | None``) by its model."""
    return [(name, _model_of(field.annotation)) for name, field in Config.model_fields.items()]


def _key_lines(prefix: str, section: type[BaseModel]) -> list[tuple[str, str]]:
    """(dotted key, schema line) for every key of ``section``, and of the sections nested in it
    (``model.lora`` and then ``model.lora.rank``, ...)."""
    out = []
    for key, field in section.model_fields.items():
        dotted = f"{prefix}.{key}"
        out.append(
            (
                dotted,
                f"{dotted}: {_field_type(field)} {_default_text(field)}  # {field.description}",
            )
        )
        if (nested := _model_of(field.annotation)) is not None:
            out += _key_lines(dotted, nested)
    return out


def schema_lines() -> list[str]:
    """One line per key, ``section.key: type = default  # help``; a blank line between sections."""
    lines: list[str] = []
    for name, section in _sections():
        if lines:
            lines.append("")
        lines += [line for _, line in _key_lines(name, section)]
    return lines


def all_keys() -> list[str]:
    """Every dotted key (``kto.beta``, ``model.lora.rank``) and section name (``kto``)."""
    keys = []
    for name, section in _sections():
        keys.append(name)
        keys += [dotted for dotted, _ in _key_lines(name, section)]
    return keys


def did_you_mean(dotted: str) -> str | None:
    """The closest known key (or section) to the unknown ``dotted`` key, when one is close; else None. A
    TRL / transformers trainer name (``train.learning_rate``) maps to this project's key (``train.lr``)."""
    leaf = dotted.rsplit(".", 1)[-1]
    mapped = TRAINER_NAMES.get(leaf) or SCRIPT_FLAGS.get(leaf)
    if mapped in all_keys():
        return mapped
    depth = dotted.count(".")
    if depth == 0:  # a section and key run together (trainlr, train_lr): the key, not the section
        joined = {k.replace(".", sep): k for k in all_keys() if k.count(".") == 1 for sep in ("", "_", "-")}
        if dotted in joined:
            return joined[dotted]
    candidates = [k for k in all_keys() if k.count(".") == depth]
    close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.75)
    if not close and depth == 1:  # a right key in the wrong section: train.beta -> kto.beta
        leaf = dotted.split(".")[1]
        close = [k for k in candidates if k.split(".")[1] == leaf]
    if not close and depth == 0:  # a key outside its section (lost indentation): max_steps -> train.max_steps
        close = [k for k in all_keys() if k.count(".") == 1 and k.split(".")[1] == dotted]
    return close[0] if close else None


def unknown_key_problem(dotted: str, value: Any = None, siblings: Mapping[str, Any] | None = None) -> str:
    """The problem line of an unknown key: a TRL name (a TRL-style flat YAML, ``bf16: true``) is translated as
    its command-line flag is (coati_kto.config.trl_flags), so each one gets its override or why it has none,
    read beside ``siblings`` (the file's other top-level keys, as the rest of a command line); otherwise the
    closest known key, when one is close."""
    hint = trl_hint(dotted.rsplit(".", 1)[-1], value, siblings)
    if hint is not None:
        return f"unknown key; {hint}"
    close = did_you_mean(dotted)
    return f"unknown key (did you mean {close}?)" if close else "unknown key"
