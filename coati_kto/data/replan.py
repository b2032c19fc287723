"""Re-planning the rest of an interrupted epoch for another data-parallel layout (resume on more or fewer ranks).

A run on R ranks consumes its epoch's global plan row by row: rank r takes rows r, r+R, ..., so after rank r
consumed p_r micro-batches, rows r + R*i (i < p_r) are used. Resuming on R' ranks, the examples of the rows not
yet consumed are dealt into new micro-batches for R' ranks: every one used exactly once, every rank gets the same
number of micro-batches, micro-batch sizes differ by at most one (at most the micro-batch size) and each
micro-batch holds the minority label while the minority lasts (and the majority while it lasts).
Pure functions of their arguments: every rank computes the same re-plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def consumed_rows(num_rows: int, positions: Sequence[int]) -> np.ndarray:
    """Bool mask [num_rows]: the rows of a global plan consumed by ranks that each took ``positions[r]`` rows.

    ``len(positions)`` is the number of ranks R of that run; rank r takes rows r, r+R, r+2R, ...
    """
    num_replicas = len(positions)
    mask = np.zeros(num_rows, dtype=bool)
    for rank, position in enumerate(positions):
        mask[rank::num_replicas][: int(position)] = True
    return mask


def replan_remaining(
    remaining: np.ndarray,
    labels: np.ndarray,
    micro_batch_size: int,
    num_replicas: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Global micro-batches (rank r takes r, r+R', ...) holding each index of ``remaining`` exactly once.

    ``remaining``: dataset indices (a multiset: a repeated minority example appears as often as the old plan
    used it); ``labels``: bool per dataset index. Returns ``num_replicas * k`` index arrays, k the fewest
    micro-batches per rank of at most ``micro_batch_size`` rows. Raises ValueError when fewer examples remain
    than ranks (some rank would get an empty micro-batch).
    """
    remaining = np.asarray(remaining, dtype=np.int64)
    total = len(remaining)
    if total == 0:
        return []
    if total < num_replicas:
        raise ValueError(
            f"{total} examples of the interrupted epoch remain, fewer than the {num_replicas} data-parallel "
            "ranks: resume on at most that many ranks, or from a checkpoint at an epoch end"
        )
    rows = num_replicas * -(-total // (num_replicas * micro_batch_size))
    sizes = np.full(rows, total // rows)
    sizes[: total % rows] += 1  # the larger rows first: they take the minority's extra examples below
    is_desirable = labels[remaining]
    minority_label = bool(is_desirable.sum() * 2 < total)
    minority = _grouped(rng, remaining[is_desirable == minority_label])
    majority = _grouped(rng, remaining[is_desirable != minority_label])
    # Minority dealt round-robin over all rows (so rows 0.. get the extra); the majority fills what is left,
    # one per row per round. Copies of one example sit side by side, so they land in different rows.
    minority_rows = np.arange(len(minority)) % rows
    room = sizes - np.bincount(minority_rows, minlength=rows)
    majority_rows = np.concatenate([np.flatnonzero(room > t) for t in range(int(room.max()))])
    owner = np.concatenate([minority_rows, majority_rows])
    order = np.argsort(owner, kind="stable")
    members = np.concatenate([minority, majority])[order]
    plan = np.split(members, np.cumsum(sizes)[:-1])
    _spread_duplicates(plan, labels)
    return [rng.permutation(plan[j]) for j in rng.permutation(rows)]


def _spread_duplicates(plan: list[np.ndarray], labels: np.ndarray) -> None:
    """Swap a repeated example out of a micro-batch holding it more often than its fair share (its copies over
    the micro-batches, rounded up) with a same-label example of another micro-batch that has room for it.

    Only repeated examples can collide; the label counts of every micro-batch stay as dealt.
    """
    rows = len(plan)
    values, counts = np.unique(np.concatenate(plan), return_counts=True)
    limit = dict(zip(values.tolist(), (-(-counts // rows)).tolist(), strict=True))
    for j in range(rows):
        row = plan[j]
        values, counts = np.unique(row, return_counts=True)
        for value in values[counts > 1]:
            for step in range(1, rows):
                if (row == value).sum() <= limit[int(value)]:
                    break
                other = plan[(j + step) % rows]
                if (other == value).sum() + 1 > limit[int(value)]:
                    continue
                swap = [
                    c
                    for c in range(len(other))
                    if labels[other[c]] == labels[value]
                    and other[c] != value
                    and (row == other[c]).sum() + 1 <= limit[int(other[c])]
                ]
                if swap:
                    col = np.flatnonzero(row == value)[-1]
                    row[col], other[swap[0]] = other[swap[0]], value


def _grouped(rng: np.random.Generator, indices: np.ndarray) -> np.ndarray:
    """``indices`` in a random order of distinct values, equal values next to each other."""
    values, counts = np.unique(indices, return_counts=True)
    pick = rng.permutation(len(values))
    return np.repeat(values[pick], counts[pick])
