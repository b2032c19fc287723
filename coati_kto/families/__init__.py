"""Model-family facts: the one place that knows how a family's model behaves under our passes and plugins.

What lives here: which model class a checkpoint builds (from config.json alone), which heads are exactly ``lm_head(hidden)``
(the chunked head is exact for them), the attention window a packed mask must apply; in ``splits``, the checks
that refuse a family a tensor- or sequence-parallel size cannot split (called by the config schema at load, and
by the hybrid-parallel backend for a class only loading tells); in ``policies``, the shardformer policies the
project corrects. A new family's facts go here and in
``coati_kto.testing.tiny`` (its tiny builder), nowhere else.

May import: ``coati_kto.errors`` only (a leaf: the config schema imports it). ColossalAI is never imported at
module level here (3-4 s): the coverage scan reads its source instead, and ``policies`` imports it lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coati_kto.errors import ConfigError

# Families whose causal-LM forward is exactly ``logits = lm_head(final_hidden)`` (no soft-capping or scaling
# after the head): the chunked head is exact for them. Others keep the logits path.
HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "smollm3"})
# Families whose decoder takes ``attention_mask`` as a mapping {layer type: 4D mask} (transformers 5): one packed
# forward gives their sliding and full layers each its own mask.
MASK_MAPPING_FAMILIES = frozenset({"gemma3_text", "qwen2", "qwen3", "smollm3"})
# Families whose model forward derives token positions from the 2D attention mask (its cumsum) when no
# position_ids are given: handed a 4D mask they fail (OPT: "size of tensor a (2) must match the size of tensor b
# (43)", modeling_opt.py:375), so their padded passes give them the 2D mask (the packed ones pass positions).
MASK_POSITION_FAMILIES = frozenset({"opt", "biogpt"})


def vision_language(config: Any) -> bool:
    """Whether ``config`` is a composite vision-language config whose text model is ``config.get_text_config()``
    (Gemma 3 4B-27B: ``model_type`` gemma3, Gemma3ForConditionalGeneration). The passes are text-only: such a
    model runs through its own logits and transformers' own masks (no packed rows), its vision tower frozen."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config is not None and get_text_config() is not config


def auto_model_class(config: Any) -> Any:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language checkpoint (trained on text
    like Gemma 3 4B-27B, its vision tower frozen and exported): transformers maps Qwen2-VL, Qwen2.5-VL, Qwen3-VL
    and Mistral 3 to no causal-LM class, and Qwen 3.5's to its text-only Qwen3_5ForCausalLM (the vision tower
    would be dropped from the export)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if vision_language(config) and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


# Vision-language families whose whole-model class cannot run the text passes (transformers 5.24): refused.
BROKEN_VISION_LANGUAGE = {
    "llama4": "transformers' Llama4ForConditionalGeneration fails on text-only batches ('MoeCausalLMOutputWithPast' "
    "has no attribute 'image_outputs')",
}


def vision_language_refusal(model_dir: str) -> str | None:
    """Why the vision-language checkpoint at ``model_dir`` cannot train (None when it can or is no such model);
    read from config.json alone."""
    raw = _config_json(model_dir)
    if raw is None or raw.get("vision_config") is None or raw.get("text_config") is None:
        return None
    why = BROKEN_VISION_LANGUAGE.get(str(raw.get("model_type")))
    return f"{model_dir} is a {raw.get('model_type')} vision-language checkpoint: {why}" if why else None


def text_only_model(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json holds no vision-language model (no ``vision_config`` and
    ``text_config``); False where it has none (a hub id: the load tells)."""
    raw = _config_json(model_dir)
    return raw is not None and (raw.get("vision_config") is None or raw.get("text_config") is None)


def text_vocab_size(config: Any) -> int:
    """The vocabulary of ``config``'s text model (a composite config keeps it in its text config)."""
    return int(config.get_text_config().vocab_size if vision_language(config) else config.vocab_size)


def plain_head(config: Any) -> bool:
    """Whether the causal LM's logits are exactly ``lm_head(final hidden)``: :data:`HEAD_FAMILIES`, and Gemma 3
    without final logit soft-capping (its default; Gemma 2 caps, so a capped Gemma 3 keeps the logits path)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3_text":
        return getattr(config, "final_logit_softcapping", None) is None
    return model_type in HEAD_FAMILIES


def _config_json(model_dir: str) -> dict[str, Any] | None:
    """``model_dir``'s config.json as a dict, for a Hub id the copy in the hub cache (no download); None where
    neither holds one (a Hub id not downloaded: the checks that read it then run when the model loads).
    ConfigError (one line) when it is not a JSON object: every config.json check reads it through here."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        if Path(model_dir).expanduser().exists():
            return None
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model_dir, "config.json")
        except ValueError:  # not a Hub id's shape (a local path that is not there yet): nothing to read
            return None
        if not isinstance(cached, str):
            return None
        config_file = Path(cached)
    try:
        raw = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{config_file}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file}: a model config must be a JSON object, not a {type(raw).__name__}")
    return raw


