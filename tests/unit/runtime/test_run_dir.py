"""Which checkpoint ``train.resume=auto`` picks, and how a failed checkpoint write is named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coati_kto.runtime.lineage import resolve_checkpoint
from coati_kto.runtime.run_dir import COMPLETE, LATEST


def _pointer(root: Path, name: str, written_ns: int) -> None:
    (root / LATEST).write_text(name)
    os.utime(root / LATEST, ns=(written_ns, written_ns))


def _checkpoint(root: Path, step: int, completed_ns: int) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / COMPLETE).write_text(f"step {step}\n")
    os.utime(path / COMPLETE, ns=(completed_ns, completed_ns))
    return path


def test_auto_prefers_a_checkpoint_completed_after_the_one_the_pointer_names(tmp_path: Path) -> None:
    """A SIGKILL between a save's rename into step-8 and the pointer's update left ``latest`` on step-4, and
    resume=auto went back to step-4 (the steps since were trained again)."""
    _checkpoint(tmp_path, 4, 1_000_000_000)
    _pointer(tmp_path, "step-4", 1_500_000_000)
    eight = _checkpoint(tmp_path, 8, 2_000_000_000)
    assert resolve_checkpoint(tmp_path, "auto") == eight


def test_auto_follows_the_pointer_over_a_higher_but_older_step(tmp_path: Path) -> None:
    """A run resumed from step-2 by hand and saved step-4: step-6 (completed before, by the abandoned run) is a
    higher step, but the pointer's step-4 is the newer checkpoint."""
    _checkpoint(tmp_path, 2, 1_000_000_000)
    _checkpoint(tmp_path, 6, 2_000_000_000)
    four = _checkpoint(tmp_path, 4, 3_000_000_000)
    _pointer(tmp_path, "step-4", 3_500_000_000)
    assert resolve_checkpoint(tmp_path, "auto") == four


def test_auto_follows_the_pointer_in_a_copied_run_directory(tmp_path: Path) -> None:
    """`cp -r` (or hf download, a sync) of a run directory gives each copied file a new time, in the copy's order:
    step-2 copied last was "completed after" the pointer's step-8, and resume=auto went back 6 steps in silence."""
    eight = _checkpoint(tmp_path, 8, 1_000_000_000)
    for n, step in enumerate((6, 4, 2)):
        _checkpoint(tmp_path, step, 2_000_000_000 + n)
    _pointer(tmp_path, "step-8", 1_500_000_000)
    assert resolve_checkpoint(tmp_path, "auto") == eight


def test_auto_follows_the_pointer_a_hand_resume_moved_back(tmp_path: Path) -> None:
    """Run A saved step-2, 6 and 8; run B resumed from step-2 by hand (the pointer moved back to it) and was killed
    before its first save: resume=auto went on with the abandoned run's step-8 (completed after step-2)."""
    two = _checkpoint(tmp_path, 2, 1_000_000_000)
    _checkpoint(tmp_path, 6, 2_000_000_000)
    _checkpoint(tmp_path, 8, 3_000_000_000)
    _pointer(tmp_path, "step-2", 4_000_000_000)
    assert resolve_checkpoint(tmp_path, "auto") == two
    four = _checkpoint(tmp_path, 4, 5_000_000_000)  # B's step-4, killed before the pointer's update
    assert resolve_checkpoint(tmp_path, "auto") == four


def _saved(root: Path, step: int, completed_ns: int, ident: str, previous: str | None) -> Path:
    """A checkpoint as saved since 2026-12-01: meta.json names its id and its run's previous checkpoint."""
    path = _checkpoint(root, step, completed_ns)
    (path / "meta.json").write_text(json.dumps({"step": step, "id": ident, "previous": previous}))
    return path


def test_auto_follows_the_runs_own_saves_whatever_the_file_times(tmp_path: Path) -> None:
    """A run resumed by hand from step-14 saved step-16 (the pointer names it); the abandoned run's step-24 was
    left. Copied in name order (rsync -r without -t), step-24 "completed after" the pointer and resume=auto took
    it. Each save now names its run's previous checkpoint: the pointer's step-16 is followed only by saves that
    name it (the crash window between a save's rename and the pointer's update), whatever the times."""
    _saved(tmp_path, 14, 1_000, "a14", "a12")
    sixteen = _saved(tmp_path, 16, 2_000, "b16", "a14")
    _pointer(tmp_path, "step-16", 3_000)
    _saved(tmp_path, 24, 4_000, "a24", "a22")  # copied last
    assert resolve_checkpoint(tmp_path, "auto") == sixteen
    # The pointer missed two saves of its run (killed in the window, or a pointer that could not be written):
    _saved(tmp_path, 18, 500, "b18", "b16")  # times older than the pointer's: a copy
    twenty = _saved(tmp_path, 20, 600, "b20", "b18")
    assert resolve_checkpoint(tmp_path, "auto") == twenty


