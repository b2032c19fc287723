"""Two ``coati-kto train`` runs of the same seed and data on different layouts (sequence or pipeline parallelism
against one process), compared as the parallelism issues require: each tensor's update after 3 steps within fp32
summation order, every logged train/ and eval/ value within 1e-5 relative (of a floor near 0), step 1's rewards
and KL exactly 0."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from test_trainer import sgd

from coati_kto.testing.tensorboard import read_scalars

STEPS = 3
UPDATE_BOUND = 2e-5  # of each tensor's update after 3 steps (the issues' figure)
METRIC_BOUND = 1e-5  # relative, per logged value
# ... of the value, or of this floor where the value is smaller. logits/ values are means over the vocabulary whose
# terms cancel: they swing from 0.035 to -4e-4 between steps while their rounding follows the logits, not the mean
# (pp2 against pp1 on a Zen 3 EPYC with AVX2 kernels: -5.282923e-4 against -5.283039e-4, 1.2e-5 of a 1e-3 floor).
FLOORS = {"logits/": 1e-2}
DEFAULT_FLOOR = 1e-3
# Wall-clock figures differ between runs; everything else is a function of the weights and the data.
TIMING = ("throughput", "seconds", "per_second", "mfu", "time", "memory", "lr")


def sgd_train(argv: list[str]) -> int:
    """``coati-kto ARGV`` with the policy's optimizer plain SGD (run on a worker rank by run_cli)."""
    from coati_kto.cli import main

    with sgd():
        return main(argv)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def update_error(run: Path, reference: Path, model_dir: Path) -> float:
    """The largest, over tensors, of max |run - reference| / max |reference - start|, after one fp32 spacing of
    the tensor's largest weight is taken off the difference: the weights are stored in fp32, so a norm weight of
    1.0 moved by 2e-3 cannot land closer than one ulp (1.2e-7, 6e-5 of that update) whatever the summation order."""
    start = load_file(model_dir / "model.safetensors")
    got, want = final_weights(run), final_weights(reference)
    errors = []
    for k in want:
        spacing = torch.finfo(torch.float32).eps * want[k].abs().max().item()
        difference = max((got[k] - want[k]).abs().max().item() - spacing, 0.0)
        errors.append(difference / (want[k] - start[k]).abs().max().item())
    return max(errors)


def logged_metrics(out: Path) -> dict[str, list[tuple[int, float]]]:
    scalars = read_scalars(out / "tensorboard")
    return {
        tag: values
        for tag, values in scalars.items()
        if tag.startswith(("train/", "eval/")) and not any(t in tag for t in TIMING)
    }


def assert_same_metrics(run: Path, reference: Path, expected: set[str]) -> None:
    """Every value ``reference`` logged (the ``expected`` tags among them), at the same steps, within METRIC_BOUND
    of the value or of its tag's floor."""
    want_all, got_all = logged_metrics(reference), logged_metrics(run)
    assert set(want_all) == set(got_all)
    assert expected <= set(want_all)
    for tag, values in want_all.items():
        got = dict(got_all[tag])
        assert [s for s, _ in values] == sorted(got), tag
        for step, want in values:
            bound = METRIC_BOUND * max(abs(want), _floor(tag))
            assert abs(got[step] - want) <= bound, (tag, step, got[step], want)


def _floor(tag: str) -> float:
    return next((floor for part, floor in FLOORS.items() if part in tag), DEFAULT_FLOOR)


def assert_step1_rewards_and_kl_zero(run: Path) -> None:
    """The online reference equals the policy at step 1: its rewards and KL are exactly 0."""
    metrics = logged_metrics(run)
    at_step1 = {
        tag: dict(values).get(1) for tag, values in metrics.items() if tag.startswith("train/rewards")
    }
    assert at_step1 and all(v == 0.0 for v in at_step1.values()), at_step1
    assert dict(metrics["train/kl"])[1] == 0.0