def model_class_name(model_dir: str) -> str | None:
    """The full class name AutoModelForCausalLM builds for ``model_dir``, from its config.json alone.

    None when it cannot be known without loading (a Hub id not in the hub cache, or remote code): the plugin then
    checks at build.
    """
    return class_name_of(_config_json(model_dir))


def class_name_of(raw: dict[str, Any] | None) -> str | None:
    """:func:`model_class_name` of config.json ``raw`` (None: no config.json, or remote code)."""
    if raw is None:
        return None
    architectures, model_type = raw.get("architectures") or [], raw.get("model_type")
    if "auto_map" in raw or not architectures or not model_type:
        return None
    module = model_type.replace("-", "_")
    return f"transformers.models.{module}.modeling_{module}.{architectures[0]}"


# Model types whose causal-LM class attends both ways unless config.json makes it a decoder: the family sweep's
# `not causal` cells (docs/family_sweep.md: at every position the logits move when a later token changes).
ENCODER_TYPES = frozenset(
    [
        "bert",
        "bert-generation",
        "big_bird",
        "camembert",
        "cpmant",
        "data2vec-text",
        "electra",
        "ernie",
        "megatron-bert",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "xlm",
        "xlm-roberta",
        "xlm-roberta-xl",
    ]
)


def encoder_refusal(raw: dict[str, Any]) -> str | None:
    """Why the model of config.json ``raw`` is no causal LM (None when it is, or cannot be told)."""
    model_type = raw.get("model_type")
    if model_type not in ENCODER_TYPES or raw.get("is_decoder") or raw.get("causal"):
        return None
    return (
        f"model_type {model_type} without is_decoder: true in config.json is an encoder: each position sees the "
        "later tokens, so a completion's log-probs would read the completion itself (KTO needs a causal LM)"
    )


def quantized_refusal(raw: dict[str, Any]) -> str | None:
    """Why the model of config.json ``raw`` cannot be trained here: its weights are quantized (bitsandbytes,
    GPTQ, AWQ, fp8...). None when they are not. The training step updates full-precision weights (all, or LoRA
    adapters beside them). bitsandbytes' 4-bit layers failed the first step, GPTQ and AWQ needed packages no
    profile installs, and fp8 was dequantized on the CPU and exported without saying so."""
    quantization = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "quantized") if isinstance(quantization, dict) else "quantized"
    return (
        f"its weights are quantized ({method}, config.json's quantization_config): coati-kto trains "
        "full-precision weights (all of them, or LoRA adapters beside them); give the unquantized model"
    )


def layer_windows(config: Any) -> list[int | None] | None:
    """Each layer's sliding window (None: full causal) as transformers 5 applies it, or None when some layer's
    attention type is neither full nor sliding (chunked, linear...: no 4D mask reproduces it).

    Transformers 5 decides per layer from ``config.layer_types`` (``sliding_attention`` uses
    ``config.sliding_window``), so a Qwen2 config with ``use_sliding_window: false`` keeps a ``sliding_window``
    value it never applies; configs without ``layer_types`` (Mistral) apply ``sliding_window`` to every layer.
    """
    window = getattr(config, "sliding_window", None)
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if not types:
        return [window]
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        return None
    return [window if t == "sliding_attention" else None for t in types]


