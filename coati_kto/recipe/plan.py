"""``coati-kto plan CONFIG``: what a rank holds for the configured layout, and the layouts that fit a cluster.

Reads the config and the model's config.json only (no weights, no data, no process group); the arithmetic is
``coati_kto.parallel.memory_plan`` (its parts), ``coati_kto.parallel.activations`` and
``coati_kto.parallel.layout_search`` (the candidates and their order). ``train`` prints
:func:`predicted_peak_line` at its start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from coati_kto.config.schema import Config, PluginSection
from coati_kto.errors import ConfigError, UserError
from coati_kto.families.splits import check_model_family, check_sequence_parallel_family
from coati_kto.parallel.activations import Workload
from coati_kto.parallel.layout_search import (
    RULE,
    USABLE_FRACTION,
    Fit,
    configured_layout,
    fitting_layouts,
    pipeline_of,
    usable_bytes,
)
from coati_kto.parallel.memory_plan import (
    DTYPE_BYTES,
    GIB,
    Layout,
    MemoryPlan,
    load_host_bytes,
    plan_memory,
    precompute_weight_bytes,
)
from coati_kto.parallel.model_shape import ModelShape, cast_rounds, model_shape

LISTED = 12  # layouts listed after the configured one
MAX_GPU_MEMORY_GIB = 1e6  # --gpu-memory: a bound that keeps the bytes a finite number (inf, 1e308 overflowed)


def _gib(n: int) -> str:
    """Bytes in GiB, or MiB under one GiB (a tiny model's parts), right-aligned."""
    return f"{n / GIB:7.2f} GiB" if n >= GIB else f"{n / 2**20:7.2f} MiB"


def breakdown_lines(plan: MemoryPlan, work: Workload, shape: ModelShape) -> list[str]:
    """The configured layout's parts, a line each."""
    layout, working = plan.layout, plan.layout.precision
    share = f"/ {layout.dp * layout.sp} ranks" if layout.zero_stage >= 1 else "whole"
    states = "bf16 moments" if work.state_dtype == "bf16" else "fp32 moments"
    masters = "fp32 masters + " if layout.precision != "fp32" else ""
    grads = f"/ {layout.dp * layout.sp} ranks (ZeRO-2)" if layout.zero_stage == 2 else "whole"
    ref = {"online": f"online, {working}", "cached": "cached: not loaded"}[work.reference]
    ref = "LoRA: the policy with its adapters off" if work.lora_rank and work.reference == "online" else ref
    ckpt = "with" if work.checkpointing else "without"
    other = dataclasses.replace(work, checkpointing=not work.checkpointing)
    other_acts = plan_memory(shape, layout, other).activations
    trained = "LoRA adapters" if work.lora_rank else "every parameter"
    if shape.tower_params and not work.lora_rank:
        trained = "all but the vision tower" if not work.train_vision else "every parameter, vision tower too"
    ref += f" ({work.reference_shape.params:,} parameters)" if work.reference_shape else ""
    lines = [
        f"  weights        {_gib(plan.weights)}  {working}, {plan.params:,} parameters per tensor-parallel rank",
        f"  gradients      {_gib(plan.gradients)}  {working}, {trained} ({plan.trainable:,}), {grads}",
        f"  optimizer      {_gib(plan.masters + plan.moments)}  {masters}{states}, {share}"
        + (f" (cpu_offload: {_gib(plan.host).strip()} in host memory)" if plan.host else ""),
        f"  step copies    {_gib(plan.step_copies)}  {_step_note(layout, work)}",
        f"  reference      {_gib(plan.reference)}  {ref}",
        f"  activations    {_gib(plan.activations)}  {work.micro_batch} x {work.length} tokens, {ckpt} "
        f"checkpointing (else {_gib(other_acts).strip()})" + "".join(f"; {n}" for n in plan.notes[1:]),
        f"  LM head        {_gib(plan.head)}  {plan.notes[0]}",
        f"  communication  {_gib(plan.communication)}  {_comm_note(layout)}",
    ]
    if layout.pp > 1:
        hidden = work.micro_batch * work.length * shape.hidden * DTYPE_BYTES[working]
        lines.append(
            f"  p2p            {_gib(plan.p2p)}  {plan.p2p // hidden} x [{work.micro_batch}, {work.length}, "
            f"{shape.hidden}] hidden states, {working} (in-flight outputs and inputs, a received gradient)"
        )
    return lines


def stage_line(plan: MemoryPlan, work: Workload) -> str:
    """Which pipeline stage the plan is of (the peak) and what it holds."""
    layout = plan.layout
    held = [f"{plan.stage_layers} layer" + "s" * (plan.stage_layers != 1)]
    held += ["the embedding"] if plan.stage == 0 else []
    held += ["the final norm and LM head"] if plan.stage == layout.pp - 1 else []
    unit = "chunk forwards" if layout.pp_style == "interleaved" else "micro-batches"
    return (
        f"per rank of stage {plan.stage} of {layout.pp} (the peak): {', '.join(held)}; {layout.pp_style} keeps "
        f"{plan.in_flight} of {work.accumulation_steps} {unit} in flight:"
    )


def _step_note(layout: Layout, work: Workload) -> str:
    """What the optimizer step makes of the gradients on the device (``memory_plan._step_copies``)."""
    if layout.cpu_offload and layout.zero_stage >= 1:
        return "none here: the gradients are cast to fp32 in host memory (cpu_offload, counted above)"
    if layout.precision == "fp32":
        return "none: fp32 gradients, no cast"
    if not work.fused_optimizer:
        return "the gradients cast to fp32 at the optimizer step"
    if layout.zero_stage >= 1 and layout.dp * layout.sp > 1:
        return (
            f"train.fused_optimizer: the updated {layout.precision} partitions ZeRO all-gathers, no fp32 copy"
        )
    return "none: train.fused_optimizer updates from the working gradients into the weights"


def _comm_note(layout: Layout) -> str:
    if layout.dp * layout.sp == 1:
        return "none: one data-parallel rank"
    if layout.pp > 1 and layout.zero_stage == 0:
        return "none: each gradient all-reduced in place (no torch DDP under pp)"
    if layout.torch_ddp:
        return "torch DDP's buckets: the gradients' size"
    return "ZeRO's reduce bucket and reduce-scatter output, 12M elements each"


def plan_lines(config: Config, gpus: int | None, gpu_memory: float, nodes: int) -> list[str]:
    """The report of ``coati-kto plan`` (module docstring); UserError one line for a bad option."""
    axes = config.plugin.tp_size * getattr(config.plugin, "sp_size", 1) * pipeline_of(config.plugin)[0]
    world = gpus if gpus is not None else axes
    _check_options(world, gpu_memory, nodes)
    shape = model_shape(config.model.path)
    work = Workload.from_config(config)
    layout = configured_layout(config.plugin, world)
    plan = plan_memory(shape, layout, work)
    budget = usable_bytes(gpu_memory)
    verdict = "fits" if plan.peak <= budget else "does NOT fit"
    defaulted = f"; its text_config leaves {', '.join(shape.defaulted)} to the family's defaults"
    lines = [
        f"model: {config.model.path} ({shape.model_type}, {shape.params:,} parameters, {shape.layers} layers, "
        f"hidden {shape.hidden}, vocabulary {shape.vocab}; read from config.json only"
        + (defaulted if shape.defaulted else "")
        + ")",
        f"layout: {layout.describe()}, on {world} GPU(s), {nodes} node(s)"
        + ("" if gpus is not None else " (--gpus not given: one data-parallel replica)"),
        *_tp_across_nodes(layout.tp, world // nodes),
        "per rank:" if layout.pp == 1 else stage_line(plan, work),
        *breakdown_lines(plan, work, shape),
        f"  peak           {_gib(plan.peak)}  {verdict} in {USABLE_FRACTION:.0%} of {gpu_memory:g} GiB",
        *precompute_lines(shape, work, layout.precision, gpu_memory),
        load_line(config, shape, work, layout, world // nodes),
    ]
    return lines + _fit_lines(config, shape, work, world, world // nodes, gpu_memory)


def precompute_lines(shape: ModelShape, work: Workload, precision: str, gpu_memory: float) -> list[str]:
    """With ``kto.reference: cached``: what computing the cache holds on each GPU, and whether that fits; the
    layouts listed fit training, which reads the cache but cannot make it."""
    if work.reference != "cached":
        return []
    weights = precompute_weight_bytes(shape, work, precision)
    line = (
        f"precompute: `coati-kto precompute` holds the whole reference on each GPU, no split: "
        f"{_gib(weights).strip()} of {precision} weights before its activations"
    )
    if weights <= usable_bytes(gpu_memory):
        return [f"{line}: the weights fit in {USABLE_FRACTION:.0%} of {gpu_memory:g} GiB"]
    return [
        f"{line}: does NOT fit in {USABLE_FRACTION:.0%} of {gpu_memory:g} GiB. The layouts below train from a "
        "cache; compute it where the whole reference fits one device, or use kto.reference: online (split "
        "as the policy)"
    ]


def load_line(config: Config, shape: ModelShape, work: Workload, layout: Layout, per_node: int) -> str:
    """Host memory at load (``memory_plan.load_host_bytes``): per rank and for a node's ``per_node`` ranks, which
    every node must have free (train refuses before loading when one has not: ``coati_kto.parallel.load_check``)."""
    rounds = cast_rounds(config.model.path, config.plugin.precision)
    per_rank = load_host_bytes(shape, work, rounds, layout)
    what = (
        "the larger model (policy, reference) in fp32" if work.reference_shape else "the whole model in fp32"
    )
    if rounds and not work.lora_rank:  # the cast keeps fp32 values beside the working copy (parallel.masters)
        share = "this rank's tp / pp share of the policy" if layout.tp * layout.pp > 1 else "the policy"
        what = f"the most of {what} and {share} in {config.plugin.precision} beside its trained fp32 values"
    return (
        f"host memory at load: {_gib(per_rank).strip()} per rank ({what}; every rank reads it), "
        f"{_gib(per_rank * per_node).strip()} for a node's {per_node} rank(s): free host memory each node needs"
    )


def _tp_across_nodes(tp: int, per_node: int) -> list[str]:
    """A note when the configured tensor-parallel groups span nodes (``tp`` does not divide the GPUs per node):
    train runs it, with every layer's collectives over the network; the search lists tp within a node only."""
    if per_node % tp == 0:
        return []
    return [
        f"note: plugin.tp_size {tp} spans nodes ({per_node} GPU(s) per node): every layer's tensor-parallel "
        "collectives cross the network; the layouts below keep tp within a node (a divisor of the GPUs per node)"
    ]


def _check_options(world: int, gpu_memory: float, nodes: int) -> None:
    if world < 1 or nodes < 1:
        raise UserError(f"--gpus and --nodes must be >= 1, got --gpus {world} --nodes {nodes}")
    if not gpu_memory <= MAX_GPU_MEMORY_GIB:  # nan too
        raise UserError(f"--gpu-memory must be a number of GiB <= {MAX_GPU_MEMORY_GIB:g}, got {gpu_memory:g}")
    if gpu_memory <= 0:
        raise UserError(f"--gpu-memory must be > 0 GiB, got {gpu_memory:g}")
    if world % nodes:
        raise UserError(f"--gpus {world} is not a multiple of --nodes {nodes} (the same GPUs on every node)")


def layouts_that_fit(
    config: Config,
    shape: ModelShape,
    work: Workload,
    world: int,
    per_node: int,
    gib: float,
    unproven_pp: bool = False,
) -> list[Fit]:
    """The layouts of ``world`` GPUs of ``gib`` GiB that config load admits for this model and that fit, best
    first (``coati_kto.parallel.layout_search``); ``unproven_pp``: every pipeline size, also those the model's
    family is not proven at yet (what proving them would buy)."""
    base = configured_layout(config.plugin, world)
    sp_axis = _sequence_admitted(config)
    admits = _admitted(config.model.path)
    admits_pp = None if unproven_pp else _admitted_pp(config.model.path, base.chunks)
    budget = usable_bytes(gib)
    pp_axis = _pipeline_admitted(config)
    return fitting_layouts(shape, base, work, world, per_node, budget, sp_axis, admits, pp_axis, admits_pp)


def _sequence_admitted(config: Config) -> bool:
    """Whether config load takes this config with sequence parallelism, but for the layout (the search asks
    ``sequence_layout_problems`` per layout): the rows, the attention kernel and the features refused under sp.
    ``auto`` attention resolved here at sp 1 (flex on a GPU) becomes sdpa under sp, so it is asked as sdpa."""
    if "sp_size" not in PluginSection.model_fields:
        return False
    from coati_kto.config.sequence import sequence_run_problems

    if config.attention_note() is not None:  # written as auto (coati_kto.config.attention.flex_refusal)
        model = config.model.model_copy(update={"attn_implementation": "sdpa"})
        config = config.model_copy(update={"model": model})
    return not sequence_run_problems(config, 2)


def _pipeline_admitted(config: Config) -> bool:
    """Whether config load takes this config with pipeline stages, but for their sizes (``_admitted_pp``) and the
    micro-batches (the search runs enough): what the plugin section and the rest of the config allow with pp."""
    if not hasattr(config.plugin, "pp_size"):
        return False
    from coati_kto.config.pipeline import pipeline_plugin_problems, pipeline_problems

    pp, style, chunks = pipeline_of(config.plugin)
    plugin = config.plugin.model_copy(
        update={"pp_size": max(pp, 2), "zero_stage": min(config.plugin.zero_stage, 1), "pp_style": style}
    )
    train = config.train.model_copy(update={"accumulation_steps": 2 * max(pp, 2)})
    trial = config.model_copy(update={"plugin": plugin, "train": train})
    problems = pipeline_plugin_problems(plugin) + pipeline_problems(trial)
    # the family's sizes are _admitted_pp's question, asked per size
    return not [p for p in problems if not p.startswith(("model.path ", "model.reference_path "))]


def _admitted_pp(model_dir: str, chunks: int) -> Callable[[int], bool]:
    """``admits_pp(pp)``: whether config load would take the model at ``pp`` stages of ``chunks`` chunks."""

    def admits_pp(pp: int) -> bool:
        from coati_kto.families.splits import check_pipeline_parallel_family

        try:
            check_pipeline_parallel_family(model_dir, "model.path", pp, chunks)
        except ConfigError:
            return False
        return True

    return admits_pp


def _fit_lines(
    config: Config, shape: ModelShape, work: Workload, world: int, per_node: int, gib: float
) -> list[str]:
    fits = layouts_that_fit(config, shape, work, world, per_node, gib)
    head = f"layouts that fit on {world} x {gib:g} GiB ({RULE}):"
    if not fits:
        return [head, f"  none, even at micro-batch 2 (the least {config.plugin.name} can run here)"]
    rows = [
        f"  {fit.layout.describe():48s} micro-batch up to {fit.micro_batch:2d}  peak {_gib(fit.plan.peak).strip()}"
        + (f" (stage {fit.plan.stage}, {fit.microbatches} micro-batches a step)" if fit.layout.pp > 1 else "")
        for fit in fits[:LISTED]
    ]
    more = [f"  ... and {len(fits) - LISTED} more"] if len(fits) > LISTED else []
    return [head, *rows, *more]


def _admitted(model_dir: str) -> Callable[[int, int], bool]:
    """``admits(tp, sp)``: whether config load would take the model at those sizes (the family's tensor- and
    sequence-parallel proofs, its heads), from config.json alone."""

    def admits(tp: int, sp: int) -> bool:
        try:
            check_model_family(model_dir, "model.path", tp)
            if sp > 1:
                check_sequence_parallel_family(model_dir, "model.path", tp, sp)
        except ConfigError:
            return False
        return True

    return admits


def predicted_peak_line(config: Config, world: int, device_bytes: int | None) -> str:
    """``train``'s line at its start: the predicted peak per rank of this layout, and a warning when it is over
    :data:`USABLE_FRACTION` of ``device_bytes`` (None on the CPU: no check, the ranks share host memory)."""
    try:
        shape = model_shape(config.model.path)
        work = Workload.from_config(config, "gpu" if device_bytes is not None else "cpu")
    except UserError as err:  # a hub id not cached yet: the model loads later; the plan says why not
        return f"predicted peak per rank: unknown ({err})"
    plan = plan_memory(shape, configured_layout(config.plugin, world), work)
    line = f"predicted peak per rank: {_gib(plan.peak).strip()} (`coati-kto plan CONFIG` shows its parts)"
    if device_bytes is None:
        return line + "; CPU: no device-memory check (the ranks share host memory)"
    if plan.peak > device_bytes * USABLE_FRACTION:
        return (
            f"warning: predicted peak per rank {_gib(plan.peak).strip()} is over {USABLE_FRACTION:.0%} of this "
            f"device's {_gib(device_bytes).strip()}: this layout may run out of memory (coati-kto plan CONFIG "
            "--gpus N lists the layouts that fit)"
        )
    return line + f", within {USABLE_FRACTION:.0%} of this device's {_gib(device_bytes).strip()}"
