"""The run's data loaders, built from the ``train`` section: training micro-batches by data-parallel rank, and
evaluation micro-batches that hold every eval example exactly once over the ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from coati_kto.config.schema import TrainSection
from coati_kto.data.collator import KTOCollator
from coati_kto.data.eval_sampler import EvalBatchSampler, ValidMaskLoader
from coati_kto.data.prepared_read import PreparedData
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.errors import ConfigError
from coati_kto.parallel.distributed import ParallelLayout


def build_loaders(
    data: PreparedData,
    train: TrainSection,
    group_by_length: bool,
    layout: ParallelLayout,
    collator: KTOCollator,
) -> tuple[Any, Any]:
    """(train loader, eval loader or None), by data-parallel rank (tensor-parallel peers see the same batches).

    ``group_by_length``: ``data.group_by_length``. Each loader has its own generator: iter() of a loader without
    one draws from torch's RNG (after a resume restored it)."""
    try:
        sampler = MixedLabelBatchSampler(
            data.train["label"],
            train.micro_batch_size,
            num_replicas=layout.dp_size,
            rank=layout.dp_rank,
            seed=train.seed,
            drop_last=True,
            lengths=data.train["length"] if group_by_length else None,
            group_by_length=group_by_length,
        )
    except ConfigError as err:  # too few examples: name the files, and what prepare took out of them
        files = ", ".join(data.stats["files"]["train"])
        raise ConfigError(f"data.train_files ({files}): {err}{_removed(data.stats)}") from None
    workers = {"num_workers": train.num_workers, "generator": torch.Generator()}
    train_loader = DataLoader(data.train, batch_sampler=sampler, collate_fn=collator, **workers)
    if data.eval is None or len(data.eval) == 0:
        return train_loader, None
    eval_sampler = EvalBatchSampler(
        len(data.eval),
        train.eval_micro_batch_size or train.micro_batch_size,
        num_replicas=layout.dp_size,
        rank=layout.dp_rank,
    )
    loader = DataLoader(data.eval, batch_sampler=eval_sampler, collate_fn=collator, **workers)
    return train_loader, ValidMaskLoader(loader, eval_sampler)


def _removed(stats: dict[str, Any]) -> str:
    """What prepare took out of the training files (stats.json): rows dropped to fit data.max_length, bad records
    skipped, examples held out for evaluation; empty when nothing was."""
    dropped = sum((stats["train"].get("dropped") or {}).values())
    skipped = (stats.get("bad_records") or {}).get("skipped", 0)
    fraction = stats["settings"].get("eval_fraction") or 0.0
    held = (stats.get("eval") or {}).get("examples", 0) if fraction else 0

    def were(n: int) -> str:
        return f"{n} {'was' if n == 1 else 'were'}"

    parts = [f"{were(dropped)} dropped as too long (data.on_too_long: skip)"] if dropped else []
    parts += [f"{were(skipped)} skipped as bad records (data.on_bad_record: skip)"] if skipped else []
    parts += [f"{were(held)} held out for evaluation (data.eval_fraction {fraction})"] if held else []
    return f"; of the files' records, {' and '.join(parts)}" if parts else ""
