"""LoRA (``model.lora``): peft adapters on the policy, enabled through ColossalAI's ``booster.enable_lora``.

The reference is the policy itself with its adapters disabled (:class:`AdapterFreeReference`): no second copy of
the model in memory. B starts at zero, so at step 0 the policy and the reference are the same function and
every reward is exactly 0.

Supported by every backend at ``plugin.tp_size`` 1 (ColossalAI 0.5.0 asserts ``tp_size == 1`` where it enables
LoRA under tensor parallelism); the config check refuses the rest at load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from coati_kto.config.lora import (
    PEFT_LAYERS,
    embedding_refusal,
    linear_layer_names,
    peft_config,
    target_matches,
    tower_refusal,
)
from coati_kto.errors import ConfigError
from coati_kto.models.hf import copy_processor_files, stored_dtype_everywhere

if TYPE_CHECKING:
    from coati_kto.config.schema import LoraSection


def enable_lora(booster: Any, model: torch.nn.Module, section: LoraSection) -> torch.nn.Module:
    """The PeftModel of ``model`` (before boosting); only adapter parameters keep ``requires_grad``.

    Every rank calls with the same seed: A is drawn from the torch RNG, so every rank gets the same adapters.
    A vision-language model's adapters go in its language model only: ConfigError (one line) for a user target
    in its tower or projector, or naming an embedding or the LM head, or that peft refuses (matching nothing, or
    a module it cannot wrap): the preflight's checks, again for a model.path it could not build (a Hub id,
    remote code).
    """
    for refusal in (tower_refusal(section, model), embedding_refusal(section, model)):
        if refusal is not None:
            raise ConfigError(refusal)
    config = peft_config(section, model)
    # before peft wraps them in place (base_layer, default)
    linear = linear_layer_names(model)
    matches = target_matches(list(section.target_modules), model)
    try:
        policy = booster.enable_lora(model, lora_config=config)
    # peft's NoMatchingPeftModuleError is a ValueError, as is its "Target module ... is not supported"
    except ValueError as err:
        raise ConfigError(peft_refusal(err, matches, type(model).__name__, linear)) from None
    missing = unmatched_targets(section, config, peft_model(policy))
    if missing:  # peft refuses only when none matches; the preflight checks a local model.path only
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(missing)} match no module of {type(model).__name__}; its "
            f"linear layers: {', '.join(linear)}"
        )
    return policy


def peft_refusal(
    err: ValueError, matches: dict[str, list[tuple[str, Any]]], model: str, linear: list[str]
) -> str:
    """One line for peft's refusal ``err`` of the targets (``matches``: each with the modules it names, read
    before peft wrapped any) on the model class ``model`` whose linear layers are ``linear``, as the preflight
    words it: the targets that matched nothing, or the module types LoRA cannot wrap, or peft's first line."""
    from peft import NoMatchingPeftModuleError

    where = f"{model}; its linear layers: {', '.join(linear)}"
    missing = [t for t, hits in matches.items() if not hits]
    if isinstance(err, NoMatchingPeftModuleError):
        return f"model.lora.target_modules: {', '.join(missing or matches)} match no module of {where}"
    kinds = sorted({type(m).__name__ for hits in matches.values() for _, m in hits} - PEFT_LAYERS)
    if "is not supported" in str(err) and kinds:
        return f"model.lora.target_modules: peft cannot put adapters on {', '.join(kinds)} (not a linear layer) of {where}"
    first = str(err).strip().splitlines()[0].rstrip("(").strip() if str(err).strip() else type(err).__name__
    return f"model.lora: peft refuses it for {model}: {first}"


def unmatched_targets(section: LoraSection, config: Any, peft: Any) -> list[str]:
    """The user's (or default) ``target_modules`` that got no adapter in ``peft`` (the PeftModel ``config``
    built), in their order: peft fails only when none matches, so a Phi-3 (fused ``qkv_proj``) under the default
    q/k/v/o trained ``o_proj`` alone. Targets peft renamed itself (transformers 5's fused experts, adapted as
    parameters) and a vision-language model's default (a regex) are not checked."""
    if isinstance(config.target_modules, str) or peft is None:
        return []
    kept = set(config.target_modules or ())  # after peft's own renames: what it matched by module name
    adapted = peft.base_model.targeted_module_names
    return [
        t
        for t in section.target_modules
        if t in kept and not any(n == t or n.endswith("." + t) for n in adapted)
    ]


