"""Bad command-line input: one line and exit 2, no traceback (the process as a user runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PLAN_CONFIG


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coati_kto", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("value", ["nan", "inf", "1e308"])
def test_plan_gpu_memory_not_a_finite_number(tmp_path: Path, tiny_model_dir: Path, value: str) -> None:
    """nan raised ValueError and inf OverflowError (int() of the bytes), each a traceback."""
    config = tmp_path / "cfg.yaml"
    config.write_text(PLAN_CONFIG.format(model=tiny_model_dir))
    proc = _run("plan", str(config), "--gpu-memory", value)
    shown = f"{float(value):g}"
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"error: --gpu-memory must be a number of GiB <= 1e+06, got {shown}"]


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_missing_config_names_only_what_is_required(command: str) -> None:
    """The overrides (any number, none too) were named among the required arguments."""
    proc = _run(command)
    assert proc.returncode == 2
    # one line, as every user mistake (argparse printed its usage block before it, from a CLI audit)
    assert proc.stderr.splitlines() == [
        f"error: coati-kto {command}: the following arguments are required: config (coati-kto {command} --help "
        "lists its options)"
    ]


def test_an_unknown_option_after_a_command_names_that_command() -> None:
    """It printed the top-level usage (4 lines) ending "coati-kto: error: unrecognized arguments"."""
    proc = _run("inspect", "cfg.yaml", "--bogus")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: coati-kto inspect: unrecognized arguments: --bogus (coati-kto inspect --help lists its options)"
    ]
