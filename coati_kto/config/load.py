"""Loading a config: the YAML file, ``section.key=value`` overrides, and one error line per mistake.

Every mistake is reported at once, one line each, naming where the value came from (``file:line``, or the
command-line override as given) and the key (with a "did you mean" for an unknown key).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from coati_kto.config.discovery import unknown_key_problem
from coati_kto.config.schema import Config
from coati_kto.config.section import DEFER_SECTION_PROBLEMS
from coati_kto.errors import ConfigError


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: cannot set {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["train.lr=1e-5", "data.train_files=[a.jsonl,b.jsonl]"]`` -> [(key, YAML-parsed value)]."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item}: expected section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item}: value is not valid YAML ({err.__class__.__name__}); to pass it as text, "
                f"quote it: {_quoted(key, raw)}"
            ) from None
        parsed.append((key.strip(), value))
    return parsed


def _quoted(key: str, raw: str) -> str:
    """The override with its value as YAML double-quoted text (each item of a ``[...]`` list), in shell quotes."""
    if raw.startswith("[") and raw.endswith("]"):
        value = "[" + ", ".join(json.dumps(item.strip()) for item in raw[1:-1].split(",")) + "]"
    else:
        value = json.dumps(raw)
    return f"{key}={value}" if "'" in value else f"'{key}={value}'"


_SECTIONS = "model|data|kto|train|plugin|output|logging|eval"
_KEY_MENTION = re.compile(rf"(?<![\w./-])((?:{_SECTIONS})(?:\.[A-Za-z_]\w*)+)")


@dataclass
class _Origins:
    """Where each value came from: a line of the YAML file, or a command-line override."""

    path: Path
    lines: dict[str, int]  # dotted key -> the line it is on in the file
    overrides: dict[str, str] = field(default_factory=dict)  # dotted key -> the override as given

    def override_of(self, key: str) -> str | None:
        """The override that set ``key`` itself (or a section above it), as given; else, for a key inside a section,
        one that set a key below it (``train.lr.x=1`` made the value a mapping); None if none did."""
        above = next(
            (item for k, item in self.overrides.items() if key == k or key.startswith(k + ".")), None
        )
        if above or "." not in key:
            return above
        return next((item for k, item in self.overrides.items() if k.startswith(key + ".")), None)

    def where(self, keys: list[str]) -> str:
        """``override K=V[, ...]`` for the overrides that set any of ``keys`` (with ``and file:line`` for one of
        the others the file sets); else ``file:line`` of each of them the file sets; else the file."""
        given = list(dict.fromkeys(o for o in map(self.override_of, keys) if o))
        from_file = [self.lines[k] for k in keys if k in self.lines and not self.override_of(k)]
        if given:
            also = f" and {self.path}:{from_file[0]}" if from_file else ""
            return "override " + ", ".join(given) + also
        # A list item's error (data.train_files.0) is on its key's line; a key the file leaves out has none. A
        # problem of several keys the file sets names each one's line.
        candidates = [re.sub(r"(\.\d+)+$", "", k) for k in keys]
        lines = sorted({self.lines[k] for k in candidates if k in self.lines})
        return " and ".join(f"{self.path}:{line}" for line in lines) if lines else str(self.path)

    def line(self, key: str, problem: str) -> str:
        """One error line for ``problem`` with ``key`` (a key or a section, "" for the whole config): a problem
        naming keys itself (a cross-key check) is blamed on them, otherwise on ``key``."""
        named = [k for k in _KEY_MENTION.findall(problem) if not key or k == key or k.startswith(key + ".")]
        where = self.where(named or [key])
        if not key or problem.startswith(key) or where == f"override {self.overrides.get(key)}":
            return f"{where}: {problem}"
        return f"{where}: {key}: {problem}"


# What a value brought from TRL / transformers means here, for the field errors it gets: pydantic's bare message
# ("Input should be a valid string") does not say what to write instead.
_FIELD_HINTS = {
    ("train.resume", "string_type"): "use auto (the newest checkpoint) or a checkpoint path",
    ("train.max_steps", "greater_than_equal"): "null (or leave it out) for no limit",
}


def _hint(key: str, kind: str, value: Any) -> str:
    """``; what to write instead`` for a field error _FIELD_HINTS knows, else ""."""
    hint = _FIELD_HINTS.get((key, kind))
    if key == "train.micro_batch_size" and kind == "greater_than_equal" and value == 1:  # TRL's batch of 1
        hint = (
            "each micro-batch must hold both labels (a desirable and an undesirable example); for the same "
            "examples per step set 2 and halve train.accumulation_steps"
        )
    return f"; {hint}" if hint else ""


def _format_errors(err: ValidationError, origins: _Origins, top: dict[str, Any]) -> str:
    """One line per error; ``top``: the file's top-level mapping, which a TRL-style flat YAML's unknown keys are
    read beside (``dataset_config`` joins ``dataset_name``, ``bf16`` sees ``use_peft``)."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = unknown_key_problem(key, e.get("input"), top if "." not in key else None)
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and not isinstance(e["input"], (dict, BaseModel)):  # a section's own check: no dump
            msg = f"{msg} (got {e['input']!r})"
            msg += _hint(key, e["type"], e["input"])
        lines += [origins.line(key, part) for part in msg.split("\n")]
    return "\n".join(lines)


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> the 1-based line of the key, for every key of the YAML mapping ``node``."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            lines[dotted] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, dotted + "."))
    return lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last one
    silently, so a second ``train:`` block holding only ``seed: 3`` dropped the first block's lr and steps."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKeyError(key, seen[key], key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _DuplicateKeyError(Exception):
    def __init__(self, key: Any, first_line: int, line: int) -> None:
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


def _read_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    """The parsed file and the line of each of its keys; ConfigError naming file and line for a missing file, a
    directory, bad YAML or a key given twice."""
    try:
        text = path.read_text()
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
        return data, _key_lines(yaml.compose(text, Loader=yaml.SafeLoader))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(
            f"{path}: is a directory, not a config file (pass the YAML file inside it)"
        ) from None
    except _DuplicateKeyError as err:
        raise ConfigError(
            f"{path}:{err.line}: key {err.key!r} is given twice in the same section (first on line "
            f"{err.first_line}); YAML would silently keep only the second: merge them"
        ) from None
    except yaml.YAMLError as err:
        # The context mark (e.g. where an unclosed bracket opened) is nearer the mistake than the problem mark.
        mark = getattr(err, "context_mark", None) or getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Read ``path``, apply ``overrides``, validate; raises ConfigError listing every problem, each blamed on
    the override that set the value or on the file's line."""
    path = Path(path)
    raw, lines = _read_yaml(path)
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    for name in ("kto", "train", "plugin", "logging"):  # a section whose keys are all commented out: defaults
        if name in raw and raw[name] is None:
            raw[name] = {}
    origins = _Origins(path, lines)
    for item, (key, value) in zip(overrides or [], parse_overrides(overrides or []), strict=True):
        _set_dotted(raw, key, value, f"override {item}")
        origins.overrides[key] = item
    try:
        config = Config.model_validate(raw, context={DEFER_SECTION_PROBLEMS: True})  # every problem at once
    except ValidationError as err:
        raise ConfigError(_format_errors(err, origins, raw)) from None
    return config


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config (defaults filled in) next to the run's outputs. Call on one rank."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(config.to_yaml())
