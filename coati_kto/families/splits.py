"""Which parallel splits a model admits, from its class and config.json: tensor parallelism (the classes
``shardformer.TENSOR_PARALLEL_FAMILIES`` proves, whole query and key-value heads per rank), all_to_all
sequence parallelism (``shardformer.SEQUENCE_PARALLEL_FAMILIES``, heads split over tp x sp ranks) and pipeline
parallelism (``shardformer.PIPELINE_PARALLEL_FAMILIES``, decoder layers split over the stages). Called by the
config schema at load and by the hybrid-parallel backend for a class only loading tells (a hub id)."""

from __future__ import annotations

from typing import Any

from coati_kto.errors import ConfigError
from coati_kto.families import (
    _config_json,
    class_name_of,
    encoder_refusal,
    model_class_name,
    quantized_refusal,
)
from coati_kto.families.shardformer import (
    pipeline_parallel_refusal,
    sequence_parallel_refusal,
    supported_summary,
    tensor_parallel_refusal,
)
from coati_kto.families.unproven import unproven_refusal


def check_model_family(model_dir: str, key: str, tp_size: int = 1) -> None:
    """ConfigError (one line) when the model at ``model_dir`` is an encoder, fails the family sweep
    (``unproven.UNPROVEN_TYPES``; any plugin) or is quantized, or when its class is not admitted at ``tp_size`` tensor-parallel
    ranks (every class at tp_size 1; above it ``shardformer.TENSOR_PARALLEL_FAMILIES``: what the tests prove).
    Checked from config.json (a Hub id's from the hub cache); a class it cannot tell (a Hub id not cached, remote
    code) is checked at boost."""
    raw = _config_json(model_dir) or {}
    if (why := encoder_refusal(raw) or unproven_refusal(raw) or quantized_refusal(raw)) is not None:
        raise ConfigError(f"{key} {model_dir}: {why}")
    if tp_size <= 1:
        return
    name = model_class_name(model_dir)
    if name is None:
        return
    refuse_unadmitted(name, tp_size, f"{key} {model_dir}: ")
    why = tensor_parallel_shape_refusal(_config_json(model_dir) or {}, tp_size)
    if why is not None:
        raise ConfigError(f"{key} {model_dir}: {why}")


# Head counts a tensor-parallel split divides (Gemma 4's full layers: num_global_key_value_heads when values are
# keys; Qwen 3.5's linear-attention layers: linear_num_*_heads).
SPLIT_HEADS = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def tensor_parallel_shape_refusal(raw: dict[str, Any], tp_size: int) -> str | None:
    """Why a model of config.json ``raw`` cannot be split over ``tp_size`` tensor-parallel ranks (None when it
    can): each rank must hold whole query heads and whole key-value heads (the project's policies split q/k/v
    by output rows and keep transformers' attention, which reshapes by ``head_dim``). Gemma 3 270M / 1B and
    SmolLM2 135M / 360M have one or an odd number of key-value heads: tp_size 2 cannot split them."""
    if tp_size <= 1:
        return None
    text = {**raw, **(raw.get("text_config") or {})}
    if text.get("enable_moe_block"):  # Gemma 4 26B-A4B: its experts have no tensor-parallel split
        return "Gemma 4 with enable_moe_block has no tensor-parallel policy: use plugin.tp_size 1"
    pad_row = gemma4_pad_row_refusal(raw, tp_size)
    if pad_row is not None:
        return pad_row
    named = uneven_heads(raw, tp_size)
    if named is None:
        return None
    return f"plugin.tp_size {tp_size} must divide {named} (each tensor-parallel rank holds whole heads): use plugin.tp_size 1"


# ColossalAI's vocabulary-parallel embedding pads the vocabulary to a multiple of 64 x tp_size (its
# make_vocab_size_divisible_by, coati_kto.parallel.model_shape.VOCAB_MULTIPLE), each rank holding an equal share
# of the padded rows.
VOCAB_MULTIPLE = 64


