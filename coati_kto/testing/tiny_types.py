"""Tiny random models of every causal-LM model type transformers can build, from its own default configs shrunk.

``causal_lm_types()`` lists the model types ``AutoModelForCausalLM`` maps (transformers 5.24: 196);
``tiny_config(model_type, tokenizer)`` is that type's default config with its sizes shrunk (hidden 32, 2 layers,
4 heads over 2 key-value heads, 4 experts, a vision tower of one layer...) and every layer type the default mixes
kept (Qwen 3.5's linear and full attention, Gemma's sliding and full layers); ``save_tiny_type`` builds the model
with ``coati_kto.families.auto_model_class`` (what training loads) and saves it with ``tokenizer``. The family
sweep (tests/distributed/family_sweep.py) runs each through the training lifecycle. A type whose config or model
cannot be built this way raises; the sweep records why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Keys shrunk wherever a config (or one of its sub-configs) has them, to the first value.
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "word_embed_proj_dim"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size"), 64),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers"), 2
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_channels"), 8),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "moe_top_k"), 2),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    **dict.fromkeys(("topk_group",), 1),
    **dict.fromkeys(("first_k_dense_replace",), 1),
    **dict.fromkeys(("linear_num_key_heads",), 2),
    **dict.fromkeys(("linear_num_value_heads",), 4),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim"), 8),
    **dict.fromkeys(("max_position_embeddings", "n_positions"), 256),
    **dict.fromkeys(("sliding_window", "attention_chunk_size"), 8),
    **dict.fromkeys(("rotary_dim",), 8),
    **dict.fromkeys(("attention_hidden_size",), 32),
    **dict.fromkeys(("hidden_size_per_layer_input",), 8),
    **dict.fromkeys(("image_size",), 28),
    **dict.fromkeys(("patch_size",), 14),
}
# Keys some defaults leave None that their models read as numbers (transformers 5.24: Ministral and HunYuan's
# head_dim, Nemotron's key-value heads, DeepSeek-V2 and dots1's experts): set, as every real checkpoint sets them.
FILL_NONE: dict[str, int] = {
    **{key: SIZES[key] for key in ("head_dim", "num_key_value_heads", "num_experts_per_tok")},
    "n_routed_experts": SIZES["num_experts"],
    "n_shared_experts": 1,
}
DOTS3_NOTE_TEXT: dict[str, Any] = {
    "head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "shared_experts_intermediate_size": 32,
}
QWEN4_EXP_INDEXER: dict[str, Any] = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 8,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "hc_lowrank": 16,
}
# Keys a type's default config lacks and its model reads, as its hub checkpoints have them.
TYPE_KEYS: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},  # DbrxAttention reads both
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # dense, then MoE
    # Mamba-2 mixers: heads x head dim = expand x hidden (2 x 32); small states and chunks.
    "granitemoehybrid": {
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "layer_types": ["linear_attention", "full_attention"],  # Granite 4's mix (the default is all Mamba)
    },
    "bamba": {
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "attn_layer_indices": [1],  # a Mamba layer, then an attention one
    },
    "mamba2": {"num_heads": 8, "head_dim": 8, "state_size": 16, "n_groups": 1, "chunk_size": 16},
    # Multi-head latent attention: the query-key head is the no-rope part and the rope part (8 + 8).
    # LongCat-Flash: 2 identity ("zero") experts beside the 4 routed ones, not the default 256, under which a
    # rank's tokens can all miss the routed experts (their weights then get no gradient on that rank).
    "longcat_flash": {"qk_head_dim": 16, "expert_ffn_hidden_size": 32, "zero_expert_num": 2},
    "kimi_linear": {
        "qk_head_dim": 16,
        "num_experts_per_token": 2,
        "linear_head_dim": 8,
        "linear_num_heads": 4,
    },
    # Zamba 2: a Mamba layer, then a hybrid one (its shared attention reads [hidden, embeddings]: 2 x 32).
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid"],
        "hybrid_layer_ids": [1],
        "attention_hidden_size": 64,
        "attention_head_dim": 16,
        "mamba_headdim": 8,
        "mamba_d_state": 16,
        "chunk_size": 16,
        "adapter_rank": 8,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32},
    # Jamba: an attention and an MoE layer among the two (the defaults put the first at layer 4 and 8).
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_dt_rank": 8},
    # Zamba: Mamba and hybrid layers in turn; two hybrid layers, which share one attention block (tied weights)
    # reading [hidden, embeddings] (2 x 32), as Zamba 2's.
    "zamba": {
        "num_hidden_layers": 4,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "attention_hidden_size": 64,
        "attention_head_dim": 16,
    },
    # Dory: input, recurrent and output layers, stored as released checkpoints store them (an attention block
    # and an mlp block per layer: the config halves every count).
    "dory": {
        "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
    },
    "xlnet": {"d_head": 8},  # d_model // n_head, which the config checks
    # xLSTM: its cache rounds the query-key and value widths (hidden x 0.5, x 1) up to multiples of 64, its
    # blocks do not: 128 wide, as 4,096 is, they agree. The default's embedding_dim and num_blocks follow.
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "num_blocks": 2},
    # HRM: one layer per stack, H_cycles x (L_cycles + 1) = 8 slots (the config stores the product).
    "hrm_text": {"num_layers_per_stack": 1, "num_hidden_layers": 8},
    # Its rotary embedding reads rope_parameters per layer type (the default leaves them empty); 3D positions
    # (text, height, width) over the 4 frequencies of an 8-wide head.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        }
    },
    # BLT: its local encoder as wide as its local decoder (a text config: 32), as in BLT 1B; both read the
    # global transformer's width (16, a sub-config's); hashed byte-group embeddings of 64 rows, not 500,002.
    "blt": {
        "encoder_config": {
            "hidden_size_global": 16,
            **{k: SIZES[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")},
            "num_key_value_heads": SIZES["num_key_value_heads"],
        },
        "decoder_config": {"hidden_size_global": 16},
        "encoder_hash_byte_group_vocab": 64,
    },
    # Qwen4-Exp's indexed-attention layers select blocks with a QSA indexer, which the checkpoint configures.
    "qwen4_exp_text": QWEN4_EXP_INDEXER,
    "qwen4_exp": {"text_config": QWEN4_EXP_INDEXER},
    # dots3 note's vision and audio adapters project from their tower's width into the text model's.
    "dots3_note": {
        "text_config": DOTS3_NOTE_TEXT,
        "vision_config": {"adapter_in_dim": 16, "adapter_out_dim": SIZES["hidden_size"]},
        "audio_config": {  # a 16-channel conv stem, not 480 (4M parameters)
            "adapter_input_size": 16,
            "adapter_out_dim": SIZES["hidden_size"],
            "downsample_hidden_size": 16,
        },
    },
    "dots3_note_text": DOTS3_NOTE_TEXT,
    # Qwen 3.5's tower: one block (the default's 27), its merger projecting into the text model's width (the
    # default's 3,584 failed the first image forward: "Image features and image tokens do not match").
    "qwen3_5": {"vision_config": {"depth": 1, "out_hidden_size": SIZES["hidden_size"]}},
    # Gemma 3n: the last 2 of 4 layers reuse the key-value states of the last sliding and full layer before them.
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "intermediate_size": [SIZES["intermediate_size"]] * 4,  # one per layer, as checkpoints list them
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "laurel_rank": 8,
    },
}
# Sub-configs that embed the text model's tokens too (BLT's byte encoder and entropy patcher): its vocabulary.
SHARED_VOCABULARY: dict[str, tuple[str, ...]] = {"blt": ("encoder_config", "patcher_config")}
# Sub-configs (vision towers, audio encoders) are smaller still.
SUB_SIZES = {
    **SIZES,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}
TEXT_KEYS = ("text_config", "language_config", "llm_config", "decoder_config")


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` maps, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layers(values: dict[str, Any]) -> int:
    return int(
        next(
            (values[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in values), 0
        )
    )


def _shrink(values: dict[str, Any], sizes: dict[str, int]) -> dict[str, Any]:
    """``values`` (a config's dict) with its sizes shrunk, per-layer lists cut to the new depth keeping each
    distinct layer type, dropout off; sub-config dicts shrunk with ``SUB_SIZES`` (a text config with ``sizes``)."""
    old_layers, out = _layers(values), dict(values)
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrink(value, sizes if key in TEXT_KEYS else SUB_SIZES)
        elif key in sizes and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = min(value, sizes[key])
        elif "dropout" in key and isinstance(value, float):
            out[key] = 0.0
        elif value is None and key in FILL_NONE:
            out[key] = FILL_NONE[key]
    types = values.get("layer_types")
    if isinstance(types, list) and types:
        kinds = list(dict.fromkeys(types))  # each distinct layer type once, in order of first use
        depth = max(_layers(out), len(kinds))
        out["layer_types"] = (kinds * depth)[:depth]
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in out:
                out[key] = depth
    new_layers = _layers(out)
    for (
        key,
        value,
    ) in values.items():  # other per-layer lists and {layer index: ...} maps, cut to the new depth
        if key != "layer_types" and isinstance(value, list) and old_layers and len(value) == old_layers:
            out[key] = value[:new_layers]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < new_layers}
    if "kv_lora_rank" in out and "num_key_value_heads" in out:  # multi-head latent attention: one kv per head
        out["num_key_value_heads"] = out.get("num_attention_heads", out["num_key_value_heads"])
    return out


def tiny_config(model_type: str, tokenizer: Any) -> Any:
    """``model_type``'s default config shrunk (``SIZES``), its vocabulary ``len(tokenizer)`` (not a multiple of
    64: padded under tensor parallelism) and the tokenizer's special ids, in its text config."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    values = _shrink(default, SIZES)
    for key, extra in TYPE_KEYS.get(model_type, {}).items():
        values[key] = {**values.get(key, {}), **extra} if isinstance(extra, dict) else extra
    text_key = next((k for k in TEXT_KEYS if isinstance(values.get(k), dict)), None)
    text = values[text_key] if text_key else values
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if "vocab_size_per_layer_input" in text:  # Gemma 3n/4 per-layer embeddings: 262,144 rows by default
        ids["vocab_size_per_layer_input"] = len(tokenizer)
    if "unpadded_vocab_size" in text:  # Inkling 2: the rows it keeps of vocab_size (saved padded to it)
        ids["unpadded_vocab_size"] = len(tokenizer)
    text.update(ids)
    if text_key:
        values.update({k: v for k, v in ids.items() if k in default})
    for key in SHARED_VOCABULARY.get(model_type, ()):
        values[key]["vocab_size"] = len(tokenizer)
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **values)


