"""Config discovery: ``coati-kto --version``, ``coati-kto config CONFIG [overrides]`` (the resolved config with
every default), ``coati-kto config --schema`` (every key: type, default, help) and "did you mean" for typos."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from helpers import MINIMAL, write_config

from coati_kto import __version__
from coati_kto.cli import main
from coati_kto.config.discovery import did_you_mean, schema_lines
from coati_kto.config.load import load_config
from coati_kto.config.push import PushToHubSection
from coati_kto.config.schema import Config, LoraSection, OutputSection
from coati_kto.errors import ConfigError


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    expected = (
        f"coati-kto {__version__} (colossalai {version('colossalai')}, torch {version('torch')}, "
        f"transformers {version('transformers')})"
    )
    assert capsys.readouterr().out.splitlines() == [expected]


def test_config_prints_the_resolved_config_with_every_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert main(["config", str(path), "kto.beta=0.25", "train.lr=1e-6"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index("kto:")
    assert lines[start : start + 7] == [
        "kto:",
        "  loss_type: kto",
        "  beta: 0.25",
        "  desirable_weight: 1.0",
        "  undesirable_weight: 1.0",
        "  auto_weights: false",
        "  kl_scope: step",
    ]
    assert "  lr: 1.0e-06" in lines and "  eval_at_start: true" in lines
    assert [line for line in lines if not line.startswith(" ")] == [
        "model:",
        "data:",
        "kto:",
        "train:",
        "plugin:",
        "output:",
        "logging:",
        "eval:",
    ]
    # Every key of the schema is printed, and the text loads back to the same config.
    printed = yaml.safe_load(out)
    assert {f"{s}.{k}" for s, keys in printed.items() for k in keys} == {
        line.split(":")[0] for line in schema_lines() if line and line.count(".", 0, line.index(":")) == 1
    }
    assert Config.model_validate(printed) == load_config(path, ["kto.beta=0.25", "train.lr=1e-6"])


def test_schema_lists_every_key_with_type_default_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--schema"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("kto.")))
    assert lines[start : start + 6] == [
        "kto.loss_type: kto | apo_zero_unpaired = kto  "
        "# kto (Eq. 7, reference point z0) or apo_zero_unpaired (no z0, no KL passes).",
        "kto.beta: float = 0.1  # Scale of the log-ratio in the sigmoid (higher: stay closer).",
        "kto.desirable_weight: float = 1.0  # lambda_D: weight of desirable examples' loss.",
        "kto.undesirable_weight: float = 1.0  # lambda_U: weight of undesirable examples' loss.",
        "kto.auto_weights: bool = false  # Set the weights into the paper's [1, 4/3] guideline.",
        "kto.kl_scope: step | micro_batch = step  "
        "# z0 over the optimizer step, or per accumulation micro-batch (all ranks).",
    ]
    required = "model.path: str (required)  # Hugging Face model directory (or hub id on machines that reach the hub)."
    assert required in lines
    assert "train.max_steps: int | null = null  # Stop after this many optimizer steps." in lines
    # One line per key of every section, each with a help text.
    keys = [line for line in lines if line]
    sections = [
        OutputSection if f.annotation == OutputSection | None else f.annotation
        for f in Config.model_fields.values()
    ]
    nested = len(LoraSection.model_fields) + len(PushToHubSection.model_fields)
    assert len(keys) == sum(len(section.model_fields) for section in sections) + nested
    assert all("  # " in line and not line.endswith("# None") for line in keys)
    # From a docs audit: constrained types (a non-empty str) printed pydantic's internals
    assert "model.reference_path: str | null = null  # Reference model; defaults to model.path." in lines
    assert not [line for line in keys if "Annotated" in line or "metadata=" in line]


def test_schema_lists_the_keys_of_a_nested_section(capsys: pytest.CaptureFixture[str]) -> None:
    """model.lora's keys were missing from --schema (one line "model.lora: LoraSection | null"), and a typo in
    them got no suggestion."""
    assert main(["config", "--schema"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("model.lora:")))
    assert lines[start : start + 5] == [
        "model.lora: mapping | null = null  # Train LoRA adapters instead of every weight (null: full fine-tuning).",
        "model.lora.rank: int = 8  # LoRA rank r of each adapter's A [r, in] and B [out, r] matrices.",
        "model.lora.alpha: float = 16.0  # LoRA scaling numerator: the update is (alpha / rank) B A.",
        "model.lora.dropout: float = 0.0  "
        "# Recorded in adapter_config.json; training runs it at 0 like all dropout (deterministic KTO).",
        "model.lora.target_modules: list[str] = [q_proj, k_proj, v_proj, o_proj]  "
        "# Module names (suffixes) that get adapters; not the LM head (lm_head) or embeddings. "
        "Unset on a vision-language model: these names in its language model only.",
    ]


@pytest.mark.parametrize(
    "text,message",
    [  # MINIMAL is 7 lines: the text starts on line 8
        ("train:\n  lrr: 1.0\n", "9: train.lrr: unknown key (did you mean train.lr?)"),
        ("trian:\n  lr: 1.0\n", "8: trian: unknown key (did you mean train?)"),
        ("train:\n  beta: 0.2\n", "9: train.beta: unknown key (did you mean kto.beta?)"),
        ("kto:\n  loss: kto\n", "9: kto.loss: unknown key (did you mean kto.loss_type?)"),
        ("kto:\n  zzz: 1\n", "9: kto.zzz: unknown key"),
        ("max_steps: 3\n", "8: max_steps: unknown key (did you mean train.max_steps?)"),  # lost indentation
        ("lr: 1.0e-6\n", "8: lr: unknown key (did you mean train.lr?)"),
    ],
)
def test_unknown_key_suggests_a_close_one(tmp_path: Path, text: str, message: str) -> None:
    path = write_config(tmp_path, MINIMAL + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:{message}"


def test_did_you_mean_on_overrides_and_far_keys() -> None:
    assert did_you_mean("train.warmup") == "train.warmup_steps"
    assert did_you_mean("output.save_intervals") == "output.save_interval"
    assert did_you_mean("train.zzzz") is None
    assert did_you_mean("model.lora.rnak") == "model.lora.rank"
    assert did_you_mean("model.lora.target_module") == "model.lora.target_modules"
    # From a docs audit: `trainlr=1` was told "did you mean train?" (a section: train=1 is wrong too)
    assert did_you_mean("trainlr") == "train.lr" and did_you_mean("train_max_steps") == "train.max_steps"


def test_config_command_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 2
    assert capsys.readouterr().err == "error: coati-kto config needs a config file (or --schema)\n"
    assert main(["config", "--schema", str(write_config(tmp_path, MINIMAL))]) == 2
    assert "takes no config file" in capsys.readouterr().err
    assert main(["config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.yaml'}: config file not found\n"
