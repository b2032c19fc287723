"""MixedLabelBatchSampler: every micro-batch on every rank holds both KTO labels; no data dropped to mix them.

Contract (micro_batch_size m >= 2, R = num_replicas, both labels present):

* Each micro-batch holds at least one desirable and one undesirable example, and its minority count is within
  one of ``m * n_minority / N``: the imbalance is spread evenly over the epoch, never front-loaded.
* Rank r yields micro-batches r, r+R, r+2R, ... of one global sequence shared by all ranks, so global step t
  is micro-batches [t*R, (t+1)*R) and every rank yields the same number of micro-batches.
* The plan depends only on (seed, epoch): deterministic per epoch, different between epochs.
* drop_last=True: when the minority has at least one example per micro-batch, no index repeats within an
  epoch and fewer than R*m examples are left out (a different random set each epoch). Otherwise the minority
  is repeated as evenly as possible (each example floor or ceil of the mean number of times), every
  micro-batch holds exactly one minority and m-1 majority examples, and fewer than R*(m-1) majority examples
  are left out: the epoch grows instead of throwing majority data away.
* drop_last=False: nothing is left out. The epoch is the smallest multiple of R micro-batches that fits all
  examples with the same mixing rule; the spare slots (fewer than R*m when no label needs repeating) are
  filled by re-using randomly chosen examples of that epoch, each example used floor or ceil of its label's
  mean, so the mix guarantees above still hold.
* Resume: ``state_dict()`` records (epoch, position = micro-batches yielded on this rank in that epoch). A
  fresh sampler given ``load_state_dict(state)`` yields exactly the rest of that epoch, and later epochs as if
  never interrupted. A trainer that counts consumed batches itself (a DataLoader prefetches from the sampler)
  calls ``load_state_dict({"epoch": e, "position": k})``; the other keys are optional and validated.
* Resume on another layout (number of ranks or micro-batch size): ``load_state_dicts(states)`` takes every
  rank's state of the saved run; the examples of that epoch's plan not yet consumed by any rank are re-planned
  over this sampler's ranks (coati_kto.data.replan: each used at least once, every micro-batch mixed, the
  minority repeated evenly where fewer remain than micro-batches, sizes 2 to m and within one), then later
  epochs follow this sampler's own plan. A state saved inside a re-planned epoch records where
  its plan came from (``replanned_from``), so it can be resumed again, on any layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from coati_kto.data.label_mix import SamplerStats, check_counts, draw_stream, slot_layout, spread_duplicates
from coati_kto.data.replan import consumed_rows, replan_remaining

__all__ = ["MixedLabelBatchSampler", "SamplerStats", "padding_saved", "padding_tokens"]

# Length grouping sorts each label's examples within chunks of this many micro-batches: large enough to cut
# most padding, small enough that the epoch still mixes lengths from the whole dataset.
GROUP_CHUNK = 64


class MixedLabelBatchSampler:
    """Batch sampler yielding ``list[int]`` micro-batches of dataset indices, both labels in each (see module)."""

    def __init__(
        self,
        labels: Sequence[bool] | Sequence[int] | np.ndarray,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        lengths: Sequence[int] | np.ndarray | None = None,
        group_by_length: bool = False,
    ) -> None:
        arr = np.asarray(labels)
        if arr.ndim != 1 or (arr.dtype != bool and not np.isin(arr, (0, 1)).all()):
            raise ValueError("labels must be a flat sequence of bool or 0/1 (True/1 = desirable)")
        arr = arr.astype(bool)
        self.stats = self.compute_stats(
            int(arr.sum()), int((~arr).sum()), micro_batch_size, num_replicas, drop_last
        )
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank {rank} out of range for num_replicas {num_replicas}: need 0 <= rank < {num_replicas}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (got {seed})")
        if group_by_length and lengths is None:
            raise ValueError("group_by_length=True needs lengths (one token count per example)")
        self._lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        if self._lengths is not None and self._lengths.shape != arr.shape:
            raise ValueError(
                f"lengths has {len(self._lengths)} entries but labels has {len(arr)}: pass one per example"
            )
        self.labels = arr
        self.micro_batch_size = micro_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.drop_last = drop_last
        self.group_by_length = group_by_length
        minority = self.stats.minority_label
        self._minor_idx = np.flatnonzero(arr == minority)
        self._major_idx = np.flatnonzero(arr != minority)
        self.epoch = 0
        self._start = 0  # micro-batches of self.epoch skipped on resume; cleared when that epoch ends
        self._position = 0  # micro-batches of self.epoch yielded on this rank, skipped ones included
        self._cache: tuple[int, int, np.ndarray] | None = None
        # A re-planned self.epoch (resume on another layout): its global rows and the saved states they came from.
        self._replanned: list[np.ndarray] | None = None
        self._replanned_from: list[dict[str, Any]] | None = None

    @staticmethod
    def compute_stats(
        n_desirable: int,
        n_undesirable: int,
        micro_batch_size: int,
        num_replicas: int = 1,
        drop_last: bool = True,
    ) -> SamplerStats:
        """The epoch's slot counts from label counts alone (no plan is built); raises the sampler's ValueErrors."""
        check_counts(n_desirable, n_undesirable, micro_batch_size, num_replicas)
        minority = n_desirable < n_undesirable
        n_minor, n_major = sorted((n_desirable, n_undesirable))
        m = micro_batch_size
        k, s = slot_layout(n_minor, n_major, m, num_replicas, drop_last)
        major_slots = k * m - s
        return SamplerStats(
            n_desirable=n_desirable,
            n_undesirable=n_undesirable,
            micro_batch_size=m,
            num_replicas=num_replicas,
            drop_last=drop_last,
            minority_label=minority,
            num_micro_batches=k,
            micro_batches_per_rank=k // num_replicas,
            effective_desirable=s if minority else major_slots,
            effective_undesirable=major_slots if minority else s,
            minority_repeats=max(0, s - n_minor),
            minority_uses=(s // n_minor, -(-s // n_minor)),
            minority_per_micro_batch=(s // k, -(-s // k)),
            repeated_slots=max(0, s - n_minor) + max(0, major_slots - n_major),
            left_out=max(0, n_minor - s) + max(0, n_major - major_slots),
        )

    @property
    def epoch_stats(self) -> SamplerStats:
        """Slot counts of every epoch of this sampler."""
        return self.stats

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; a pending resume offset survives only if ``epoch`` is the saved one."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0 (got {epoch})")
        if epoch != self.epoch:
            self.epoch, self._start, self._position = epoch, 0, 0
            self._replanned = self._replanned_from = None

    def plan(self, epoch: int | None = None) -> np.ndarray:
        """The global ``[num_micro_batches, micro_batch_size]`` index plan of an epoch, shared by all ranks."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[:2] == (self.seed, epoch):
            return self._cache[2]
        rng = np.random.default_rng([self.seed, epoch])
        k, m = self.stats.num_micro_batches, self.micro_batch_size
        s = (self.stats.effective_desirable, self.stats.effective_undesirable)[not self.stats.minority_label]
        counts = np.full(k, s // k)
        counts[rng.permutation(k)[: s % k]] += 1  # which micro-batches get the extra minority: seeded
        minor = draw_stream(rng, self._minor_idx, s)
        major = draw_stream(rng, self._major_idx, k * m - s)
        if self.group_by_length:
            assert self._lengths is not None
            # Sort each label's draws by length inside chunks of micro-batches, so neighbours have similar lengths.
            for stream, per_row in ((minor, counts), (major, m - counts)):
                chunk = np.repeat(np.arange(k) // GROUP_CHUNK, per_row)
                stream[:] = stream[np.lexsort((self._lengths[stream], chunk))]
        # Row j takes its counts[j] minority draws, then m - counts[j] majority draws, in stream order.
        cols = np.arange(m)[None, :]
        at_minor = (np.cumsum(counts) - counts)[:, None] + cols
        at_major = (np.cumsum(m - counts) - (m - counts))[:, None] + cols - counts[:, None]
        is_minor = cols < counts[:, None]
        plan = np.where(
            is_minor, minor[np.minimum(at_minor, len(minor) - 1)], major[np.clip(at_major, 0, len(major) - 1)]
        )
        if self.stats.repeated_slots:
            spread_duplicates(plan, counts)
        plan = rng.permuted(plan[rng.permutation(k)], axis=1)  # shuffle micro-batch order and positions
        self._cache = (self.seed, epoch, plan)
        return plan

    def _rank_rows(self) -> Sequence[np.ndarray]:
        rows = self.plan() if self._replanned is None else self._replanned
        return rows[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        rows = self._rank_rows()
        self._position = self._start
        for i in range(self._start, len(rows)):
            self._position = i + 1  # counted before the yield: the consumer holds this batch
            yield rows[i].tolist()
        self._start = 0  # the resume offset applies to the saved epoch only, never to later ones

    def __len__(self) -> int:
        if self._replanned is not None:
            return len(self._replanned) // self.num_replicas - self._start
        return self.stats.micro_batches_per_rank - self._start

    @property
    def start(self) -> int:
        """Micro-batches of ``epoch`` already consumed on this rank before a resume (0 after a re-plan)."""
        return self._start

    def state_dict(self) -> dict[str, Any]:
        """Plain ints (and, inside a re-planned epoch, the saved states it came from); valid during iteration."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self._position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "micro_batch_size": self.micro_batch_size,
            "dataset_size": len(self.labels),
            "n_desirable": self.stats.n_desirable,
            "drop_last": int(self.drop_last),
            "group_by_length": int(self.group_by_length),
        }
        if self._replanned_from is not None:
            state["replanned_from"] = self._replanned_from
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]`` of ``state["epoch"]``; only those two keys are required.

        The saved seed is adopted; the other keys, when present, must match this sampler (ValueError otherwise).
        """
        mine = self.state_dict()
        for key in (
            "num_replicas",
            "micro_batch_size",
            "dataset_size",
            "n_desirable",
            "drop_last",
            "group_by_length",
        ):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"sampler state has {key}={int(state[key])} but this sampler has {key}={mine[key]}: "
                    f"resume with the same {key} or start a new run"
                )
        missing = [key for key in ("epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}: pass at least epoch and position")
        epoch, position = int(state["epoch"]), int(state["position"])
        self._replanned = self._replanned_from = None
        if state.get("replanned_from") is not None:  # the saved epoch was itself re-planned: rebuild its rows
            self._replanned_from = list(state["replanned_from"])
            self._replanned = self._replan(self._replanned_from, self.num_replicas, self.micro_batch_size)
        per_rank = (
            len(self._rank_rows()) if self._replanned is not None else self.stats.micro_batches_per_rank
        )
        if epoch < 0 or not 0 <= position <= per_rank:
            self._replanned = self._replanned_from = None
            raise ValueError(
                f"sampler state epoch={epoch}, position={position}: need epoch >= 0 and "
                f"0 <= position <= {per_rank} micro-batches per rank"
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self._start, self._position = epoch, position, position

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume from every rank's state of the saved run (``states[r]`` from its data-parallel rank r).

        The same layout resumes at this rank's position; another number of ranks or micro-batch size re-plans
        the saved epoch's unconsumed examples over this sampler's ranks. ValueError when the states do not
        describe one run over this dataset.
        """
        if not states:
            raise ValueError("no sampler states given")
        first = states[0]
        for key in ("dataset_size", "n_desirable", "drop_last", "group_by_length"):
            if key in first and int(first[key]) != self.state_dict()[key]:
                raise ValueError(
                    f"sampler state has {key}={int(first[key])} but this sampler has "
                    f"{key}={self.state_dict()[key]}: resume with the same data and {key}"
                )
        common = ("epoch", "seed", "num_replicas", "micro_batch_size")
        if any(key not in s for s in states for key in (*common, "position")):
            raise ValueError(f"every sampler state needs {', '.join(common)} and position")
        if any(any(int(s[k]) != int(first[k]) for k in common) for s in states) or len(states) != int(
            first["num_replicas"]
        ):
            raise ValueError(
                f"the {len(states)} sampler states are not one run's ranks (they differ in {common})"
            )
        positions = [int(s["position"]) for s in states]
        same = (int(first["num_replicas"]), int(first["micro_batch_size"])) == (
            self.num_replicas,
            self.micro_batch_size,
        )
        if same and len(set(positions)) == 1:
            self.load_state_dict({**first, "position": positions[0]})
            return
        self.seed = int(first["seed"])
        self.epoch, self._start, self._position = int(first["epoch"]), 0, 0
        self._replanned_from = [dict(s) for s in states]
        self._replanned = self._replan(self._replanned_from, self.num_replicas, self.micro_batch_size)

    def saved_rows(self, state: dict[str, Any]) -> list[np.ndarray]:
        """The global rows of the epoch a saved state was recorded in (its own plan, or its re-plan)."""
        if state.get("replanned_from") is not None:
            return self._replan(
                state["replanned_from"], int(state["num_replicas"]), int(state["micro_batch_size"])
            )
        old = MixedLabelBatchSampler(
            self.labels,
            int(state["micro_batch_size"]),
            int(state["num_replicas"]),
            0,
            int(state["seed"]),
            self.drop_last,
            self._lengths,
            self.group_by_length,
        )
        return list(old.plan(int(state["epoch"])))

    def _replan(
        self, states: Sequence[dict[str, Any]], num_replicas: int, micro_batch_size: int
    ) -> list[np.ndarray]:
        """Rows of ``states``' epoch not consumed by its ranks, dealt over ``num_replicas`` ranks (deterministic)."""
        rows = self.saved_rows(states[0])
        used = consumed_rows(len(rows), [int(s["position"]) for s in states])
        left = [row for row, done in zip(rows, used, strict=True) if not done]
        remaining = np.concatenate(left) if left else np.zeros(0, dtype=np.int64)
        first = states[0]
        rng = np.random.default_rng([int(first["seed"]), int(first["epoch"]), len(states), num_replicas, 1])
        return replan_remaining(remaining, self.labels, micro_batch_size, num_replicas, rng)


def padding_tokens(batches: Iterable[Sequence[int]], lengths: Sequence[int] | np.ndarray) -> int:
    """Pad tokens of dynamically padded micro-batches: sum of ``max_len * len(batch) - sum(len)``."""
    lens = np.asarray(lengths)
    return int(sum(lens[b].max() * len(b) - lens[b].sum() for b in map(list, batches)))


def padding_saved(
    labels: Sequence[bool] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    micro_batch_size: int,
    num_replicas: int = 1,
    seed: int = 0,
    epoch: int = 0,
) -> tuple[int, int]:
    """Pad tokens over one epoch (all ranks) without and with ``group_by_length``."""
    out = []
    for group in (False, True):
        s = MixedLabelBatchSampler(
            labels, micro_batch_size, num_replicas, 0, seed, lengths=lengths, group_by_length=group
        )
        out.append(padding_tokens(s.plan(epoch), lengths))
    return out[0], out[1]
