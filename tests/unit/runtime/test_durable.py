"""Directories replaced without a window where neither the old nor the new one is there, in temporary folders of
our own: coati_kto.runtime.durable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coati_kto.runtime.durable import recover, write_dir


def _write(text: str):
    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_text(text)

    return write


def _listing(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_a_kill_between_the_renames_leaves_the_old_directory_which_the_next_write_puts_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """final/ was deleted (rmtree) before the new one was renamed in: a kill between left no final/ at all."""
    final = tmp_path / "final"
    write_dir(final, _write("old"))
    real = os.replace

    def killed(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == final:  # the old one is aside, the new one not yet in
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_dir(final, _write("new"))
    monkeypatch.setattr(os, "replace", real)
    # the window: final/ renamed aside whole; the partial new one was removed on the way out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".final.coati-kto-old-")]
    assert (aside / "model.safetensors").read_text() == "old"
    recover(tmp_path)  # what the next write of final/ does first
    assert _listing(tmp_path) == ["final"] and (final / "model.safetensors").read_text() == "old"
    write_dir(final, _write("new"))
    assert _listing(tmp_path) == ["final"] and (final / "model.safetensors").read_text() == "new"


def test_only_our_own_temporary_names_are_ever_removed(tmp_path: Path) -> None:
    """A user's final.tmp or step-9.prepared beside the target was deleted (fixed temporary names)."""
    final = tmp_path / "final"
    for theirs in ("final.tmp", "final.prepared", ".final.tmp", ".final.coati-kto-old-notours"):
        (tmp_path / theirs).mkdir()
        (tmp_path / theirs / "keep").write_text("mine")
    write_dir(final, _write("one"))
    write_dir(final, _write("two"))
    recover(tmp_path)
    assert _listing(tmp_path) == [
        ".final.coati-kto-old-notours",
        ".final.tmp",
        "final",
        "final.prepared",
        "final.tmp",
    ]
    assert all((tmp_path / n / "keep").read_text() == "mine" for n in _listing(tmp_path) if n != "final")


def test_a_failed_write_removes_its_partial_directory_and_keeps_the_old_one(tmp_path: Path) -> None:
    final = tmp_path / "final"
    write_dir(final, _write("old"))

    def full(directory: Path) -> None:
        (directory / "model.safetensors").write_text("par")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_dir(final, full)
    assert _listing(tmp_path) == ["final"] and (final / "model.safetensors").read_text() == "old"


def test_the_written_directory_has_the_usual_permissions(tmp_path: Path) -> None:
    """Not tempfile.mkdtemp's 0700: final/ is read by other users of a shared filesystem."""
    mask = os.umask(0o022)
    try:
        write_dir(tmp_path / "final", _write("x"))
    finally:
        os.umask(mask)
    assert (tmp_path / "final").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_safetensors_files_get_the_mode_the_umask_gives(tmp_path: Path, umask: int, expected: int) -> None:
    """From a security audit: safetensors writes 0600 (a temporary file renamed), so final/'s model.safetensors
    was unreadable to the group and others who could read its config.json. A write now gives it the umask's mode."""
    import torch
    from safetensors.torch import save_file

    def write(directory: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")

    mask = os.umask(umask)
    try:
        write_dir(tmp_path / "final", write)
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "final").iterdir()}
    assert modes == {"model.safetensors": expected, "config.json": expected}
