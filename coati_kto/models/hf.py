"""Loading Hugging Face causal LMs: the policy, and the reference where no plugin runs it.

Every model the project trains or scores is built here, so a load option (attention implementation, remote
code, dtype, fused norms) is decided once. May import: config, errors, parallel.fp32_kept, models.compile and
models.norms (and transformers / colossalai).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coati_kto.config.hub import local_snapshot
from coati_kto.config.schema import ModelSection
from coati_kto.errors import ConfigError
from coati_kto.families import auto_model_class, eager_attention_reason, quantized_refusal
from coati_kto.models.compile import wants_compile
from coati_kto.models.last_mlp import skip_unread_mlp
from coati_kto.models.norms import fuse_rms_norms
from coati_kto.models.rotary import fuse_rotary
from coati_kto.parallel.fp32_kept import meta_rebuild_key, round_trainable
from coati_kto.parallel.model_shape import tower_ids


def attention_implementation(path: str, model_cfg: ModelSection) -> tuple[str | None, str | None]:
    """(the attention kernel to load ``path`` with, a one-line note when it was chosen here rather than by the
    user). ``model.attn_implementation`` unset means transformers' default (sdpa), except for models whose
    attention only the eager kernel computes exactly (:func:`coati_kto.families.eager_attention_reason`)."""
    if model_cfg.attn_implementation is not None:
        return model_cfg.attn_implementation, None
    reason = eager_attention_reason(path)
    if reason is None:
        return None, None
    return "eager", f"model.attn_implementation: eager for {path} ({reason}; sdpa would skip it silently)"


def load_causal_lm(path: str, model_cfg: ModelSection, dtype: torch.dtype) -> torch.nn.Module:
    """A Hugging Face causal LM (a vision-language model whole: :func:`auto_model_class`). Dropout is switched off on the modules by KTOTrainer, not in the config, so
    the exported model keeps the user's config."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    # transformers 5 draws a "Loading weights" bar on stderr for every load on every rank (policy, reference):
    # noise between the run's own lines, and in front of a one-line refusal.
    hf_logging.disable_progress_bar()
    if (
        model_cfg.attn_implementation == "flash_attention_2"
        and importlib.util.find_spec("flash_attn") is None
    ):
        # transformers raises a multi-line ImportError only after reading the config; say it in one line.
        raise ConfigError(
            "model.attn_implementation flash_attention_2 needs the flash-attn package, which is not installed: "
            "pip install flash-attn --no-build-isolation, or set model.attn_implementation=sdpa"
        )
    attention, _ = attention_implementation(path, model_cfg)
    extra = {"attn_implementation": attention} if attention else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    if (why := quantized_refusal(config.to_dict())) is not None:  # a Hub id the config load could not read
        raise ConfigError(f"{path}: {why}")
    model = auto_model_class(config).from_pretrained(
        path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code, **extra
    )
    _restore_frozen(model)
    # Compiled layers fuse these ops already (and would break their graph at the last MLP's context variable).
    if not wants_compile(model_cfg.compile):
        if model_cfg.fused_norms:
            fuse_rms_norms(model)
        if model_cfg.fused_rotary:
            fuse_rotary(model)
        if model_cfg.skip_unread_mlp:
            skip_unread_mlp(model)
    return model


def _restore_frozen(model: torch.nn.Module) -> None:
    """Give back ``requires_grad=False`` to the parameters the model's own constructor freezes (Ernie-4.5-MoE's
    ``moe_statics.e_score_correction_bias``, AFMoE's ``expert_bias``): transformers 5's loader re-wraps every
    loaded tensor as ``nn.Parameter(requires_grad=is_floating_point())`` (core_model_loading.py), so they became
    trainable parameters that never get a gradient (DDP raises at the next step; an optimizer would own them)."""
    frozen = _constructor_frozen(model)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


# Per process, keyed by meta_rebuild_key: the policy's and the reference's loads share one rebuild.
_FROZEN_BY_CONSTRUCTOR: dict[tuple[type, str], frozenset[str]] = {}


