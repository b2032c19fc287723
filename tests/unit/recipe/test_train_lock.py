"""recipe.train's order at the end of a run: the lock on output.dir is held until final/'s upload is done."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.runtime import run_dir


def test_the_output_dir_stays_locked_while_final_is_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock went before output.push_to_hub's upload of final/ (hours for a large model): a run started in the
    same output.dir meanwhile (output.overwrite, or resume=auto exporting again) could clear final/ under it."""
    import coati_kto.recipe.train as recipe

    config = load_config(write_config(tmp_path, MINIMAL), [f"output.dir={tmp_path / 'out'}"])
    out = Path(config.training_output().dir).resolve()
    held_during_push = []

    def trained(*args: object) -> SimpleNamespace:
        run_dir.claim_output_dir(out)  # as setup_training does on global rank 0
        return SimpleNamespace()

    monkeypatch.setattr(recipe, "check_training", lambda config: None)
    monkeypatch.setattr(
        recipe, "STOP", SimpleNamespace(install=lambda: None)
    )  # pytest's own signal handlers stay
    monkeypatch.setattr(recipe, "_train", trained)
    monkeypatch.setattr(recipe, "push_final", lambda output: held_during_push.append(out in run_dir._held))
    recipe.train(config)
    assert held_during_push == [True]
    assert out not in run_dir._held  # released after it
