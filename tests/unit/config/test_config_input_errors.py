"""Config input that raised a traceback, was refused though valid, or was blamed on the wrong place: bytes that are
not UTF-8, keys that are not text, YAML merge keys, an empty eval section, the override that set a value, and
mistakes that came in rounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.cli import main
from coati_kto.config.load import load_config
from coati_kto.config.trl_flags import trl_flags_line
from coati_kto.errors import ConfigError


def _errors(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return str(info.value).splitlines()


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"model:\n  path: \xff\xfe\n")
    assert main(["config", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}:2: not UTF-8 text (byte 0xff at position 15)\n"
    # The TRL-flag translation reads the file too (best effort): it goes on without it.
    assert trl_flags_line(["train", str(path), "--bf16", "true"]) is not None
    path.write_bytes("model: {}\n".encode("utf-16"))  # a UTF-16 file (with its byte-order mark)
    assert _errors(path) == [f"{path}:1: not UTF-8 text (byte 0xff at position 0; UTF-16: save it as UTF-8)"]


def test_keys_that_are_not_text_are_named_on_their_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = MINIMAL.replace("model:\n", "model:\n  ? [a, b]\n  : 3\n")  # lines 2-3; path: line 4
    text += "train:\n  on: 1\n  seed: -1\nnull: 4\nplugin: {1: x}\n"  # lines 10-14
    path = write_config(tmp_path, text)
    assert main(["config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}:2: model: keys must be strings (got a list as a key)",
        f"{path}:11: train.on: keys must be strings (on is read as a boolean)",
        f"{path}:13: null: keys must be strings (null is read as null)",
        f"{path}:14: plugin.1: keys must be strings (1 is read as a number)",
        f"{path}:12: train.seed: Input should be greater than or equal to 0 (got -1)",
    ]
    # Alone, they are still refused.
    path = write_config(tmp_path, MINIMAL + "train: {1: x}\n")
    assert _errors(path) == [f"{path}:8: train.1: keys must be strings (1 is read as a number)"]


def test_yaml_merge_keys_are_read(tmp_path: Path) -> None:
    """``<<: *anchor`` was refused (no constructor for the merge tag); a key of the mapping itself overrides a
    merged one (no duplicate), and a merged value's mistake is on the line it is written on."""
    text = MINIMAL.replace("model:\n", "model:\n  <<: {trust_remote_code: false}\n").replace(
        "prepared_dir: prepared\n",
        "prepared_dir: prepared\n  <<: [{max_length: 64}, {max_length: 32, max_prompt_length: 16}]\n"
        "  max_length: 128\n",
    )
    path = write_config(tmp_path, text)
    config = load_config(path)
    assert (config.data.max_length, config.data.max_prompt_length, config.model.trust_remote_code) == (
        128,
        16,
        False,
    )
    text = "base: &b\n  path: some/model\n  trust_remote_code: maybe\n" + MINIMAL.replace(
        "model:\n  path: some/model\n", "model:\n  <<: *b\n"
    )
    path = write_config(tmp_path, text)
    assert _errors(path) == [
        f"{path}:3: model.trust_remote_code: Input should be a valid boolean, unable to interpret input "
        "(got 'maybe')",
        f"{path}:1: base: unknown key",
    ]
    # A key given twice in the mapping itself is still a duplicate.
    path = write_config(tmp_path, MINIMAL + "kto:\n  <<: {beta: 0.2}\n  beta: 0.1\n  beta: 0.3\n")
    assert _errors(path) == [
        f"{path}:11: key 'beta' is given twice in the same section (first on line 10); YAML would silently "
        "keep only the second: merge them"
    ]


def test_an_empty_eval_section_is_its_defaults(tmp_path: Path) -> None:
    """``eval:`` with its keys commented out was refused (got None) while kto, train... fell back to defaults."""
    config = load_config(write_config(tmp_path, MINIMAL + "eval:\n  # every: 100\nkto:\n"))
    assert config.eval == type(config.eval)()
    path = write_config(tmp_path, MINIMAL.replace("  path: some/model\n", "  # path: some/model\n"))
    assert _errors(path) == [f"{path}: model.path: required key is missing"]


def test_an_override_adding_a_section_is_named(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["nosection.x=1", "Train.seed=1"]) == [
        "override nosection.x=1: nosection: unknown key",
        "override Train.seed=1: Train: unknown key (did you mean train?)",
    ]


