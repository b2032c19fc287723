"""The attention path every pass of a KTO step takes (coati_kto.testing.kernels, per model pass): padded sdpa
passes run sdpa's causal kernel with no mask, the shared-prompt passes hand it a dense mask; what model.attn_implementation auto runs on a GPU (flex_attention, every
pass padding-free, the shared-prompt passes folded) puts every pass on a flex block mask, none on a dense mask.
One process, one optimizer step of two micro-batches, counted after a first step."""

from __future__ import annotations

import contextlib
from pathlib import Path

from test_trainer import _build, _config, _rank_loader, one_row

from coati_kto.testing.distributed import run_distributed


def _step_paths(model_dir: str, out_dir: str, flex: bool) -> dict:
    from coati_kto.testing.flex import flex_reference
    from coati_kto.testing.kernels import KernelCounter

    model = {"path": model_dir, "attn_implementation": "flex_attention" if flex else "sdpa"}
    train = {"accumulation_steps": 2, "micro_batch_size": 4}
    plugin = {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"}
    cfg = _config(model_dir, out_dir, model=model, plugin=plugin, train=train)
    _, trainer = _build(cfg, 4, pack_reference=True, pack_policy=True)
    batches = _rank_loader(1, 0)
    if flex:  # what KTOCollator(padding_free="one") plans
        batches = one_row(batches)
    with flex_reference() if flex else contextlib.nullcontext():
        trainer._train_step(batches[0:2], 0)
        with KernelCounter() as count:
            trainer._train_step(batches[2:4], 0)
    summary = count.summary(1)
    return {"attention": summary["attention"], "syncs": summary["syncs"]}


def _both(model_dir: str, out_dir: str) -> tuple[dict, dict]:
    return _step_paths(model_dir, out_dir + "/sdpa", False), _step_paths(model_dir, out_dir + "/flex", True)


def test_every_pass_of_a_flex_step_is_on_a_block_mask(tiny_model_dir: Path, tmp_path: Path) -> None:
    padded, flex = run_distributed(_both, 1, str(tiny_model_dir), str(tmp_path))[0]
    print(f"sdpa padded: {padded}\nflex padding-free: {flex}")
    # Per micro-batch: the reference's shared-prompt pass and the policy's KL pass, then its gradient pass
    # (padded: the shared-prompt pass on the project's 4D mask; the policy's own passes over right-padded rows
    # on sdpa's causal kernel with no mask: they were on a dense mask too, and took no flash kernel on a GPU).
    layers = 2  # the tiny model's
    assert len(padded["attention"]) == len(flex["attention"]) == 2 * 3
    dense, causal = f"sdpa dense mask x{layers}", f"sdpa causal no mask x{layers}"
    assert padded["attention"] == [dense, causal, dense, causal, causal, causal], padded
    assert all(path == f"flex block mask x{layers}" for path in flex["attention"]), flex
    assert flex["syncs"] == padded["syncs"] == 1  # the step's one metric read: block masks read nothing back
