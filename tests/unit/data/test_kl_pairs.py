"""KL pairs: a seeded derangement that avoids equal prompts as far as the data allows (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.data.kl_pairs import derangement, min_same_prompt_pairs, pair_stats

SETTINGS = settings(max_examples=200, deadline=None)

# Prompt ids with many repeats: alphabets of 1-8 distinct prompts, sizes 2-300 (odd and even).
groups_strategy = st.integers(1, 8).flatmap(
    lambda k: st.lists(st.integers(0, k - 1), min_size=2, max_size=300).map(np.array)
)


def brute_force_min(groups: np.ndarray) -> int:
    """The fewest equal-prompt pairs over ALL derangements (tiny inputs only)."""
    from itertools import permutations

    n = len(groups)
    best = n
    for perm in permutations(range(n)):
        if all(perm[i] != i for i in range(n)):
            best = min(best, sum(groups[perm[i]] == groups[i] for i in range(n)))
    return best


@SETTINGS
@given(groups_strategy, st.integers(0, 2**32 - 1))
def test_derangement_properties(groups: np.ndarray, seed: int) -> None:
    pi = derangement(groups, seed)
    n = len(groups)
    assert sorted(pi.tolist()) == list(range(n))  # a permutation: every completion used exactly once
    assert not (pi == np.arange(n)).any()  # never an example's own completion
    same = int((groups[pi] == groups).sum())
    assert same == min_same_prompt_pairs(groups)  # as few equal-prompt pairs as any derangement allows
    assert np.array_equal(pi, derangement(groups, seed))  # deterministic for a seed
    stats = pair_stats(groups, pi)
    assert stats["self_pairs"] == 0 and stats["same_prompt_pairs"] == same


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=2, max_size=6).map(np.array), st.integers(0, 1000))
def test_minimum_is_the_true_minimum(groups: np.ndarray, seed: int) -> None:
    assert min_same_prompt_pairs(groups) == brute_force_min(groups)
    assert int((groups[derangement(groups, seed)] == groups).sum()) == brute_force_min(groups)


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_all_prompts_equal_still_no_self_pairs(n: int) -> None:
    groups = np.zeros(n, dtype=np.int64)
    pi = derangement(groups, 0)
    assert not (pi == np.arange(n)).any()
    assert pair_stats(groups, pi)["same_prompt_pairs"] == n == pair_stats(groups, pi)["min_same_prompt_pairs"]


def test_small_and_odd_cases() -> None:
    assert derangement([5, 9], 0).tolist() == [1, 0]  # 2 examples: the swap, both prompts differ
    pi = derangement([1, 2, 3], 0)  # odd: reversing would pair the middle example with itself
    assert not (pi == np.arange(3)).any()
    with pytest.raises(ValueError, match="at least 2 examples"):
        derangement([7], 0)


def test_seed_changes_pairs() -> None:
    groups = np.arange(100)
    assert not np.array_equal(derangement(groups, 0), derangement(groups, 1))
    # Pairs are spread, not a fixed neighbour: many different offsets j - i.
    assert len(np.unique(derangement(groups, 0) - groups)) > 20
