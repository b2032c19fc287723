"""``DataPosition.epochs`` (``train/epoch``, TRL's fractional epoch) across resumes."""

from __future__ import annotations

import pytest

from coati_kto.trainer.position import DataPosition


def _run(resume: dict, micro_batches: int, steps: int) -> list[float]:
    """``train/epoch`` after each of ``steps`` one-micro-batch steps of epoch 0, resumed from ``resume``, on a
    loader of ``micro_batches`` (a plain list: the consumed prefix is skipped)."""
    position = DataPosition(accumulation_steps=1)
    position.resume_from(resume)
    out = []
    for _ in zip(range(steps), position.steps(list(range(micro_batches)), 0), strict=False):
        position.consumed += 1
        out.append(position.epochs())
    return out


def test_a_second_resume_inside_a_replanned_epoch_goes_on_from_the_saved_fraction() -> None:
    """One rank of 100 micro-batches stopped at 50 (0.5); resumed on 2 ranks, the rest re-planned to 25 each,
    saved at 10 of them (0.5 + 0.5 x 10 / 25 = 0.7). Resumed again on that layout, it goes on from 0.7: 0.9 at
    20. It went on from 10 / 25 = 0.4 (0.8 at 20), and saved that."""
    got = _run({"epoch": 0, "consumed": 10, "epoch_progress": 0.7, "sampler": None}, 25, 15)
    assert got[9] == pytest.approx(0.9) and got[-1] == pytest.approx(1.0)


def test_a_resume_of_an_epoch_never_replanned_logs_what_the_uninterrupted_run_did() -> None:
    whole = _run({"epoch": 0, "consumed": 0, "epoch_progress": None, "sampler": None}, 25, 25)
    resumed = _run({"epoch": 0, "consumed": 10, "epoch_progress": whole[9], "sampler": None}, 25, 15)
    assert resumed == pytest.approx(whole[10:], abs=1e-15)
    old = _run({"epoch": 0, "consumed": 10, "sampler": None}, 25, 15)  # a checkpoint without epoch_progress
    assert old == pytest.approx(whole[10:], abs=1e-15)
