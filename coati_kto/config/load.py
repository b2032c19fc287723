"""Loading a config: the YAML file, ``section.key=value`` overrides, and one error line per mistake.

Every mistake is reported at once, one line each, naming the file and the key (with a "did you mean" for an
unknown key).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from coati_kto.config.discovery import did_you_mean
from coati_kto.config.schema import Config
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
            raise ConfigError(f"override {item!r}: expected section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: value is not valid YAML ({err.__class__.__name__})"
            ) from None
        parsed.append((key.strip(), value))
    return parsed


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = did_you_mean(key)
            msg = f"unknown key (did you mean {close}?)" if close else "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines += [f"{source}: {key}: {part}" if key else f"{source}: {part}" for part in msg.split("\n")]
    return "\n".join(lines)


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


def _read_yaml(path: Path) -> Any:
    """The parsed file; ConfigError naming file and line for a missing file, a directory, bad YAML or a key
    given twice."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
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


def _refuse_ignored_settings(config: Config, path: Path) -> None:
    """Settings that another one would override in silence: one line per pair, all at once."""
    problems = []
    if config.data.eval_files and config.data.eval_fraction > 0:
        problems.append(
            f"{path}: data.eval_fraction {config.data.eval_fraction} with data.eval_files: the fraction is "
            "held out only when data.eval_files is empty; set one of them"
        )
    kto = config.kto
    weights = {"desirable_weight": kto.desirable_weight, "undesirable_weight": kto.undesirable_weight}
    if kto.auto_weights and any(value != 1.0 for value in weights.values()):
        given = ", ".join(f"kto.{key} {value:g}" for key, value in weights.items() if value != 1.0)
        problems.append(
            f"{path}: {given} with kto.auto_weights: the weights are computed from the data and yours would be "
            "ignored; set kto.auto_weights=false to use them, or leave them at 1"
        )
    if problems:
        raise ConfigError("\n".join(problems))


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Read ``path``, apply ``overrides``, validate; raises ConfigError listing every problem."""
    path = Path(path)
    raw = _read_yaml(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    for name in ("kto", "train", "plugin", "logging"):  # a section whose keys are all commented out: defaults
        if name in raw and raw[name] is None:
            raw[name] = {}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value, f"{path} (override {key})")
    try:
        config = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, str(path))) from None
    _refuse_ignored_settings(config, path)
    return config


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config (defaults filled in) next to the run's outputs. Call on one rank."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(config.to_yaml())
