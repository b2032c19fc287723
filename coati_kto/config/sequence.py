"""Where sequence parallelism (``plugin.sp_size``, ``plugin.sp_mode``) is refused at config load: what it is not
proven on, one line each, before any process starts (docs/sequence_parallelism.md says why for each).

Proven (tests/distributed/test_sequence_parallel.py, _train.py, _layouts_4.py): all_to_all under
hybrid_parallel at tp_size 1 and 2, ZeRO 0 and 2, fp32 and bf16, padding-free rows, sdpa or eager attention, activation checkpointing, the online and the
cached reference, LoRA (tp_size 1, as ColossalAI allows it), resume on the same and another sp size, the classes
of ``coati_kto.families.shardformer.SEQUENCE_PARALLEL_FAMILIES`` at their proven sp sizes.
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


def sequence_problems(config: Any) -> list[str]:
    """Problems of a ``Config`` (duck-typed: the schema imports this module) with ``plugin.sp_size`` > 1, beyond
    the plugin section's own: what all_to_all is not proven with, and the model's heads it cannot split."""
    plugin = config.plugin
    if plugin.sp_size == 1 or plugin.name != "hybrid_parallel":
        return []
    head = f"plugin.sp_size {plugin.sp_size} with"
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
    out += [f"{head} {what} is not supported: set plugin.sp_size=1" for what, on in unproven.items() if on]
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