def test_the_most_specific_override_is_named(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["train={lr: 0}", "train.seed=-1"]) == [
        "override train.seed=-1: Input should be greater than or equal to 0 (got -1)",
        "override train={lr: 0}: train.lr: Input should be greater than 0 (got 0)",
    ]
    # A later mapping sets its own keys: it is named for them, not an earlier override of the same key.
    assert _errors(path, ["train.seed=-1", "train={seed: -2}"]) == [
        "override train={seed: -2}: train.seed: Input should be greater than or equal to 0 (got -2)"
    ]


def test_a_key_the_file_leaves_out_is_on_its_nearest_key_line(tmp_path: Path) -> None:
    """`push_to_hub: ""` has no repo_id key of its own: its error is on push_to_hub's line."""
    path = write_config(tmp_path, MINIMAL + '  push_to_hub: ""\n')
    assert _errors(path) == [
        f"{path}:8: output.push_to_hub.repo_id: '' is no Hub repo id (OWNER/NAME) (got '')"
    ]


def test_a_whole_section_override_merges_key_by_key(tmp_path: Path) -> None:
    """`train={lr: 0.001}` after `train.seed=7` dropped the seed and the file's other train keys."""
    path = write_config(tmp_path, MINIMAL + "train:\n  micro_batch_size: 4\n")
    config = load_config(path, ["train.seed=7", "train={lr: 0.001}", "model={lora: {rank: 4}}"])
    assert (config.train.seed, config.train.lr, config.train.micro_batch_size) == (7, 0.001, 4)
    assert (config.model.path, config.model.lora.rank) == ("some/model", 4)
    # Any other value replaces.
    assert load_config(path, ["data.train_files=[a.jsonl]"]).data.train_files == ["a.jsonl"]


def test_every_problem_is_listed_at_once(tmp_path: Path) -> None:
    """A field error (train.seed) hid the sections' own cross-key problems until it was fixed."""
    text = MINIMAL.replace(
        "prepared_dir: prepared\n", "prepared_dir: prepared\n  max_length: 64\n  max_prompt_length: 100\n"
    )
    path = write_config(tmp_path, text + "train:\n  seed: -1\n")  # lines 6, 7 and 11
    assert _errors(path) == [
        f"{path}:11: train.seed: Input should be greater than or equal to 0 (got -1)",
        f"{path}:6 and {path}:7: data.max_prompt_length (100) must be smaller than data.max_length (64) to leave "
        "room for the completion",
    ]


def test_a_control_character_is_one_line_with_its_line(tmp_path: Path) -> None:
    """PyYAML's reader error ran over two lines, with no line number (`in "<unicode string>", position 58`)."""
    path = write_config(tmp_path, MINIMAL.replace("dir: out", "dir: o\0ut"))
    assert _errors(path) == [
        f"{path}:7: not valid YAML (character #x0000: special characters are not allowed)"
    ]


def test_a_field_error_no_longer_hides_the_configs_own_checks(tmp_path: Path) -> None:
    """``Config``'s cross-section checks (settings that override each other in silence, a merge without LoRA)
    ran only on a config whose every field was valid: with a mistyped value beside them, they came in a second
    round. They now run with the mistyped key at its default, and a problem naming that key is left out."""
    text = MINIMAL + (
        "kto:\n  auto_weights: true\n  desirable_weight: 2.0\n"  # lines 8-10: the weights would be ignored
        "train:\n  seed: -1\n  lr: fast\n"  # lines 11-13: two field errors
    )
    path = write_config(tmp_path, text)
    assert _errors(path) == [
        f"{path}:12: train.seed: Input should be greater than or equal to 0 (got -1)",
        f"{path}:13: train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')",
        f"{path}:9 and {path}:10: kto.desirable_weight 2 with kto.auto_weights: the weights are computed from the "
        "data and yours would be ignored; set kto.auto_weights=false to use them, or leave them at 1",
    ]
    # A check on a key that failed is not run on its default: kto.desirable_weight mistyped says only that.
    path = write_config(tmp_path, text.replace("desirable_weight: 2.0", "desirable_weight: heavy"))
    lines = _errors(path)
    assert [line.split(": ")[1] for line in lines] == ["kto.desirable_weight", "train.seed", "train.lr"], (
        lines
    )
    # A required key missing leaves no config to check: the field errors alone, as before.
    path = write_config(tmp_path, text.replace("  path:", "  not_path:"))
    assert not any("auto_weights" in line for line in _errors(path))
