"""Two writers of one target at once (two ``coati-kto export`` to one --out: a command re-run, two CI jobs):
``coati_kto.runtime.target_lock``, held by ``durable.write_dir`` and by an export's rank 0 from its checks on.

Before: both passed export's "target exists" check; the second's ``write_dir`` began with ``recover()``, which
deleted the first's ``.step-2.coati-kto-new-XXXXXXXX`` mid-write (the first failed with a FileNotFoundError
traceback), and its rename put its own export in place without a word. The writers here are real processes (a
kernel lock is per process), held mid-write until the test lets them finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coati_kto.errors import UserError
from coati_kto.runtime.durable import recover, write_dir

# A write_dir whose write stops half-way until its stdin gets a line: the first export, mid-write.
_WRITER = """
import sys
from pathlib import Path
from coati_kto.runtime.durable import write_dir

def write(directory):
    (directory / "config.json").write_text("first")
    print("writing", flush=True)
    sys.stdin.readline()
    (directory / "model.safetensors").write_text("first")

write_dir(Path(sys.argv[1]), write)
print("done", flush=True)
"""

# What coati-kto export's rank 0 does around its write (recipe.export): claim the target, write, release.
_EXPORTER = """
import sys
from pathlib import Path
from coati_kto.outputs.export import claim_target, release_target

target = Path(sys.argv[1])
claim_target(target, Path("checkpoints/step-2"))
print("writing", flush=True)
sys.stdin.readline()
release_target(target)
print("done", flush=True)
"""


def _start(script: str, target: Path) -> subprocess.Popen:
    """``script`` for ``target`` in a process of its own, once it says it is writing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    assert line == "writing\n", line + proc.communicate()[0]
    return proc


def _finish(proc: subprocess.Popen) -> str:
    output = proc.communicate("\n", timeout=60)[0]
    assert proc.returncode == 0, output
    return output


def _write(directory: Path) -> None:
    (directory / "model.safetensors").write_text("second")


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def target(tmp_path: Path) -> Path:
    (tmp_path / "exports").mkdir()
    return tmp_path / "exports" / "step-2"


def test_a_second_write_of_a_target_being_written_is_refused_and_the_first_completes(target: Path) -> None:
    first = _start(_WRITER, target)
    try:
        with pytest.raises(UserError) as err:
            write_dir(target, _write)
        assert str(err.value) == (
            f"{target} is being written by another process (coati-kto, pid {first.pid} on {os.uname().nodename} "
            f"since {str(err.value).split(' since ')[1]}"
        )
    finally:
        output = _finish(first)
    assert output.endswith("done\n"), output
    assert _listing(target) == ["config.json", "model.safetensors"]
    assert (target / "model.safetensors").read_text() == "first"
    assert _listing(target.parent) == ["step-2"]  # no leftover, no lock file


def test_recover_leaves_the_directory_a_live_process_is_writing(target: Path) -> None:
    first = _start(_WRITER, target)
    try:
        (new,) = target.parent.glob(".step-2.coati-kto-new-*")
        recover(target.parent, target.name)
        recover(target.parent)
        assert new.is_dir() and _listing(new) == ["config.json"]
    finally:
        _finish(first)
    assert _listing(target) == ["config.json", "model.safetensors"]


def test_a_second_export_to_a_target_being_exported_is_refused_in_one_line(target: Path) -> None:
    from coati_kto.outputs.export import check_export, claim_target, release_target

    first = _start(_EXPORTER, target)
    holder = f"(coati-kto export of step-2, pid {first.pid} "
    busy = f"coati-kto export: {target} is being written by another process {holder}"
    try:
        with pytest.raises(UserError) as claimed:
            claim_target(target, Path("step-2"))
        # the launcher of --nproc-per-node N says it before its ranks start
        output, plugin = SimpleOutput(str(_checkpoint(target.parent.parent))), SimplePlugin()
        with pytest.raises(UserError) as launched:
            check_export(output, None, plugin, ("auto", str(target), False), 2)
    finally:
        _finish(first)
    for err in (claimed, launched):
        assert str(err.value).startswith(busy), str(err.value)
        assert str(err.value).endswith("; wait for it to end, or name another with --out")
        assert "\n" not in str(err.value)
    claim_target(target, Path("step-2"))  # free again: this process writes it (write_dir nests in the hold)
    write_dir(target, _write)
    release_target(target)
    assert _listing(target.parent) == ["step-2"]
    with pytest.raises(UserError, match=r"step-2 exists; remove it or name another with --out$"):
        claim_target(target, Path("step-2"))  # one that finished before the claim is not replaced
    assert _listing(target.parent) == ["step-2"]


def test_a_killed_export_s_lock_file_stops_nobody(target: Path) -> None:
    from coati_kto.outputs.export import claim_target, release_target

    first = _start(_EXPORTER, target)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert _listing(target.parent) == [".step-2.coati-kto.lock"]  # unheld: the kernel dropped the lock
    claim_target(target, Path("step-2"))
    release_target(target)
    assert _listing(target.parent) == []


def _checkpoint(out_dir: Path) -> Path:
    """``out_dir`` holding one complete checkpoint, step-2 (what export_target reads of one); returns it."""
    import torch

    from coati_kto.runtime.run_dir import COMPLETE, LATEST

    step = out_dir / "checkpoints" / "step-2"
    for folder in ("model", "optimizer", "trainer_state"):
        (step / folder).mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 2, "world_size": 1}')
    torch.save({}, step / "trainer_state" / "rank-0.pt")
    torch.save({}, step / "lr_scheduler.pt")
    (step / COMPLETE).write_text("2\n")
    (step.parent / LATEST).write_text("step-2")
    return out_dir


class SimpleOutput:
    """The OutputSection fields check_export reads."""

    def __init__(self, out_dir: str) -> None:
        self.dir, self.export_dtype = out_dir, "model"


class SimplePlugin:
    precision = "fp32"


def test_a_file_system_without_flock_is_written_unlocked_and_leaves_no_lock_file(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a review: where flock is refused (ENOLCK, some FUSE mounts) every final/ save and export left its
    ``.NAME.coati-kto.lock`` behind."""
    import errno

    import coati_kto.locks as locks

    def refused(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", refused)
    write_dir(target, lambda directory: (directory / "config.json").write_text("{}"))
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert (target / "config.json").read_text() == "{}"
