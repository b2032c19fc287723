"""Config errors blamed on the input that holds the mistake: a command-line override by itself as given, a value
of the YAML file by ``file:line``; TRL's command-line flags get the overrides they mean, in one line."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.cli_args import parse as _parse
from coati_kto.config.discovery import TRAINER_NAMES, all_keys
from coati_kto.config.load import load_config
from coati_kto.config.trl_flags import DATASET_QUERY, SCRIPT_FLAGS, SWITCHES
from coati_kto.errors import ConfigError

# MINIMAL is lines 1-7; these are lines 8-11.
TEXT = MINIMAL + "train:\n  micro_batch_size: 0\nplugin:\n  name: ddp\n"


def _errors(path: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value).splitlines()


def test_an_invalid_override_is_named_not_the_file(tmp_path: Path) -> None:
    """`train.micro_batch_size=-1` was reported as `cfg.yaml: train.micro_batch_size: ...`, a mistake of the file."""
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["train.micro_batch_size=-1"]) == [
        "override train.micro_batch_size=-1: Input should be greater than or equal to 2 (got -1)"
    ]
    assert _errors(path, ["train.lr=1e-5", "train.learning_rate=1e-5", "model.lora={rank: 0}"]) == [
        "override model.lora={rank: 0}: model.lora.rank: Input should be greater than or equal to 1 (got 0)",
        "override train.learning_rate=1e-5: unknown key (did you mean train.lr?)",
    ]
    assert _errors(path, ["model.path.x=1"]) == [
        "override model.path.x=1: cannot set model.path.x: path is not a section"
    ]


def test_a_value_of_the_file_is_named_by_its_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, TEXT.replace("train_files: data.jsonl", "train_files: [a.jsonl, [7]]"))
    assert _errors(path, []) == [
        f"{path}:4: data.train_files.1: Input should be a valid string (got [7])",
        f"{path}:9: train.micro_batch_size: Input should be greater than or equal to 2 (got 0)",
    ]
    # The same key, overridden: the override is named, not the file.
    path = write_config(tmp_path, TEXT)
    assert _errors(path, ["train.micro_batch_size=-3"]) == [
        "override train.micro_batch_size=-3: Input should be greater than or equal to 2 (got -3)"
    ]


def test_a_cross_key_problem_names_each_input_it_comes_from(tmp_path: Path) -> None:
    path = write_config(tmp_path, TEXT.replace("micro_batch_size: 0", "micro_batch_size: 2"))
    assert _errors(path, ["plugin.tp_size=2"]) == [
        "override plugin.tp_size=2: plugin.tp_size 2 needs hybrid_parallel, not ddp"
    ]
    assert _errors(path, ["plugin.precision=bf16"]) == [
        f"override plugin.precision=bf16 and {path}:11: plugin.name ddp trains in fp32 here (got plugin.precision "
        "bf16): set plugin.precision=fp32, or use low_level_zero / hybrid_parallel for bf16"
    ]
    # A section's own cross-key check (model_validator "after"): its message, not the section object's dump too.
    derived = write_config(tmp_path, MINIMAL.replace("  prepared_dir: prepared\n", ""))  # from output.dir
    assert _errors(derived, ["data.max_length=64", "data.max_prompt_length=64"]) == [
        "override data.max_prompt_length=64, data.max_length=64: data.max_prompt_length (64) must be "
        "smaller than data.max_length (64) to leave room for the completion"
    ]
    both = write_config(tmp_path, MINIMAL + "kto:\n  auto_weights: true\n  desirable_weight: 1.2\n")
    assert _errors(both, []) == [
        f"{both}:9 and {both}:10: kto.desirable_weight 1.2 with kto.auto_weights: the weights are computed from the "
        "data and "
        "yours would be ignored; set kto.auto_weights=false to use them, or leave them at 1"
    ]
    assert _errors(both, ["kto.desirable_weight=1.3"])[0].startswith(
        f"override kto.desirable_weight=1.3 and {both}:9: kto.desirable_weight 1.3 with kto.auto_weights:"
    )


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        (
            "data.train_files=[hf://datasets/o/n?config=en&revision=3f2a9c]",
            "'data.train_files=[\"hf://datasets/o/n?config=en&revision=3f2a9c\"]'",
        ),
        ("output.dir=@runs/a", "'output.dir=\"@runs/a\"'"),
        ("output.dir=`date`", "'output.dir=\"`date`\"'"),
    ],
)
def test_an_override_that_is_not_yaml_says_how_to_quote_it(
    tmp_path: Path, override: str, quoted: str
) -> None:
    """A value YAML cannot parse was "value is not valid YAML (ParserError)", with no word on quoting."""
    path = write_config(tmp_path, MINIMAL)
    (line,) = _errors(path, [override])
    assert line.startswith(f"override {override}: value is not valid YAML (")
    assert line.endswith(f"); to pass it as text, quote it: {quoted}")
    # The quoted form, as the shell passes it, loads and holds the text given.
    (as_given,) = shlex.split(quoted)
    key, _, raw = override.partition("=")
    config = load_config(path, [as_given])
    got = config.data.train_files if key == "data.train_files" else config.output.dir
    assert got == ([raw[1:-1]] if raw.startswith("[") else raw)


def _trl_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_trl_flags_get_the_overrides_they_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model_name_or_path M --dataset_name D` was argparse's "unrecognized arguments" (with M taken for the
    config file when no config came first)."""
    line = _trl_line(
        ["train", "--model_name_or_path", "Qwen/Qwen2-0.5B", "--dataset_name", "trl-lib/kto"], capsys
    )
    assert line == (
        "error: TRL-style flags are not options of coati-kto train: --model_name_or_path Qwen/Qwen2-0.5B is "
        "model.path=Qwen/Qwen2-0.5B; --dataset_name trl-lib/kto is data.train_files=hf://datasets/trl-lib/kto; as "
        "overrides after the config: coati-kto train CONFIG.yaml model.path=Qwen/Qwen2-0.5B "
        "data.train_files=hf://datasets/trl-lib/kto (coati-kto config --schema lists every key)"
    )
    path = write_config(tmp_path, MINIMAL)
    flags = [
        *("--dataset_name", "trl-lib/kto-mix-14k", "--dataset_config", "en", "--learning_rate", "5e-7"),
        *("--beta=0.2", "--per_device_train_batch_size", "4", "--output_dir", "runs/a", "--num_train_epochs"),
        *("2", "--gradient_accumulation_steps", "8", "--gradient_checkpointing", "--bf16", "--use_peft"),
        *("--lora_r", "16", "--max_steps", "30", "--seed", "3"),
    ]
    line = _trl_line(["inspect", str(path), *flags], capsys)
    command = line.split("as overrides after the config: ")[1].removesuffix(
        " (coati-kto config --schema lists every key)"
    )
    assert command.startswith(f"coati-kto inspect {path} ")
    # The overrides it names load, and hold what TRL's flags said.
    config = load_config(path, shlex.split(command)[3:])
    assert config.data.train_files == ["hf://datasets/trl-lib/kto-mix-14k?config=en"]
    assert (config.train.lr, config.kto.beta, config.train.micro_batch_size) == (5e-7, 0.2, 4)
    assert (config.output.dir, config.train.max_epochs, config.train.accumulation_steps) == ("runs/a", 2, 8)
    assert (config.model.gradient_checkpointing, config.plugin.precision) == (True, "bf16")
    assert (config.model.lora.rank, config.train.max_steps, config.train.seed) == (16, 30, 3)


def test_every_trl_flag_maps_to_a_key_and_other_options_pass(capsys: pytest.CaptureFixture[str]) -> None:
    keys = set(all_keys())
    assert {*SCRIPT_FLAGS.values(), *TRAINER_NAMES.values()} <= keys
    assert {o.split("=")[0] for pair in SWITCHES.values() for o in pair} <= keys
    assert set(DATASET_QUERY) == {"dataset_config", "dataset_train_split", "dataset_revision"}
    # Options of the commands, overrides and a command without a config (tiny-model's --seed) are not TRL's.
    args = _parse(["inspect", "cfg.yaml", "train.seed=1", "--ranks", "2"])
    assert (args.config, args.overrides, args.ranks) == ("cfg.yaml", ["train.seed=1"], 2)
    assert _parse(["tiny-model", "out", "--seed", "3"]).seed == 3
    with pytest.raises(SystemExit):
        _parse(["train", "cfg.yaml", "--bogus", "1"])
    assert "unrecognized arguments: --bogus 1" in capsys.readouterr().err
