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
from test_trainer import _build, _config, _rank_loader, one_row

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
    from coati_kto.testing.syncs import HostSyncCounter

    train = {"accumulation_steps": MICRO_BATCHES, "micro_batch_size": 4}
    cfg = _config(model_dir, out_dir, plugin=plugin, train=train)
    _, trainer = _build(cfg, 4, pack_reference=pack, pack_policy=pack)
    batches = _rank_loader(1, 0)
    if padding_free:  # what KTOCollator(padding_free="one") plans
        batches = one_row(batches)
    trainer._train_step(batches[0:2], 0)  # the first step builds what later steps reuse
    with HostSyncCounter() as syncs:
        trainer._train_step(batches[2:4], 0)
    return {"total": syncs.total, "in_model": syncs.in_model, "places": dict(syncs.by_place)}


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_one_host_sync_per_step_outside_the_model(plugin: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    counts = run_distributed(_count, 1, str(tiny_model_dir), str(tmp_path), PLUGINS[plugin])[0]
    # The metric / vote all-reduce, read once (it was 37). Nothing in the model: transformers' sdpa path reads
    # whether the 2D mask is all ones, twice per pass (16 per step here); the collator's plan answers it instead
    # (coati_kto.models.packing.padded_attention).
    assert counts["total"] == 1 and counts["in_model"] == 0, counts


@pytest.mark.parametrize("padding_free", [False, True])
def test_packed_passes_read_nothing_back(padding_free: bool, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The packed layouts are planned on the host and their masks built by broadcasts: the shared-prompt
    reference pass adds no sync (it cost 19 per micro-batch of 8 on an H100 when planned on the device), padded
    or padding-free."""
    plugin = PLUGINS["hybrid_zero2_bf16"]
    counts = run_distributed(_count, 1, str(tiny_model_dir), str(tmp_path), plugin, padding_free, True)[0]
    assert counts["total"] == 1, counts


# The one place a step reads back: reduce_sums' read-back of the step's all-reduced sums.
_SOURCE = Path(__file__).parents[2] / "coati_kto" / "parallel" / "distributed.py"
READ_BACK = next(
    f"parallel/distributed.py:{n}"
    for n, line in enumerate(_SOURCE.read_text().splitlines(), 1)
    if "flat.tolist()" in line
)

PATHS = {
    "online": {},
    "cached": {"kto": {"reference": "cached"}},
    "pack_reference": {"kto": {"pack_reference": True}},
    "padding_free": {"data": {"padding_free": True}},
    "lora": {"model": {"lora": {"rank": 4, "alpha": 8}}},
}


def _train_counted(root: str, model_dir: str, paths: dict = PATHS) -> dict:
    """Each path of PATHS trained 3 steps by coati_kto.train.train under the kernel counter: host syncs per
    optimizer step as CUDA counts them (coati_kto.testing.kernels, windows cut at optimizer-step ends)."""
    from coati_kto.config.schema import Config
    from coati_kto.data.files import write_jsonl
    from coati_kto.testing.kernels import KernelCounter
    from coati_kto.train import train

    prompts = ["What is the capital of France?", "Please add 2 and 3.", "What is the weather in Berlin?"]
    answers = ["The capital of France is Paris.", "The answer is 5. Thank you!", "I cannot help with that."]
    records = [
        {"prompt": f"{prompts[i % 3]} ({i})", "completion": answers[i % 3] * (1 + i % 2), "label": i % 4 != 3}
        for i in range(48)
    ]
    write_jsonl(records, Path(root) / "train.jsonl")
    out = {}
    for name, sections in paths.items():
        raw = {
            "model": {"path": model_dir, "attn_implementation": "sdpa"},
            "data": {"train_files": [f"{root}/train.jsonl"], "prepared_dir": f"{root}/prepared"},
            "train": {"micro_batch_size": 4, "accumulation_steps": 2, "max_steps": 3, "log_interval": 1},
            "plugin": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
            "output": {"dir": f"{root}/out-{name}", "save_final": False},
            "logging": {"tensorboard": False},
        }
        for section, values in sections.items():
            raw[section] = {**raw.get(section, {}), **values}
        with KernelCounter(steps=True) as counter:
            trainer = train(Config.model_validate(raw))
        steady = counter.windows[:-1]  # the last window: after the last step
        out[name] = [(w.syncs.total, dict(w.syncs.by_place)) for w in steady]
        out[f"{name} losses"] = [round(r["train/loss"], 6) for r in trainer.history if "train/loss" in r]
    return out


@pytest.fixture(scope="module")
def counted_paths(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("syncs")
    return run_distributed(_train_counted, 1, str(root), str(tiny_model_dir))[0]


@pytest.mark.parametrize("path", list(PATHS))
def test_one_host_sync_per_step_on_every_path(path: str, counted_paths: dict) -> None:
    """Whole training runs, every step counted as CUDA counts syncs (read-backs, pageable host-to-device copies,
    data-dependent shapes, synchronize calls): one per optimizer step, the step's metric all-reduce read-back
    (it was 7 on each path: the gradient norm's float(), the metrics' tolist, the all-reduce's pageable copy in
    and its read-back, the step's row count and the loss weights as torch.tensor on the device)."""
    windows = counted_paths[path]
    assert len(windows) == 2, windows
    assert all(total == 1 for total, _ in windows), windows
    assert all(list(places) == [READ_BACK] for _, places in windows), windows


def test_one_host_sync_per_step_under_tensor_parallelism(tiny_model_dir: Path, tmp_path: Path) -> None:
    """tp_size 2: the step's sums and the stop vote go in one world all-reduce (tp rank 0 adds the sums its
    tensor-parallel peer holds too), not one over the data-parallel group and a second for the vote: 2 syncs per
    step before. Both ranks log the same losses (the peer's come from rank 0's sums)."""
    tp = {"tp": {"plugin": {"tp_size": 2}}}
    ranks = run_distributed(_train_counted, 2, str(tmp_path), str(tiny_model_dir), tp)
    for windows in (r["tp"] for r in ranks):
        assert len(windows) == 2 and all(total == 1 for total, _ in windows), windows
        assert all(list(places) == [READ_BACK] for _, places in windows), windows
    assert ranks[0]["tp losses"] == ranks[1]["tp losses"] and len(ranks[0]["tp losses"]) == 3
