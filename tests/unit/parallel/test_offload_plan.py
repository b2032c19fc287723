"""``coati-kto plan`` with ``plugin.cpu_offload``: offload is ZeRO's, so the search lists no ZeRO-0 layout with it
(config load refuses that pair), and a config without ZeRO never reaches the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PLAN_CONFIG

from coati_kto.cli import main
from coati_kto.parallel.layout_search import candidates
from coati_kto.parallel.memory_plan import Layout
from coati_kto.parallel.model_shape import ModelShape


def _shape() -> ModelShape:
    """Llama 3.1 8B's shape by hand, as test_memory_plan's."""
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    return ModelShape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, 2 * 128256 * 4096, 32 * layer, 65 * 4096, ()
    )


def test_the_search_keeps_zero_under_cpu_offload() -> None:
    hybrid = Layout("hybrid_parallel", "bf16", 2, cpu_offload=True)
    for base in (hybrid, Layout("low_level_zero", "bf16", 2, cpu_offload=True)):
        layouts = candidates(base, _shape(), 8, 8, sp_axis=False)
        assert layouts and all(x.cpu_offload and x.zero_stage in (1, 2) for x in layouts)
    # one data-parallel rank too (hybrid runs ZeRO as 0 there only without offload)
    one_rank = [x for x in candidates(hybrid, _shape(), 8, 8, sp_axis=False) if x.dp == 1]
    assert one_rank and {x.zero_stage for x in one_rank} == {1, 2}


def test_plan_lists_no_zero_0_layout_with_cpu_offload(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(PLAN_CONFIG.format(model=tiny_model_dir))
    assert main(["plan", str(config), "plugin.cpu_offload=true", "--gpus", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = lines[lines.index(next(line for line in lines if line.startswith("layouts that fit"))) + 1 :]
    assert listed and all("cpu_offload" in line and "ZeRO-0" not in line for line in listed if line.strip())
    assert main(["plan", str(config), "plugin.name=ddp", "plugin.cpu_offload=true"]) == 2
    err = capsys.readouterr().err
    assert "plugin.cpu_offload needs ZeRO" in err and "ddp fp32, tp 1 x dp 1, ZeRO-0, cpu_offload" not in err
