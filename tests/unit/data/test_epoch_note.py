"""The line `train` prints at its start about an epoch (``SamplerStats.epoch_note``): how many examples of each
label the sampler leaves out, and why, checked against the indices the sampler actually yields (issue 50: 14 of
30 examples were left out of the README example's epoch and only `inspect` said so)."""

from __future__ import annotations

import numpy as np
import pytest

from coati_kto.data.sampler import MixedLabelBatchSampler


def _left_out(n_desirable: int, n_undesirable: int, m: int, r: int) -> tuple[int, int]:
    """(desirable, undesirable) examples no rank's micro-batch holds in epoch 0, from the sampler's plan."""
    labels = np.array([True] * n_desirable + [False] * n_undesirable)
    used = MixedLabelBatchSampler(labels, m, num_replicas=r, seed=3).plan(0).ravel()
    unused = np.setdiff1d(np.arange(len(labels)), used)
    return int(labels[unused].sum()), int((~labels[unused]).sum())


def test_the_issue_example_says_14_of_30_left_out_and_why() -> None:
    assert _left_out(15, 15, 8, 2) == (7, 7)
    assert MixedLabelBatchSampler.compute_stats(15, 15, 8, 2).epoch_note() == (
        "per epoch: 1 micro-batch per rank (2 ranks x train.micro_batch_size 8): 14 of the 30 train examples left "
        "out (7 desirable, 7 undesirable; a different random set each epoch): an epoch is whole rounds of 2 ranks "
        "x 8 = 16 examples"
    )


@pytest.mark.parametrize("minority_desirable", [False, True])
def test_a_repeated_minority_leaves_out_majority_examples_only(minority_desirable: bool) -> None:
    n_d, n_u = (3, 20) if minority_desirable else (20, 3)
    # 23 examples fill 5 micro-batches of 4, but 3 minority examples cannot mix 5: one each, repeated, and 3
    # majority examples each: 6 micro-batches take 18 of the 20, so 2 majority examples are left out.
    assert _left_out(n_d, n_u, 4, 1) == ((0, 2) if minority_desirable else (2, 0))
    minority, majority = ("desirable", "undesirable") if minority_desirable else ("undesirable", "desirable")
    counts = "0 desirable, 2 undesirable" if minority_desirable else "2 desirable, 0 undesirable"
    assert MixedLabelBatchSampler.compute_stats(n_d, n_u, 4, 1).epoch_note() == (
        f"per epoch: 6 micro-batches per rank (1 rank x train.micro_batch_size 4): 2 of the 23 train examples left "
        f"out ({counts}; a different random set each epoch): every micro-batch holds 1 {minority} example (too "
        f"few for one each: they repeat) and 3 {majority}, and an epoch is whole rounds of 1 rank x 3 = 3 "
        f"{majority} examples"
    )


def test_an_epoch_that_uses_everything_says_so_and_how_often_the_minority_repeats() -> None:
    assert _left_out(24, 24, 4, 1) == (0, 0)
    assert MixedLabelBatchSampler.compute_stats(24, 24, 4, 1).epoch_note() == (
        "per epoch: 12 micro-batches per rank (1 rank x train.micro_batch_size 4), every one of the 48 train "
        "examples used"
    )
    assert _left_out(746, 254, 2, 1) == (0, 0)
    assert MixedLabelBatchSampler.compute_stats(746, 254, 2, 1).epoch_note() == (
        "per epoch: 746 micro-batches per rank (1 rank x train.micro_batch_size 2), every one of the 1000 train "
        "examples used (the 254 undesirable ones 2-3 times each)"
    )
