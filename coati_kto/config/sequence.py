"""Where sequence parallelism (``plugin.sp_size``, ``plugin.sp_mode``) is refused at config load: what it is not
proven on, one line each, before any process starts (docs/sequence_parallelism.md says why for each).

Proven, and admitted: all_to_all under hybrid_parallel on padding-free rows, sdpa or eager attention, at tp_size 1
- in fp32 with ZeRO 0 (tests/distributed/test_sequence_parallel_train.py: sp 2 = sp 1 through the recipe), with
  activation checkpointing, the online or the cached reference, LoRA, resume on the same and another sp size;
- in bf16 with ZeRO 2 (test_sequence_parallel_layouts_4.py: sp 2 x dp 2 against tp 1 x dp 4), without LoRA;
and tp 2 x sp 2 in bf16 with ZeRO 2 for Llama only (the same file; ``families.splits.TENSOR_SEQUENCE_PARALLEL``).
The recipe ran on Llama at sp 2; the model side of each class of ``families.shardformer.SEQUENCE_PARALLEL_FAMILIES``
is proven at its sp sizes (test_sequence_parallel.py: Llama at sp 2 and 4, the others at sp 2), which is what
differs between them. Everything else is refused: fp16, bf16 at ZeRO 0 or 1, cpu_offload, tensor parallelism in
fp32 or at another tp x sp or family, LoRA in bf16 with ZeRO 2.
"""

from __future__ import annotations

from typing import Any

from coati_kto.errors import ConfigError
from coati_kto.families.splits import check_sequence_parallel_family

# Why each mode other than all_to_all is refused (one line each; the docs give the detail).
MODE_REFUSALS = {
    "split_gather": "plugin.sp_mode split_gather gathers the sequence inside the tensor-parallel projections, "
    "and transformers' attention reshapes their output to its input's (split) length: it needs ColossalAI's "
    "forwards, written for transformers 4.51; use plugin.sp_mode all_to_all",
    "ring": "plugin.sp_mode ring splits the sequence as split_gather does (and needs the same forwards): use "
    "plugin.sp_mode all_to_all",
    "ring_attn": "plugin.sp_mode ring_attn needs flash-attention on CUDA and cannot express the KL pairs' "
    "visibility rule (its varlen ring attends causally within a document): use plugin.sp_mode all_to_all",
}


def sequence_plugin_problems(name: str, tp_size: int, sp_size: int, sp_mode: str | None) -> list[str]:
    """The ``plugin`` section's own sequence-parallel problems (no model needed)."""
    if sp_size == 1 and sp_mode is None:
        return []
    out = []
    if name != "hybrid_parallel":
        key = f"plugin.sp_size {sp_size}" if sp_size > 1 else f"plugin.sp_mode {sp_mode}"
        out.append(f"{key} needs plugin.name hybrid_parallel, not {name} (it has no sequence-parallel group)")
    if sp_mode is not None and sp_size == 1:
        out.append(f"plugin.sp_mode {sp_mode} needs plugin.sp_size > 1 (sequence parallelism is off at 1)")
    if sp_mode in ("split_gather", "ring") and sp_size != tp_size:
        # ColossalAI makes the tensor-parallel group the sequence-parallel one in these modes, ignoring sp_size.
        out.append(
            f"plugin.sp_mode {sp_mode} splits sequences over the tensor-parallel group: plugin.sp_size "
            f"({sp_size}) must equal plugin.tp_size ({tp_size}), which must be > 1"
        )
    if sp_mode in MODE_REFUSALS and sp_size > 1:
        out.append(MODE_REFUSALS[sp_mode])
    return out


# The (plugin.precision, plugin.zero_stage) pairs the whole recipe ran at under sequence parallelism (module docstring).
PROVEN_PRECISIONS = (("fp32", 0), ("bf16", 2))


