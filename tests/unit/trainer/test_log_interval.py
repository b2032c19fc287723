"""The interval's record (``KTOTrainer._log_interval``) when every step of it was skipped (non-finite loss or
gradient with ``train.on_nonfinite: skip``): no model FLOP/s, so no ``train/mfu``. It logged 0, a false drop."""

from __future__ import annotations

from types import SimpleNamespace

from coati_kto.trainer.kto import KTOTrainer


def _record(summary: dict) -> dict:
    records: list[dict] = []
    trainer = SimpleNamespace(
        _interval=SimpleNamespace(summary=lambda: summary, reset=lambda: None),
        _last_lr=1e-3,
        skipped_steps=2,
        position=SimpleNamespace(epochs=lambda: None),
        layout=SimpleNamespace(world_size=2),
        options=SimpleNamespace(peak_flops=1e12),
        _record=records.append,
    )
    KTOTrainer._log_interval(trainer)
    (record,) = records
    return record


def test_an_interval_of_skipped_steps_only_logs_no_mfu() -> None:
    record = _record({"skipped_in_interval": 2.0})
    assert "train/mfu" not in record and record["train/skipped_steps"] == 2.0


def test_an_interval_with_trained_steps_logs_mfu_over_every_device() -> None:
    record = _record({"model_flops_per_second": 5e11})
    assert record["train/mfu"] == 5e11 / (2 * 1e12)
