"""The layouts of a cluster that fit a model, best first: what ``coati-kto plan`` lists after the configured one.

Candidates keep the configured plugin and precision and vary what that plugin can vary: the tensor-parallel
size (hybrid_parallel: a divisor of the GPUs per node that splits the heads whole), the sequence-parallel size
(``sp_axis``: the caller's answer for the config's other sections, such as padding-free rows; each layout only
where config load would take it, asked of ``coati_kto.config.sequence``: hybrid_parallel, the proven precision
and ZeRO pairs, no offload, LoRA in fp32 only, tensor parallelism in bf16 ZeRO 2 only; the family's sizes:
``admits``), the ZeRO stage (1 or 2 under
``plugin.cpu_offload``: offload is ZeRO's), and the micro-batch
(from 2, the least that holds both labels, up to :data:`MAX_MICRO_BATCH`). Where the config may split the layers
(``pp_axis``: hybrid_parallel and nothing config load refuses with pp, such as LoRA) also the pipeline-parallel
size: a divisor of the GPUs per tensor-parallel group that leaves every (virtual) stage a layer and that the
model's family is proven at (``admits_pp``), at ZeRO 0 or 1 only (ColossalAI refuses ZeRO 2
with pp), without sequence parallelism, in the configured ``pp_style``, running at least ``pp`` micro-batches a
step (1F1B's least; interleaved: a multiple of ``pp``). A layout fits at a micro-batch when
its predicted peak is at most :data:`USABLE_FRACTION` of the GPU's memory: the rest is the CUDA context, NCCL's
buffers and the caching allocator's fragmentation.

Best first (:data:`RULE`): the fewest ranks per model replica (tp x sp x pp: tp and sp collectives run inside
every layer, pipeline stages idle ``(pp - 1) / (m + pp - 1)`` of a step of m micro-batches), then the fewer
pipeline stages (at equal ranks per replica, the bubble costs more than a node's tensor-parallel collectives),
then the largest micro-batch that fits (fewer, fuller passes), then the lower ZeRO stage (fewer collectives per
step), then the lower peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from coati_kto.config.schema import PluginSection
from coati_kto.config.sequence import sequence_layout_problems, sequence_plugin_problems
from coati_kto.errors import UserError
from coati_kto.parallel.activations import Workload
from coati_kto.parallel.memory_plan import GIB, Layout, MemoryPlan, plan_memory
from coati_kto.parallel.model_shape import ModelShape
from coati_kto.parallel.plan import running_zero_stage
from coati_kto.parallel.stages import least_microbatches


def pipeline_of(plugin: PluginSection) -> tuple[int, str, int]:
    """(pp_size, pp_style, num_model_chunks) of the plugin section; (1, "1f1b", 1) where the schema has none."""
    return (
        getattr(plugin, "pp_size", 1),
        getattr(plugin, "pp_style", "1f1b"),
        getattr(plugin, "num_model_chunks", 1),
    )


def configured_layout(plugin: PluginSection, world: int) -> Layout:
    """The config's layout on ``world`` ranks (the ZeRO stage that runs there); UserError one line when ``world``
    is no multiple of tp x sp x pp."""
    sp = getattr(plugin, "sp_size", 1)
    pp, style, chunks = pipeline_of(plugin)
    axes = plugin.tp_size * sp * pp
    if world % axes:
        named = (
            f"plugin.tp_size {plugin.tp_size}"
            + (f" x plugin.sp_size {sp}" if sp > 1 else "")
            + (f" x plugin.pp_size {pp}" if pp > 1 else "")
        )
        raise UserError(f"--gpus {world} is not a multiple of {named} = {axes}")
    # The backend's ZeRO group (the plan's dp_size) is dp x sp: world / (tp x pp), as recipe/setup.py builds it.
    stage = running_zero_stage(plugin, world // (plugin.tp_size * pp))
    return Layout(
        plugin.name,
        plugin.precision,
        stage,
        plugin.tp_size,
        world // axes,
        sp,
        plugin.cpu_offload,
        pp,
        style,
        chunks,
    )


Admits = Callable[[int, int], bool]  # (tp, sp) -> whether the model's family runs at those sizes
AdmitsPipeline = Callable[[int], bool]  # pp -> whether the model's family runs at that many stages
USABLE_FRACTION = 0.9
MAX_MICRO_BATCH = 64
MIN_MICRO_BATCH = 2  # train.micro_batch_size's least: each micro-batch holds both labels
RULE = (
    "best first: fewest ranks per replica (tp x sp x pp), then fewer pipeline stages (their bubble: "
    "(pp-1)/(m+pp-1) of a step of m micro-batches), then the largest micro-batch that fits, then the lower ZeRO "
    "stage, then the lower peak"
)


@dataclass(frozen=True)
class Fit:
    """A layout that fits, the largest micro-batch at which it does, and its plan at that micro-batch;
    ``microbatches``: the micro-batches a step runs (more than the config's where the pipeline needs them)."""

    layout: Layout
    micro_batch: int
    plan: MemoryPlan
    microbatches: int = 1


def usable_bytes(gpu_memory_gib: float) -> int:
    return int(gpu_memory_gib * USABLE_FRACTION * GIB)


def largest_micro_batch(shape: ModelShape, layout: Layout, work: Workload, budget: int) -> Fit | None:
    """The largest micro-batch (MIN..MAX_MICRO_BATCH) whose peak is within ``budget`` bytes; None if not even
    the least. The peak grows with the micro-batch, so a bisection finds it."""

    def plan(batch: int) -> MemoryPlan:
        return plan_memory(shape, layout, dataclasses.replace(work, micro_batch=batch))

    if plan(MIN_MICRO_BATCH).peak > budget:
        return None
    low, high = MIN_MICRO_BATCH, MAX_MICRO_BATCH
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if plan(mid).peak <= budget else (low, mid - 1)
    return Fit(layout, low, plan(low), work.accumulation_steps)


def candidates(
    base: Layout,
    shape: ModelShape,
    gpus: int,
    per_node: int,
    sp_axis: bool,
    lora: bool = False,
    admits: Admits | None = None,
    pp_axis: bool = False,
    admits_pp: AdmitsPipeline | None = None,
) -> list[Layout]:
    """Every layout of ``gpus`` GPUs (``per_node`` a node) the configured plugin ``base`` can run (``lora``: the
    policy trains adapters, which hybrid_parallel admits at tp 1 only; ``admits(tp, sp)``, ``admits_pp(pp)``:
    whether the model's family is proven at those sizes, as config load checks; ``pp_axis``: pipeline stages
    too, module docstring)."""
    tps = [1]
    if (
        base.plugin == "hybrid_parallel" and not lora
    ):  # ColossalAI 0.5.0: LoRA under hybrid_parallel at tp 1 only
        tps = [t for t in _divisors(per_node) if shape.heads % t == 0 and shape.kv_heads % t == 0]
    stages = {"ddp": [0], "low_level_zero": [1, 2]}.get(base.plugin, [0, 1, 2])
    if base.precision == "fp32" and base.plugin == "hybrid_parallel":
        stages = [0]  # hybrid_parallel's ZeRO needs bf16 / fp16
    if base.cpu_offload:
        stages = [s for s in stages if s >= 1]  # offload is ZeRO's: config load refuses it at stage 0
    pipelined = pp_axis and base.plugin == "hybrid_parallel"
    out = []
    for tp in [t for t in tps if gpus % t == 0]:
        sps = [s for s in _divisors(gpus // tp) if _splits_heads(shape, tp * s)] if sp_axis else [1]
        pps = [p for p in _divisors(gpus // tp) if p * base.chunks <= shape.layers] if pipelined else [1]
        pps = [p for p in pps if p == 1 or admits_pp is None or admits_pp(p)]
        axes = [(s, 1) for s in sps] + [(1, p) for p in pps if p > 1]
        for sp, pp in [(s, p) for s, p in axes if admits is None or admits(tp, s)]:
            dp = gpus // (tp * sp * pp)
            for stage in [s for s in stages if pp == 1 or s <= 1]:  # ZeRO 2 refused with pp
                one_rank = base.plugin == "hybrid_parallel" and dp * sp == 1 and not base.cpu_offload
                running = 0 if one_rank else stage
                if sp > 1 and _sequence_refused(base, tp, sp, running, lora):
                    continue
                style, chunks = (base.pp_style, base.chunks) if pp > 1 else ("1f1b", 1)
                layout = Layout(
                    base.plugin, base.precision, running, tp, dp, sp, base.cpu_offload, pp, style, chunks
                )
                if layout not in out and gpus % (tp * sp * pp) == 0:
                    out.append(layout)
    return out


def _splits_heads(shape: ModelShape, ways: int) -> bool:
    """Whether ``ways`` ranks (tp x sp) each hold whole query and key-value heads."""
    return shape.heads % ways == 0 and shape.kv_heads % ways == 0


def _sequence_refused(base: Layout, tp: int, sp: int, stage: int, lora: bool) -> bool:
    """Whether config load refuses ``base``'s plugin at ``tp`` x ``sp`` and ZeRO ``stage`` (``lora``: adapters):
    its plugin section's sequence-parallel lines and the layout's own, asked, not restated."""
    return bool(
        sequence_plugin_problems(base.plugin, tp, sp, None)
        or sequence_layout_problems(base.precision, stage, tp, sp, base.cpu_offload, lora)
    )


def fitting_layouts(
    shape: ModelShape,
    base: Layout,
    work: Workload,
    gpus: int,
    per_node: int,
    budget: int,
    sp_axis: bool,
    admits: Admits | None = None,
    pp_axis: bool = False,
    admits_pp: AdmitsPipeline | None = None,
) -> list[Fit]:
    """The candidates that fit within ``budget`` bytes per GPU, best first (:data:`RULE`); a pipelined one at
    the least micro-batches a step its schedule runs from the config's (``work.accumulation_steps``)."""
    fits = []
    for layout in candidates(
        base, shape, gpus, per_node, sp_axis, work.lora_rank > 0, admits, pp_axis, admits_pp
    ):
        steps = least_microbatches(layout.pp, layout.pp_style, work.accumulation_steps)
        fit = largest_micro_batch(shape, layout, dataclasses.replace(work, accumulation_steps=steps), budget)
        if fit is not None:
            fits.append(fit)
    return sorted(fits, key=rank)


def rank(fit: Fit) -> tuple[int, int, int, int, int]:
    """The sort key of :data:`RULE`."""
    layout = fit.layout
    return (layout.tp * layout.sp * layout.pp, layout.pp, -fit.micro_batch, layout.zero_stage, fit.plan.peak)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
