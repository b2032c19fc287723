"""What stays fp32 when a plugin casts a model (loaded in fp32) to the working dtype (bf16 / fp16).

The rule is transformers' own: a tensor runs in fp32 where ``from_pretrained(dtype=...)`` keeps it in fp32, so the
policy, the reference (online, cached, or the policy with its adapters off) and the exported model reloaded in
that dtype compute the same numbers. ``from_pretrained`` keeps in fp32:

- what the class's constructor makes fp32 whatever the default dtype: rotary ``inv_freq`` (an explicit
  ``.float()``), but not Falcon-H1's ``mup_vector`` (built with ``torch.ones``, so bf16 under bf16: keeping it
  fp32 promoted Falcon-H1's Mamba projections to fp32, 2e-3 per token away from transformers' bf16 model);
- what matches ``_keep_in_fp32_modules_strict`` (bf16 and fp16) or ``_keep_in_fp32_modules`` (fp16 only), as a
  regular-expression search of the parameter's or persistent buffer's name: the MoE routers' ``gate.weight`` and
  ``e_score_correction_bias`` of DeepSeek-V3, GLM-4-MoE, Ernie-4.5-MoE.

Except trainable parameters: ZeRO's optimizer holds one dtype (LowLevelZeroOptimizer asserts it, its flat buckets
assume it), so a router trained in full runs in the working dtype, and so does its reference. Frozen ones (the
base model under LoRA, a parameter the class freezes, the whole online reference's, whose flags as loaded are
the policy's) keep fp32.
"""

from __future__ import annotations

import re

import torch
from torch import nn

Kept = list[tuple[nn.Module, str, torch.Tensor]]


def _transformers_model(module: nn.Module) -> nn.Module:
    """The transformers model inside ``module`` (a LoRA PeftModel's base model; the model itself otherwise)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def meta_rebuild_key(model: nn.Module) -> tuple[type, str] | None:
    """(class, config JSON): all a rebuild of ``type(model)(model.config)`` depends on, to key per-process caches
    of what such rebuilds find; None when the config does not serialize (rebuild each time)."""
    try:
        return type(model), model.config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - any config a class accepts; only its JSON form is asked for
        return None


# Per process, keyed by meta_rebuild_key and dtype: the policy's and the reference's loads share one rebuild.
_FP32_NAMES: dict[tuple[tuple[type, str], torch.dtype], frozenset[str] | None] = {}


def transformers_fp32_names(model: nn.Module, dtype: torch.dtype) -> set[str] | None:
    """The names (``named_parameters`` / ``named_buffers`` of the transformers model) of the floating tensors that
    ``from_pretrained(dtype=dtype)`` keeps in fp32; None when the class cannot be rebuilt from its config alone.
    Rebuilt on the meta device once per class, config and dtype in a process."""
    rebuild = meta_rebuild_key(model)
    if rebuild is None:
        return _fp32_names(model, dtype)
    key = (rebuild, dtype)
    if key not in _FP32_NAMES:
        names = _fp32_names(model, dtype)
        _FP32_NAMES[key] = frozenset(names) if names is not None else None
    names = _FP32_NAMES[key]
    return set(names) if names is not None else None


def _fp32_names(model: nn.Module, dtype: torch.dtype) -> set[str] | None:
    import copy

    from transformers.modeling_utils import local_torch_dtype

    # As from_pretrained: the dtype on the config and its sub-configs too (a vision-language model builds its
    # towers in their config's dtype), the class built under that default dtype.
    config = copy.deepcopy(model.config)
    for sub in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]:
        if sub is not None:
            sub.dtype = dtype
    try:
        with torch.device("meta"), local_torch_dtype(dtype):
            fresh = type(model)(config)
    except Exception:
        return None
    strict = list(getattr(fresh, "_keep_in_fp32_modules_strict", None) or ())
    loose = list(getattr(fresh, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else []
    keys = strict + loose
    pattern = re.compile("|".join(k.replace("*", ".*") for k in keys)) if keys else None
    saved = set(fresh.state_dict())  # parameters and persistent buffers: the loader applies the dtype plan
    names = set()
    for name, tensor in [*fresh.named_parameters(), *fresh.named_buffers()]:
        if not tensor.is_floating_point():
            continue
        if tensor.dtype == torch.float32 or (pattern and name in saved and pattern.search(name)):
            names.add(name)
    return names


def _fallback_fp32(model: nn.Module, name: str, owner: nn.Module, leaf: str) -> bool:
    """Where the class cannot be rebuilt: non-persistent buffers (rotary frequencies) and the strict keep list."""
    keep = set()
    for sub in model.modules():
        keep |= set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
    return leaf in owner._non_persistent_buffers_set or any(re.search(k, name) for k in keep)


def fp32_kept(module: nn.Module, dtype: torch.dtype) -> Kept:
    """(owner, name, fp32 copy) of every buffer, and every frozen parameter, of ``module`` (loaded in fp32, maybe a
    LoRA PeftModel) that runs in fp32 under ``dtype``; taken before the plugin casts, put back by ``restore``."""
    if dtype == torch.float32:
        return []
    model = _transformers_model(module)
    names = transformers_fp32_names(model, dtype)
    found = []
    for prefix, owner in model.named_modules():
        tensors = [*owner._buffers.items(), *((n, p) for n, p in owner._parameters.items() if p is not None)]
        for leaf, tensor in tensors:
            if tensor is None or not tensor.is_floating_point():
                continue
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                continue
            name = f"{prefix}.{leaf}".replace(".base_layer.", ".") if prefix else leaf
            if (names is not None and name in names) or (
                names is None and _fallback_fp32(model, name, owner, leaf)
            ):
                found.append((owner, leaf, tensor.detach().float().clone()))
    return found


def restore(kept: Kept) -> None:
    """Give the tensors ``fp32_kept`` found their fp32 values back after the cast (a parameter keeps its object,
    flags and shape: one a plugin re-shaped or replaced stays as the plugin left it)."""
    for owner, name, value in kept:
        if name in owner._buffers:
            owner._buffers[name] = value.to(owner._buffers[name].device)
            continue
        param = owner._parameters.get(name)
        if param is not None and param.shape == value.shape:
            param.data = value.to(param.device)


def round_trainable(model: nn.Module, dtype: torch.dtype) -> None:
    """Round to ``dtype`` the trainable parameters ``from_pretrained(dtype=dtype)`` left in fp32 (a router's
    ``gate.weight``): the policy trains them in ``dtype`` (``fp32_kept``), so a reference loaded by transformers
    for the policy (the reference cache) must score with them rounded as the policy's are."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype == torch.float32:
            param.data = param.data.to(dtype)
