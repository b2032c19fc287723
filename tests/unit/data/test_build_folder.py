"""A prepare killed mid-build (SIGKILL, the OOM killer) left ``.prepared.tmp-PID-XXXXXXXX`` beside
data.prepared_dir for good, as large as the data. The next build removes it, and only it: a live build's folder
(its process holds the lock) and a folder without a lock file (an older version's) stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import data_settings
from test_data_formats import write_jsonl
from test_prepare import make_config, rows

from coati_kto.data.build_folder import build_folder, remove_abandoned
from coati_kto.data.prepared import prepare

# A process that opens a build folder for ``target``, says its name and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from coati_kto.data.build_folder import build_folder
with build_folder(Path(sys.argv[1])) as work:
    (work / "train").mkdir()
    print(work.name, flush=True)
    time.sleep(600)
"""


def _holder(target: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_builds_folder_is_removed_by_the_next_prepare(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    target = tmp_path / "prepared"
    killed, name = _holder(target)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert (tmp_path / name).is_dir() and (tmp_path / f"{name}.lock").is_file()
    old_version = tmp_path / ".prepared.tmp-1-0123abcd"  # no lock file: whose it is cannot be known
    old_version.mkdir()

    data = write_jsonl(tmp_path / "t.jsonl", rows(8, 8))
    prepare(*data_settings(make_config(tmp_path, tiny_model_dir, [str(data)], max_length=128)))
    out = capsys.readouterr().out
    assert (
        f"data.prepared_dir {target}: removed 1 unfinished build folder(s) of processes that were killed: {name}"
        in out
    )
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".prepared"))
    assert left == [old_version.name]  # the killed build's folder and lock gone; the build's own removed too


def test_a_live_builds_folder_stays_and_a_finished_one_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "prepared"
    live, name = _holder(target)
    try:
        assert remove_abandoned(target) == []
        with build_folder(target) as work:
            assert work.is_dir() and work.name != name
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, f"{name}.lock"])
    finally:
        live.kill()
        live.wait()
    assert remove_abandoned(target) == [name] and list(tmp_path.iterdir()) == []


def test_a_sweep_never_takes_the_lock_of_a_build_being_made(tmp_path: Path, monkeypatch) -> None:
    """From a review: the lock file was made, then locked; a sweep that took it in between removed the live
    build's folder once the build went on unlocked. It is made and locked under a name no sweep opens."""
    import coati_kto.data.build_folder as build

    target, swept = tmp_path / "prepared", []
    real_flock = build.fcntl.flock

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if (
            not swept
        ):  # another build's sweep, at the worst moment: between the lock file's making and its flock
            swept.append(remove_abandoned(target))
        real_flock(fd, operation)

    monkeypatch.setattr(build.fcntl, "flock", flock_after_a_sweep)
    with build_folder(target) as work:
        assert swept == [[]] and work.is_dir() and (tmp_path / f"{work.name}.lock").is_file()
        monkeypatch.setattr(build.fcntl, "flock", real_flock)
        assert remove_abandoned(target) == [] and work.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_the_sweeps_line_tells_build_folders_from_set_aside_copies() -> None:
    from coati_kto.data.build_folder import removed_line

    names = [".p.tmp-41-0123abcd", ".c.old-89abcdef"]
    assert removed_line("where", names) == (
        "where: removed 1 unfinished build folder(s) and 1 set-aside old copy(ies) of processes that were killed: "
        ".p.tmp-41-0123abcd, .c.old-89abcdef"
    )
    # a build folder whose target's name holds ".old-" is still a build folder
    assert removed_line("where", [".my.old-data.tmp-41-0123abcd"]).startswith(
        "where: removed 1 unfinished build"
    )
