"""logging.wandb online needs an API key where wandb.init looks: checked before anything heavy."""

from __future__ import annotations

from pathlib import Path

import pytest

from coati_kto.config.output import LoggingSection
from coati_kto.runtime.wandb_check import wandb_problems

pytest.importorskip("wandb")


@pytest.fixture
def no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    return tmp_path


def test_an_online_run_without_a_key_is_refused(no_key: Path) -> None:
    assert wandb_problems(LoggingSection(wandb=True)) == [
        "logging.wandb: no W&B API key for https://api.wandb.ai (WANDB_API_KEY, `wandb login`'s ~/.netrc, or "
        "wandb's settings file): set one, or logging.wandb_mode=offline"
    ]
    assert wandb_problems(LoggingSection(wandb=True, wandb_mode="offline")) == []
    assert wandb_problems(LoggingSection(wandb=False)) == []


def test_a_key_wherever_wandb_finds_one_passes(no_key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on = LoggingSection(wandb=True)
    (no_key / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (no_key / "netrc").chmod(0o600)
    assert wandb_problems(on) == []
    (no_key / "netrc").unlink()
    (no_key / "wandb").mkdir()
    (no_key / "wandb" / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_problems(on) == []
    (no_key / "wandb" / "settings").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_problems(on) == []
