"""The table of docs/plan.md: what fits of 8B, 32B and 70B on 8, 16 and 32 x 80 GB, by `coati-kto plan`'s arithmetic.

    PYTHONPATH=. python benchmarks/plan_table.py [--smoke]

The shapes are config.json files in benchmarks/model_shapes (Llama 3.1 8B and 70B; Qwen2.5 32B, as no Llama 3
32B exists). The workload is configs/multinode_zero2.yaml's: hybrid_parallel bf16, ZeRO-2 configured,
data.max_length 2048, gradient checkpointing, flash attention, no accumulation. Each row: full fine-tuning or
LoRA (rank 16 on q, k, v, o), the reference online or cached, on one node of 8 GPUs, two or four; the cell is the
best layout that fits (the plan's rule, pipeline stages included where the config admits them: not with LoRA) and
the largest micro-batch it fits at, or "does not fit". Two tables: the sizes config load admits today, and every
pipeline-parallel size (what proving them for the family would buy). ``--smoke``: the 8B rows only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"8B": "llama-3.1-8b", "32B": "qwen2.5-32b", "70B": "llama-3.1-70b"}
CLUSTERS = {"8 x 80 GB": (8, 1), "16 x 80 GB": (16, 2), "32 x 80 GB": (32, 4)}
MODES = {
    "full, online": [],
    "full, cached": ["kto.reference=cached"],
    "LoRA, online": ["model.lora={rank: 16}"],
    "LoRA, cached": ["model.lora={rank: 16}", "kto.reference=cached"],
}


def cell(overrides: list[str], gpus: int, nodes: int, unproven_pp: bool = False) -> str:
    """The best fitting layout and its largest micro-batch, as `coati-kto plan` lists them first (``unproven_pp``:
    with the pipeline sizes the family is not proven at too)."""
    from coati_kto.config.load import load_config
    from coati_kto.parallel.activations import Workload
    from coati_kto.parallel.model_shape import model_shape
    from coati_kto.recipe.plan import layouts_that_fit

    config = load_config(ROOT / "configs" / "multinode_zero2.yaml", overrides)
    shape = model_shape(config.model.path)
    work = Workload.from_config(config)
    fits = layouts_that_fit(config, shape, work, gpus, gpus // nodes, 80, unproven_pp)
    if not fits:
        return "does not fit"
    return _layout_cell(fits[0]) + _cache_note(shape, work, config.plugin.precision)


def _cache_note(shape: Any, work: Any, precision: str) -> str:
    """With the cached reference: whether one 80 GB GPU holds the whole reference that computing the cache
    scores (``coati-kto plan``'s precompute line)."""
    from coati_kto.parallel.layout_search import usable_bytes
    from coati_kto.parallel.memory_plan import precompute_weight_bytes

    weights = precompute_weight_bytes(shape, work, precision)
    if work.reference != "cached" or weights <= usable_bytes(80):
        return ""
    return f"; the cache: {weights / 2**30:.0f} GiB of weights, no one GPU can compute it"


def _layout_cell(best: Any) -> str:
    """A fitting layout as a cell: its sizes, ZeRO stage, schedule, largest micro-batch and peak."""
    layout = best.layout
    peak = f"{best.plan.peak / 2**30:.0f} GiB"
    if layout.pp == 1:
        return f"tp {layout.tp} x dp {layout.dp}, ZeRO-{layout.zero_stage}: micro-batch {best.micro_batch} ({peak})"
    return (
        f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp}, ZeRO-{layout.zero_stage}, {layout.pp_style} over "
        f"{best.microbatches} micro-batches: micro-batch {best.micro_batch} ({peak}, stage {best.plan.stage})"
    )


def table(smoke: bool, unproven_pp: bool) -> None:
    print("| model | training | " + " | ".join(CLUSTERS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in CLUSTERS) + " |")
    for size, folder in list(SHAPES.items())[: 1 if smoke else None]:
        path = ROOT / "benchmarks" / "model_shapes" / folder
        for mode, extra in MODES.items():
            cells = [cell([f"model.path={path}", *extra], g, n, unproven_pp) for g, n in CLUSTERS.values()]
            print(f"| {size} | {mode} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(ROOT))
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)
    print("The sizes config load admits today:\n")
    table(smoke, unproven_pp=False)
    print("\nWith every pipeline-parallel size, also those the family is not proven at yet:\n")
    table(smoke, unproven_pp=True)


if __name__ == "__main__":
    main()