def test_a_resaved_step_is_not_followed_by_the_abandoned_runs_next_save(tmp_path: Path) -> None:
    """Run A saved step-6 and step-8; run B resumed from step-4 and saved its own step-6 over A's. A's step-8
    names A's step-6, not B's: resume=auto stays on B's."""
    _saved(tmp_path, 4, 1_000, "a4", "a2")
    _saved(tmp_path, 8, 3_000, "a8", "a6")
    six = _saved(tmp_path, 6, 5_000, "b6", "a4")
    _pointer(tmp_path, "step-6", 6_000)
    assert resolve_checkpoint(tmp_path, "auto") == six


def test_a_full_disk_under_torch_save_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save given a path turns ENOSPC into "RuntimeError: [enforce fail ...] unexpected pos A vs B"."""
    import shutil

    from coati_kto.trainer.write_failures import describe, with_disk_hint

    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 863872 vs 863764")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(8 << 20, 8 << 20, 0))
    assert describe(with_disk_hint(err, tmp_path)) == (
        f"No space left on device: 0 bytes free under {tmp_path} ([enforce fail at inline_container.cc:672] . "
        "unexpected pos 863872 vs 863764)"
    )
    other = ValueError("not a write")
    assert with_disk_hint(other, tmp_path) is other


_HOLD = """
import sys, time
from pathlib import Path
from coati_kto.runtime.run_dir import claim_output_dir
claim_output_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_live_run_holds_its_output_dir_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    """A relaunch while the old ranks still trained (a launcher killed with -9 leaves them ~20 s; two jobs
    given one directory) wrote into the same checkpoints. Now the live run's lock refuses it in one line, on
    the launcher side (preflight) and in rank 0 (claim); a run killed with -9 leaves nothing to clean up."""
    import socket
    import subprocess
    import sys

    from coati_kto.errors import UserError
    from coati_kto.runtime.run_dir import claim_output_dir, lock_holder, release_output_dir

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        who = lock_holder(out)
        assert who is not None and who.startswith(f"pid {holder.pid} on {socket.gethostname()} since ")
        with pytest.raises(UserError) as err:
            claim_output_dir(out)
        assert str(err.value) == (
            f"output.dir: {out} is in use by a run still training there ({who}): wait for it to end or stop "
            "it, or use another output.dir"
        )
        assert lock_holder(out) == who  # the refused claim did not disturb the holder's lock or its text
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(out) is None
    assert claim_output_dir(out) is None
    assert lock_holder(out).startswith(f"pid {os.getpid()} on ")
    release_output_dir(out)
    assert lock_holder(out) is None  # released at the end of the run


def test_overwrite_clears_our_own_scratch_copies_and_nothing_of_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output.overwrite deleted final/ but left ``.final.coati-kto-old-XXXXXXXX`` (a kill between write_dir's
    renames: the earlier run's whole model, aside) and an export's scratch data: the cleared directory still held
    the previous run. A user's look-alike names are not ours and stay."""
    from coati_kto.runtime.durable import DATA, own_dir, write_dir
    from coati_kto.runtime.run_dir import clear_previous_run

    out = tmp_path / "out"
    out.mkdir()
    final = out / "final"

    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_text("weights")

    write_dir(final, write)
    real = os.replace

    def killed(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == final:  # the old final/ is aside, the new one not yet in
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_dir(final, write)
    monkeypatch.setattr(os, "replace", real)
    (own_dir(final, DATA) / "prepared").mkdir()  # `coati-kto export --out final` killed before its cleanup
    theirs = [".final.tmp", ".final.coati-kto-old-mine", ".notes.coati-kto-new-0123abcd", "keep"]
    for name in theirs:
        (out / name).mkdir()
        (out / name / "file").write_text("mine")
    ours = [p.name for p in out.iterdir() if p.name.startswith(".final.coati-kto-") and p.name not in theirs]
    assert sorted(n.split("-")[2] for n in ours) == ["data", "old"]
    clear_previous_run(out)  # one process: it is rank 0
    assert sorted(p.name for p in out.iterdir()) == sorted(theirs)
    assert all((out / name / "file").read_text() == "mine" for name in theirs)
