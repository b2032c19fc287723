"""The problems a field error would hide: a config's own checks (``Config._combinations``, a section's cross-key
checks) run only once every field is valid, so a file with a mistyped value and two settings that conflict was
reported in rounds: fix one line, run again, learn of the next.

Both functions take the raw mapping the failed validation read and return problem texts (no file or line: the
loader blames each on the keys it names). Called only after a validation with a field error.
"""

from __future__ import annotations

import copy
import re
import typing
from typing import Any

from pydantic import ValidationError

from coati_kto.config.schema import Config
from coati_kto.config.section import DEFER_SECTION_PROBLEMS, Section


def valid_sections_problems(raw: dict[str, Any]) -> list[str]:
    """The cross-key problems of each section that validates by itself."""
    problems = []
    for name, spec in Config.model_fields.items():
        model = next(
            (a for a in typing.get_args(spec.annotation) or (spec.annotation,) if isinstance(a, type)), None
        )
        value = raw.get(name, None if spec.is_required() else {})
        if model is None or not issubclass(model, Section) or not isinstance(value, dict):
            continue
        try:
            section = model.model_validate(value, context={DEFER_SECTION_PROBLEMS: True})
        except ValidationError:
            continue  # its errors are listed already
        problems += section.own_deferred_problems()
    return problems


def combination_problems(raw: dict[str, Any], err: ValidationError) -> list[str]:
    """The config's own checks, run on ``raw`` with every key ``err`` names left out (its default). A problem
    naming a key left out is dropped: it would judge the default, not what was written. None when a key
    left out is required (``model.path``): no config to check."""
    trial = copy.deepcopy(raw)
    failed = sorted((e["loc"] for e in err.errors()), key=lambda loc: [str(p) for p in loc], reverse=True)
    for loc in failed:  # the last list items first: dropping one shifts those after it
        _drop(trial, loc)
    try:
        Config.model_validate(trial, context={DEFER_SECTION_PROBLEMS: True})
    except ValidationError as second:
        if any(e["loc"] for e in second.errors()):
            return []
        names = [".".join(str(p) for p in loc) for loc in failed]
        texts = [e["msg"].removeprefix("Value error, ") for e in second.errors()]
        return [line for text in texts for line in text.split("\n") if not _names_any(line, names)]
    return []


def _drop(tree: Any, loc: tuple[Any, ...]) -> None:
    """Remove the deepest key or item of ``loc`` that ``tree`` holds (pydantic's location may go on past the
    value, into a union's member names)."""
    parent, key = None, None
    node = tree
    for part in loc:
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_list or isinstance(node, dict) and part in node):
            break
        parent, key, node = node, part, node[part]
    if parent is not None:
        del parent[key]


def _names_any(problem: str, keys: list[str]) -> bool:
    """Whether ``problem`` names one of ``keys`` or a key inside one (``plugin`` names ``plugin.tp_size``)."""
    return any(re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", problem) for key in keys if key)
