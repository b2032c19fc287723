"""Re-planning the rest of an interrupted epoch for another data-parallel layout (resume on more or fewer ranks).

A run on R ranks consumes its epoch's global plan row by row: rank r takes rows r, r+R, ..., so after rank r
consumed p_r micro-batches, rows r + R*i (i < p_r) are used. Resuming on R' ranks, the examples of the rows not
yet consumed are dealt into new micro-batches for R' ranks: every one used at least once, every rank gets the
same number of micro-batches, micro-batch sizes differ by at most one (2 to the micro-batch size) and every
micro-batch holds both labels. Like a fresh epoch, a label with fewer examples left than micro-batches is
repeated as evenly as possible (the fewest-used examples first), and the epoch grows when the majority needs
more micro-batches than the size alone asks for (each micro-batch keeps a slot for the minority).
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
    """Global micro-batches (rank r takes r, r+R', ...) holding every index of ``remaining`` at least once.

    ``remaining``: dataset indices (a multiset: a repeated minority example appears as often as the old plan
    used it); ``labels``: bool per dataset index. Returns ``num_replicas * k`` index arrays of 2 to
    ``micro_batch_size`` indices, each with both labels, k the fewest micro-batches per rank that fit them (see
    :func:`replan_rows`). Raises ValueError when fewer examples remain than ranks.
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
    is_desirable = labels[remaining]
    minority_label = bool(is_desirable.sum() * 2 < total)
    minority = remaining[is_desirable == minority_label]
    majority = remaining[is_desirable != minority_label]
    rows = replan_rows(len(minority), len(majority), micro_batch_size, num_replicas)
    minor_slots = max(len(minority), rows) if len(minority) else 0
    minority = _grouped(rng, _topped_up(rng, minority, minor_slots))
    majority = _grouped(rng, _topped_up(rng, majority, max(len(majority), rows, 2 * rows - minor_slots)))
    total = len(minority) + len(majority)
    sizes = np.full(rows, total // rows)
    sizes[: total % rows] += 1  # the larger rows first: they take the minority's extra examples below
    # Minority dealt round-robin over all rows (so rows 0.. get the extra); the majority fills what is left,
    # one per row per round: every row gets at least one of each. Copies of one example sit side by side, so
    # they land in different rows. (A re-plan that repeats nothing deals exactly as before repeats existed, so
    # a checkpoint saved inside such a re-planned epoch rebuilds the same rows.)
    minority_rows = np.arange(len(minority)) % rows
    room = sizes - np.bincount(minority_rows, minlength=rows)
    majority_rows = np.concatenate([np.flatnonzero(room > t) for t in range(int(room.max()))])
    owner = np.concatenate([minority_rows, majority_rows])
    order = np.argsort(owner, kind="stable")
    members = np.concatenate([minority, majority])[order]
    plan = np.split(members, np.cumsum(sizes)[:-1])
    _spread_duplicates(plan, labels)
    return [rng.permutation(plan[j]) for j in rng.permutation(rows)]


def replan_rows(n_minor: int, n_major: int, micro_batch_size: int, num_replicas: int) -> int:
    """Micro-batches of a re-plan (all ranks): the fewest multiple of ``num_replicas`` that hold the examples
    at ``micro_batch_size`` each while keeping a slot for the minority in each (the majority fills the rest)."""
    m, total = micro_batch_size, n_minor + n_major
    need = -(-total // m)
    if n_minor:
        need = max(need, -(-n_major // (m - 1)))
    return num_replicas * -(-need // num_replicas)


def _topped_up(rng: np.random.Generator, indices: np.ndarray, slots: int) -> np.ndarray:
    """``indices`` (a multiset) with ``slots - len(indices)`` extra copies added to the least-used examples
    (ties broken at random), so uses end as even as the multiset allows; ``indices`` itself when it fills them."""
    extra = slots - len(indices)
    if extra <= 0:
        return indices
    values, counts = np.unique(indices, return_counts=True)
    pick = rng.permutation(len(values))
    values, counts = values[pick], counts[pick]
    level = int(counts.min())
    while np.maximum(0, level + 1 - counts).sum() <= extra:
        level += 1  # every example raised to ``level`` uses still fits in the extra slots
    uses = np.maximum(counts, level)
    below = np.flatnonzero(uses == level)[: extra - int((uses - counts).sum())]
    uses[below] += 1
    return np.repeat(values, uses)


def _spread_duplicates(plan: list[np.ndarray], labels: np.ndarray) -> None:
    """Swap a repeated example out of a micro-batch holding it more often than its fair share (its copies over
    the micro-batches, rounded up) with a same-label example of another micro-batch that has room for it.

    Only repeated examples can collide (none repeats: nothing to do); the label counts of every micro-batch
    stay as dealt.
    """
    rows = len(plan)
    values, counts = np.unique(np.concatenate(plan), return_counts=True)
    if len(counts) == 0 or counts.max() <= 1:
        return
    limit = dict(zip(values.tolist(), (-(-counts // rows)).tolist(), strict=True))
    # Only rows holding an example twice can exceed its share (a swap never takes one past it): visit those.
    flat = np.concatenate(plan)
    row_of = np.repeat(np.arange(rows), [len(row) for row in plan])
    order = np.lexsort((flat, row_of))
    flat, row_of = flat[order], row_of[order]
    twice = (flat[1:] == flat[:-1]) & (row_of[1:] == row_of[:-1])
    for j in np.unique(row_of[1:][twice]).tolist():
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
