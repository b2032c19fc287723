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


def test_too_few_examples_names_the_files_and_what_prepare_took_out(tmp_path: Path) -> None:
    """From an audit of degenerate sizes: 8 records of which prepare dropped 6 (too long) or held out 6
    (data.eval_fraction) were refused as "the dataset has 2 examples", naming neither the files nor the 6."""
    import pytest
    from datasets import Dataset

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.loaders import build_loaders
    from coati_kto.errors import ConfigError
    from coati_kto.parallel.distributed import ParallelLayout

    config = Config.model_validate(
        {
            "model": {"path": str(tmp_path / "model")},
            "data": {"train_files": ["f.jsonl"], "prepared_dir": str(tmp_path / "prepared")},
            "output": {"dir": str(tmp_path / "out")},
            "train": {"micro_batch_size": 2},
        }
    )
    rows = {"label": [True, False], "length": [5] * 2}
    layout = ParallelLayout(rank=0, world_size=2, local_rank=0, dp_rank=0, dp_size=2, dp_group=None)
    stats = {
        "files": {"train": ["/d/f.jsonl"]},
        "settings": {"eval_fraction": 0.5},
        "train": {"dropped": {"too_long": 4}},
        "bad_records": {"skipped": 1},
        "eval": {"examples": 2},
    }
    data = SimpleNamespace(train=Dataset.from_dict(rows), eval=None, stats=stats)
    with pytest.raises(ConfigError) as err:
        build_loaders(data, config.train, False, layout, KTOCollator(pad_token_id=0))
    assert str(err.value) == (
        "data.train_files (/d/f.jsonl): the dataset has 2 examples, fewer than one global batch (2 data-parallel "
        "ranks x train.micro_batch_size 2 = 4): lower train.micro_batch_size or the number of processes, or add "
        "data; of the files' records, 4 were dropped as too long (data.on_too_long: skip) and 1 was skipped as "
        "bad records (data.on_bad_record: skip) and 2 were held out for evaluation (data.eval_fraction 0.5)"
    )