def save_tiny_type(model_type: str, out_dir: str | Path, tokenizer: Any, seed: int = 0) -> Path:
    """Build ``model_type``'s tiny model (``tiny_config``) with the class training loads, run one forward as a
    check, and save it with ``tokenizer`` in ``out_dir``. Raises whatever building or the forward raises."""
    from coati_kto.families import auto_model_class

    config = tiny_config(model_type, tokenizer)
    torch.manual_seed(seed)
    model = auto_model_class(config).from_config(config)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([[tokenizer.bos_token_id or 0, 5, 6, 7]])
        # As training runs it (coati_kto.models.lm_head.forward_inputs): no KV cache, which BLT cannot build.
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def late_2026_shapes(exact: int) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """``coati_kto.testing.tiny``'s Gemma 4 text and Qwen 3.5 dense text families: (model class, config class, keys)
    over transformers 5.24's config defaults, shrunk, with every layer kind and feature a tensor-parallel split
    must keep; ``exact`` is the tokenizer's vocabulary."""
    return {
        "gemma4": (
            "Gemma4ForCausalLM",
            "Gemma4TextConfig",
            dict(
                num_hidden_layers=4,
                num_key_value_heads=4,
                head_dim=8,
                global_head_dim=16,
                num_global_key_value_heads=2,
                attention_k_eq_v=True,
                num_kv_shared_layers=2,
                use_double_wide_mlp=True,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=exact,
                final_logit_softcapping=30.0,
                tie_word_embeddings=True,
            ),
        ),
        "qwen3_5": (
            "Qwen3_5ForCausalLM",
            "Qwen3_5TextConfig",
            dict(
                num_hidden_layers=2,
                head_dim=8,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                tie_word_embeddings=False,
            ),
        ),
    }
