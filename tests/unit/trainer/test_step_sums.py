"""StepSums: the step's sums from one fp64 matmul per micro-batch, against a row-by-row reference."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.models.logit_means import LogitMeans
from coati_kto.testing.kernels import KernelCounter
from coati_kto.trainer.metrics import SUM_KEYS, IntervalMeter, StepSums, summarize

_ROW = st.tuples(
    st.floats(-5, 5, width=32),
    st.floats(-5, 5, width=32),
    st.floats(-60, 0, width=32),
    st.booleans(),
    st.booleans(),
)


def _reference(batches: list[list[tuple]]) -> dict[str, float]:
    """Row by row in Python floats: what every key must hold."""
    out = dict.fromkeys(["examples", "loss", "tokens", "model_flops", "nonfinite"], 0.0)
    for side in ("chosen", "rejected"):
        out.update({f"count/{side}": 0.0, f"rewards/{side}": 0.0, f"logps/{side}": 0.0, f"loss/{side}": 0.0})
    for rows in batches:
        out["tokens"] += 3 * len(rows)
        out["model_flops"] += 0.5 * len(rows)
        for loss, reward, logp, label, valid in rows:
            if not valid:
                continue
            side = "chosen" if label else "rejected"
            out["examples"] += 1
            out["loss"] += loss
            out[f"count/{side}"] += 1
            out[f"rewards/{side}"] += reward
            out[f"logps/{side}"] += logp
            out[f"loss/{side}"] += loss
    return out


def _arguments(rows: list[tuple], nan_padding: bool = True) -> list[torch.Tensor]:
    loss, reward, logp, label, valid = (list(c) for c in zip(*rows, strict=True))
    if nan_padding:  # what evaluation padding may hold: nothing of it may reach a sum
        loss = [v if ok else math.nan for v, ok in zip(loss, valid, strict=True)]
    return [torch.tensor(c) for c in (loss, reward, logp, label, valid)]


def _add(sums: StepSums, rows: list[tuple], nan_padding: bool = True) -> None:
    sums.add(*_arguments(rows, nan_padding))
    sums.add_host(tokens=3 * len(rows), flops=0.5 * len(rows))  # host counts: added once, when read


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_ROW, min_size=1, max_size=9), min_size=1, max_size=4))
def test_sums_equal_the_row_by_row_reference(batches: list[list[tuple]]) -> None:
    sums = StepSums(torch.device("cpu"))
    for rows in batches:
        _add(sums, rows)
    local, _ = sums.local()
    for key, want in _reference(batches).items():
        assert math.isclose(local[key], want, rel_tol=1e-12, abs_tol=1e-9), (key, local[key], want)


def test_an_infinite_reward_is_flagged_and_gives_no_means() -> None:
    """A -inf reward under a finite loss (the sigmoid saturates) counts its micro-batch as non-finite; no mean
    of that step is logged (its counts are)."""
    sums = StepSums(torch.device("cpu"))
    _add(sums, [(0.5, 0.2, -3.0, True, True), (0.7, -math.inf, -math.inf, False, True)], nan_padding=False)
    _add(sums, [(0.1, 0.1, -1.0, True, True)], nan_padding=False)
    local, _ = sums.local()
    assert local["nonfinite"] == 1 and local["count/chosen"] == 2 and local["count/rejected"] == 1
    out = summarize(local, None)
    assert out == {"count/chosen": 2.0, "count/rejected": 1.0}


def test_one_micro_batch_costs_a_few_kernels() -> None:
    """The sums of a micro-batch with its recorded logit means, as the trainer adds them: thirteen small kernels
    (one matmul for the eighteen label sums; its tokens and FLOPs counted on the host), where a masked sum per key
    took about fifty."""
    sums = StepSums(torch.device("cpu"))
    arguments = _arguments([(0.5, 0.2, -3.0, True, True), (0.7, -0.1, -4.0, False, True)])
    means = LogitMeans()
    means.add(torch.tensor([1.5, -2.0]), torch.tensor([3.0, 2.0]))
    with KernelCounter(log=True) as counter:
        sums.add(*arguments, means)
    assert sum(counter.kernels.values()) <= 13, counter.log


def test_logit_means_are_summed_per_label_and_divided_per_token() -> None:
    """TRL's logits/chosen|rejected: the step's sums over every micro-batch divided by its completion tokens (not
    a mean of per-batch means); padding rows (NaN) add nothing, a micro-batch that recorded none adds no token."""
    sums = StepSums(torch.device("cpu"))
    first = LogitMeans()
    first.add(torch.tensor([6.0, -4.0, math.nan]), torch.tensor([3.0, 2.0, 5.0]))
    labels, valid = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    sums.add(torch.zeros(3), torch.zeros(3), torch.zeros(3), labels, valid, first)
    second = LogitMeans()
    second.add(torch.tensor([1.0, 9.0]), torch.tensor([1.0, 1.0]))
    sums.add(
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.tensor([True, True]),
        torch.ones(2).bool(),
        second,
    )
    sums.add(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.tensor([False]), torch.tensor([True]))
    local, _ = sums.local()
    assert (local["logits/chosen"], local["completion_tokens/chosen"]) == (16.0, 5.0)
    assert (local["logits/rejected"], local["completion_tokens/rejected"]) == (-4.0, 2.0)
    out = summarize(local, None)
    # Per token 16 / 5 = 3.2, where the mean of the two batches' means is (6 / 3 + 10 / 2) / 2 = 3.5.
    assert out["logits/chosen"] == 16.0 / 5.0 and out["logits/rejected"] == -2.0


def test_an_evaluation_is_one_interval_of_the_meter() -> None:
    """Evaluation's means and throughput come from the meter training logs with (no second formula): the
    totals' means, and examples, tokens and model FLOPs per second of the wall time; no skipped count."""
    totals = dict.fromkeys(SUM_KEYS, 0.0) | {"examples": 6.0, "loss": 3.0, "tokens": 90.0, "model_flops": 4e6}
    totals |= {"count/chosen": 4.0, "rewards/chosen": 2.0, "count/rejected": 2.0, "rewards/rejected": -1.0}
    kl = {"kl": 0.25, "kl_raw": 0.25}
    meter = IntervalMeter()
    meter.add(totals, kl, 2.0, None)
    rates = {"examples_per_second": 3.0, "tokens_per_second": 45.0, "model_flops_per_second": 2e6}
    assert meter.measured() == summarize(totals, kl) | rates
    assert meter.measured()["rewards/margins"] == 1.0
    assert meter.summary() == {"skipped_in_interval": 0.0} | meter.measured()


def test_a_step_the_loss_scaler_skipped_counts_as_skipped_and_keeps_its_finite_sums() -> None:
    """fp16: the scaler skips an overflowing step's update, but its loss and rewards are finite observations of the
    batch: they enter the means, and the step counts in skipped_in_interval (it counted as taken)."""
    totals = dict.fromkeys(SUM_KEYS, 0.0) | {"examples": 6.0, "loss": 3.0, "tokens": 90.0}
    meter = IntervalMeter()
    meter.add(totals, None, 1.0, 0.5)
    meter.add(totals, None, 1.0, None, skipped=True)
    summary = meter.summary()
    assert summary["skipped_in_interval"] == 1.0 and summary["grad_norm"] == 0.5
    assert summary["loss"] == summarize({k: 2 * v for k, v in totals.items()}, None)["loss"]
