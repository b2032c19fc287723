"""A training step skipped under ``train.on_nonfinite: skip`` is said on the console, not only counted.

Before, the only trace of a skipped step was ``train/skipped_steps`` in the next logged record: a run whose loss
went NaN for a stretch looked healthy on the console. Now the main rank prints one line per skip for the first
``SKIP_LINES_IN_FULL``, then one each time the count doubles (a diverged run skips every step).
"""

from __future__ import annotations

import pytest

from coati_kto.trainer.logging import SKIP_LINES_IN_FULL, warn_skipped_step


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_a_skipped_step_names_its_step_epoch_cause_and_count(capsys: pytest.CaptureFixture[str]) -> None:
    warn_skipped_step(True, step=12, epoch=1, bad_grad=False, skipped_steps=1)
    warn_skipped_step(True, step=13, epoch=1, bad_grad=True, skipped_steps=2)
    first, second = _lines(capsys)
    assert first.startswith(
        "warning: non-finite (NaN/inf) KTO loss or rewards at optimizer step 12 (epoch 1)"
    )
    assert "train.on_nonfinite=skip" in first and "1 skipped so far" in first
    assert "gradient norm at optimizer step 13" in second and "2 skipped so far" in second


def test_only_the_main_rank_speaks(capsys: pytest.CaptureFixture[str]) -> None:
    warn_skipped_step(False, step=3, epoch=0, bad_grad=False, skipped_steps=1)
    assert _lines(capsys) == []


def test_every_early_skip_then_the_doublings(capsys: pytest.CaptureFixture[str]) -> None:
    for count in range(1, 100):
        warn_skipped_step(True, step=count, epoch=0, bad_grad=False, skipped_steps=count)
    lines = _lines(capsys)
    said = [int(line.split("; ")[1].split(" ")[0]) for line in lines]
    assert said == [*range(1, SKIP_LINES_IN_FULL + 1), 16, 32, 64]
    assert "the count doubles" in lines[SKIP_LINES_IN_FULL - 1]
    assert sum("the count doubles" in line for line in lines) == 1
