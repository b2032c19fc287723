"""The label-mixing arithmetic behind MixedLabelBatchSampler, in exact integers: how many minority slots each
micro-batch gets (``slot_layout``), the shuffled streams that fill them (``draw_stream``), repeated examples kept
apart (``spread_duplicates``), and the per-epoch counts it reports (``SamplerStats``).

Pure functions of counts and a seeded generator; the sampler (``coati_kto.data.sampler``) owns the contract.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from coati_kto.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class SamplerStats:
    """Per-epoch slot counts (identical for every epoch); the effective counts are what the model sees."""

    n_desirable: int
    n_undesirable: int
    micro_batch_size: int
    num_replicas: int
    drop_last: bool
    minority_label: bool  # True when desirable is the minority; ties count undesirable (False) as minority
    num_micro_batches: int  # global, all ranks together
    micro_batches_per_rank: int
    effective_desirable: int  # desirable slots filled per epoch, repeats included
    effective_undesirable: int
    minority_repeats: int  # minority slots beyond one use of each minority example
    minority_uses: tuple[int, int]  # (min, max) uses of one minority example per epoch
    minority_per_micro_batch: tuple[int, int]  # (min, max) minority examples in one micro-batch
    repeated_slots: int  # slots beyond the first use of an example, both labels
    left_out: int  # examples not used at all in an epoch

    @property
    def repeats_minority(self) -> bool:
        """Whether the minority label had to be repeated to mix every micro-batch."""
        return self.minority_repeats > 0

    def epoch_note(self) -> str:
        """One line: the micro-batches of an epoch, the examples it leaves out (of each label) and why, or that
        it uses every example (and how often a repeated minority)."""
        n, m, r = self.n_desirable + self.n_undesirable, self.micro_batch_size, self.num_replicas
        ranks = f"{r} rank{'s' * (r > 1)}"
        k = self.micro_batches_per_rank
        head = f"per epoch: {k} micro-batch{'es' * (k > 1)} per rank ({ranks} x train.micro_batch_size {m})"
        minority, majority = ("desirable", "undesirable")[:: 1 if self.minority_label else -1]
        if not self.left_out:
            uses = "-".join(str(u) for u in sorted(set(self.minority_uses)))
            n_minor = min(self.n_desirable, self.n_undesirable)
            repeats = f" (the {n_minor} {minority} ones {uses} times each)" if self.repeats_minority else ""
            return f"{head}, every one of the {n} train examples used{repeats}"
        left_d = max(0, self.n_desirable - self.effective_desirable)
        left_u = max(0, self.n_undesirable - self.effective_undesirable)
        why = f"an epoch is whole rounds of {ranks} x {m} = {r * m} examples"
        if (
            self.repeats_minority
        ):  # one minority example (repeated) in every micro-batch: the majority sets the size
            why = (
                f"every micro-batch holds 1 {minority} example (too few for one each: they repeat) and {m - 1} "
                f"{majority}, and an epoch is whole rounds of {ranks} x {m - 1} = {r * (m - 1)} {majority} examples"
            )
        return (
            f"{head}: {self.left_out} of the {n} train examples left out ({left_d} desirable, {left_u} "
            f"undesirable; a different random set each epoch): {why}"
        )


def check_counts(n_desirable: int, n_undesirable: int, micro_batch_size: int, num_replicas: int) -> None:
    if micro_batch_size < 2:
        raise ValueError(
            f"micro_batch_size must be >= 2 so each micro-batch can hold both labels (got {micro_batch_size})"
        )
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1 (got {num_replicas})")
    # The data's own shortcomings are user errors (one line, no traceback), the same on every rank.
    if n_desirable == 0 or n_undesirable == 0:
        raise DataError(
            f"KTO needs both desirable and undesirable examples; got {n_desirable} desirable and "
            f"{n_undesirable} undesirable: add examples of the missing label"
        )
    n = n_desirable + n_undesirable
    if n < micro_batch_size * num_replicas:
        raise ConfigError(
            f"the dataset has {n} examples, fewer than one global batch ({num_replicas} data-parallel ranks x "
            f"train.micro_batch_size {micro_batch_size} = {micro_batch_size * num_replicas}): lower "
            "train.micro_batch_size or the number of processes, or add data"
        )


def slot_layout(n_minor: int, n_major: int, m: int, r: int, drop_last: bool) -> tuple[int, int]:
    """Global micro-batch count K (a multiple of r) and minority slots s; the majority fills K*m - s."""
    n = n_minor + n_major

    def rounded(k: int) -> int:  # round(k*m*n_minor/n), half up, in exact integers
        return (2 * k * m * n_minor + n) // (2 * n)

    if drop_last:
        k = r * (n // (r * m))
        if n_minor >= k:
            s = min(max(rounded(k), k), n_minor)
        else:  # one minority per micro-batch, repeated; the majority bounds the epoch
            k = r * (n_major // ((m - 1) * r))
            s = k
        assert k <= k * m - s <= n_major and s >= k
        return k, s
    # Smallest epoch that uses every example with at least one of each label per micro-batch.
    k = r * -(-n // (r * m))
    while True:
        s = max(k, rounded(k))
        if n_minor <= s <= k * m - max(k, n_major):
            return k, s
        k += r


def draw_stream(rng: np.random.Generator, idx: np.ndarray, slots: int) -> np.ndarray:
    """``slots`` draws from ``idx``: whole shuffled copies, then a random subset, so uses differ by <= 1."""
    copies, extra = divmod(slots, len(idx))
    full = rng.permuted(np.tile(idx, (copies, 1)), axis=1).ravel()
    return np.concatenate([full, idx[rng.permutation(len(idx))[:extra]]])


def spread_duplicates(plan: np.ndarray, counts: np.ndarray) -> None:
    """Swap a repeated example out of any micro-batch that holds it twice, with a same-label example nearby.

    Only possible when examples repeat; rows after ``j`` are tried first so length grouping is barely disturbed.
    """
    k, m = plan.shape
    srt = np.sort(plan, axis=1)
    for j in np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1)):
        for col in range(m):
            v = plan[j, col]
            if (plan[j] == v).sum() < 2:
                continue
            minor = col < counts[j]
            for step in range(1, k):
                o = (j + step) % k
                if v in plan[o]:
                    continue
                cols = range(counts[o]) if minor else range(counts[o], m)
                c = next((c for c in cols if plan[o, c] not in plan[j]), None)
                if c is not None:
                    plan[j, col], plan[o, c] = plan[o, c], v
                    break