def _constructor_frozen(model: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters ``type(model)(model.config)`` makes with ``requires_grad=False`` (built on the
    meta device once per class and config in a process; empty for a class that cannot be rebuilt from its config)."""
    key = meta_rebuild_key(model)
    if key in _FROZEN_BY_CONSTRUCTOR:
        return _FROZEN_BY_CONSTRUCTOR[key]
    try:
        with torch.device("meta"):
            fresh = type(model)(model.config)
    except Exception:  # a class that cannot be rebuilt from its config alone keeps the loader's flags
        return frozenset()
    frozen = frozenset(name for name, param in fresh.named_parameters() if not param.requires_grad)
    if key is not None:
        _FROZEN_BY_CONSTRUCTOR[key] = frozen
    return frozen


def freeze_vision_tower(model: torch.nn.Module, keep_fp32: bool = False) -> dict[str, torch.Tensor]:
    """Freeze what a vision-language model's text passes never reach (``coati_kto.families.vision_language``: the
    vision tower and projector of Gemma 3 4B-27B), so it takes no optimizer state (ZeRO saves none for a
    parameter without a gradient; DDP waits for gradients of every trainable one) and is exported unchanged.

    Returns, with ``keep_fp32``, a CPU fp32 copy of each frozen parameter by name, taken before a plugin casts
    it (an fp32 export has no optimizer master to take them from); else {}. A text-only model: nothing, {}."""
    tower = tower_ids(model)  # the plan counts the same parameters (coati_kto.parallel.model_shape)
    frozen = {n: p for n, p in model.named_parameters() if id(p) in tower}
    for p in frozen.values():
        p.requires_grad_(False)
    return {n: p.detach().float().cpu().clone() for n, p in frozen.items()} if keep_fp32 else {}


def load_reference(model_cfg: ModelSection, dtype: torch.dtype) -> torch.nn.Module:
    """The reference model (``model.reference_path``, default ``model.path``) in ``dtype`` on the device, eval,
    frozen: its log-probs equal those of the reference ``train`` builds through the plugin
    (``ParallelBackend.build_reference`` keeps in fp32 what ``from_pretrained`` in the training dtype keeps, except
    trainable parameters, rounded here as the policy trains them: ``coati_kto.parallel.fp32_kept``). Used where no
    plugin runs the reference (precomputing the reference cache)."""
    from colossalai.accelerator import (
        get_accelerator,  # colossalai costs 3-4 s to import: callers that need it
    )

    model = load_causal_lm(model_cfg.reference_path or model_cfg.path, model_cfg, dtype)
    # Trained in full, the policy runs the routers transformers keeps in fp32 in ``dtype`` (fp32_kept): so must this.
    if model_cfg.lora is None:
        round_trainable(model, dtype)
    return model.to(get_accelerator().get_current_device()).eval().requires_grad_(False)


# Float attributes that transformers' modules read in forward as dropout probabilities: any name holding "dropout"
# (attention_dropout, residual_dropout and embedding_dropout of Starcoder2 and Seed-OSS, MPT's attn_dropout_p) or
# ending in "pdrop" (DBRX's resid_pdrop, GPT-2's attn_pdrop). MoE router jitter (Mixtral's jitter_noise, PhiMoE's
# router/input jitter, DBRX's moe_jitter_eps) is noise in training mode like dropout: it would make the policy
# differ from the reference at step 0.
_JITTER_ATTRS = frozenset({"jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps"})


def _is_dropout(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop") or name in _JITTER_ATTRS


def disable_dropout(module: nn.Module) -> None:
    """Set every dropout probability of ``module`` to 0 (nn.Dropout layers and float attributes read in forward)."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for name, value in list(vars(sub).items()):
            if isinstance(value, float) and _is_dropout(name):
                setattr(sub, name, 0.0)


def without_dropout(policy: nn.Module, reference: Any) -> None:
    """No dropout anywhere (the log-ratios compare two models), the reference frozen in eval mode. A LoRA run's
    reference is the policy with its adapters off (coati_kto.models.lora): not an nn.Module, not frozen here."""
    disable_dropout(policy)  # LoRA's dropout layers too
    if isinstance(reference, nn.Module):
        disable_dropout(reference)
        reference.eval()
        reference.requires_grad_(False)


# A processor's own files beside the tokenizer's (transformers 5.24): AutoProcessor.from_pretrained reads them.
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_processor_files(source: str | Path, config: Any, out: Path) -> list[str]:
    """A vision-language model's processor files from its checkpoint ``source`` (``model.path``: a folder, or a
    Hub id read from the hub cache) into ``out``, unchanged (training does not change them), where ``out`` holds
    none of that name yet (the tokenizer writes its own template): AutoProcessor reloads the export. Returns the
    names copied."""
    from coati_kto.families import vision_language

    if not vision_language(config):
        return []
    folder = local_snapshot(source)
    if folder is None:
        return []
    copied = [name for name in PROCESSOR_FILES if (folder / name).is_file() and not (out / name).exists()]
    for name in copied:
        shutil.copyfile(folder / name, out / name)
    return copied


def stored_dtype_everywhere(path: Path, dtype: str | None = None) -> None:
    """``path`` (a config.json) with ``dtype`` (default: its top-level dtype, what save_pretrained wrote) in
    every sub-config that names one too: a model loaded in fp32 and cast before saving kept "float32" in
    ``text_config``/``vision_config``, and tools that read the text config's dtype (vLLM's ``dtype=auto``) loaded
    bf16 weights as fp32."""
    config = json.loads(path.read_text())
    top = "dtype" if "dtype" in config else "torch_dtype"
    dtype = dtype or config.get(top)
    if dtype is None:
        return

    def fix(node: dict[str, Any]) -> None:
        for key in ("dtype", "torch_dtype"):
            if node.get(key) is not None:
                node[key] = dtype
        for value in node.values():
            if isinstance(value, dict) and (
                "dtype" in value or "torch_dtype" in value or "model_type" in value
            ):
                fix(value)

    before = json.dumps(config, sort_keys=True)
    config[top] = dtype
    fix(config)
    if json.dumps(config, sort_keys=True) != before:
        # a plain write: the export's folder is a staging one, synced and renamed in whole (write_final)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