def peft_model(model: Any) -> Any:
    """The PeftModel inside a (boosted) model, or None when it has no adapters."""
    from peft import PeftModel

    inner = model.unwrap(unwrap_peft=False) if hasattr(model, "unwrap") else model
    return inner if isinstance(inner, PeftModel) else None


def base_module(model: Any) -> torch.nn.Module:
    """The Hugging Face model under any ColossalAI wrapper and PeftModel (adapter layers included).

    ColossalAI's ``unwrap()`` returns a ``PeftUnwrapMixin`` for a PeftModel (state-dict renaming only: no
    forward, no config), so callers that need the model itself come here.
    """
    peft = peft_model(model)
    if peft is not None:
        return peft.get_base_model()
    return model.unwrap() if hasattr(model, "unwrap") else model


class AdapterFreeReference:
    """The reference model of a LoRA run: the boosted policy called with its adapters disabled.

    Not an ``nn.Module`` on purpose: the trainer freezes and evals its reference, which must not touch the
    policy. Calls must run under ``torch.no_grad()`` (the trainer's reference passes do). The policy's dropout
    is already 0 (KTOTrainer), LoRA's included, so these forwards are deterministic.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.peft = peft_model(policy)
        if self.peft is None:
            raise ValueError("AdapterFreeReference needs a policy with LoRA adapters")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft.disable_adapter():
            return self.policy(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> Any:
        return self.policy.unwrap(unwrap_peft=unwrap_peft)


def lora_adapters(
    model: Any, gather: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor] | None:
    """What :func:`write_lora` writes of the adapters, where peft's own state is not the whole: under pipeline
    parallelism each stage holds its own layers' adapters, which ``gather`` (a collective: every rank calls)
    merges from every stage's; None otherwise. Adapters are replicated on every rank (ddp, ZeRO gathers its working
    parameters, LoRA runs at tp_size 1 only), so the main rank's copy is the model."""
    peft = peft_model(model)
    if hasattr(model, "_force_wait_all_gather"):
        model._force_wait_all_gather()  # ZeRO's overlapped all-gather: the working weights must be current
    if gather is None:
        return None
    return gather({k: v.detach().cpu() for k, v in peft.state_dict().items() if "lora_" in k})


def write_lora(
    model: Any, adapters: dict[str, torch.Tensor] | None, tokenizer: Any, out_dir: Path, merge: bool
) -> None:
    """The main rank only: the adapter directory ``out_dir/adapter`` (peft's ``save_pretrained``: adapter_config.json
    and adapter_model.safetensors, loads with ``PeftModel.from_pretrained(base, dir)``) and, with ``merge``,
    ``out_dir/merged``: the adapters folded into a copy of the base weights (loads with transformers alone).
    ``adapters``: :func:`lora_adapters`'s."""
    peft = peft_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    saving = {} if adapters is None else {"state_dict": adapters}
    peft.save_pretrained(out_dir / "adapter", safe_serialization=True, **saving)
    # peft's own card: a template of "[More Information Needed]" whose base_model is model.path, a local folder
    # where the run's card (final/README.md) leaves base_model out; pushed with final/, the Hub refuses it.
    (out_dir / "adapter" / "README.md").unlink(missing_ok=True)
    folders = [out_dir / "adapter"]
    if merge:
        _save_merged(peft, out_dir / "merged")
        folders.append(out_dir / "merged")
    base = peft.get_base_model()
    for (
        folder
    ) in folders:  # each reloads alone: a vision-language model's processor files beside the tokenizer's
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        copy_processor_files(getattr(base.config, "_name_or_path", ""), base.config, folder)


def _save_merged(peft: Any, out: Path) -> None:
    """base + (alpha / r) B A per adapted layer, on a CPU copy in the working dtype (the training model is left
    as it is: export may come before more training in tests, and the copy costs memory only at the end)."""
    cpu_copy(peft).merge_and_unload().save_pretrained(out, safe_serialization=True)
    stored_dtype_everywhere(out / "config.json")  # the sub-configs' too (a vision-language model's)


def cpu_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are new host tensors, each copied straight from
    its device: ``copy.deepcopy(module).cpu()`` first copied every weight on the GPU (twice the model there, at
    the end of a run). Ties are kept (one copy per tensor); ``module`` is left as it is."""
    import copy
    import itertools

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        host = tensor.detach().to("cpu", copy=True)
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(host, tensor.requires_grad) if is_parameter else host
    return copy.deepcopy(module, memo)
