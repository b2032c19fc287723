"""Resume on another layout, end to end: 2 gloo processes train part of an epoch and save; 1 process resumes
from that checkpoint and finishes the epoch. Every example of the epoch's plan is consumed exactly once (counted
from the dataset indices each collated micro-batch held) and the loss stays finite.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import _build, _config, _row

from coati_kto.testing.distributed import run_distributed

ROWS, MBS, SEED, STEPS_BEFORE = 24, 2, 3, 2
PLUGIN = {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}


class _Recording:
    """A collator that records the dataset indices of every micro-batch it builds (num_workers=0: no prefetch)."""

    def __init__(self) -> None:
        from coati_kto.data.collator import KTOCollator

        self.collate = KTOCollator(pad_token_id=0)
        self.seen: list[int] = []

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        self.seen += [row["idx"] for row in rows]
        return self.collate([{k: v for k, v in row.items() if k != "idx"} for row in rows])


def _rows() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [{**_row(gen, i % 3 != 0), "idx": i} for i in range(ROWS)]


def _run(model_dir: str, out_dir: str, max_steps: int | None, resume: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from coati_kto.data.sampler import MixedLabelBatchSampler
    from coati_kto.errors import UserError

    rows = _rows()
    world, rank = dist.get_world_size(), dist.get_rank()
    sampler = MixedLabelBatchSampler(
        [r["label"] for r in rows], MBS, num_replicas=world, rank=rank, seed=SEED
    )
    recording = _Recording()
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=recording)
    cfg = _config(model_dir, out_dir, plugin=PLUGIN, train={"micro_batch_size": MBS})
    parts, trainer = _build(cfg, 12, max_steps=max_steps, save_dir=str(Path(out_dir) / "checkpoints"))
    # Rank 0 resolves train.resume for everyone: its error reaches every rank (none waits in a collective).
    try:
        trainer.checkpoint_manager.resolve_everywhere(str(Path(out_dir) / "missing"))
        missing_error = None
    except UserError as err:
        missing_error = str(err)
    if resume:
        trainer.resume(trainer.checkpoint_manager.resolve_everywhere("auto"))
    resumed_at = trainer.global_step
    left = trainer.position.left_in_epoch(loader)  # what the schedule's length is computed from
    trainer.fit(loader)
    return {
        "seen": recording.seen,
        "losses": [h["train/loss"] for h in trainer.history if "train/loss" in h],
        "resumed_at": resumed_at,
        "left": left,
        "missing_error": missing_error,
        "steps": trainer.global_step,
    }


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("relayout"))
    first = run_distributed(_run, 2, str(tiny_model_dir), out, STEPS_BEFORE, False)
    second = run_distributed(_run, 1, str(tiny_model_dir), out, None, True)[0]
    return {"first": first, "second": second}


def test_two_ranks_then_one_consumes_every_example_of_the_epoch_once(runs: dict[str, Any]) -> None:
    from coati_kto.data.sampler import MixedLabelBatchSampler

    plan = MixedLabelBatchSampler([r["label"] for r in _rows()], MBS, num_replicas=2, seed=SEED).plan(0)
    first, second = runs["first"], runs["second"]
    assert [len(r["seen"]) for r in first] == [STEPS_BEFORE * MBS] * 2
    consumed = Counter(first[0]["seen"]) + Counter(first[1]["seen"]) + Counter(second["seen"])
    assert consumed == Counter(plan.ravel().tolist())
    # 16 desirable : 8 undesirable in micro-batches of 2: the plan repeats undesirable examples (16 rows), each
    # slot consumed once: 2 steps x 2 ranks before, the 12 rows left on 1 rank (accumulation 1) after.
    left = len(plan) - 2 * STEPS_BEFORE
    assert len(plan) == 16 and left == 12
    assert second["resumed_at"] == STEPS_BEFORE and second["steps"] == STEPS_BEFORE + left
    assert second["left"] == (0, left) and first[0]["left"] is None
    assert len(second["losses"]) == left and all(math.isfinite(x) for x in second["losses"])
    assert all(math.isfinite(x) for r in first for x in r["losses"])


def test_resume_path_is_resolved_on_rank_zero_for_every_rank(runs: dict[str, Any]) -> None:
    errors = [r["missing_error"] for r in runs["first"]]
    assert errors[0] == errors[1] and errors[0].startswith("train.resume: checkpoint ")
    assert errors[0].endswith("missing does not exist (train.resume=auto picks the latest one)")
