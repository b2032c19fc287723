"""KL pairs: example i is paired with the completion of example j = pi(i), pi a seeded derangement.

KTO's reference point z0 averages log-ratios of *mismatched* (prompt, completion) pairs. Pairing by reversing
the batch (as peers do) pairs the middle example of an odd batch, and every example at batch size 1, with its
own completion. Here pairs are fixed once per split, before batching:

* pi is a permutation with no fixed point (j != i) for any n >= 2;
* j's prompt differs from i's wherever the data allows. With g the size of the largest group of equal
  prompts, the fewest same-prompt pairs any derangement can have is max(0, 2g - n) (n when every prompt is
  equal); pi reaches exactly that minimum;
* pi depends only on (prompt groups, kinds, seed);
* j is of i's kind (records given as plain text or as messages: :func:`derangement_by_kind`), so a KL row joins a
  prompt and a completion rendered alike, never a raw-text prompt with a template's turn or the reverse. Only a
  kind with a single example (it has no partner of its own) pairs across.

Construction: order the examples group by group (largest group first, groups and members shuffled) and map
position k to position k + s (mod n), with s = g. Runs of equal prompts are at most s long, so a shift of s
leaves the run, and only when g > n/2 does the wrap-around land 2g - n members of the first group back in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def derangement(groups: Sequence[int] | np.ndarray, seed: int | Sequence[int]) -> np.ndarray:
    """pi[i] = j: a permutation of range(n) with pi[i] != i, minimising groups[pi[i]] == groups[i].

    ``groups``: one int id per example (equal ids = equal prompts); ``seed``: anything numpy.random.default_rng
    takes. Raises ValueError for n < 2.
    """
    groups = np.asarray(groups)
    n = len(groups)
    if n < 2:
        raise ValueError(f"KL pairs need at least 2 examples (got {n}): an example cannot pair with itself")
    rng = np.random.default_rng(seed)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    group_rank = rng.permutation(len(counts))  # random order among groups of equal size
    member_rank = rng.permutation(n)  # random order within a group
    # lexsort: last key is primary -> largest groups first, then a random group order, then random members.
    order = np.lexsort((member_rank, group_rank[inverse], -counts[inverse]))
    largest = int(counts.max())
    shift = largest if largest < n else 1  # all prompts equal: any shift is a derangement
    pi = np.empty(n, dtype=np.int64)
    pi[order] = order[(np.arange(n) + shift) % n]
    return pi


def derangement_by_kind(
    groups: Sequence[int] | np.ndarray, kinds: Sequence[bool] | np.ndarray, seed: Sequence[int]
) -> np.ndarray:
    """:func:`derangement` within each kind (``kinds``: one value per example, e.g. whether it was given as
    messages), so example i's KL completion comes from an example of its own kind; one kind alone gives exactly
    ``derangement(groups, seed)``. A kind with a single example has no partner of its own: it joins another
    kind's cycle (i -> it -> pi[i]: two pairs across kinds). Raises ValueError for n < 2."""
    groups = np.asarray(groups)
    _, inverse, sizes = np.unique(np.asarray(kinds), return_inverse=True, return_counts=True)
    if len(sizes) < 2 or sizes.max() < 2:  # one kind, or none with two examples: nothing to keep apart
        return derangement(groups, seed)
    pi = np.arange(len(groups))
    for k in np.flatnonzero(sizes > 1):
        rows = np.flatnonzero(inverse == k)
        pi[rows] = rows[derangement(groups[rows], [*seed, int(k)])]
    rng = np.random.default_rng([*seed, len(sizes)])
    for k in np.flatnonzero(sizes == 1):
        lone, i = int(np.flatnonzero(inverse == k)[0]), int(rng.choice(np.flatnonzero(sizes[inverse] > 1)))
        pi[lone], pi[i] = pi[i], lone
    return pi


def min_same_prompt_pairs_by_kind(
    groups: Sequence[int] | np.ndarray, kinds: Sequence[bool] | np.ndarray
) -> int:
    """The fewest pairs with equal prompts :func:`derangement_by_kind` can reach: the minimum within each kind."""
    groups, kinds = np.asarray(groups), np.asarray(kinds)
    if len(np.unique(kinds)) < 2:
        return min_same_prompt_pairs(groups)
    return sum(min_same_prompt_pairs(groups[kinds == k]) for k in np.unique(kinds) if (kinds == k).sum() > 1)


def min_same_prompt_pairs(groups: Sequence[int] | np.ndarray) -> int:
    """The fewest pairs with equal prompts that any derangement of ``groups`` can have."""
    groups = np.asarray(groups)
    n = len(groups)
    if n == 0:
        return 0
    largest = int(np.unique(groups, return_counts=True)[1].max())
    return n if largest == n else max(0, 2 * largest - n)


def pair_stats(
    groups: Sequence[int] | np.ndarray, pi: np.ndarray, kinds: Sequence[bool] | np.ndarray | None = None
) -> dict[str, int]:
    """The checks stats.json reports: self pairs (must be 0), same-prompt pairs and their minimum; with
    ``kinds`` (:func:`derangement_by_kind`), the pairs across kinds (0 unless a kind has a single example)."""
    groups = np.asarray(groups)
    kinds = np.zeros(len(groups), bool) if kinds is None else np.asarray(kinds)
    return {
        "pairs": len(pi),
        "self_pairs": int((pi == np.arange(len(pi))).sum()),
        "same_prompt_pairs": int((groups[pi] == groups).sum()),
        "min_same_prompt_pairs": min_same_prompt_pairs_by_kind(groups, kinds),
        "distinct_prompts": len(np.unique(groups)),
        "cross_format_pairs": int((kinds[pi] != kinds).sum()),
    }
