"""Where pipeline parallelism (``plugin.pp_size``, ``plugin.pp_style``, ``plugin.num_model_chunks``) is refused at
config load: what ColossalAI 0.5.0's HybridParallelPlugin and schedules assert, and what the project's stage forward
is not proven with, one line each, before any process starts (docs/pipeline_parallelism.md says why for each).

The plan: docs/pipeline_parallelism_plan.md (§1: what the plugin asserts, §4: the passes that cannot run, §5: these
refusals). Under pp the schedule splits every tensor of a batch along dim 0, so the trainer runs padded rows: the
padding-free rows, the shared-prompt packing and the KL continuation are turned off with a note, not refused.
"""

from __future__ import annotations

from typing import Any

from coati_kto.errors import ConfigError
from coati_kto.families.splits import check_pipeline_parallel_family, decoder_layers, distribute_layers

# Measured here (docs/pipeline_parallelism.md): ColossalAI 0.5.0's interleaved schedule on gloo (2 stages, 2 chunks,
# overlap_p2p off) runs the first optimizer step, then hangs in a later run's warm-up send_forward_recv_forward,
# with or without KTO's forward-only passes before it.
INTERLEAVED_REFUSAL = (
    "plugin.pp_style interleaved is not proven: ColossalAI 0.5.0's interleaved schedule hung in the warm-up "
    "transfers of the run after the first (2 stages, 2 chunks, gloo); use plugin.pp_style=1f1b"
)


def pipeline_zero_stage(data: dict[str, Any]) -> int | None:
    """The ZeRO stage an unset ``plugin.zero_stage`` defaults to under ``pp_size`` > 1 (None: the usual default):
    1 for hybrid_parallel in bf16/fp16, as ColossalAI allows ZeRO 0 or 1 only with pp
    (hybrid_parallel_plugin.py:1134-1136) and the usual default there is 2; fp32 keeps its 0."""
    try:
        pipelined = int(data.get("pp_size", 1)) > 1
    except (TypeError, ValueError):  # the field's own check reports it
        return None
    if not pipelined or data.get("name", "hybrid_parallel") != "hybrid_parallel":
        return None
    return 0 if data.get("precision") == "fp32" else 1


def pipeline_plugin_problems(plugin: Any) -> list[str]:
    """The ``plugin`` section's own pipeline-parallel problems (no model needed); ``plugin`` is a PluginSection
    (duck-typed: the section imports this module)."""
    pp, style, chunks = plugin.pp_size, plugin.pp_style, plugin.num_model_chunks
    if pp == 1:
        # pp_style and num_model_chunks mean nothing without stages: a value other than the default is a mistake.
        unused = [f"plugin.pp_style {style}"] if style != "1f1b" else []
        unused += [f"plugin.num_model_chunks {chunks}"] if chunks != 1 else []
        return [
            f"{key} has no effect at plugin.pp_size 1 (pipeline parallelism is off at 1)" for key in unused
        ]
    out = []
    if plugin.name != "hybrid_parallel":
        out.append(
            f"plugin.pp_size {pp} needs plugin.name hybrid_parallel, not {plugin.name} (it has no pipeline stages)"
        )
    elif plugin.zero_stage == 2:
        out.append(
            f"plugin.pp_size {pp} with plugin.zero_stage 2: ColossalAI allows ZeRO stage 0 or 1 with pipeline "
            "parallelism (hybrid_parallel_plugin.py:1134): set plugin.zero_stage=1"
        )
    if style == "1f1b" and chunks != 1:
        out.append(
            f"plugin.pp_style 1f1b holds one model chunk per stage (got plugin.num_model_chunks {chunks}): set "
            "plugin.num_model_chunks=1, or plugin.pp_style=interleaved"
        )
    if style == "interleaved":
        out.append(INTERLEAVED_REFUSAL)
    if style == "interleaved" and chunks < 2:
        out.append(
            "plugin.pp_style interleaved needs plugin.num_model_chunks >= 2 (each stage holds that many slices of "
            "the layers): set plugin.num_model_chunks=2, or plugin.pp_style=1f1b"
        )
    unproven = {
        f"plugin.sp_size {plugin.sp_size}": plugin.sp_size > 1,
        "plugin.cpu_offload": plugin.cpu_offload,
    }
    return out + [
        f"plugin.pp_size {pp} with {what} is not supported: set plugin.pp_size=1"
        for what, on in unproven.items()
        if on
    ]


def schedule_problem(pp_size: int, style: str, accumulation_steps: int) -> str | None:
    """Why the ``style`` schedule cannot fill ``pp_size`` stages with ``accumulation_steps`` micro-batches per
    optimizer step (None when it can): 1F1B needs at least one micro-batch per stage (one_f_one_b.py:93-95),
    interleaved a multiple of the stage count (interleaved_pp.py:88-90). Forward-only passes have no such rule."""
    head = f"plugin.pp_size {pp_size} with plugin.pp_style {style} needs train.accumulation_steps"
    if style == "1f1b" and accumulation_steps < pp_size:
        return (
            f"{head} >= {pp_size} (got {accumulation_steps}): each optimizer step's micro-batches fill the stages, "
            "one each at least (one_f_one_b.py:93-95)"
        )
    if style == "interleaved" and accumulation_steps % pp_size:
        return (
            f"{head} a multiple of {pp_size} (got {accumulation_steps}): the schedule runs each step's "
            "micro-batches in rounds of one per stage (interleaved_pp.py:88-90)"
        )
    return None


