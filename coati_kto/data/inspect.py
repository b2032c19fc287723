"""``coati-kto inspect``: what each data-parallel rank's micro-batches will hold, before any GPU is involved.

Prints, for ``num_ranks`` ranks and the configured micro-batch size and seed: each rank's first micro-batches
as a label pattern (``rank 0 batch 0: [T F T T]  mixed``), the share of mixed micro-batches over the whole
epoch, the sampler's minority repeats and effective counts, the KTO weights report, and a few decoded
examples (prompt | completion | KL completion) to eyeball.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coati_kto.config.schema import Config
from coati_kto.data.prepared import load_prepared
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.data.tokenize import load_tokenizer
from coati_kto.data.weights import resolve_kto_weights
from coati_kto.errors import DataError


def _clip(text: str, limit: int = 160, keep_end: bool = False) -> str:
    """One line: newlines shown as \\n, long text cut in the middle of nowhere but marked with '...'."""
    text = text.replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if keep_end else text[:limit] + "..."


def inspect_batches(
    config: Config, num_ranks: int | None = None, num_batches: int = 4, num_examples: int = 3
) -> None:
    """Print the micro-batch layout of epoch 0 for ``num_ranks`` data-parallel ranks (default 1)."""
    ranks = num_ranks or 1
    data = load_prepared(config)
    train = data.train
    labels = np.asarray(train["label"], dtype=bool)
    lengths = np.asarray(train["length"], dtype=np.int64)
    mbs, seed = config.train.micro_batch_size, config.train.seed
    try:
        samplers = [
            MixedLabelBatchSampler(
                labels, mbs, ranks, rank, seed, lengths=lengths, group_by_length=config.data.group_by_length
            )
            for rank in range(ranks)
        ]
    except ValueError as err:
        raise DataError(f"data.prepared_dir {config.data.prepared_dir}: {err}") from None

    print(
        f"{len(labels)} train examples ({int(labels.sum())} desirable, {int((~labels).sum())} undesirable); "
        f"micro_batch_size {mbs}, {ranks} rank{'s' * (ranks > 1)}, seed {seed}, epoch 0"
    )
    first_batch: list[int] = []
    for rank, sampler in enumerate(samplers):
        batches = list(sampler)
        first_batch = first_batch or batches[0]
        for b, batch in enumerate(batches[:num_batches]):
            pattern = " ".join("T" if labels[i] else "F" for i in batch)
            mixed = labels[batch].any() and not labels[batch].all()
            print(f"rank {rank} batch {b}: [{pattern}]  {'mixed' if mixed else 'SINGLE LABEL'}")
        n_mixed = sum(bool(labels[b].any() and not labels[b].all()) for b in batches)
        print(
            f"rank {rank}: {n_mixed}/{len(batches)} micro-batches mixed ({n_mixed / len(batches):.1%}) over the epoch"
        )

    s = samplers[0].stats
    minority = "desirable" if s.minority_label else "undesirable"
    print(
        f"per epoch: {s.micro_batches_per_rank} micro-batches per rank; effective {s.effective_desirable} "
        f"desirable / {s.effective_undesirable} undesirable; minority ({minority}) repeats {s.minority_repeats} "
        f"(each used {s.minority_uses[0]}-{s.minority_uses[1]} times); {s.left_out} examples left out"
    )
    print(resolve_kto_weights(config, data.stats, ranks)[2])

    if num_examples > 0:
        _print_examples(config, train, first_batch[:num_examples])


def _print_examples(config: Config, train: Any, indices: list[int]) -> None:
    """Decode rows ``indices`` of the train split: prompt, completion and KL completion, clipped."""
    tokenizer = load_tokenizer(config)
    print("\nexamples from rank 0's first micro-batch (prompt | completion | KL completion):")
    for i in indices:
        row = train[int(i)]
        ids, start = row["input_ids"], row["completion_start"]
        kl_ids, kl_start = row["kl_input_ids"], row["kl_completion_start"]
        label = "desirable" if row["label"] else "undesirable"
        print(
            f"[{i}] {label}, {row['source']}, {row['length']} tokens, KL completion from [{row['kl_index']}]"
        )
        print(f"  prompt        | {_clip(tokenizer.decode(ids[:start]), keep_end=True)}")
        print(f"  completion    | {_clip(tokenizer.decode(ids[start:]))}")
        print(f"  KL completion | {_clip(tokenizer.decode(kl_ids[kl_start:]))}")
