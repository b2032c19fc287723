"""The run's data loaders leave torch's global RNG alone: a resume restores it from the checkpoint, then starts the
epoch's iterator; a loader without its own generator drew its base seed from the restored RNG there (one draw the
uninterrupted run took before step 1), so every random op of the resumed steps shifted (PhiMoE's sparsemixer
samples its gradient estimator in training: its resume was not bit-exact, 0.0157 apart, in the family sweep)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch


def test_iterating_the_loaders_draws_nothing_from_torch_rng(tmp_path: Path) -> None:
    from datasets import Dataset

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.loaders import build_loaders
    from coati_kto.parallel.distributed import ParallelLayout

    config = Config.model_validate(
        {
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_files": ["unused.jsonl"], "prepared_dir": str(tmp_path / "prepared")},
            "output": {"dir": str(tmp_path / "out")},
            "train": {"micro_batch_size": 2},
        }
    )
    rows = {"label": [True, False] * 4, "length": [5] * 8}
    data = SimpleNamespace(train=Dataset.from_dict(rows), eval=Dataset.from_dict(rows))
    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, dp_group=None)
    collator = KTOCollator(pad_token_id=0)
    train_loader, eval_loader = build_loaders(
        data, config.train, config.data.group_by_length, layout, collator
    )
    torch.manual_seed(5)
    before = torch.get_rng_state()
    iter(train_loader), iter(eval_loader.loader)
    assert torch.equal(torch.get_rng_state(), before)
