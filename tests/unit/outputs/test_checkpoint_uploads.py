"""``output.push_to_hub.checkpoints`` where ``output.dir`` takes no hard links (gcsfuse, s3fs, CIFS, or
``checkpoints/`` on another mount): the checkpoint is not uploaded and the run goes on. The staging link's OSError
used to leave ``CheckpointManager.save`` after the checkpoint was complete: every rank raised "could not be
written" about a whole checkpoint, and the run stopped."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from coati_kto.config.push import PushToHubSection
from coati_kto.outputs.push import CheckpointUploads


def test_a_checkpoint_that_cannot_be_staged_is_skipped_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = tmp_path / "checkpoints" / "step-4"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "weights.safetensors").write_bytes(b"0")

    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)

    monkeypatch.setattr(os, "link", no_links)
    uploads = CheckpointUploads(
        PushToHubSection(repo_id="org/run", checkpoints=True), tmp_path / ".hub_uploads"
    )
    uploads(checkpoint)  # does not raise
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"checkpoint step-4 not uploaded: cannot hard-link it into {tmp_path / '.hub_uploads'} ([Errno 18] "
        "Invalid cross-device link: "
    )
    assert line.endswith(
        "the run goes on; to upload it while output.keep_last keeps it: "
        f"`hf upload org/run {checkpoint} --revision step-4`"
    )
    assert "\n" not in line
    assert not (tmp_path / ".hub_uploads" / "step-4").exists() and checkpoint.is_dir()
    assert uploads.wait() is False  # counted as a failed upload at the end of the run (exit 3)


def test_a_run_ending_with_an_error_waits_for_no_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """From an audit: a run ending with an error (a disk full at a save) had global rank 0 wait for its running
    uploads while its peers exited 2; torchrun then killed it (SIGKILL 30 s on) and the job exited 1, "rank 0
    failed with signal SIGKILL". Now it says which checkpoints did not go up, with their commands, and leaves."""
    import threading
    import time

    from coati_kto.outputs import push as push_module

    uploading, never = threading.Event(), threading.Event()

    def slow_push(*args: object, **kwargs: object) -> tuple[bool, str]:
        uploading.set()
        never.wait(timeout=60)  # a large checkpoint on a slow link
        return True, "pushed"

    monkeypatch.setattr(push_module, "push_folder", slow_push)
    uploads = CheckpointUploads(PushToHubSection(repo_id="org/run", checkpoints=True), tmp_path / ".hub_uploads")
    steps = []
    for step in (2, 4):
        checkpoint = tmp_path / "checkpoints" / f"step-{step}"
        (checkpoint / "model").mkdir(parents=True)
        (checkpoint / "model" / "weights.safetensors").write_bytes(b"0")
        uploads(checkpoint)
        steps.append(checkpoint)
    assert uploading.wait(timeout=20)  # step-2 under way, step-4 queued
    started = time.monotonic()
    uploads.abandon()
    assert uploads.wait() is False and time.monotonic() - started < 5
    lines = [line for line in capsys.readouterr().out.splitlines() if "the run ended with an error" in line]
    assert lines == [
        f"checkpoint {c.name} not uploaded: the run ended with an error; to upload it while output.keep_last "
        f"keeps it: `hf upload org/run {c} --revision {c.name}`"
        for c in steps
    ]
    never.set()


def test_a_failed_upload_of_a_checkpoint_pruned_meanwhile_keeps_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """From an audit: the retry line of an upload that failed after output.keep_last pruned its checkpoint named
    the deleted directory, and the staged copy (the only one left) was removed."""
    import shutil

    from coati_kto.outputs import push as push_module

    checkpoint = tmp_path / "checkpoints" / "step-2"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "weights.safetensors").write_bytes(b"0")

    def pruned_then_failed(folder: Path, push: object, what: str, on_failure: str, *args: object, **kw: object):
        shutil.rmtree(checkpoint)  # the run's next save pruned it
        return False, f"output.push_to_hub: uploading {checkpoint} failed (HfHubHTTPError: 500); {on_failure}"

    monkeypatch.setattr(push_module, "push_folder", pruned_then_failed)
    staging = tmp_path / ".hub_uploads"
    uploads = CheckpointUploads(PushToHubSection(repo_id="org/run", checkpoints=True), staging)
    uploads(checkpoint)
    assert uploads.wait() is False
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith(
        f"the run goes on; it was pruned since, so its copy stays: `hf upload org/run {staging / 'step-2'} "
        "--revision step-2`"
    )
    assert (staging / "step-2" / "model" / "weights.safetensors").read_bytes() == b"0"
