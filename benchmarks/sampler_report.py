"""Print how MixedLabelBatchSampler lays out the seeds' 746:254 dataset, and what length grouping saves.

Run from the repository root: ``python benchmarks/sampler_report.py``. Every number is measured by iterating
the samplers of all ranks, then checked against the stats the sampler reports without building a plan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from coati_kto.data.sampler import MixedLabelBatchSampler, padding_saved  # noqa: E402

N_DESIRABLE, N_UNDESIRABLE = 746, 254


def seeds_table() -> None:
    """Micro-batches per rank, % mixed, minority repeats, left out and effective counts per (mbs, ranks)."""
    labels = np.array([True] * N_DESIRABLE + [False] * N_UNDESIRABLE)
    labels = labels[np.random.default_rng(0).permutation(len(labels))]
    head = (
        f"{'mbs':>3} {'ranks':>5} {'mb/rank':>7} {'mixed':>7} {'U repeats':>9} {'U uses':>6} "
        f"{'left out':>8} {'eff D':>5} {'eff U':>5} {'D:U seen':>8}"
    )
    print(f"{N_DESIRABLE} desirable : {N_UNDESIRABLE} undesirable, drop_last=True, epoch 0")
    print(head)
    print("-" * len(head))
    for mbs in (2, 4):
        for ranks in (1, 2, 4, 8):
            batches = [b for rank in range(ranks) for b in MixedLabelBatchSampler(labels, mbs, ranks, rank)]
            mixed = np.mean([labels[b].any() and not labels[b].all() for b in batches])
            used = np.bincount(np.concatenate(batches), minlength=len(labels))
            stats = MixedLabelBatchSampler.compute_stats(N_DESIRABLE, N_UNDESIRABLE, mbs, ranks)
            eff_d, eff_u = int(used[labels].sum()), int(used[~labels].sum())
            assert (eff_d, eff_u) == (stats.effective_desirable, stats.effective_undesirable)
            assert int((used == 0).sum()) == stats.left_out
            assert len(batches) == ranks * stats.micro_batches_per_rank
            uses = f"{stats.minority_uses[0]}-{stats.minority_uses[1]}"
            print(
                f"{mbs:>3} {ranks:>5} {stats.micro_batches_per_rank:>7} {mixed:>7.1%} {stats.minority_repeats:>9} "
                f"{uses:>6} {stats.left_out:>8} {eff_d:>5} {eff_u:>5} {eff_d / eff_u:>8.2f}"
            )


def padding_table() -> None:
    """Pad tokens per epoch with dynamic padding, without and with group_by_length, on log-normal lengths."""
    rng = np.random.default_rng(0)
    labels = np.array([True] * N_DESIRABLE + [False] * N_UNDESIRABLE)
    lengths = np.clip(rng.lognormal(5.0, 0.7, len(labels)).astype(int), 8, 2048)  # median ~150 tokens
    print(
        f"\npadding tokens per epoch, synthetic log-normal lengths (total {int(lengths.sum())} real tokens)"
    )
    head = f"{'mbs':>3} {'ranks':>5} {'without':>9} {'grouped':>9} {'saved':>6}"
    print(head)
    print("-" * len(head))
    for mbs in (2, 4, 8):
        for ranks in (1, 8):
            without, grouped = padding_saved(labels, lengths, mbs, ranks)
            print(f"{mbs:>3} {ranks:>5} {without:>9} {grouped:>9} {1 - grouped / without:>6.1%}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Already seconds at full size: --smoke is the same report, accepted so every benchmark has the flag.
    parser.add_argument("--smoke", action="store_true", help="same as without (it takes seconds)")
    parser.parse_args()
    seeds_table()
    padding_table()
