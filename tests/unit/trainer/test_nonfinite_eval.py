"""A non-finite evaluation is visible: a NaN/inf eval loss or reward left only missing means in the logged record.

``KTOTrainer._evaluate`` reduces the evaluation's sums (exact global sums and counts) and logs their means; one
non-finite valid row poisons its values' sums, so :func:`~coati_kto.trainer.metrics.summarize` leaves every mean
out, as it does for a non-finite training step. Now the evaluation also counts its non-finite examples
(``StepSums(evaluation=True)``), logs them as ``eval/nonfinite_examples`` (when there are any) and the main rank
prints one warning line naming the step, the non-finite values and the count. Training's sums are unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coati_kto.testing.tensorboard import read_scalars
from coati_kto.trainer.kto import KTOTrainer
from coati_kto.trainer.logging import MetricWriter
from coati_kto.trainer.loss import preference_loss
from coati_kto.trainer.metrics import SUM_KEYS, StepSums

CPU = torch.device("cpu")
REFERENCE = torch.tensor([-10.0, -12.0, -9.0, -11.0])
LABELS = torch.tensor([True, True, False, True])
VALID = torch.tensor([True, True, True, False])  # the last row is evaluation padding: it counts nowhere


def _sums(policy: torch.Tensor, evaluation: bool = True) -> StepSums:
    """The sums of one eval micro-batch scored as ``policy`` log-probs, through the KTO loss (z0 0)."""
    losses, rewards = preference_loss("kto", policy, REFERENCE, LABELS, torch.tensor(0.0), 0.1)
    sums = StepSums(CPU, evaluation=evaluation)
    sums.add(losses, rewards, policy, LABELS, VALID)
    return sums


def _evaluate(sums: StepSums, log_dir: Path | None, is_main: bool = True, step: int = 7) -> dict[str, float]:
    """``KTOTrainer._evaluate`` on one process, its passes answering ``sums``."""
    trainer = SimpleNamespace(
        _eval_loader=[object()],
        policy=SimpleNamespace(eval=lambda: None, train=lambda: None),
        pipeline=None,
        passes=SimpleNamespace(evaluate=lambda batches: sums),
        layout=SimpleNamespace(sums_group=lambda: (None, True), is_main=is_main),
        _samples=None,
        _progress=None,
        global_step=step,
        history=[],
        _writer=MetricWriter(is_main, log_dir),
    )
    trainer._record = lambda metrics: KTOTrainer._record(trainer, metrics)
    metrics = KTOTrainer._evaluate(trainer)
    trainer._writer.close()
    return metrics


def test_an_infinite_eval_log_prob_is_warned_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A -inf policy log-prob (one valid row) and a NaN on a padding row: the rewards and log-probs are non-finite,
    no mean is logged, one warning names step 7, what was non-finite and 1 of 3 examples; TensorBoard counts it."""
    policy = torch.tensor([-10.5, -math.inf, -9.5, math.nan])
    metrics = _evaluate(_sums(policy), tmp_path)
    assert metrics["eval/nonfinite_examples"] == 1.0
    assert "eval/loss" not in metrics and "eval/rewards/chosen" not in metrics
    lines = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert lines == [
        "warning: non-finite (NaN/inf) eval rewards, logps at optimizer step 7: 1 of 3 eval examples; the "
        "evaluation's means are not logged (eval/nonfinite_examples counts the examples). Check the data or the "
        "model"
    ]
    assert read_scalars(tmp_path)["eval/nonfinite_examples"] == [(7, 1.0)]


def test_a_finite_eval_warns_nothing_and_keeps_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A NaN on a padding row only: the record and TensorBoard hold the means and no count (the keys of every
    finite evaluation before, which tests/regression/reference_runs.json records)."""
    metrics = _evaluate(_sums(torch.tensor([-10.5, -11.0, -9.5, math.nan])), tmp_path, step=3)
    assert "eval/nonfinite_examples" not in metrics and math.isfinite(metrics["eval/loss"])
    assert "non-finite" not in capsys.readouterr().err
    scalars = read_scalars(tmp_path)
    assert "eval/nonfinite_examples" not in scalars and scalars["eval/loss"][0][0] == 3


def test_only_the_main_rank_warns(capsys: pytest.CaptureFixture) -> None:
    metrics = _evaluate(_sums(torch.tensor([-10.5, -math.inf, -9.5, -1.0])), None, is_main=False)
    assert metrics["eval/nonfinite_examples"] == 1.0  # every rank records the same reduced record
    assert "non-finite" not in capsys.readouterr().err


def test_training_sums_are_unchanged_and_count_no_rows() -> None:
    """A training step's sums: the same keys and values as an evaluation's, without ``nonfinite_examples``."""
    policy = torch.tensor([-10.5, -math.inf, -9.5, math.nan])
    train, _ = _sums(policy, evaluation=False).local()
    evaluation, _ = _sums(policy).local()
    assert tuple(train) == SUM_KEYS and evaluation.pop("nonfinite_examples") == 1.0
    assert train.keys() == evaluation.keys()
    assert all(math.isnan(train[k]) and math.isnan(evaluation[k]) or train[k] == evaluation[k] for k in train)


def test_a_nan_router_loss_counts_its_passs_valid_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An MoE evaluation pass whose router load-balancing loss is NaN, its log-probs finite: the warning named
    aux_loss but counted 0 examples (eval/nonfinite_examples 0), though every row's loss holds that NaN. Now the
    pass's valid rows count, once each (a row also NaN in its own values is not counted twice); the padding row
    never."""
    policy = torch.tensor([-10.5, -11.0, -9.5, math.nan])
    sums = StepSums(CPU, evaluation=True)
    sums.add_aux(torch.tensor(math.nan), VALID.sum())
    losses, rewards = preference_loss("kto", policy, REFERENCE, LABELS, torch.tensor(0.0), 0.1)
    sums.add(losses, rewards, policy, LABELS, VALID)
    with_inf = policy.clone()
    with_inf[0] = -math.inf  # the next micro-batch: one row non-finite itself, the router loss finite
    sums.add_aux(torch.tensor(0.25), VALID.sum())
    losses, rewards = preference_loss("kto", with_inf, REFERENCE, LABELS, torch.tensor(0.0), 0.1)
    sums.add(losses, rewards, with_inf, LABELS, VALID)
    metrics = _evaluate(sums, tmp_path)
    assert metrics["eval/nonfinite_examples"] == 3.0 + 1.0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert "aux_loss" in line and ": 4 of 6 eval examples" in line


def test_a_non_finite_z0_is_named_as_what_every_row_shares(capsys: pytest.CaptureFixture) -> None:
    """From an evaluation audit: one eval record whose KL pair is NaN makes z0 (one value over the set) NaN, so
    every row's loss holds it and every row counts; the warning said "7 of 7" with no word of why. It now names
    z0 as the shared cause."""
    from coati_kto.trainer.logging import warn_nonfinite_eval

    totals = {"loss": math.nan, "rewards": -1.0, "logps": -80.0, "examples": 7.0, "nonfinite_examples": 7.0}
    warn_nonfinite_eval(True, 0, totals, {"kl": math.nan, "kl_raw": math.nan})
    warn_nonfinite_eval(True, 0, totals, {"kl": 0.0, "kl_raw": 0.0})
    first, second = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert first == (
        "warning: non-finite (NaN/inf) eval loss at optimizer step 0: 7 of 7 eval examples; z0 (eval/kl_raw, the "
        "eval set's KL pairs) is non-finite and every example's loss holds it; the evaluation's means are not "
        "logged (eval/nonfinite_examples counts the examples). Check the data or the model"
    )
    assert "z0" not in second
