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


def test_a_failed_config_json_write_is_held_too(tmp_path: Path) -> None:
    """ColossalAI's sharded model save ends with the writing rank's config.json and generation_config.json
    (save_pretrained, a plain open): a failure there left the save at once on that rank while, under ZeRO, its
    peers went on into the optimizer's gathers (the collectives no longer lined up). Held like the shards'."""
    from transformers import GenerationConfig, LlamaConfig

    (tmp_path / "step-4.tmp").write_text("a file where the checkpoint's folder should be")
    unwritable = tmp_path / "step-4.tmp" / "model"  # NotADirectoryError, as a full disk's ENOSPC: an OSError
    reached = []
    with pytest.raises(OSError) as caught, held_write_failures():
        LlamaConfig(num_hidden_layers=1).save_pretrained(unwritable)
        reached.append("config")
        GenerationConfig(eos_token_id=2).save_pretrained(tmp_path / "generation")
        reached.append("generation")  # skipped: the checkpoint is already lost
        torch.save({"x": 1}, tmp_path / "optimizer.pt")
    assert reached == ["config", "generation"] and str(unwritable) in str(caught.value)
    assert not (tmp_path / "generation").exists() and not (tmp_path / "optimizer.pt").exists()
