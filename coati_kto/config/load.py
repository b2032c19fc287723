"""Loading a config: the YAML file, ``section.key=value`` overrides, and one error line per mistake.

Every mistake is reported at once, one line each, naming where the value came from (``file:line``, or the
command-line override as given) and the key (with a "did you mean" for an unknown key).
"""

from __future__ import annotations

import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from coati_kto.config.discovery import unknown_key_problem
from coati_kto.config.hidden import combination_problems, valid_sections_problems
from coati_kto.config.schema import Config
from coati_kto.config.section import DEFER_SECTION_PROBLEMS
from coati_kto.errors import ConfigError


def _merge(node: dict[str, Any], key: str, value: Any) -> None:
    """``node[key] = value``, except that a mapping given where a mapping is merges into it key by key (as the
    dotted form does): ``train.seed=1 'train={lr: 0}'`` keeps the seed and the file's other train keys."""
    old = node.get(key)
    if isinstance(value, dict) and isinstance(old, dict):
        node[key] = merged = dict(old)  # a copy: a YAML alias shares the mapping with another key
        for k, v in value.items():
            _merge(merged, k, v)
    else:
        node[key] = value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: cannot set {dotted}: {key} is not a section")
        child = node[key] = dict(child)  # a copy: a YAML alias shares the mapping with another key
        node = child
    _merge(node, keys[-1], value)


def _leaves(key: str, value: Any) -> list[str]:
    """The dotted keys an override of ``key`` sets: each leaf of a (merged) mapping, else ``key`` itself."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [key]


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
    setters: dict[str, str] = field(default_factory=dict)  # dotted key -> the override that set it last

    def record(self, key: str, item: str, value: Any) -> None:
        """The override ``item`` set ``key`` to ``value`` (a mapping: each of its leaves, merged)."""
        self.overrides[key] = item
        for leaf in _leaves(key, value):
            for earlier in [k for k in self.setters if k == leaf or k.startswith(leaf + ".")]:
                del self.setters[earlier]
            self.setters[leaf] = item

    def override_of(self, key: str) -> str | None:
        """The override that set ``key`` itself (or a section above it: the most specific one), as given; else
        one that set a key below it (``train.lr.x=1`` made the value a mapping; ``nosection.x=1`` added a
        section the file lacks); None if none did."""
        above = [k for k in self.setters if key == k or key.startswith(k + ".")]
        if above:
            return self.setters[max(above, key=len)]
        if "." not in key and key in self.lines:  # a section of the file: not blamed on one key set inside it
            return None
        return next((item for k, item in self.setters.items() if key and k.startswith(key + ".")), None)

    def _file_lines(self, keys: list[str]) -> list[int]:
        """The lines of ``keys`` in the file (a list item's error, data.train_files.0, is on its key's line);
        where the file has none of them, the line of each one's nearest ancestor it has below its section
        (``output.push_to_hub.repo_id`` from ``push_to_hub: ""``)."""
        exact = {self.lines[k] for k in (re.sub(r"(\.\d+)+$", "", k) for k in keys) if k in self.lines}
        if exact:
            return sorted(exact)
        near = set()
        for key in keys:
            while key.count(".") > 1 and key not in self.lines:  # not up to a section: it says no more
                key = key.rsplit(".", 1)[0]
            if key in self.lines:
                near.add(self.lines[key])
        return sorted(near)

    def where(self, keys: list[str]) -> str:
        """``override K=V[, ...]`` for the overrides that set any of ``keys`` (with ``and file:line`` for one of
        the others the file sets); else ``file:line`` of each of them the file sets; else the file."""
        given = list(dict.fromkeys(o for o in map(self.override_of, keys) if o))
        from_file = [self.lines[k] for k in keys if k in self.lines and not self.override_of(k)]
        if given:
            also = f" and {self.path}:{from_file[0]}" if from_file else ""
            return "override " + ", ".join(given) + also
        lines = self._file_lines(keys)
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


_MERGE, _STR = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:str"
_KINDS = {"int": "a number", "float": "a number", "bool": "a boolean", "null": "null", "timestamp": "a date"}


@dataclass
class _Keys:
    """The walk of the YAML file's nodes: the line of each key, and a problem for each key that is not text."""

    path: Path
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> its 1-based line
    problems: list[str] = field(default_factory=list)
    _reported: set[int] = field(default_factory=set)

    def walk(self, node: yaml.Node, prefix: str = "", path: frozenset[int] = frozenset()) -> None:
        """Record the keys under ``node``; drop each pair whose key is not a string (a number, ``on``, ``null``,
        ``? [a, b]``), saying so with its line. Merged mappings (``<<: *anchor``) first: a key of the mapping
        itself wins over them, as YAML has it, and the first of ``<<: [*a, *b]`` over the others."""
        if id(node) in path:  # a recursive alias
            return
        path |= {id(node)}
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.walk(item, f"{prefix}{index}.", path)
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in reversed(sources):
                    self.walk(source, prefix, path)
        kept = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                kept.append((key_node, value_node))
            elif self._text_key(key_node, prefix):
                kept.append((key_node, value_node))
                self.lines[prefix + key_node.value] = key_node.start_mark.line + 1
                self.walk(value_node, f"{prefix}{key_node.value}.", path)
        node.value = kept

    def _text_key(self, key_node: yaml.Node, prefix: str) -> bool:
        if key_node.tag == _STR and isinstance(key_node, yaml.ScalarNode):
            return True
        if id(key_node) not in self._reported:  # a mapping merged in elsewhere too: said once
            self._reported.add(id(key_node))
            where = f"{self.path}:{key_node.start_mark.line + 1}"
            if isinstance(key_node, yaml.ScalarNode):
                text = key_node.value or "(empty)"
                kind = _KINDS.get(key_node.tag.rsplit(":", 1)[-1], key_node.tag)
                self.problems.append(
                    f"{where}: {prefix}{text}: keys must be strings ({text} is read as {kind})"
                )
            else:
                kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                self.problems.append(
                    f"{where}: {prefix.rstrip('.') or 'top level'}: keys must be strings (got {kind} as a key)"
                )
        return False


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last one
    silently, so a second ``train:`` block holding only ``seed: 3`` dropped the first block's lr and steps. A key
    merged in (``<<: *anchor``) is no duplicate: the mapping's own key overrides it, as YAML has it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKeyError(key, seen[key], key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)  # flatten_mapping: the merged keys, then its own


