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
