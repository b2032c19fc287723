"""A rank that finished leaves no process group for interpreter exit to tear down.

A 2-process ddp run that had written final/ once died at exit: rank 1 aborted with "terminate called without an
active exception" (gloo's worker threads still held finished work while the interpreter was being finalized), rank
0 got SIGTERM from the launcher, and the run exited 1 after succeeding. ``coati_kto.cli.main`` now destroys the
groups before it returns whenever the ranks left their collectives together.
"""

from __future__ import annotations

from pathlib import Path

from helpers import write_run

from coati_kto.testing.distributed import run_distributed


def _train_through_the_cli(config: str, out: str) -> tuple[int, bool, bool]:
    import torch.distributed as dist

    from coati_kto.cli import main

    code = main(
        [
            "train",
            config,
            "plugin.name=ddp",
            "plugin.precision=fp32",
            "plugin.zero_stage=0",
            f"output.dir={out}",
        ]
    )
    return code, dist.is_initialized(), (Path(out) / "final" / "model.safetensors").is_file()


def test_a_finished_rank_destroys_its_process_groups_before_returning(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = write_run(tmp_path, tiny_model_dir, steps=2, save_interval=100)
    results = run_distributed(_train_through_the_cli, 2, str(config), str(tmp_path / "out"))
    assert results == [(0, False, True), (0, False, True)]