def pipeline_problems(config: Any) -> list[str]:
    """Problems of a ``Config`` (duck-typed: the schema imports this module) with ``plugin.pp_size`` > 1, beyond
    the plugin section's own: the micro-batches the schedule cannot fill, what the stage forward is not proven
    with, and the model's class and layer count."""
    plugin = config.plugin
    if plugin.pp_size == 1 or plugin.name != "hybrid_parallel":
        return []
    why = schedule_problem(plugin.pp_size, plugin.pp_style, config.train.accumulation_steps)
    out = [why] if why else []
    model, coef = config.model, config.kto.router_aux_loss_coef
    compiled, router = model.compile is not False, coef not in ("auto", 0)
    unproven = {
        "model.compile (the compiled regions are unproven under the stage forward)": compiled,
        "eval.samples > 0 (decoding one token at a time through the stages is not written)": config.eval.samples,
        "kto.router_aux_loss_coef > 0 (the router logits stay on the stage of their layer)": router,
    }
    out += [
        f"plugin.pp_size {plugin.pp_size} with {what} is not supported: set plugin.pp_size=1"
        for what, on in unproven.items()
        if on
    ]
    if config.output.merge_lora:
        out.append(
            f"plugin.pp_size {plugin.pp_size} with output.merge_lora: each stage holds its own layers' weights, so "
            "no rank can fold the adapters in; set output.merge_lora=false (the adapter export is whole: merge it "
            "afterwards with peft's merge_and_unload)"
        )
    for key in ("model.path", "model.reference_path"):
        if path := getattr(config.model, key.split(".")[1]):
            try:
                check_pipeline_parallel_family(path, key, plugin.pp_size, plugin.num_model_chunks)
            except ConfigError as err:
                out.append(str(err))
    return out


def pipeline_note(config: Any) -> str | None:
    """One line when pipeline parallelism turns off a pass layout the config asks for (None otherwise): the schedule
    splits every tensor of a batch along dim 0, so every pass runs on padded rows."""
    kto, pp = config.kto, config.plugin.pp_size
    kl = kto.loss_type != "apo_zero_unpaired"  # the KL passes' layouts: none without KL passes
    asked = [
        k
        for k, on in (
            ("data.padding_free", config.data.padding_free),
            ("kto.pack_policy", kl and kto.policy_packing()),
            ("kto.pack_reference", kl and kto.pack_reference),
            ("kto.kl_continuation", kl and kto.kl_continuation),
        )
        if on
    ]
    if pp == 1 or not asked:
        return None
    return (
        f"note: plugin.pp_size {pp}: the pipeline schedule splits a batch along its rows, so {', '.join(asked)} "
        f"{'does' if len(asked) == 1 else 'do'} not run (every pass runs on padded rows, the examples and the KL "
        "pairs each take one; equal within rounding)"
    )


def stage_note(config: Any) -> str | None:
    """One line under pipeline parallelism: how the model's decoder layers split into the stages (None at pp_size 1
    or without a config.json to read): ColossalAI's split, the remainder on the middle stages."""
    plugin = config.plugin
    layers = decoder_layers(str(config.model.path)) if plugin.pp_size > 1 else None
    if layers is None:
        return None
    split = distribute_layers(layers, plugin.pp_size, plugin.num_model_chunks)
    uneven = " (uneven: the remainder on the middle stages)" if len(set(split)) > 1 else ""
    return (
        f"note: plugin.pp_size {plugin.pp_size}: the {layers} decoder layers split into stages of {split}{uneven}; "
        "the first stage also holds the embedding, the last the final norm and the LM head"
    )


def check_pipeline_divides_world(plugin: Any, world: int) -> None:
    """ConfigError (one line; every rank raises it, rank 0 prints it) when ``world`` processes cannot form
    tensor- x sequence- x pipeline-parallel groups of ``plugin``'s sizes (ColossalAI's plugin asserts it later, a
    traceback on every rank). Nothing at ``pp_size`` 1: ``parallel.plan.check_tp_divides_world`` checks tp x sp."""
    if plugin.pp_size == 1:
        return
    axes = plugin.tp_size * plugin.sp_size * plugin.pp_size
    if world % axes == 0:
        return
    named = [f"plugin.tp_size {plugin.tp_size}"] + [f"plugin.sp_size {plugin.sp_size}"] * (plugin.sp_size > 1)
    named.append(f"plugin.pp_size {plugin.pp_size}")
    raise ConfigError(
        f"{' x '.join(named)} = {axes} must divide the number of processes, {world}: launch a multiple of {axes} "
        f"(e.g. --nproc-per-node {axes})"
    )
