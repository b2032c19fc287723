"""Stopping precompute and export, through the real CLI and real processes: a SIGTERM to the launcher of a
2-process export, Ctrl-C twice to a one-process precompute. Each ends with one line saying what was stopped and
what it left, exit 128 + the signal, no traceback, no scratch folder, and the earlier outputs (an export, a
complete reference cache) and the checkpoint byte for byte as they were.

Before: the forwarded SIGTERM killed the export's ranks with the default action (the launch exited 1 with one
"launcher: rank N ... failed with signal SIGTERM" line per rank and left ``.step-N.coati-kto-data-XXXXXXXX``
behind), and Ctrl-C said "interrupted before training started: nothing to save".

The workers are frozen (SIGSTOP) once the scratch folder or the scoring line shows they are mid-command, so the
signal lands there however loaded the machine is."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import env, write_run

from coati_kto.testing.cli import run_cli


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "coati_kto", *args]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def contents(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path: its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def stopped_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " stopped by " in line]


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A prepared run with checkpoint step-2 (2 ranks, on worker ranks: the CLI's code path)."""
    config = write_run(tmp_path_factory.mktemp("stops"), tiny_model_dir, steps=2, save_interval=2)
    trained = run_cli(["train", str(config)], 2)
    assert trained.returncodes == [0, 0], trained.stderr[-3000:]
    return config


def test_sigterm_to_a_launched_export_removes_its_scratch_and_exits_143(
    run_config: Path, tmp_path: Path
) -> None:
    out = run_config.parent / "out"
    earlier = out / "exports" / "earlier"
    assert run_cli(["export", str(run_config), "--out", str(earlier)]).returncode == 0
    kept = {"earlier": contents(earlier), "checkpoint": contents(out / "checkpoints" / "step-2")}
    target = out / "exports" / "step-2"

    # data.prepared_dir without the run's data: export prepares it in a scratch folder beside its target.
    argv = ["export", "--nproc-per-node", "2", str(run_config), f"data.prepared_dir={tmp_path / 'none'}"]
    proc = start(cli(*argv))
    deadline = time.monotonic() + 300
    while not list(target.parent.glob(".step-2.coati-kto-data-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no scratch folder"
        time.sleep(0.02)
    workers = psutil.Process(proc.pid).children()
    for worker in workers:
        worker.suspend()
    assert list(target.parent.glob(".step-2.coati-kto-data-*")) and not target.exists()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # relayed by the launcher's watch: pending in the frozen workers
    for worker in workers:
        worker.resume()
    time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # delivered twice, as schedulers and `kill -- -PGID` may
    output = proc.communicate(timeout=120)[0]

    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert stopped_lines(output) == [
        f"export stopped by SIGTERM: nothing written to {target}; the checkpoint and output.dir are as they were"
    ], output[-3000:]
    assert "Traceback" not in output and "launcher:" not in output, output[-3000:]
    assert sorted(p.name for p in target.parent.iterdir()) == ["earlier"]
    assert {"earlier": contents(earlier), "checkpoint": contents(out / "checkpoints" / "step-2")} == kept


def test_ctrl_c_twice_on_precompute_writes_no_cache_and_exits_130(run_config: Path) -> None:
    caches = run_config.parent / "prepared" / "reference_cache"
    # A complete cache for another key (the attention implementation is part of it): it must stay as it is.
    earlier = run_cli(
        ["precompute", str(run_config), "kto.reference=cached", "model.attn_implementation=eager"]
    )
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    kept = {p.name: contents(p) for p in caches.iterdir() if p.is_dir()}

    proc = start(cli("precompute", str(run_config), "kto.reference=cached"))
    assert proc.stdout is not None
    head = []
    while line := proc.stdout.readline():
        head.append(line)
        if line.startswith("reference log-probs: computing"):
            break
    assert head and head[-1].startswith("reference log-probs: computing"), "".join(head)[-3000:]
    frozen = psutil.Process(proc.pid)
    frozen.suspend()  # mid-scoring
    proc.send_signal(signal.SIGINT)
    frozen.resume()
    time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    output = "".join(head) + proc.communicate(timeout=120)[0]

    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert stopped_lines(output) == [
        f"precompute stopped by SIGINT: no reference cache written; the caches under {caches} are as they were"
    ], output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert {
        p.name: contents(p) for p in caches.iterdir() if p.is_dir()
    } == kept  # no new one, no temporary one


def test_sigterm_to_prepare_removes_its_work_folder_and_keeps_the_old_build(run_config: Path) -> None:
    """From a CLI audit: a SIGTERM to `coati-kto prepare` (and inspect) killed it silently with the default
    action and left ``.prepared.tmp-PID-XXXXXXXX`` behind for good; Ctrl-C said training's line."""
    prepared = run_config.parent / "prepared"
    kept = contents(prepared)
    # another max_length: a new build, in a work folder beside the old one until its rename
    proc = start(cli("prepare", str(run_config), "data.max_length=60"))
    deadline = time.monotonic() + 300
    while not list(prepared.parent.glob(".prepared.tmp-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no work folder"
        time.sleep(0.01)
    frozen = psutil.Process(proc.pid)
    frozen.suspend()
    proc.send_signal(signal.SIGTERM)
    frozen.resume()
    output = proc.communicate(timeout=120)[0]

    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert stopped_lines(output) == [f"prepare stopped by SIGTERM: data.prepared_dir {prepared} is as it was"]
    assert "Traceback" not in output, output[-3000:]
    assert not list(prepared.parent.glob(".prepared.*")) and contents(prepared) == kept
