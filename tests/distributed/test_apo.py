"""kto.loss_type=apo_zero_unpaired on 2 real gloo ranks: it trains (rewards of desirable examples up, of
undesirable ones down, loss down on the same batches), and it runs no KL-pair pass and no z0 collective
(forward calls counted on the policy and the reference model; KTO with the same harness as the control).
Also the step-0 baseline evaluation (eval_at_start) and the raw KL estimate logged beside z0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_trainer import MBS, _build, _config, _eval_loader, _rank_loader, _records, _weights

from coati_kto.testing.distributed import run_distributed

STEPS_PER_EPOCH = 3  # _rank_loader: 3 steps x 2 micro-batches per rank on 2 ranks
EVAL_BATCHES = 2  # _eval_loader(2, rank): 7 rows (+1 padding) in micro-batches of 2 over 2 ranks


def _worker(model_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    from coati_kto.trainer import passes as kto_module

    rank = dist.get_rank()
    counts = {"policy": 0, "reference": 0, "kl_collective": 0}
    estimate = kto_module.estimate_kl_raw

    def counted_estimate(*args, **kwargs):
        counts["kl_collective"] += 1
        return estimate(*args, **kwargs)

    kto_module.estimate_kl_raw = counted_estimate
    results = {}
    for loss_type, epochs in (("kto", 1), ("apo_zero_unpaired", 3)):
        cfg = _config(
            model_dir,
            out_dir,
            plugin={"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
            train={"accumulation_steps": 2, "micro_batch_size": MBS},
            kto={"loss_type": loss_type, "beta": 0.5},
        )
        # The reference is the policy's own starting point (model.path): rewards start at exactly 0.
        parts, trainer = _build(
            cfg,
            total_steps=STEPS_PER_EPOCH * epochs,
            max_epochs=epochs,
            loss_type=loss_type,
            eval_at_start=True,
        )
        for name, module in (("policy", parts.policy.unwrap()), ("reference", parts.reference)):
            module.register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
        for key in counts:
            counts[key] = 0
        trainer.fit(_rank_loader(2, rank), _eval_loader(2, rank))
        results[loss_type] = {
            "counts": dict(counts),
            "history": list(trainer.history),
            "weights": _weights(parts.policy),
        }
    return results


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, 2, str(tiny_model_dir), str(tmp_path_factory.mktemp("apo")))


def test_apo_runs_no_kl_pass_and_no_z0_collective(runs: list[dict]) -> None:
    for rank_result in runs:
        kto, apo = rank_result["kto"]["counts"], rank_result["apo_zero_unpaired"]["counts"]
        # KTO, 3 steps x 2 micro-batches + 2 evaluations (step 0, epoch end) x 2 batches: each batch runs the
        # policy and the reference on the example and on its KL pair; one z0 per step and per evaluation.
        kto_batches = STEPS_PER_EPOCH * 2 + 2 * EVAL_BATCHES
        assert kto == {"policy": 2 * kto_batches, "reference": 2 * kto_batches, "kl_collective": 3 + 2}
        # APO, 9 steps x 2 micro-batches + 4 evaluations (step 0 and 3 epoch ends) x 2 batches: one pass each.
        apo_batches = 3 * STEPS_PER_EPOCH * 2 + 4 * EVAL_BATCHES
        assert apo == {"policy": apo_batches, "reference": apo_batches, "kl_collective": 0}
    # Every rank took the same collectives: the run finished and the weights agree.
    assert np.array_equal(runs[0]["apo_zero_unpaired"]["weights"], runs[1]["apo_zero_unpaired"]["weights"])


def test_apo_trains_the_right_way(runs: list[dict]) -> None:
    history = runs[0]["apo_zero_unpaired"]["history"]
    train = _records(history)
    assert sorted(train) == list(range(1, 10))
    # Step 1 and step 7 see the same micro-batches (epochs 1 and 3): the policy started as the reference.
    first, later = train[1], train[7]
    assert first["train/rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/rewards/rejected"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/loss"] == pytest.approx(0.5, abs=1e-6)  # sigmoid(0) for every example
    # Anchored at 0: desirable log-ratios pushed above 0, undesirable below, and the loss falls.
    assert later["train/rewards/chosen"] > 0.05, later
    assert later["train/rewards/rejected"] < -0.05, later
    assert later["train/loss"] < first["train/loss"] - 0.02, (first["train/loss"], later["train/loss"])
    # No reference point: no kl metrics at all (rather than a constant 0).
    assert not any(k.endswith("/kl") or k.endswith("/kl_raw") for h in history for k in h)


def test_step_zero_baseline_and_raw_kl(runs: list[dict]) -> None:
    kto_history = runs[0]["kto"]["history"]
    evals = [h for h in kto_history if "eval/loss" in h]
    assert [int(h["step"]) for h in evals] == [0, 3]  # the baseline, then the epoch end
    baseline = evals[0]
    # Before any update the policy is the reference: rewards 0, loss 0.5 (the weights are 1), raw KL 0.
    assert baseline["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert baseline["eval/loss"] == pytest.approx(0.5, abs=1e-6)
    assert baseline["eval/kl_raw"] == pytest.approx(0.0, abs=1e-6)
    assert baseline["eval/count/chosen"] + baseline["eval/count/rejected"] == 7
    apo_evals = [int(h["step"]) for h in runs[0]["apo_zero_unpaired"]["history"] if "eval/loss" in h]
    assert apo_evals == [0, 3, 6, 9]
    # z0 is the raw estimate clamped at 0: the raw one is logged beside it, negative values included.
    for h in kto_history:
        if "train/kl" in h:
            assert h["train/kl"] == pytest.approx(max(0.0, h["train/kl_raw"]), abs=1e-9)
    assert any(h.get("train/kl_raw", 0.0) != 0.0 for h in kto_history)