def sequence_layout_problems(
    precision: str, zero_stage: int, tp_size: int, sp_size: int, cpu_offload: bool, lora: bool
) -> list[str]:
    """What all_to_all (hybrid_parallel, ``sp_size`` > 1) is not proven with among a layout's own settings: the
    precision and ZeRO stage, offload, tensor parallelism and LoRA (``coati-kto plan`` asks it per layout)."""
    if sp_size == 1:
        return []
    head, pair, out = f"plugin.sp_size {sp_size} with", (precision, zero_stage), []
    # fp32 with ZeRO is the plugin section's own line (hybrid_parallel's ZeRO needs bf16 or fp16).
    if pair not in PROVEN_PRECISIONS and precision != "fp32":
        fix = "fp32 and plugin.zero_stage=0" if lora else "bf16 and plugin.zero_stage=2"
        out.append(
            f"{head} plugin.precision {precision} and plugin.zero_stage {zero_stage} is not proven (sequence "
            f"parallelism is proven in bf16 with ZeRO 2 and in fp32 with ZeRO 0): set plugin.precision={fix}"
        )
    if cpu_offload:
        out.append(f"{head} plugin.cpu_offload is not proven: set plugin.cpu_offload=false")
    if lora and pair == ("bf16", 2):
        out.append(
            f"{head} model.lora is proven in fp32 with ZeRO 0 only: set plugin.precision=fp32 and "
            "plugin.zero_stage=0, or plugin.sp_size=1"
        )
    if tp_size > 1 and pair == ("fp32", 0):  # LoRA above tp_size 1 is the lora section's line
        out.append(
            f"plugin.tp_size {tp_size} x plugin.sp_size {sp_size} is proven in bf16 with ZeRO 2 only: set "
            "plugin.precision=bf16 and plugin.zero_stage=2, or plugin.tp_size=1"
        )
    return out


def sequence_run_problems(config: Any, sp_size: int) -> list[str]:
    """What all_to_all at ``sp_size`` is not proven with in a ``Config``'s other sections, whatever its layout:
    the rows, the attention kernel, and the features refused under sp (``coati-kto plan`` asks it at sp 2)."""
    head = f"plugin.sp_size {sp_size} with"
    out = []
    if not config.data.padding_free:
        out.append(
            f"{head} data.padding_free false: sequence parallelism splits the padding-free rows (set "
            "data.padding_free=true)"
        )
    if config.model.attn_implementation not in ("sdpa", "eager", None):
        out.append(
            f"{head} model.attn_implementation {config.model.attn_implementation}: its attention wraps sdpa or "
            "eager only (a dense whole-row mask per rank's slice; set model.attn_implementation=sdpa)"
        )
    unproven = {
        "eval.samples > 0 (decoding one token at a time cannot be split)": config.eval.samples > 0,
        "kto.router_aux_loss_coef > 0 (the router loss is not summed over the sequence-parallel group)": (
            config.kto.router_aux_loss_coef not in ("auto", 0)
        ),
        "model.compile": config.model.compile is not False,
        "train.fused_optimizer": config.train.fused_optimizer,
    }
    return out + [
        f"{head} {what} is not supported: set plugin.sp_size=1" for what, on in unproven.items() if on
    ]


def sequence_problems(config: Any) -> list[str]:
    """Problems of a ``Config`` (duck-typed: the schema imports this module) with ``plugin.sp_size`` > 1, beyond
    the plugin section's own: what all_to_all is not proven with, and the model's class and heads."""
    plugin = config.plugin
    if plugin.sp_size == 1 or plugin.name != "hybrid_parallel":
        return []
    out = sequence_run_problems(config, plugin.sp_size)
    out += sequence_layout_problems(
        plugin.precision,
        plugin.zero_stage,
        plugin.tp_size,
        plugin.sp_size,
        plugin.cpu_offload,
        config.model.lora is not None,
    )
    for key in ("model.path", "model.reference_path"):
        if path := getattr(config.model, key.split(".")[1]):
            try:
                check_sequence_parallel_family(path, key, plugin.tp_size, plugin.sp_size)
            except ConfigError as err:
                out.append(str(err))
    return out


def sequence_note(config: Any) -> str | None:
    """One line when sequence parallelism turns off a pass layout the config asks for (None otherwise): every pass
    runs on its own sliced rows, so the shared-prompt packing and the KL continuation do not run."""
    kto = config.kto
    asked = [
        k
        for k, on in (
            ("kto.pack_policy", kto.policy_packing()),
            ("kto.pack_reference", kto.pack_reference),
            ("kto.kl_continuation", kto.kl_continuation),
        )
        if on
    ]
    if config.plugin.sp_size == 1 or not asked or kto.loss_type == "apo_zero_unpaired":  # no KL passes
        return None
    return (
        f"note: plugin.sp_size {config.plugin.sp_size}: every pass runs on its own sliced rows, so {', '.join(asked)} "
        f"{'does' if len(asked) == 1 else 'do'} not run (the examples and the KL pairs each take a pass; equal "
        "within rounding)"
    )
