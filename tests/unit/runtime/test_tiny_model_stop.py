"""A stop signal while ``coati-kto tiny-model`` writes its folder: one line, 128 + the signal, and the folder whole
or as it was (``durable.write_dir`` writes a copy beside it and renames it in).

Before: SIGTERM and SIGUSR1 had the default action (no line, and the weights without their tokenizer and
README.md left in the folder); a Ctrl-C there said ``nothing written`` over the same half-written folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coati_kto.models.tiny import write_tiny_model

# The process sends itself the signal as the tokenizer is saved: the weights are written, the rest is not.
_CHILD = """
import os, signal, sys

from transformers import PreTrainedTokenizerFast

signame = sys.argv[1]
saved = PreTrainedTokenizerFast.save_pretrained


def signalled(self, *args, **kwargs):
    os.kill(os.getpid(), getattr(signal, signame))
    return saved(self, *args, **kwargs)


PreTrainedTokenizerFast.save_pretrained = signalled
sys.argv = ["coati-kto", *sys.argv[2:]]
from coati_kto.cli import entry

sys.exit(entry())
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _stopped(signame: str, out: Path, seed: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, signame, "tiny-model", str(out), "--seed", str(seed)],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_stop_mid_write_leaves_nothing_half_written(tmp_path: Path, signame: str) -> None:
    out = tmp_path / "tiny"
    done = _stopped(signame, out, seed=1)
    assert (done.returncode, done.stdout, done.stderr) == (
        128 + getattr(signal, signame),
        "",
        f"tiny-model stopped by {signame}: nothing written to {out}\n",
    )
    assert sorted(tmp_path.iterdir()) == []  # no folder, no partial copy beside it, no lock file


def test_a_stop_mid_rewrite_leaves_the_previous_model_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    write_tiny_model(out, seed=0, hidden_size=8, num_layers=1)
    before = _files(out)
    assert {"model.safetensors", "tokenizer.json", "README.md"} <= set(before)
    done = _stopped("SIGTERM", out, seed=1)
    assert (done.returncode, done.stderr) == (143, f"tiny-model stopped by SIGTERM: {out} is as it was\n")
    assert _files(out) == before
    assert sorted(tmp_path.iterdir()) == [out]


def test_an_unstopped_write_is_the_same_model(tmp_path: Path) -> None:
    """Through the CLI (write_dir) and in place, the same arguments write the same files."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    cli = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "coati_kto", "tiny-model", str(cli), "--seed", "3"],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {cli}: a random Llama (")
    write_tiny_model(tmp_path / "direct", seed=3)
    assert _files(cli) == _files(tmp_path / "direct")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "direct"]


@pytest.mark.parametrize("name", [".", "sub/.."])
def test_the_current_folder_is_refused_in_one_line(tmp_path: Path, name: str) -> None:
    """``coati-kto tiny-model .`` (an empty current folder): ``write_dir`` renamed "." aside, which rename(2)
    refuses (EBUSY): a traceback, exit 1, and an empty ``..coati-kto-old-*`` folder left in it. Now one line,
    exit 2, nothing written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-m", "coati_kto", "tiny-model", name],
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[3])},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"error: coati-kto tiny-model: {name} is the current folder or holds it, and the model's folder is "
        "written beside it and renamed in (a stop leaves it whole or as it was): name a folder inside it, e.g. "
        "tiny (nothing was written)\n"
    )
    assert sorted(tmp_path.iterdir()) == []
