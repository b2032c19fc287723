"""held_write_failures: the first failed write is raised when the block ends, later writes are skipped, and other
threads' writes are untouched (tests/distributed/test_checkpoint.py holds it inside a real ZeRO save)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

from coati_kto.trainer.write_failures import held_write_failures


def test_first_failure_raised_at_the_end_and_later_writes_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.save
    written: list[str] = []

    def save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        name = Path(str(f)).name
        if name == "b.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        written.append(name)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    reached = []
    with pytest.raises(OSError, match="No space left") as caught, held_write_failures():
        for name in ("a.pt", "b.pt", "c.pt"):
            torch.save({"x": 1}, tmp_path / name)
            reached.append(name)  # the code after each write (upstream's next gather) still runs
    assert caught.value.filename == str(tmp_path / "b.pt")
    assert reached == ["a.pt", "b.pt", "c.pt"] and written == ["a.pt"]  # c.pt skipped: the save is lost
    assert torch.save is save  # put back


def test_other_threads_writes_fail_as_usual(tmp_path: Path) -> None:
    seen: list[BaseException] = []

    def upload() -> None:
        try:
            torch.save({"x": 1}, tmp_path / "missing" / "x.pt")
        except Exception as err:  # noqa: BLE001
            seen.append(err)

    with held_write_failures():
        thread = threading.Thread(target=upload)
        thread.start()
        thread.join()
        torch.save({"x": 2}, tmp_path / "ok.pt")
    assert len(seen) == 1 and (tmp_path / "ok.pt").is_file()
