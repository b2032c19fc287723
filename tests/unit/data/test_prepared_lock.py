"""A shared data.prepared_dir: a run or prepare of other data settings replaced the build a run was training on
without a word (its reference cache went with the folder; its resume later replaced the other's build in turn).
A process that uses a build now holds it (coati_kto.data.prepared_lock): a build that would replace it is refused
in one line naming that process, reuse of the same build goes on, and one process at a time decides and builds.

The other process is a small one that registers as a run's global rank 0 does (no torch: a fraction of a second)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import data_settings
from test_data_formats import write_jsonl
from test_prepare import make_config, rows

from coati_kto.data import prepared_lock
from coati_kto.data.prepared import load_prepared, prepare
from coati_kto.errors import DataError
from coati_kto.locks import probe

# Uses the build of ``target`` as a run's rank 0 does after its decision (store.ensure), says so, and waits to be
# killed; with a second argument, holds the decision itself that long (a build in progress) and exits.
USER = """
import sys, time
from pathlib import Path
from coati_kto.data.prepared_lock import deciding, read_from_now
target = Path(sys.argv[1])
with deciding(target):
    print("ready", flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
        sys.exit(0)
    read_from_now(target)
print("reading", flush=True)
time.sleep(600)
"""


def _user(target: Path, *hold: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", USER, str(target), *hold], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _digest(target: Path) -> str:
    return json.loads((target / "fingerprint.json").read_text())["digest"]


def _beside(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".prepared"))


def test_a_build_another_process_uses_is_refused_and_the_same_build_is_shared(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    target, data = tmp_path / "prepared", write_jsonl(tmp_path / "t.jsonl", rows(8, 8))
    run_a = make_config(tmp_path, tiny_model_dir, [str(data)], max_length=128)
    prepare(*data_settings(run_a))
    built = _digest(target)
    (target / "reference_cache").mkdir()  # what run A scored for hours lives in the build's folder
    (target / "reference_cache" / "scores.npy").write_bytes(b"A's scores")
    assert _beside(tmp_path) == []  # prepare used it while it ran: nothing left beside it

    user = _user(target)
    try:
        assert user.stdout.readline().strip() == "reading"
        capsys.readouterr()
        other = make_config(tmp_path, tiny_model_dir, [str(data)], max_length=64)
        with pytest.raises(DataError) as refused:
            prepare(*data_settings(other))
        line = str(refused.value)
        assert "\n" not in line and line.startswith(
            f"data.prepared_dir {target}: another process uses the build there (python -c {target}, "
            f"pid {user.pid} on {socket.gethostname()} since "
        )
        assert line.endswith(
            "); building these data settings (changed: max_length, max_prompt_length) would replace it under it: give these settings "
            "their own data.prepared_dir, or run this once it has ended"
        )
        # Nothing replaced, nothing built: the user's build and its cache are as they were.
        assert (
            _digest(target) == built
            and (target / "reference_cache" / "scores.npy").read_bytes() == b"A's scores"
        )
        assert "prepared " not in capsys.readouterr().out
        # The same data settings share it meanwhile (a sweep over train.lr).
        prepare(*data_settings(run_a))
        assert "reusing " in capsys.readouterr().out and _digest(target) == built
    finally:
        user.send_signal(signal.SIGKILL)  # however it ends, the kernel drops its lock
        user.wait()
    assert len([n for n in _beside(tmp_path) if n.endswith(".reader")]) == 1  # a killed user's file stays...
    prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(data)], max_length=64)))
    assert _digest(target) != built and not (target / "reference_cache").exists()
    assert _beside(tmp_path) == []  # ...until the next decision removes it


def test_a_run_uses_its_build_until_it_releases_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``load_prepared`` (a run's global rank 0) registers; the command releases it at its end (recipe.train)."""
    target = tmp_path / "prepared"
    config = make_config(tmp_path, tiny_model_dir, [str(write_jsonl(tmp_path / "t.jsonl", rows(6, 4)))])
    load_prepared(*data_settings(config))
    try:
        (reader,) = [tmp_path / n for n in _beside(tmp_path)]
        assert reader.name.startswith(f".prepared.coati-kto.{os.getpid()}-") and reader.suffix == ".reader"
        assert f"pid {os.getpid()} on {socket.gethostname()} since " in probe(reader)
    finally:
        prepared_lock.release(target)
    assert _beside(tmp_path) == []


def test_one_process_decides_at_a_time_and_the_other_waits_then_reuses(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    """Runs of one data setting started together: the second waits for the first's decision (a build), then
    finds its build, rather than building it again and renaming over it."""
    target = tmp_path / "prepared"
    config = make_config(tmp_path, tiny_model_dir, [str(write_jsonl(tmp_path / "t.jsonl", rows(6, 4)))])
    prepare(*data_settings(config))
    built = _digest(target)
    deciding = _user(target, "1.0")
    try:
        capsys.readouterr()
        prepare(*data_settings(config))
        out = capsys.readouterr().out
    finally:
        deciding.kill()
        deciding.wait()
    assert out.startswith(
        f"data.prepared_dir {target}: waiting for another process preparing it (python -c {target} 1.0, "
        f"pid {deciding.pid} on {socket.gethostname()} since "
    )
    assert "reusing " in out and _digest(target) == built and _beside(tmp_path) == []
