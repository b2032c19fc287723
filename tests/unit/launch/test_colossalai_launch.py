"""``coati_kto.colossalai_launch`` (``colossalai run``) and launch/colossalai_run.sh: what the nodes' shells are
given, and the exit status of ColossalAI's own checks. The launches themselves are the drills' (tests/drills)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coati_kto.launch import colossalai as launcher

REPO = Path(__file__).resolve().parents[3]


def test_the_node_command_cds_into_a_path_with_quotes_and_dollars(tmp_path: Path, monkeypatch) -> None:
    """ColossalAI's own cd escapes spaces only: a repository under /home/o'brien broke every node's command
    ("unexpected EOF while looking for matching"). The command now starts with its own quoted cd."""
    workdir = tmp_path / "o'brien's $HOME \"repo\""
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    command = launcher._quoting(lambda **kw: f"torchrun {kw['user_script']} {' '.join(kw['user_args'])}")(
        user_script="-m", user_args=["coati_kto", "train", "my config.yaml"]
    )
    done = subprocess.run(
        ["bash", "-c", f'cd / && export A="1" && {command.replace("torchrun", "pwd; printf %s,")}'],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(workdir), "-m,coati_kto,train,my config.yaml,"]


def test_master_addr_reaches_torchrun_as_one_literal_argument(tmp_path: Path, monkeypatch) -> None:
    """From a security audit: MASTER_ADDR went unquoted into the command every node's shell runs, so a value holding
    ``;`` or ``$()`` ran as a command there (and the launcher still said success). ColossalAI's own
    get_launch_command, through ``_quoting``."""
    from colossalai.cli.launcher.run import get_launch_command

    marker = tmp_path / "ran"
    monkeypatch.chdir(tmp_path)
    addr = f"10.0.0.1;touch {marker};$(touch {marker})"
    command = launcher._quoting(get_launch_command)(
        master_addr=addr,
        master_port=29500,
        nproc_per_node=2,
        user_script="coati_kto",
        user_args=["train", "c.yaml"],
        node_rank=0,
        num_nodes=2,
        run_as_module=True,
    )
    done = subprocess.run(
        ["bash", "-c", command.replace("torchrun", "printf %s,", 1)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"--master_addr={addr}," in done.stdout
    assert not marker.exists()


def test_values_the_export_line_cannot_carry_are_left_out(monkeypatch, capsys) -> None:
    """ColossalAI re-exports the environment as export K="V" on every node: a value holding a double quote broke
    the line, one holding $(...) ran on every node. Those, and secret-looking names, are left out and named."""
    monkeypatch.setenv("QUOTED", 'a"b')
    monkeypatch.setenv("INJECTED", "$(touch /tmp/x)")
    monkeypatch.setenv("BACKSLASH", "a\\b")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("PLAIN", "a b [c] 'd'")
    launcher._leave_out_of_the_export_line()
    assert "PLAIN" in os.environ
    assert not {"QUOTED", "INJECTED", "BACKSLASH", "HF_TOKEN"} & set(os.environ)
    err = capsys.readouterr().err
    assert err.startswith("launcher: not passed to the nodes: ") and "hf_secret" not in err
    named = err.strip().removeprefix("launcher: not passed to the nodes: ").split(", ")
    assert {"BACKSLASH", "HF_TOKEN", "INJECTED", "QUOTED"} <= set(named)


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_missing_hostfile_is_a_user_error_not_success(tmp_path: Path, how: str) -> None:
    """ColossalAI ends its hostfile check with a bare exit(): status 0. The script gave a relative HOSTFILE from
    the repo root (it cds there), and both reported success for a launch that never started."""
    if how == "script":
        (tmp_path / "cfg.yaml").write_text("model: {}\n")
        env = {**os.environ, "HOSTFILE": "hosts", "MASTER_ADDR": "node1", "NPROC_PER_NODE": "1"}
        argv = ["bash", str(REPO / "launch" / "colossalai_run.sh"), "cfg.yaml"]
    else:
        env = dict(os.environ)
        argv = [sys.executable, "-m", "coati_kto.colossalai_launch", "--hostfile", str(tmp_path / "hosts")]
        argv += ["--nproc_per_node", "1", "-m", "coati_kto", "train", "cfg.yaml"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    said = done.stdout + done.stderr
    assert "no such file" in said.lower() and "hosts" in said
