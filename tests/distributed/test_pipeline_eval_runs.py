"""Pipeline evaluation (plugin.pp_size 2) holds one run of micro-batches on the device at a time, not the eval set.

``PipelinePasses.evaluate`` scores the eval set in forward-only runs of ``_EVAL_RUN`` micro-batches. Each run's
batches go to the device when it starts and are released when it ends: the device holds one run's tensors and the
runs' per-row results, so its memory does not grow with the eval set. On CPU the move is a no-op, so the test
counts the moved batches alive at once (``KTOBatch.to`` wrapped, each result released through a weakref): with
``_EVAL_RUN`` 2 and 5 eval micro-batches, at most 2. The same evaluation in one run (``_EVAL_RUN`` 16) gives the
same sums within fp32 rounding (a run pads its rows to its own longest: the summation order of attention).

One ``coati-kto train`` of 1 step on 2 gloo processes (tiny Llama, 2 layers: one a stage), fp32, one evaluation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli

OUT_ENV = "COATI_KTO_TEST_EVAL_RUNS_OUT"
EVAL_BATCHES = 5  # eval micro-batches of 2 rows: runs of 2, 2 and 1 at _EVAL_RUN 2


def counting_train(argv: list[str]) -> int:
    """``coati-kto ARGV`` on a worker rank, each evaluation run twice (``_EVAL_RUN`` 16, then 2, whose sums the
    trainer logs), with the moved batches alive at once counted; what it saw written to ``$OUT_ENV/rank-R.json``."""
    import weakref

    import torch.distributed as dist

    from coati_kto.cli import main
    from coati_kto.data.batch import KTOBatch
    from coati_kto.trainer import pipeline

    live = {"now": 0, "peak": 0}
    seen: list[dict] = []
    original_to, original_evaluate = KTOBatch.to, pipeline.PipelinePasses.evaluate

    def release() -> None:
        live["now"] -= 1

    def counted_to(self: KTOBatch, device, non_blocking: bool = False) -> KTOBatch:
        moved = original_to(self, device, non_blocking)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(moved, release)
        return moved

    def evaluate(self, batches):
        batches = list(batches)
        pipeline._EVAL_RUN = 16
        whole = original_evaluate(self, batches).local()
        pipeline._EVAL_RUN, before = 2, live["now"]
        live["peak"] = before
        sums = original_evaluate(self, batches)
        seen.append(
            {"batches": len(batches), "peak": live["peak"] - before, "whole": whole, "runs": sums.local()}
        )
        return sums

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    KTOBatch.to, pipeline.PipelinePasses.evaluate = counted_to, evaluate
    try:
        code = main(argv)
    finally:
        KTOBatch.to, pipeline.PipelinePasses.evaluate = original_to, original_evaluate
        pipeline._EVAL_RUN = 16
    Path(os.environ[OUT_ENV], f"rank-{rank}.json").write_text(json.dumps(seen))
    return code


def _config(root: Path, model_dir: Path) -> Path:
    config = {
        "model": {"path": str(model_dir), "attn_implementation": "sdpa"},
        "data": {
            "train_files": [str(write_jsonl(preference_records(8, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(preference_records(2 * EVAL_BATCHES, 50), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
        },
        "train": {
            "seed": 3,
            "micro_batch_size": 2,
            "accumulation_steps": 2,
            "eval_micro_batch_size": 2,
            "max_steps": 1,
            "eval_interval": 1,
            "eval_at_start": False,
        },
        "plugin": {"name": "hybrid_parallel", "precision": "fp32", "zero_stage": 0, "pp_size": 2},
        "output": {"dir": str(root / "run"), "save_final": False},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pipeline_evaluation_moves_one_run_at_a_time_with_the_same_sums(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    proc = run_cli(
        ["train", str(_config(tmp_path, tiny_model_dir))],
        2,
        env={OUT_ENV: str(tmp_path)},
        command=counting_train,
    )
    assert proc.returncode == 0, proc.ranks[-1].stdout[-3000:] + proc.ranks[-1].stderr[-3000:]
    for rank in range(2):
        evaluations = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert evaluations, f"rank {rank} ran no evaluation"
        for seen in evaluations:
            assert seen["batches"] == EVAL_BATCHES, seen
            assert seen["peak"] <= 2, f"rank {rank}: {seen['peak']} eval batches moved at once, a run is 2"
            (whole, whole_kl), (runs, runs_kl) = seen["whole"], seen["runs"]
            assert (whole_kl is None) == (runs_kl is None), (whole_kl, runs_kl)
            for key, value in [*whole.items(), *(whole_kl or {}).items()]:
                runs = runs | (runs_kl or {})
                assert math.isclose(runs[key], value, rel_tol=1e-6, abs_tol=1e-5), (key, runs[key], value)
    last = json.loads((tmp_path / "rank-1.json").read_text())[0]["runs"][0]
    assert last["examples"] == 2 * EVAL_BATCHES and math.isfinite(last["loss"]), last
