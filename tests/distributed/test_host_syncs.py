"""Host syncs per optimizer step in steady state: the ops that make the host wait for the GPU (reading a value
back, data-dependent shapes), counted on CPU by the ops that run (coati_kto.testing.syncs).

The project's own code reads one value back per step: the step's metric and vote all-reduce. Completion
positions and logits_to_keep are planned on the host by the collator, z0 uses masked sums. What remains runs
inside the model's forward: transformers' sdpa path checks ``torch.all(attention_mask == 1)`` once per forward
pass (4 passes per micro-batch here), which only a padding-free or 4D-mask path avoids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer import _build, _config, _rank_loader

from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "ddp_fp32": {"name": "ddp", "precision": "fp32"},
    "low_level_zero_zero2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    # What hybrid_parallel runs on one GPU (parallel.plan.running_zero_stage): the AMP optimizer.
    "hybrid_zero0_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"},
}
MICRO_BATCHES, PASSES = 2, 4  # per step; per micro-batch: policy and reference on examples and KL pairs


def _count(
    model_dir: str, out_dir: str, plugin: dict, padding_free: bool = False, pack: bool = False
) -> dict:
    from dataclasses import replace

    from coati_kto.data.packed import plan_rows
    from coati_kto.testing.syncs import HostSyncCounter

    train = {"accumulation_steps": MICRO_BATCHES, "micro_batch_size": 4}
    cfg = _config(model_dir, out_dir, plugin=plugin, train=train)
    _, trainer = _build(cfg, 4, pack_reference=pack, pack_policy=pack)
    batches = _rank_loader(1, 0)
    if padding_free:  # what KTOCollator(padding_free="one") plans
        batches = [
            replace(
                b,
                pairs=plan_rows(b.example, b.kl, "one"),
                example_rows=plan_rows(b.example, None, "one"),
                kl_rows=plan_rows(None, b.kl, "one"),
            )
            for b in batches
        ]
    trainer._train_step(batches[0:2], 0)  # the first step builds what later steps reuse
    with HostSyncCounter() as syncs:
        trainer._train_step(batches[2:4], 0)
    return {"total": syncs.total, "in_model": syncs.in_model, "places": dict(syncs.by_place)}


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_one_host_sync_per_step_outside_the_model(plugin: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    counts = run_distributed(_count, 1, str(tiny_model_dir), str(tmp_path), PLUGINS[plugin])[0]
    # Nothing read back by an aten op (it was 37, then 1: the gradient norm's float(), now read with the step's
    # sums by their one ``tolist``, a copy this dispatch-level counter does not see). Nothing in the model:
    # transformers' sdpa path reads whether the 2D mask is all ones, twice per pass (16 per step here); the
    # collator's plan answers it instead (coati_kto.models.packing.padded_attention).
    assert counts["total"] == 0 and counts["in_model"] == 0, counts


@pytest.mark.parametrize("padding_free", [False, True])
def test_packed_passes_read_nothing_back(padding_free: bool, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The packed layouts are planned on the host and their masks built by broadcasts: the shared-prompt
    reference pass adds no sync (it cost 19 per micro-batch of 8 on an H100 when planned on the device), padded
    or padding-free."""
    plugin = PLUGINS["hybrid_zero2_bf16"]
    counts = run_distributed(_count, 1, str(tiny_model_dir), str(tmp_path), plugin, padding_free, True)[0]
    assert counts["total"] == 0, counts
