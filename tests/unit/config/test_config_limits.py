"""Bad values refused at config load, one line each, rather than later with a traceback or a deleted run:
data.prepared_dir and output.dir one inside the other, true for plugin.zero_stage, numbers past what numpy,
torch and timedelta take, and empty paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.limits import RUN_OUTPUTS
from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.runtime import run_dir


def _errors(path: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value).splitlines()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # MINIMAL's relative prepared_dir and output.dir: from the working directory
    return write_config(tmp_path, MINIMAL)


def test_output_dir_at_or_inside_prepared_dir_is_refused(config: Path, tmp_path: Path) -> None:
    """A run there went with the old copy when `prepare` rebuilt prepared_dir by rename."""
    fix = "give them separate directories (or leave data.prepared_dir unset: output.dir/prepared)"
    rebuild = (
        "`prepare` with changed settings replaces data.prepared_dir whole, deleting the run's checkpoints"
    )
    assert _errors(config, ["output.dir=prepared"]) == [
        f"override output.dir=prepared and {config}:5: data.prepared_dir and output.dir are the same directory "
        f"({tmp_path / 'prepared'}): {rebuild}; {fix}"
    ]
    assert _errors(config, ["output.dir=./prepared/../prepared/run"]) == [
        f"override output.dir=./prepared/../prepared/run and {config}:5: output.dir {tmp_path / 'prepared/run'} "
        f"is inside data.prepared_dir {tmp_path / 'prepared'}: {rebuild}; {fix}"
    ]
    # The same directory by way of a link.
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    assert len(_errors(config, ["data.prepared_dir=link"])) == 1


def test_prepared_dir_inside_what_a_run_replaces_is_refused(config: Path, tmp_path: Path) -> None:
    assert _errors(config, ["data.prepared_dir=out/final/data"]) == [
        f"override data.prepared_dir=out/final/data and {config}:7: data.prepared_dir "
        f"{tmp_path / 'out/final/data'} is inside output.dir's final/, which a run replaces (and output.overwrite "
        "deletes), the prepared data with it; give them separate directories (or leave data.prepared_dir unset: "
        "output.dir/prepared)"
    ]
    # Beside the run's outputs, as the default output.dir/prepared is: taken.
    assert load_config(config, ["data.prepared_dir=out/data"]).data.prepared_dir == "out/data"
    assert load_config(config, ["data.prepared_dir=null"]).data.prepared_dir == "out/prepared"


def test_the_run_outputs_are_run_dirs() -> None:
    assert run_dir.RUN_OUTPUTS == RUN_OUTPUTS


def test_true_is_not_a_zero_stage(config: Path) -> None:
    assert _errors(config, ["plugin.zero_stage=true"]) == [
        "override plugin.zero_stage=true: must be 0, 1 or 2, not a boolean (got True)"
    ]


BIG, HUGE = "99999999999999999999999", "1.0e+308"  # an int for the int keys, a float for the seconds


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("data.max_length", BIG, "2147483647"),
        ("data.max_prompt_length", BIG, "2147483647"),
        ("data.pad_to_multiple_of", BIG, "2147483647"),
        ("train.seed", BIG, "4294967295"),
        ("train.dist_timeout", HUGE, "864000"),
        ("train.file_wait_timeout", HUGE, "864000"),
        ("train.heartbeat_timeout", HUGE, "864000"),
    ],
)
def test_numbers_past_their_bound_are_refused(tmp_path: Path, key: str, value: str, bound: str) -> None:
    """data.max_length 1e23 raised OverflowError in numpy at prepare, train.seed 1e23 ValueError in manual_seed,
    train.dist_timeout 1e308 OverflowError at timedelta."""
    section, name = key.split(".")
    text = MINIMAL + "train:\n  micro_batch_size: 2\n"  # lines 8-9; the key: line 4 or 10
    path = write_config(tmp_path, text.replace(f"{section}:\n", f"{section}:\n  {name}: {value}\n", 1))
    line = 4 if section == "data" else 9
    got = int(value) if value == BIG else float(value)
    assert _errors(path, []) == [
        f"{path}:{line}: {key}: Input should be less than or equal to {bound} (got {got!r})"
    ]


def test_numbers_at_their_bound_are_taken(config: Path) -> None:
    bounds = ["train.seed=4294967295", "train.dist_timeout=864000", "data.max_length=2147483647"]
    loaded = load_config(config, bounds)
    assert (loaded.train.seed, loaded.data.max_prompt_length) == (4294967295, 1073741823)


def test_a_max_length_past_its_bound_is_one_error(config: Path) -> None:
    """The prompt budget it sets by default (half of it) is not a second error, about a key not set."""
    assert _errors(config, ["data.max_length=99999999999999999999999"]) == [
        "override data.max_length=99999999999999999999999: Input should be less than or equal to 2147483647 "
        "(got 99999999999999999999999)"
    ]


@pytest.mark.parametrize(("key", "line"), [("model.path", 2), ("data.prepared_dir", 5), ("output.dir", 7)])
def test_an_empty_path_is_refused(tmp_path: Path, key: str, line: int) -> None:
    """data.prepared_dir "" became the working directory; output.dir "" too."""
    name = key.split(".")[1]
    text = MINIMAL.replace(f"  {name}: ", f"  {name}: ''  # ", 1)
    path = write_config(tmp_path, text)
    assert _errors(path, []) == [f"{path}:{line}: {key}: String should have at least 1 character (got '')"]


@pytest.mark.parametrize("key", ["model.tokenizer", "model.reference_path"])
def test_an_empty_optional_path_is_refused(config: Path, key: str) -> None:
    """model.tokenizer "" and model.reference_path "" were taken as unset, in silence."""
    assert _errors(config, [f"{key}=''"]) == [
        f"override {key}='': String should have at least 1 character (got '')"
    ]


def test_paths_given_from_home_are_the_folders_they_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an audit: `model.path: ~/tiny` passed the preflight (which expands ~) and then went to transformers as
    a Hub id ("Repo id must use alphanumeric chars", a traceback after prepare); `output.dir: ~/runs/x` made a
    folder named ~ in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = ("model.path", "model.tokenizer", "model.reference_path", "output.dir", "data.prepared_dir")
    config = load_config(
        write_config(tmp_path, MINIMAL),
        [
            *(f"{key}=~/{key}" for key in keys),
            "data.train_files=[~/t.jsonl, hf://datasets/o/n]",
            "train.resume=~/c",
        ],
    )
    dumped = config.model_dump()
    for key in keys:
        section, name = key.split(".")
        assert dumped[section][name] == f"{tmp_path}/{key}", key
    assert config.data.train_files == [f"{tmp_path}/t.jsonl", "hf://datasets/o/n"]
    assert config.train.resume == f"{tmp_path}/c"

    (tmp_path / "~" / "runs").mkdir(parents=True)  # what `output.dir: ~/runs` made before: a folder named ~
    monkeypatch.chdir(tmp_path)
    errors = _errors(write_config(tmp_path, MINIMAL), ["output.dir=~/runs"])
    assert errors == [
        f"override output.dir=~/runs: ./~/runs exists here (a folder named ~, as runs before coati-kto read ~ as the "
        f"home folder made it), and ~ now means {tmp_path}: move it to {tmp_path}/runs, or write ./~/runs (got "
        "'~/runs')"
    ]