def packed_masks(config: Any) -> dict[str, int | None] | None:
    """The windows of the 4D masks one packed forward needs: ``{"": window}`` where every layer attends with
    the same window (one mask), ``{layer type: window}`` where layers mix windows and the family takes a mapping
    (:data:`MASK_MAPPING_FAMILIES`); None where no set of 4D masks reproduces the layers (chunked or linear
    attention, or mixed windows in a family that takes one mask) or for a vision-language model (its top config
    holds no windows: it builds its own masks from the 2D one)."""
    windows = None if vision_language(config) else layer_windows(config)
    if windows is None:
        return None
    if len(set(windows)) == 1:
        return {"": windows[0]}
    if getattr(config, "model_type", None) not in MASK_MAPPING_FAMILIES:
        return None
    return dict(zip(config.layer_types, windows, strict=True))


def packing_refusal(model_dirs: list[str], attention: str | None = None) -> str | None:
    """Why packed rows cannot run (None when they can, or when only loading the model would tell: a hub id):
    flash_attention_2 (no 4D mask), a family whose head is outside :data:`HEAD_FAMILIES`, or layers whose
    windows no 4D masks reproduce. Tensor parallelism packs too (through the model's logits)."""
    if attention == "flash_attention_2":
        return "model.attn_implementation flash_attention_2 (use sdpa or flex_attention)"
    for model_dir in model_dirs:
        if not (Path(model_dir) / "config.json").is_file():
            continue
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        if not plain_head(config):
            covered = sorted(HEAD_FAMILIES | {"gemma3_text"})
            return f"model_type {config.model_type} at {model_dir} (the chunked LM head covers {covered})"
        if packed_masks(config) is None:
            return f"the model at {model_dir} (no 4D masks reproduce its layers' attention {layer_windows(config)})"
    return None


def eager_attention_reason(model_dir: str) -> str | None:
    """Why ``model_dir``'s attention must run eager (None when any kernel computes it): attention-logit
    soft-capping (Gemma 2; Gemma 3 when set) is applied by transformers' eager kernel only, and sdpa / flash
    attention skip it without an error. Read from config.json alone; None when there is none."""
    raw = _config_json(model_dir)
    if raw is None:
        return None
    softcap = raw.get("attn_logit_softcapping", (raw.get("text_config") or {}).get("attn_logit_softcapping"))
    if softcap is None:
        return None
    return f"its attention soft-capping (attn_logit_softcapping {softcap}) runs in the eager kernel only"


def model_notes(
    model_dir: str, router_aux_loss_coef: float | str = "auto", train_vision: bool = False
) -> list[str]:
    """One line each for what training does with ``model_dir``'s config that the user may not expect (read from
    config.json alone): whether an MoE's router load-balancing loss joins the KTO loss
    (:func:`router_aux_note`), and a vision-language checkpoint (:func:`vision_language`: its language model
    trained, its vision tower frozen unless ``train_vision``)."""
    raw, notes = _config_json(model_dir), []
    if raw is None:
        return notes
    notes += [note for note in [router_aux_note(model_dir, router_aux_loss_coef)] if note]
    if raw.get("vision_config") is not None and raw.get("text_config") is not None:
        name = f"note: {model_dir} is a vision-language model ({raw.get('model_type')})"
        notes.append(
            f"{name}: trained: its language model and the vision tower and projector (model.train_vision), on "
            "text and image records"
            if train_vision
            else f"{name}: KTO trains its language model (on text and image records); the vision tower and "
            "projector stay frozen (no gradient, no optimizer state) and are exported unchanged"
        )
    return notes


# transformers' Switch load-balancing loss: Mixtral's ``load_balancing_loss_func``, copied into ~30 MoE families.
SWITCH_LOSS_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


