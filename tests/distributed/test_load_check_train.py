"""A node whose free host memory cannot hold what its ranks read at load stops every rank in one line, before any
weight is read (coati_kto.parallel.load_check), through ``coati-kto train`` on 2 gloo ranks: without it the
kernel's OOM killer ended a rank partway through the load and the job died with no word of why."""

from __future__ import annotations

import socket
from pathlib import Path

import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli


def short_on_rank_1(argv: list[str]) -> int:
    """``coati-kto ARGV`` with rank 1's node reporting 1 MiB available (run on a worker rank by run_cli)."""
    import os

    import coati_kto.parallel.load_check as load_check
    from coati_kto.cli import main

    if os.environ["RANK"] == "1":
        load_check.available_host_bytes = lambda: 1 << 20
    return main(argv)


def test_one_node_short_of_host_memory_stops_every_rank_before_loading(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(16, 0), tmp_path / "train.jsonl"))],
            "prepared_dir": str(tmp_path / "prepared"),
            "max_length": 48,
        },
        "train": {"micro_batch_size": 4, "max_steps": 1},
        "plugin": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
        "output": {"dir": str(tmp_path / "out")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_cli(["train", str(path)], 2, command=short_on_rank_1)
    assert [rank.returncode for rank in done.ranks] == [2, 2]
    errors = [[line for line in rank.stderr.splitlines() if "error:" in line] for rank in done.ranks]
    # tiny Llama saved in fp32, trained in bf16: 6 bytes x 147,776 parameters per rank, 2 ranks on the node, whose
    # memory is the least its ranks read: every rank names the node and the figures alike
    line = (
        "error: host memory: each rank reads the whole model into host memory in fp32 as it loads (0.85 MiB per "
        f"rank), 1.69 MiB for the 2 rank(s) on {socket.gethostname()}, which has 1.00 MiB available (MemAvailable): "
        "start fewer ranks per node or free host memory (`coati-kto plan CONFIG --gpus N --nodes M` shows the "
        "need; COATI_KTO_NO_HOST_MEMORY_CHECK=1 skips this check)"
    )
    assert errors == [[line], [f"[rank 1] {line}"]]
    assert not (tmp_path / "prepared").exists()  # refused before the data was prepared


def _fp32_copies_at_each_load(model_dir: str, out_dir: str) -> list[int]:
    """For each model load of a bf16 run with an online reference: how many fp32 copies of the model's embedding
    matrix are alive in the process when it starts (another whole fp32 model in host memory)."""
    import gc

    import torch
    from test_trainer import _build, _config

    import coati_kto.recipe.components as components

    load, seen = components.load_causal_lm, []

    def counting_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        gc.collect()
        shape = (512, 64)  # the tiny Llama's embedding: vocabulary x hidden
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float32]
        seen.append(sum(tuple(t.shape) == shape for t in alive))
        return load(*args, **kwargs)

    components.load_causal_lm = counting_load
    try:
        plugin = {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}
        _build(_config(model_dir, out_dir, plugin=plugin), total_steps=1)
    finally:
        components.load_causal_lm = load
    return seen


def test_the_reference_is_cast_and_placed_before_the_policy_is_read(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The online reference used to be read while the policy's fp32 copy was in host memory: 8 bytes per
    parameter on every rank at once. It is read first and cast (on a GPU, moved) before the policy is read."""
    from coati_kto.testing.distributed import run_distributed

    (seen,) = run_distributed(_fp32_copies_at_each_load, 1, str(tiny_model_dir), str(tmp_path / "out"))
    # reference, then policy: no fp32 copy of the model is alive at the policy's read but what the process held
    # before the first (a pooled rank keeps earlier tests' models; the old order had the policy's two more)
    assert len(seen) == 2 and seen[1] == seen[0], seen
