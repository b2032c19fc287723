"""A checkpoint's Hub branch holds that checkpoint and nothing else (output.push_to_hub.checkpoints), against the
stand-in Hub on the loopback (coati_kto.testing.hub), in this process.

From an audit: the branch was forked from main and ``upload_folder`` only adds, so ``step-N`` also held main's
final/ files (a run that pushed before, or a rerun), and a re-saved step kept the older save's shards:
``hf download --revision step-N`` gave two runs' files as one checkpoint, and nothing on resume could tell."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coati_kto.config.push import PushToHubSection
from coati_kto.outputs.push import CheckpointUploads, pushed_at_end
from coati_kto.testing.hub import StandInHub

TOKEN = "hf_standInSecret0123456789"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHub]:
    from huggingface_hub import constants

    with StandInHub(token=TOKEN) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)  # read at import: HfApi() takes it from here
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server
    assert server.unhandled == []


def _checkpoint(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_checkpoint_branch_holds_only_that_checkpoint(hub: StandInHub, tmp_path: Path) -> None:
    hub.commit("model", "me/run", {"model.safetensors": b"final of an earlier run", "README.md": b"card"})
    push = PushToHubSection(repo_id="me/run", checkpoints=True)
    first = {"COMPLETE": b"step 2\n", "model/model-00001.safetensors": b"a", "master_weights/rank-1.pt": b"m"}
    step2 = _checkpoint(tmp_path / "run1" / "checkpoints" / "step-2", first)
    uploads = CheckpointUploads(push, tmp_path / "run1" / ".hub_uploads")
    uploads(step2)
    assert uploads.wait() is True
    assert set(hub.files("model", "me/run", "step-2")) - {".gitattributes"} == set(first)
    assert set(hub.files("model", "me/run")) == {"model.safetensors", "README.md"}  # main as it was

    # the step saved again (a rerun, a hand resume): on one rank now, so no rank-1 masters
    again = {"COMPLETE": b"step 2\n", "model/model-00001.safetensors": b"b"}
    step2 = _checkpoint(tmp_path / "run2" / "checkpoints" / "step-2", again)
    uploads = CheckpointUploads(push, tmp_path / "run2" / ".hub_uploads")
    uploads(step2)
    assert uploads.wait() is True
    branch = hub.files("model", "me/run", "step-2")
    assert set(branch) - {".gitattributes"} == set(again) and branch["model/model-00001.safetensors"] == b"b"


def test_a_failed_checkpoint_upload_fails_the_run_even_when_final_went_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """From an audit: the run exited 0 when final/ went up but a checkpoint had not (a missing resume point on
    the Hub, unsaid to a script); documented as exit 3."""
    assert pushed_at_end(True, checkpoints_up=False) is False
    assert capsys.readouterr().out.startswith("output.push_to_hub.checkpoints: not every checkpoint went up")
    assert pushed_at_end(True, checkpoints_up=True) is True
    assert pushed_at_end(None, checkpoints_up=True) is None  # nothing pushed from this rank
