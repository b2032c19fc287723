"""model.compile on 2 real gloo processes, on each plugin it admits: policy and reference compiled alike, so the
rewards and KL of step 1 (reference = the policy's weights) are exactly 0.0; a resume with compile on continues
bit-exactly (weights after the resume == the uninterrupted run's). Compiled vs eager numbers:
tests/unit/models/test_compiled_model.py.

Marker ``compile``: inductor builds the layers' kernels (bf16 and fp32 graphs) in both processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_trainer import _build, _config, _global_steps, _row, _weights

from coati_kto.testing.distributed import run_distributed

pytestmark = pytest.mark.compile

PLUGINS = {
    "hybrid_z2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "low_level_zero_z2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "ddp_fp32": {"name": "ddp", "precision": "fp32"},
}
STEP_ONE = ("train/rewards/chosen", "train/rewards/rejected", "train/kl", "train/rewards/margins")


def _first_step(model_dir: str, out_dir: str, plugin: dict, rank: int) -> dict:
    """One optimizer step (2 micro-batches per rank), compile on, the reference = the policy's weights."""
    from coati_kto.models.compile import compiled_layers

    cfg = _config(model_dir, out_dir, plugin=plugin, model={"compile": True}, train={"accumulation_steps": 2})
    parts, trainer = _build(cfg, 1)
    trainer.fit(_global_steps()[0][rank::2])
    step = next(h for h in trainer.history if "train/kl" in h)
    return {
        "step": {k: step[k] for k in STEP_ONE},
        "compiled": (compiled_layers(parts.policy), compiled_layers(parts.reference)),
    }


def _resume_run(model_dir: str, out_dir: str, rank: int, resume_from: str | None) -> np.ndarray:
    """3 optimizer steps of 2 micro-batches on hybrid_parallel ZeRO-2 bf16, compile on, checkpoint at step 2;
    ``resume_from``: continue from that checkpoint instead. The policy's weights at the end."""
    from torch.utils.data import DataLoader

    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.sampler import MixedLabelBatchSampler

    gen = torch.Generator().manual_seed(7)
    rows = [_row(gen, i % 2) for i in range(24)]
    sampler = MixedLabelBatchSampler([r["label"] for r in rows], 2, num_replicas=2, rank=rank, seed=3)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=KTOCollator(pad_token_id=0))
    run_dir = Path(out_dir) / ("resumed" if resume_from else "full")
    cfg = _config(
        model_dir,
        str(run_dir),
        plugin=PLUGINS["hybrid_z2_bf16"],
        model={"compile": True},
        train={"max_steps": 3, "micro_batch_size": 2, "accumulation_steps": 2},
    )
    parts, trainer = _build(cfg, 3, max_steps=3, save_interval=2, save_dir=str(run_dir / "checkpoints"))
    if resume_from:
        trainer.resume(resume_from)
    trainer.fit(loader)
    return _weights(parts.policy)


def _compiled_runs(model_dir: str, out_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from coati_kto.models.compile import compiled_graphs

    rank = dist.get_rank()
    out: dict[str, Any] = {
        name: _first_step(model_dir, str(Path(out_dir) / name), plugin, rank)
        for name, plugin in PLUGINS.items()
    }
    full = _resume_run(model_dir, out_dir, rank, None)
    checkpoint = str(Path(out_dir) / "full" / "checkpoints" / "step-2")
    graphs = compiled_graphs()
    out["resume"] = {"full": full, "resumed": _resume_run(model_dir, out_dir, rank, checkpoint)}
    out["graphs"] = (graphs, compiled_graphs())
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("compiled")
    return run_distributed(_compiled_runs, 2, str(tiny_model_dir), str(out))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_step_one_rewards_and_kl_exactly_zero(runs: list[dict], plugin: str) -> None:
    for rank in runs:
        assert rank[plugin]["step"] == dict.fromkeys(STEP_ONE, 0.0)
        assert rank[plugin]["compiled"] == (2, 2)  # the tiny Llama's 2 layers, policy and reference


def test_resume_is_bit_exact_with_compile(runs: list[dict]) -> None:
    for rank in runs:
        full, resumed = rank["resume"]["full"], rank["resume"]["resumed"]
        assert np.array_equal(full, resumed)
        assert full.size > 10_000  # the tiny Llama's weights, not an empty array
    # The resumed run (new models, the same shapes' kinds) reuses the graphs compiled before: no recompiles
    assert all(rank["graphs"][1] == rank["graphs"][0] > 0 for rank in runs)


@pytest.mark.parametrize("layout", ["one", "bins"])
def test_padding_free_passes_compiled_equal_eager(layout: str) -> None:
    """Packed rows (data.padding_free: per-document positions, a dense mask under sdpa) through compiled layers:
    the eager model's log-probs within fp32 rounding, and a second batch of other lengths compiles nothing."""
    import copy

    from test_packing import _model, _rows
    from test_padding_free import _layouts
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.data.collator import KTOCollator
    from coati_kto.models.compile import compile_layers, compiled_graphs

    eager = _model(LlamaForCausalLM, LlamaConfig, "sdpa")
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    graphs = []
    for seed, rows in ((7, 6), (9, 5)):
        batch = KTOCollator(0, padding_free=layout)(_rows(seed, rows, mismatched=(3,)))
        want, got = _layouts(eager, batch), _layouts(compiled, batch)
        for name, values in want.items():
            for a, b in zip(values, got[name], strict=True):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
        graphs.append(compiled_graphs())
    assert graphs[1] == graphs[0]
