"""Evaluation batches: every example exactly once over the data-parallel ranks, the same number of micro-batches
on every rank, padding rows marked invalid so exact metrics ignore them.

Why equal counts: evaluation forward passes may hold collectives (a sharded forward gathers weights, and the eval
reduction itself), so a rank with one micro-batch fewer would hang the others. Why padding instead of a
shorter last batch: a rank may have no example left at all for its last micro-batch.

Layout: rank r takes examples r, r+R, r+2R, ... (counts differ by at most one between ranks), in order, and
cuts them into ``num_micro_batches`` micro-batches of ``micro_batch_size`` slots; slots after its last example
repeat its own examples (or example 0 when it has none) and are invalid. Valid slots come first in each
micro-batch, so ``valid`` is a prefix mask: it survives any collator that keeps row order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from coati_kto.data.batch import KTOBatch
from coati_kto.data.packed import counted


class EvalBatchSampler:
    """Batch sampler of ``list[int]`` micro-batches for evaluation on one data-parallel rank (see module).

    Deterministic (no shuffling, no epochs): evaluation order does not change the metrics, which are sums.
    """

    def __init__(
        self, num_examples: int, micro_batch_size: int, num_replicas: int = 1, rank: int = 0
    ) -> None:
        if num_examples < 1:
            raise ValueError("the eval set is empty: add eval examples or leave data.eval_files empty")
        if micro_batch_size < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"need micro_batch_size >= 1 and 0 <= rank < num_replicas, got {micro_batch_size}, {rank}, "
                f"{num_replicas}"
            )
        self.num_examples = num_examples
        self.micro_batch_size = micro_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.indices = list(range(rank, num_examples, num_replicas))  # this rank's examples, each once
        per_rank_max = -(-num_examples // num_replicas)
        self.num_micro_batches = -(-per_rank_max // micro_batch_size)

    def __len__(self) -> int:
        return self.num_micro_batches

    def num_valid(self, k: int) -> int:
        """How many leading rows of this rank's micro-batch ``k`` are real examples (the rest is padding)."""
        return max(0, min(self.micro_batch_size, len(self.indices) - k * self.micro_batch_size))

    def __iter__(self) -> Iterator[list[int]]:
        m = self.micro_batch_size
        filler = self.indices or [0]
        for k in range(self.num_micro_batches):
            real = self.indices[k * m : (k + 1) * m]
            pad = [filler[i % len(filler)] for i in range(m - len(real))]
            yield real + pad


class ValidMaskLoader:
    """Iterate ``loader`` (built on an EvalBatchSampler) marking each batch's ``valid`` rows ([B] bool, False on padding).

    Assumes the collator keeps the sampler's row order (dynamic padding does).
    """

    def __init__(self, loader: Iterable[KTOBatch], sampler: EvalBatchSampler) -> None:
        self.loader = loader
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[KTOBatch]:
        for k, batch in enumerate(self.loader):
            yield counted(batch.with_valid(torch.arange(len(batch)) < self.sampler.num_valid(k)))
