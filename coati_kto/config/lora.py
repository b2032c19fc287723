"""``model.lora`` (its schema section) and the ``peft.LoraConfig`` it stands for: one definition for the
preflight's check on the meta model (coati_kto.runtime.preflight) and the run's adapters (coati_kto.models.lora)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from coati_kto.config.section import Section
from coati_kto.families import vision_language

_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# The layer classes peft's LoRA adapts as modules (a list target naming anything else fails in peft).
PEFT_LAYERS = frozenset({"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention"})


class LoraSection(Section):
    """LoRA adapters (peft) on the policy; the reference is the same model with the adapters disabled."""

    rank: int = Field(8, ge=1, description="LoRA rank r of each adapter's A [r, in] and B [out, r] matrices.")
    alpha: float = Field(
        16.0, gt=0.0, description="LoRA scaling numerator: the update is (alpha / rank) B A."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Recorded in adapter_config.json; training runs it at 0 like all dropout (deterministic KTO).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(_DEFAULT_TARGETS),
        min_length=1,
        description="Module names (suffixes) that get adapters; not the LM head (lm_head) or embeddings. "
        "Unset on a vision-language model: these names in its language model only.",
    )

    @field_validator("target_modules")
    @classmethod
    def _not_the_head(cls, value: list[str]) -> list[str]:
        # The chunked LM head path reads the head's weight directly: an adapter there would be skipped.
        bad = [m for m in value if m in ("lm_head", "embed_tokens", "embed_out", "wte")]
        if bad:
            raise ValueError(f"{', '.join(bad)}: adapters on the embeddings or LM head are not supported")
        return value


def peft_config(section: LoraSection, model: Any = None) -> Any:
    """The ``peft.LoraConfig`` of a ``model.lora`` section (causal LM, no bias trained) for ``model``: with
    ``target_modules`` unset on a vision-language model, a regex over its language model's modules (the
    suffixes would also match the vision tower's attention, e.g. SigLIP's ``q_proj``)."""
    import peft  # the config layer imports no model library until asked

    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=peft_targets(section, model),
        bias="none",
    )


def peft_targets(section: LoraSection, model: Any = None) -> list[str] | str:
    """``section.target_modules`` as peft matches them (suffixes), or, where they are the default and ``model``
    is vision-language, one regex that peft matches in full: the same names under its decoder only."""
    targets = list(section.target_modules)
    decoder = _decoder_name(model)
    if decoder is None or not default_targets(section):
        return targets
    return rf".*{re.escape(decoder)}\..*\.({'|'.join(re.escape(t) for t in targets)})"


def tower_refusal(section: LoraSection, model: Any) -> str | None:
    """One line refusing the user's ``target_modules`` that match a module outside a vision-language model's
    decoder (its vision tower or projector: frozen, their features computed once without gradient); None when
    none does, the targets are the default, or ``model`` is text-only."""
    decoder = _decoder_name(model)
    if decoder is None or default_targets(section):
        return None
    hits: dict[str, str] = {}  # each target's first module outside the decoder
    for name, _ in model.named_modules():
        for t in section.target_modules:
            if (name == t or name.endswith("." + t)) and not name.startswith(decoder + "."):
                hits.setdefault(t, name)
    if not hits:
        return None
    where = ", ".join(f"{t} ({n})" for t, n in hits.items())
    return (
        f"model.lora.target_modules: {where} in the vision tower or projector of {type(model).__name__}, which "
        "stay frozen; name language-model modules only, or leave target_modules unset (its "
        f"{', '.join(_DEFAULT_TARGETS)} in the language model)"
    )


def default_targets(section: LoraSection) -> bool:
    """Whether ``target_modules`` is the default list, by value: a config saved and read back (a checkpoint's
    state, ``output.dir/config.yaml``) writes the default out, and must mean what the unset key meant."""
    return list(section.target_modules) == _DEFAULT_TARGETS


def target_matches(targets: list[str], model: Any) -> dict[str, list[tuple[str, Any]]]:
    """Each of ``targets`` with the modules of ``model`` it names as peft matches a list target: the module's
    name equal to it or ending with ``.`` and it."""
    modules = list(model.named_modules())
    return {t: [(n, m) for n, m in modules if n == t or n.endswith("." + t)] for t in targets}


def embedding_refusal(section: LoraSection, model: Any) -> str | None:
    """One line refusing the ``target_modules`` that name (as peft matches them) ``model``'s input or output
    embeddings or any ``nn.Embedding`` (``model.embed_tokens``, ``embed_tokens_per_layer``...): the chunked LM
    head reads the head's weight directly, and on a tied model the merged export came out wrong. None when none
    does."""
    inputs, outputs = _embeddings(model, "input"), _embeddings(model, "output")
    hits = []
    for target, found in target_matches(list(section.target_modules), model).items():
        roles = [(n, _embedding_role(m, inputs, outputs)) for n, m in found]
        hits += [f"{target} ({n}: {role})" for n, role in roles if role][:1]  # each target's first
    if not hits:
        return None
    return (
        f"model.lora.target_modules: {', '.join(hits)} of {type(model).__name__}: adapters on the embeddings or "
        f"LM head are not supported; name linear layers: {', '.join(linear_layer_names(model))}"
    )


def _embedding_role(module: Any, inputs: Any, outputs: Any) -> str | None:
    """What ``module`` is among the embeddings: the model's input embeddings, its LM head, another embedding."""
    import torch

    if module is inputs:
        return "the input embeddings"
    if module is outputs:
        return "the LM head"
    return "an embedding" if isinstance(module, torch.nn.Embedding) else None


def _embeddings(model: Any, which: str) -> Any:
    """``model.get_input_embeddings()`` (``which`` input) or ``get_output_embeddings()``; None where it has none."""
    try:
        return getattr(model, f"get_{which}_embeddings")()
    except (AttributeError, NotImplementedError):
        return None


def _decoder_name(model: Any) -> str | None:
    """The module name of a vision-language ``model``'s decoder (``model.language_model``); None otherwise."""
    if model is None or not vision_language(getattr(model, "config", None)):
        return None
    decoder = model.get_decoder()
    return next((n for n, m in model.named_modules() if m is decoder), None)


def is_linear(module: Any) -> bool:
    """A linear layer as peft adapts it: ``nn.Linear``, or GPT-2's ``Conv1D``."""
    import torch

    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def linear_layer_names(model: Any) -> list[str]:
    """The last name part of ``model``'s linear layers, sorted, the LM head left out: what a refusal of
    ``model.lora.target_modules`` offers instead."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m)} - {"lm_head"})
