"""``coati-kto plan``'s search offers sequence parallelism only at the layouts config load admits: it asks
``coati_kto.config.sequence`` (the plugin section's lines and the layout's own), so a ddp or low_level_zero config,
offload, an unproven precision or ZeRO stage, LoRA in bf16 and tensor parallelism in fp32 get no sp layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from coati_kto.parallel.layout_search import Admits, candidates
from coati_kto.parallel.memory_plan import Layout
from coati_kto.parallel.model_shape import ModelShape
from coati_kto.recipe.plan import _admitted

REPO = Path(__file__).resolve().parents[3]


def _llama_8b() -> ModelShape:
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    return ModelShape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, 2 * 128256 * 4096, 32 * layer, 65 * 4096, (), 4096
    )


def _sp(base: Layout, lora: bool = False, admits: Admits | None = None) -> set[tuple[int, int, int]]:
    """(tp, sp, ZeRO stage) of every sp layout the search offers ``base`` on 8 GPUs of a node."""
    layouts = candidates(base, _llama_8b(), 8, 8, True, lora, admits)
    return {(x.tp, x.sp, x.zero_stage) for x in layouts if x.sp > 1}


@pytest.mark.parametrize(
    "base, lora",
    [
        (Layout("ddp", "fp32", 0), False),
        (Layout("low_level_zero", "bf16", 2), False),
        (Layout("hybrid_parallel", "bf16", 2, cpu_offload=True), False),
        (Layout("hybrid_parallel", "fp16", 2), False),
        (Layout("hybrid_parallel", "bf16", 2), True),
    ],
    ids=["ddp", "low_level_zero", "offload", "fp16", "lora-bf16"],
)
def test_no_sp_layout_where_config_load_refuses_sp(base: Layout, lora: bool) -> None:
    assert _sp(base, lora) == set()


def test_sp_layouts_are_the_proven_precision_zero_and_tp_pairs() -> None:
    """bf16: ZeRO 2 only; fp32: ZeRO 0 at tp 1 only, with LoRA too. The heads bound the sizes (8 key-value heads
    over tp x sp); the family's sizes are ``admits``' question (the CLI's, from config.json): Llama at sp 2 and 4,
    and tp 2 x sp 2, not tp 2 x sp 4 nor tp 4."""
    hybrid, fp32 = Layout("hybrid_parallel", "bf16", 2), Layout("hybrid_parallel", "fp32", 0)
    assert _sp(hybrid) == {(1, 2, 2), (1, 4, 2), (1, 8, 2), (2, 2, 2), (2, 4, 2), (4, 2, 2)}
    assert _sp(fp32) == _sp(fp32, lora=True) == {(1, 2, 0), (1, 4, 0), (1, 8, 0)}
    admits = _admitted(str(REPO / "benchmarks" / "model_shapes" / "llama-3.1-8b"))
    assert _sp(hybrid, admits=admits) == {(1, 2, 2), (1, 4, 2), (2, 2, 2)}
    assert _sp(fp32, admits=admits) == {(1, 2, 0), (1, 4, 0)}
