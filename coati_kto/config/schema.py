"""The one config schema: every section and key of the YAML file, its type, default and check (pydantic).

Unknown keys are errors (a typo must not silently fall back to a default); cross-key checks are model validators,
so every mistake is reported at once. Loading, overrides and error text: ``coati_kto.config.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, JsonValue, PrivateAttr, ValidationInfo, field_validator, model_validator

from coati_kto.config.attention import resolve_attention
from coati_kto.config.compile_check import compile_problems
from coati_kto.config.evaluation import EvalSection, sample_problems
from coati_kto.config.hub import is_hub_dataset, parse_hub_dataset
from coati_kto.config.kto import KTOSection
from coati_kto.config.limits import MAX_TOKENS, Text, Tokens, home_expanded, prepared_dir_overlap
from coati_kto.config.lora import LoraSection
from coati_kto.config.output import LoggingSection, OutputSection
from coati_kto.config.pipeline import pipeline_problems
from coati_kto.config.plugin import GEMINI_REFUSAL, PluginName, PluginSection, Precision  # noqa: F401
from coati_kto.config.section import Section as _Section
from coati_kto.config.section import bool_or_auto
from coati_kto.config.sequence import sequence_problems
from coati_kto.config.template_kwargs import template_kwargs_problems
from coati_kto.config.train import TrainSection
from coati_kto.errors import ConfigError
from coati_kto.families import packing_refusal, router_aux_problem, text_only_model
from coati_kto.families.splits import check_model_family

# GEMINI_REFUSAL, PluginName, Precision and TrainSection: re-exported for the layers that import them from the
# schema.


class ModelSection(_Section):
    path: Text = Field(description="Hugging Face model directory (or hub id on machines that reach the hub).")
    tokenizer: Text | None = Field(None, description="Tokenizer directory; defaults to model.path.")
    reference_path: Text | None = Field(None, description="Reference model; defaults to model.path.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward: less memory.")
    compile: bool | Literal["auto"] = Field(
        False,
        description="torch.compile each decoder layer and the LM head's chunks, policy and reference (auto: on "
        "CUDA only). Off by default: on the CPU the 7.4M fixture's step is 0.94x and compiling costs seconds to "
        "minutes (docs/performance.md).",
    )
    fused_norms: bool = Field(
        True,
        description="Llama-style RMSNorms (checked per class) as one kernel forward and one backward "
        "(torch's _fused_rms_norm) instead of 7-9 and about 20; off under model.compile (inductor fuses them).",
    )
    fused_rotary: bool = Field(
        True,
        description="Llama-style rotary embeddings (checked per family) as 4 kernels per tensor each way instead "
        "of 5 forward and about 10 backward; off under model.compile (inductor fuses them).",
    )
    skip_unread_mlp: bool = Field(
        True,
        description="In log-prob passes the last decoder layer's MLP runs only at the completion positions the "
        "LM head reads, not at prompt and padding positions nothing reads (families checked per type, dense "
        "MLPs); off under model.compile and activation checkpointing. Same log-probs, 5% fewer FLOPs on the "
        "step fixture.",
    )
    attn_implementation: Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "auto"] | None = (
        Field(
            None,
            description="Attention kernel passed to from_pretrained; None: the model's default. auto: on a GPU "
            "flex_attention with data.padding_free on (no pass builds a dense mask) where the model packs at tp_size "
            "1, else the default; decided at load (a note line says which).",
        )
    )
    trust_remote_code: bool = Field(
        False, description="Allow model/tokenizer code shipped with the checkpoint."
    )
    lora: LoraSection | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full fine-tuning)."
    )
    # Off: the tower's features are constants, computed once per micro-batch for every pass (issue 49).
    train_vision: bool = Field(
        False,
        description="A vision-language model: train its vision tower and projector too (the gradient pass "
        "recomputes the image features with a graph; the reference computes its own). False: they stay frozen.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _true_false_or_auto(cls, value: Any) -> bool | str:
        return bool_or_auto(value)


class DataSection(_Section):
    # accepts: the type `config --schema` shows (one path alone is taken as a list of one: _one_or_many)
    train_files: list[str] = Field(
        min_length=1,
        json_schema_extra={"accepts": "str | list[str]"},
        description="Feedback files or directories (JSONL, parquet, HF dataset dirs), or Hub datasets: "
        "hf://datasets/OWNER/NAME?config=C&split=S&revision=R (each part optional; load_dataset(OWNER/NAME, "
        "name=C, split=S, revision=R); split default train, revision main).",
    )
    eval_files: list[str] = Field(
        default_factory=list,
        json_schema_extra={"accepts": "str | list[str]"},
        description="Held-out feedback files for evaluation (Hub datasets: split default test).",
    )
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of train held out for evaluation when eval_files is empty."
    )
    prepared_dir: Text | None = Field(
        None,
        description="Where `prepare` writes the tokenized, KL-paired data and stats.json. Default: "
        "output.dir/prepared (a run with another output.dir never rebuilds this one's).",
    )
    max_length: Tokens = Field(
        1024, ge=8, description="Tokens per example (prompt + completion) after truncation."
    )
    max_prompt_length: Tokens = Field(
        512,
        ge=1,
        description="Prompt tokens kept when an example is too long. Default: half of data.max_length.",
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="A malformed record: stop with its file:line, or skip it and count it."
    )
    on_too_long: Literal["truncate", "skip", "error"] = Field(
        "truncate", description="An example over data.max_length: truncate it, skip it (counted) or stop."
    )
    chat_template_kwargs: dict[str, JsonValue] = Field(
        default_factory=dict, description="Chat template variables, e.g. {enable_thinking: false} (Qwen3)."
    )
    num_proc: int = Field(1, ge=1, description="Tokenization processes for `prepare`.")
    pad_to_multiple_of: Tokens | None = Field(
        None,
        ge=1,
        description="Pad the padded example and KL batches to a multiple of this; the KL continuation, the "
        "shared-prompt pairs (kto.pack_policy / pack_reference) and padding_free rows are not.",
    )
    group_by_length: bool = Field(False, description="Batch examples of similar length (less padding).")
    padding_free: bool = Field(
        False,
        description="Each pass runs the micro-batch's rows as one sequence, each row seeing only itself (no "
        "padding reaches the model); pair with flex_attention on GPUs. Any tp_size; not flash_attention_2.",
    )

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any, info: ValidationInfo) -> Any:
        value = [value] if isinstance(value, str) else value
        value = (
            [home_expanded(v) if isinstance(v, str) else v for v in value]
            if isinstance(value, list)
            else value
        )
        for item in (
            [v for v in value if isinstance(v, str) and is_hub_dataset(v)] if isinstance(value, list) else []
        ):
            try:  # a malformed one: its line, at config load (which names the key and the value)
                parse_hub_dataset(item, f"data.{info.field_name}")
            except ValueError as err:
                raise ValueError(str(err).removeprefix(f"data.{info.field_name}: {item}: ")) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _prompt_budget_from_max_length(cls, data: Any) -> Any:
        # An unset prompt budget follows max_length, so `max_length: 64` alone is a valid config.
        # max_length as pydantic reads an int (a quoted "256" from envsubst, 256.0), so the default is the same.
        unset = isinstance(data, dict) and "max_prompt_length" not in data
        max_length = _as_int(data.get("max_length")) if unset else None
        if max_length is not None:
            return {**data, "max_prompt_length": min(max(1, max_length // 2), MAX_TOKENS)}  # one error
        return data

    def _problems(self) -> list[str]:
        problems = template_kwargs_problems(self.chat_template_kwargs)  # apply_chat_template's own arguments
        if self.max_prompt_length >= self.max_length:
            problems.append(
                f"data.max_prompt_length ({self.max_prompt_length}) must be smaller than data.max_length "
                f"({self.max_length}) to leave room for the completion"
            )
        return problems


class Config(_Section):
    model: ModelSection
    data: DataSection
    kto: KTOSection = Field(default_factory=KTOSection)
    train: TrainSection = Field(default_factory=TrainSection)
    plugin: PluginSection = Field(default_factory=PluginSection)
    output: OutputSection | None = Field(None, description="Required by `train`; `prepare` needs none.")
    logging: LoggingSection = Field(default_factory=LoggingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    # model.attn_implementation auto: what it became on this device, and why (coati_kto.config.attention).
    _attention_note: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        self._resolve_attention()
        found = self._prepared_dir_problems() + self._family_problems() + self._padding_free_problems()
        found += self._export_problems() + self._attention_problems()
        problems = self.deferred_problems() + found + self._lora_problems() + sample_problems(self)
        problems += compile_problems(self)
        problems += sequence_problems(self) + pipeline_problems(self) + self._ignored_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _ignored_problems(self) -> list[str]:
        """Settings that another one would override in silence: one line per pair."""
        problems = []
        if self.data.eval_files and self.data.eval_fraction > 0:
            problems.append(
                f"data.eval_fraction {self.data.eval_fraction} with data.eval_files: the fraction is "
                "held out only when data.eval_files is empty; set one of them"
            )
        kto = self.kto
        weights = {"desirable_weight": kto.desirable_weight, "undesirable_weight": kto.undesirable_weight}
        if kto.auto_weights and any(value != 1.0 for value in weights.values()):
            given = ", ".join(f"kto.{key} {value:g}" for key, value in weights.items() if value != 1.0)
            problems.append(
                f"{given} with kto.auto_weights: the weights are computed from the data and yours would be "
                "ignored; set kto.auto_weights=false to use them, or leave them at 1"
            )
        return problems

    def _resolve_attention(self) -> None:
        """``model.attn_implementation: auto`` replaced by the kernel (and ``data.padding_free``) it becomes."""
        if self.model.attn_implementation != "auto":
            return
        import torch

        plugin = self.plugin
        cuda = torch.cuda.is_available()
        resolved = resolve_attention(
            self.model, self.data, plugin.tp_size, cuda, plugin.sp_size, plugin.pp_size
        )
        attention, padding_free, self._attention_note = resolved
        self.model.derive(attn_implementation=attention)
        self.data.derive(padding_free=padding_free)

    def _prepared_dir_problems(self) -> list[str]:
        """``data.prepared_dir`` unset: ``output.dir/prepared``, so runs told apart by their output.dir (overrides of
        one config) keep their prepared data apart; with no output.dir either, a problem."""
        if self.data.prepared_dir is not None:  # and not one inside the other: either would destroy the other
            return prepared_dir_overlap(self.data.prepared_dir, self.output.dir) if self.output else []
        if self.output is None:
            return [
                "data.prepared_dir: required key is missing (its default, output.dir/prepared, needs output.dir)"
            ]
        self.data.derive(prepared_dir=str(Path(self.output.dir) / "prepared"))
        return []

    def attention_note(self) -> str | None:
        """The line saying what ``model.attn_implementation: auto`` became here (None without auto)."""
        return self._attention_note

    def _family_problems(self) -> list[str]:
        out = [why for why in [router_aux_problem(self.model.path, self.kto.router_aux_loss_coef)] if why]
        if self.model.train_vision and text_only_model(self.model.path):
            out.append(
                f"model.train_vision: model.path {self.model.path} is a text-only model (no vision tower to train)"
            )
        for key in (
            "model.path",
            "model.reference_path",
        ):  # encoders; no tensor-parallel policy: no plugin.tp_size above 1
            try:
                if path := getattr(self.model, key.split(".")[1]):
                    check_model_family(path, key, self.plugin.tp_size)
            except ConfigError as err:
                out.append(str(err))
        return out

    def _padding_free_problems(self) -> list[str]:
        paths = [p for p in (self.model.path, self.model.reference_path) if p]
        why = packing_refusal(paths, self.model.attn_implementation) if self.data.padding_free else None
        return [] if why is None else [f"data.padding_free needs packed rows, which {why} cannot take"]

    def _attention_problems(self) -> list[str]:
        # transformers only warns at load; FlashAttention then raises at the first forward, the models loaded
        if self.model.attn_implementation == "flash_attention_2" and self.plugin.precision == "fp32":
            return [
                "model.attn_implementation flash_attention_2 with plugin.precision fp32: FlashAttention runs in "
                "bf16 and fp16 only (set plugin.precision=bf16, or model.attn_implementation=sdpa)"
            ]
        return []

    def _export_problems(self) -> list[str]:
        out, fp32 = [], self.output is not None and self.output.export_dtype == "fp32"
        if fp32 and self.model.lora is not None:
            out.append("output.export_dtype fp32 with model.lora: the adapters are exported as trained")
        if fp32 and self.plugin.tp_size > 1:
            out.append(
                f"output.export_dtype fp32 with plugin.tp_size {self.plugin.tp_size}: the fp32 masters are "
                "gathered for tensor-parallel size 1 only (export the training dtype, or train with tp_size 1)"
            )
        return out

    def _lora_problems(self) -> list[str]:
        if self.model.lora is None:
            merge = self.output is not None and self.output.merge_lora
            return ["output.merge_lora needs model.lora (there are no adapters to merge)"] if merge else []
        adapters = "model.train_vision with model.lora: the adapters are language-model-only"
        out = [adapters] if self.model.train_vision else []
        if self.plugin.name == "hybrid_parallel" and self.plugin.tp_size > 1:
            out.append(
                f"model.lora with plugin.tp_size {self.plugin.tp_size}: ColossalAI 0.5.0 enables LoRA under "
                "hybrid_parallel only with tp_size 1 (set plugin.tp_size=1, or use low_level_zero or ddp)"
            )
        if self.model.reference_path and self.kto.reference == "online":
            out.append(
                "model.reference_path with model.lora: the online reference is model.path with the adapters "
                "disabled (remove model.reference_path, or use kto.reference cached)"
            )
        return out

    def training_output(self) -> OutputSection:
        """The ``output`` section, which training needs (``prepare`` and ``inspect`` do not)."""
        if self.output is None:
            raise ConfigError("output.dir: required key is missing (train writes checkpoints and logs there)")
        return self.output

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _as_int(value: Any) -> int | None:
    """``value`` as pydantic's lax mode reads an int field (256, "256", 256.0); None where it would not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None