def switch_aux_loss(module_name: str) -> bool:
    """Whether the transformers modeling module ``module_name`` holds the Switch load-balancing loss its MoE
    causal LM adds when its config asks for router logits (``load_balancing_loss_func`` with Mixtral's
    arguments: Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen 3.5-MoE, OLMoE, GPT-OSS, PhiMoE, GraniteMoE, Jamba, ...).
    False for families without one (DeepSeek-V3 and GLM-4-MoE balance with a bias; Llama 4) or with another
    (Doge)."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    function = getattr(module, "load_balancing_loss_func", None)
    return function is not None and tuple(inspect.signature(function).parameters) == SWITCH_LOSS_PARAMETERS


def router_aux_note(model_dir: str, setting: float | str) -> str | None:
    """The line saying whether ``model_dir``'s router load-balancing loss joins the KTO loss under
    ``kto.router_aux_loss_coef`` = ``setting`` (None for a dense model, or one config.json cannot tell)."""
    raw, name = _config_json(model_dir) or {}, model_class_name(model_dir)
    text = {**raw, **(raw.get("text_config") or {})}
    if name is None or "output_router_logits" not in text or not switch_aux_loss(name.rsplit(".", 1)[0]):
        return None
    if setting == "auto" and text.get("output_router_logits"):
        coefficient = text.get("router_aux_loss_coef", text.get("aux_loss_coef", "its coefficient"))
        return (
            f"note: {model_dir} sets output_router_logits: its router load-balancing loss x {coefficient} "
            "(router_aux_loss_coef) joins the KTO loss (train/aux_loss; kto.router_aux_loss_coef=0 turns it off)"
        )
    if setting == "auto" or float(setting) == 0:
        return (
            f"note: {model_dir} is an MoE whose router load-balancing loss is not added ("
            + (
                "kto.router_aux_loss_coef 0"
                if setting != "auto"
                else "its config sets no output_router_logits"
            )
            + "); kto.router_aux_loss_coef=<weight> adds it"
        )
    return (
        f"note: {model_dir}: the router load-balancing loss x {setting} joins the KTO loss (train/aux_loss)"
    )


def router_aux_problem(model_dir: str, setting: float | str) -> str | None:
    """Why ``kto.router_aux_loss_coef`` = ``setting`` (a number > 0) cannot apply to ``model_dir``: its family has
    no Switch load-balancing loss (:func:`switch_aux_loss`). From config.json alone; None when it applies, is
    ``auto`` or 0, or config.json cannot tell (checked when the model is built)."""
    name = model_class_name(model_dir)
    if setting == "auto" or float(setting) == 0 or name is None or switch_aux_loss(name.rsplit(".", 1)[0]):
        return None
    return (
        f"kto.router_aux_loss_coef {setting}: {name.rsplit('.', 1)[-1]} ({model_dir}) has no router "
        "load-balancing loss in transformers (set it to auto or 0)"
    )


def vocabulary_size(*model_dirs: str | None) -> int | None:
    """The fewest token embedding rows of ``model_dirs`` (None entries skipped) from their config.json; None when
    none of them tells (a hub id)."""
    sizes = []
    for model_dir in filter(None, model_dirs):
        raw = _config_json(model_dir) or {}
        vocab = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
        if isinstance(vocab, int):
            sizes.append(vocab)
    return min(sizes, default=None)


def vocabulary_problem(model_dir: str, max_token_id: int) -> str | None:
    """Why ``model_dir`` cannot read token id ``max_token_id`` (None when it can, or when config.json does not
    tell): an id past the embedding rows is an index error on CPU and a device-side assert on a GPU."""
    vocab = vocabulary_size(model_dir)
    if vocab is None or max_token_id < vocab:
        return None
    return (
        f"{model_dir} has {vocab} token embeddings, but the prepared data holds token id {max_token_id}: the "
        "tokenizer has tokens the model cannot embed (resize its embeddings to the tokenizer with "
        "model.resize_token_embeddings(len(tokenizer)) and save it, or use the model's own tokenizer)"
    )


def positions_problem(model_dir: str, longest: int) -> str | None:
    """Why ``model_dir`` cannot take rows of ``longest`` tokens (None when it can, or config.json does not tell):
    a learned position table (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``: no rotary or ALiBi
    keys in the config) has no row for a later position, an index error on CPU and a device-side assert on a
    GPU. Rotary models run past their trained length; that is the user's call."""
    raw = _config_json(model_dir)
    if raw is None:
        return None
    raw = {**raw, **(raw.get("text_config") or {})}
    table = raw.get("n_positions", raw.get("max_position_embeddings"))
    relative = any("rope" in key or "rotary" in key or "alibi" in key for key in raw)
    if relative or not isinstance(table, int) or longest <= table:
        return None
    return (
        f"{model_dir} has {table} learned positions, but the prepared rows reach {longest} tokens: set "
        f"data.max_length to at most {table}"
    )
