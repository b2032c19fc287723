"""``coati-kto inspect``: what each data-parallel rank's micro-batches will hold, before any GPU is involved.

Prints, for ``num_ranks`` ranks and the configured micro-batch size and seed: each rank's first micro-batches
as a label pattern (``rank 0 batch 0: [T F T T]  mixed``), the share of mixed micro-batches over the whole
epoch, the sampler's minority repeats and effective counts, the KTO weights report, the padding of rank 0's
first micro-batches as configured and padding-free (:func:`pad_fractions`), and a few decoded examples
(prompt | completion | KL completion) to eyeball.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from coati_kto.data.collator import KTOCollator
from coati_kto.data.prepared import elsewhere, load_prepared
from coati_kto.data.prepared_lock import release
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.tokenize import load_tokenizer
from coati_kto.data.weights import WeightSettings, resolve_kto_weights
from coati_kto.errors import DataError


def _clip(text: str, limit: int = 160, keep_end: bool = False) -> str:
    """One line: newlines shown as \\n, long text cut in the middle of nowhere but marked with '...'."""
    text = text.replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if keep_end else text[:limit] + "..."


def inspect_batches(
    settings: PrepareSettings,
    weights: WeightSettings,
    num_ranks: int | None = None,
    num_batches: int = 4,
    num_examples: int = 3,
) -> None:
    """Print the micro-batch layout of epoch 0 for ``num_ranks`` data-parallel ranks (default 1): the batches
    :func:`~coati_kto.data.prepared.load_prepared`'s data gives at ``weights.micro_batch_size``. A
    ``data.prepared_dir`` that holds another build (a changed seed, say) is left as it is: the data is prepared
    in a temporary directory instead."""
    with tempfile.TemporaryDirectory(prefix="coati-kto-inspect-") as scratch:
        settings, note = elsewhere(settings, Path(scratch) / "prepared", "inspect", missing_too=False)
        if note:
            print(note, flush=True)
        try:
            _inspect(settings, weights, num_ranks, num_batches, num_examples)
        finally:  # the build it read (prepared_lock): another process may replace it from now
            release(Path(settings.data.prepared_dir))


def _inspect(
    settings: PrepareSettings,
    weights: WeightSettings,
    num_ranks: int | None,
    num_batches: int,
    num_examples: int,
) -> None:
    ranks, d = num_ranks or 1, settings.data
    data = load_prepared(settings, weights)
    train = data.train
    labels = np.asarray(train["label"], dtype=bool)
    lengths = np.asarray(train["length"], dtype=np.int64)
    mbs, seed = weights.micro_batch_size, settings.seed
    try:
        samplers = [
            MixedLabelBatchSampler(
                labels, mbs, ranks, rank, seed, lengths=lengths, group_by_length=d.group_by_length
            )
            for rank in range(ranks)
        ]
    except ValueError as err:
        raise DataError(f"data.prepared_dir {d.prepared_dir}: {err}") from None

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
    print(resolve_kto_weights(weights, data.stats, ranks, d.prepared_dir)[2])
    print(_padding_line(d.pad_to_multiple_of, train, batches_of_rank0=list(samplers[0])[:PADDING_BATCHES]))

    if num_examples > 0:
        _print_examples(load_tokenizer(settings.model), train, first_batch[:num_examples])


PADDING_BATCHES = 256  # micro-batches of rank 0 whose padding inspect measures (collating each takes ms)
PASSES = {"example": "examples", "kl": "KL pairs", "pairs": "shared-prompt pairs"}
FEATURES = ("input_ids", "completion_start", "label", "kl_input_ids", "kl_completion_start")


def pad_fractions(batches: list[list[dict]], pad_to_multiple_of: int | None = None) -> dict[str, float]:
    """Share of padding in the tokens each pass processes, over ``batches`` (each a micro-batch's rows):
    ``{"<pass>/<layout>": fraction}`` for passes example, kl, pairs and layouts ``padded`` (to the longest row,
    and to ``pad_to_multiple_of`` if given; the pairs layout is never padded to a multiple), ``bins`` and
    ``one`` (``data.padding_free`` with dense masks / flex attention: coati_kto.data.packed)."""
    collators = {
        "padded": KTOCollator(0, pad_to_multiple_of),
        "bins": KTOCollator(0, padding_free="bins"),
        "one": KTOCollator(0, padding_free="one"),
    }
    data = dict.fromkeys(PASSES, 0)
    processed: dict[str, int] = {}
    for layout, collate in collators.items():
        for features in batches:
            batch = collate(features)
            views = {
                "example": batch.example.input_ids,
                "kl": batch.kl.input_ids,
                "pairs": batch.pairs.input_ids,
            }
            if layout != "padded":
                views.update(example=batch.example_rows.input_ids, kl=batch.kl_rows.input_ids)
            for name, ids in views.items():
                processed[f"{name}/{layout}"] = processed.get(f"{name}/{layout}", 0) + ids.numel()
            if layout == "padded":
                data["example"] += int(batch.example.attention_mask.sum())
                data["kl"] += int(batch.kl.attention_mask.sum())
                data["pairs"] += int((batch.pairs.document >= 0).sum())
    return {key: 1.0 - data[key.split("/")[0]] / tokens for key, tokens in processed.items()}


def _padding_line(pad_to_multiple_of: int | None, train: Any, batches_of_rank0: list[list[int]]) -> str:
    """One line: the padding of these micro-batches as configured (``data.pad_to_multiple_of``), and with
    data.padding_free."""
    batches = [[{k: train[int(i)][k] for k in FEATURES} for i in batch] for batch in batches_of_rank0]
    f = pad_fractions(batches, pad_to_multiple_of)
    shares = ", ".join(f"{what} {f[name + '/padded']:.1%}" for name, what in PASSES.items())
    bins = ", ".join(f"{f[name + '/bins']:.1%}" for name in PASSES)
    return (
        f"padding (rank 0's first {len(batches)} micro-batches, share of the tokens each pass processes): "
        f"{shares}; data.padding_free: bins (eager/sdpa) {bins}, one row (flex_attention) 0"
    )


def _print_examples(tokenizer: Any, train: Any, indices: list[int]) -> None:
    """Decode rows ``indices`` of the train split with ``tokenizer``: prompt, completion and KL completion,
    clipped."""
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
