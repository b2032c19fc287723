"""``model.lora`` (its schema section) and the ``peft.LoraConfig`` it stands for: one definition for the
preflight's check on the meta model (coati_kto.runtime.preflight) and the run's adapters (coati_kto.models.lora)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from coati_kto.config.section import Section


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
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Module names (suffixes) that get adapters; not the LM head (lm_head) or embeddings.",
    )

    @field_validator("target_modules")
    @classmethod
    def _not_the_head(cls, value: list[str]) -> list[str]:
        # The chunked LM head path reads the head's weight directly: an adapter there would be skipped.
        bad = [m for m in value if m in ("lm_head", "embed_tokens", "embed_out", "wte")]
        if bad:
            raise ValueError(f"{', '.join(bad)}: adapters on the embeddings or LM head are not supported")
        return value


def peft_config(section: LoraSection) -> Any:
    """The ``peft.LoraConfig`` of a ``model.lora`` section (causal LM, no bias trained)."""
    import peft  # the config layer imports no model library until asked

    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
    )