class _DuplicateKeyError(Exception):
    def __init__(self, key: Any, first_line: int, line: int) -> None:
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


def _text(path: Path) -> str:
    """The file's text; ConfigError for a missing file, a directory, or bytes that are not UTF-8."""
    try:
        data = path.read_bytes()
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(
            f"{path}: is a directory, not a config file (pass the YAML file inside it)"
        ) from None
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        utf16 = "; UTF-16: save it as UTF-8" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else ""
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at position {err.start}{utf16})"
        ) from None


def _read_yaml(path: Path) -> tuple[Any, _Keys]:
    """The parsed file, the line of each of its keys and its keys that are not text (dropped); ConfigError naming
    file and line for a missing file, a directory, bytes that are not UTF-8, bad YAML or a key given twice."""
    text, keys = _text(path), _Keys(path)
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # its reader refuses control characters (a NUL) at once
        node = loader.get_single_node()
        if node is None:
            return None, keys
        keys.walk(node)
        return loader.construct_document(node), keys
    except _DuplicateKeyError as err:
        raise ConfigError(
            f"{path}:{err.line}: key {err.key!r} is given twice in the same section (first on line "
            f"{err.first_line}); YAML would silently keep only the second: merge them"
        ) from None
    except yaml.reader.ReaderError as err:
        line = text[: err.position].count("\n") + 1
        raise ConfigError(
            f"{path}:{line}: not valid YAML (character #x{err.character:04x}: {err.reason})"
        ) from None
    except yaml.YAMLError as err:
        # The context mark (e.g. where an unclosed bracket opened) is nearer the mistake than the problem mark.
        mark = getattr(err, "context_mark", None) or getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _empty_sections(raw: dict[str, Any]) -> None:
    """A section whose keys are all commented out (``eval:``, read as null) is the section's defaults; a section
    that may be left out (``output``) is left out."""
    for name, spec in Config.model_fields.items():
        if name in raw and raw[name] is None and type(None) not in typing.get_args(spec.annotation):
            raw[name] = {}


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Read ``path``, apply ``overrides``, validate; raises ConfigError listing every problem, each blamed on
    the override that set the value or on the file's line."""
    path = Path(path)
    raw, keys = _read_yaml(path)
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    _empty_sections(raw)
    origins = _Origins(path, keys.lines)
    for item, (key, value) in zip(overrides or [], parse_overrides(overrides or []), strict=True):
        _set_dotted(raw, key, value, f"override {item}")
        origins.record(key, item, value)
    try:
        config = Config.model_validate(raw, context={DEFER_SECTION_PROBLEMS: True})  # every problem at once
    except ValidationError as err:
        problems = [*keys.problems, _format_errors(err, origins, raw)]
        if all(e["loc"] for e in err.errors()):  # a field failed: the config's own checks did not run
            hidden = valid_sections_problems(raw)
            hidden += [p for p in combination_problems(raw, err) if p not in hidden]
            problems += [origins.line("", p) for p in hidden]
        raise ConfigError("\n".join(problems)) from None
    if keys.problems:
        raise ConfigError("\n".join(keys.problems))
    return config


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config (defaults filled in) next to the run's outputs. Call on one rank."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(config.to_yaml())