def gemma4_pad_row_refusal(raw: dict[str, Any], tp_size: int) -> str | None:
    """Why a Gemma 4 vision-language model of config.json ``raw`` cannot run at ``tp_size`` (None when it can):
    its forward indexes the embedding weight by the text config's ``pad_token_id`` directly
    (``Gemma4Model.forward``, modeling_gemma4.py:2385), which under tensor parallelism is the rank's shard of the
    vocabulary-parallel embedding. The value read is dead while ``input_ids`` are given (plan §3; the tripwire:
    tests/unit/models/test_vision_features.py), but a pad id past the shard's rows raises IndexError."""
    text = raw.get("text_config") or {}
    pad, vocab = text.get("pad_token_id"), text.get("vocab_size")
    if raw.get("model_type") != "gemma4" or not isinstance(pad, int) or not isinstance(vocab, int):
        return None
    multiple = VOCAB_MULTIPLE * tp_size
    rows = -(-vocab // multiple) * multiple // tp_size
    if pad < rows:
        return None
    return (
        f"Gemma 4 vision-language with pad_token_id {pad}: its forward reads that row of the embedding directly, "
        f"past the {rows} rows each of plugin.tp_size {tp_size} ranks holds: use plugin.tp_size 1"
    )


def uneven_heads(raw: dict[str, Any], ways: int) -> str | None:
    """The head counts of config.json ``raw`` that ``ways`` does not divide, named with the query and key-value
    counts (e.g. ``num_attention_heads 4 and num_key_value_heads 1``), or None when it divides them all."""
    text = {**raw, **(raw.get("text_config") or {})}
    counts = {name: text.get(name) for name in SPLIT_HEADS}
    counts["num_key_value_heads"] = counts["num_key_value_heads"] or counts["num_attention_heads"]
    if not text.get("attention_k_eq_v"):  # Gemma 4 reads num_global_key_value_heads only then
        counts.pop("num_global_key_value_heads")
    for layer, overrides in (text.get("per_layer_config") or {}).items():  # Gemma 4's full layers
        counts[f"layer {layer}'s num_key_value_heads"] = (overrides or {}).get("num_key_value_heads")
    counts = {k: v for k, v in counts.items() if isinstance(v, int)}
    if not any(v % ways for v in counts.values()):
        return None
    return " and ".join(f"{k} {v}" for k, v in counts.items() if v % ways or k in SPLIT_HEADS[:2])


# (tp_size, sp_size) above tp_size 1 at which each class is proven under sequence parallelism: Llama at tp 2 x sp 2
# (tests/distributed/test_sequence_parallel_layouts_4.py, bf16 ZeRO-2 against tp 1 x dp 4). The other families'
# tensor-parallel policies and tp 2 x sp 4 never ran under the attention wrapper.
TENSOR_SEQUENCE_PARALLEL: dict[str, tuple[tuple[int, int], ...]] = {"LlamaForCausalLM": ((2, 2),)}


def tensor_sequence_refusal(architecture: str, tp_size: int, sp_size: int) -> str | None:
    """Why ``architecture`` cannot run at ``tp_size`` x ``sp_size`` (one line), or None: every admitted class at
    tp_size 1, :data:`TENSOR_SEQUENCE_PARALLEL` above it."""
    if tp_size <= 1 or sp_size <= 1 or (tp_size, sp_size) in TENSOR_SEQUENCE_PARALLEL.get(architecture, ()):
        return None
    admitted = ", ".join(
        f"{name} ({', '.join(f'tp_size {t} x sp_size {s}' for t, s in sizes)})"
        for name, sizes in TENSOR_SEQUENCE_PARALLEL.items()
    )
    return (
        f"{architecture} is not proven at plugin.tp_size {tp_size} x plugin.sp_size {sp_size} (tensor with "
        f"sequence parallelism: {admitted}): set plugin.tp_size=1"
    )


def check_sequence_parallel_family(model_dir: str, key: str, tp_size: int, sp_size: int) -> None:
    """ConfigError (one line) when the model at ``model_dir`` cannot run at ``sp_size`` all_to_all ranks: its class
    unproven there (``shardformer.SEQUENCE_PARALLEL_FAMILIES``, :data:`TENSOR_SEQUENCE_PARALLEL` above tp_size 1),
    or head counts tp_size x sp_size does not divide (each sp rank takes 1/sp of a tensor-parallel rank's query
    and key-value heads). From config.json, a Hub id's from the hub cache; one not cached is checked when the
    model is loaded (its class, and its heads before any forward)."""
    raw = _config_json(model_dir)
    name = class_name_of(raw)
    if name is None:
        return
    architecture = name.rsplit(".", 1)[-1]
    why = sequence_parallel_refusal(architecture, sp_size) or tensor_sequence_refusal(
        architecture, tp_size, sp_size
    )
    if (why := why or sequence_heads_refusal(raw, tp_size, sp_size)) is not None:
        raise ConfigError(f"{key} {model_dir}: {why}")


def sequence_heads_refusal(raw: dict[str, Any], tp_size: int, sp_size: int) -> str | None:
    """Why all_to_all over ``sp_size`` ranks cannot split the heads of config.json ``raw`` (a loaded model's
    ``config.to_dict()`` alike) at ``tp_size``, or None: config load's line, and the backend's for a Hub id
    config load could not read."""
    named = uneven_heads(raw, tp_size * sp_size)
    if named is None:
        return None
    return (
        f"plugin.tp_size {tp_size} x plugin.sp_size {sp_size} must divide {named} (all_to_all gives each rank "
        "whole heads)"
    )


def distribute_layers(layers: int, stages: int, chunks: int = 1) -> list[int]:
    """Decoder layers per virtual stage (``stages x chunks`` entries), as ColossalAI 0.5.0's
    ``PipelineStageManager.distribute_layers`` splits them: ``layers // (stages x chunks)`` each, the remainder one
    more on the middle ones (from ``(stages x chunks) // 2 - remainder // 2``)."""
    virtual = stages * chunks
    split = [layers // virtual] * virtual
    remainder = layers % virtual
    start = virtual // 2 - remainder // 2
    for i in range(start, start + remainder):
        split[i] += 1
    return split


def decoder_layers(model_dir: str) -> int | None:
    """``num_hidden_layers`` of the model at ``model_dir`` (a vision-language model's text model's), from config.json;
    None without one (a Hub id not in the hub cache)."""
    return layers_of(_config_json(model_dir) or {})


def layers_of(raw: dict[str, Any]) -> int | None:
    """``num_hidden_layers`` of config.json ``raw`` (a loaded model's ``config.to_dict()`` alike), a vision-language
    model's text model's; None where it names none."""
    layers = {**raw, **(raw.get("text_config") or {})}.get("num_hidden_layers")
    return layers if isinstance(layers, int) else None


def pipeline_layers_refusal(layers: int | None, pp_size: int, num_model_chunks: int) -> str | None:
    """Why ``layers`` decoder layers cannot fill ``pp_size`` stages of ``num_model_chunks`` chunks (each chunk holds
    at least one layer; ColossalAI's stage manager asserts otherwise), or None."""
    chunks = pp_size * num_model_chunks
    if layers is None or chunks <= layers:
        return None
    return (
        f"plugin.pp_size {pp_size} x plugin.num_model_chunks {num_model_chunks} = {chunks} is more than its "
        f"num_hidden_layers {layers} (each chunk of a stage holds at least one decoder layer)"
    )


def check_pipeline_parallel_family(model_dir: str, key: str, pp_size: int, num_model_chunks: int = 1) -> None:
    """ConfigError (one line) when the model at ``model_dir`` cannot run at ``pp_size`` pipeline stages of
    ``num_model_chunks`` chunks each: its class unproven there (``shardformer.PIPELINE_PARALLEL_FAMILIES``), or
    fewer decoder layers than chunks in all (:func:`pipeline_layers_refusal`). From config.json, a Hub id's from
    the hub cache; one not cached is checked when the model is loaded (the backend's ``prepare_policy``)."""
    name = model_class_name(model_dir)
    why = None if name is None else pipeline_parallel_refusal(name.rsplit(".", 1)[-1], pp_size)
    why = why or pipeline_layers_refusal(decoder_layers(model_dir), pp_size, num_model_chunks)
    if why is not None:
        raise ConfigError(f"{key} {model_dir}: {why}")


def refuse_unadmitted(
    model_class: str, tp_size: int, prefix: str = "", sp_size: int = 1, pp_size: int = 1
) -> None:
    """ConfigError unless ``model_class`` (a class name, bare or with its module) is admitted at ``tp_size``
    tensor-parallel, ``sp_size`` sequence-parallel and ``pp_size`` pipeline-parallel ranks."""
    name = model_class.rsplit(".", 1)[-1]
    why = tensor_parallel_refusal(name, tp_size)
    if why is not None:
        raise ConfigError(
            f"{prefix}{why} (tensor parallelism: {supported_summary()}); plugin.tp_size 1 runs every family "
            "without a tensor-parallel policy"
        )
    why = sequence_parallel_refusal(name, sp_size) or tensor_sequence_refusal(name, tp_size, sp_size)
    if (why := why or pipeline_parallel_refusal(name, pp_size)) is not None:
        raise ConfigError(f"{prefix}{why}")
