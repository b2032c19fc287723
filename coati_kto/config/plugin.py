"""The ``plugin`` section of the config: the ColossalAI booster plugin and its parallel sizes, with what each
combination cannot train refused at load (sequence parallelism: ``coati_kto.config.sequence``, pipeline
parallelism: ``coati_kto.config.pipeline``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from coati_kto.config.pipeline import pipeline_plugin_problems, pipeline_zero_stage
from coati_kto.config.section import Section as _Section
from coati_kto.config.sequence import sequence_plugin_problems

# The enumerations other layers share (the plan): one list each, here (the loss types: coati_kto.config.kto).
PluginName = Literal["hybrid_parallel", "low_level_zero", "gemini", "ddp"]
# Why plugin.name gemini is refused (here at load, and by coati_kto.parallel.backends.gemini for a plugin built by hand).
GEMINI_REFUSAL = (
    "plugin.name gemini is not supported: it needs CUDA and is unverified here (the no-grad policy forward before "
    "the first backward trips GeminiDDP's placement assertion, and gradient accumulation needs "
    "enable_gradient_accumulation); use hybrid_parallel with zero_stage 2, or low_level_zero"
)
Precision = Literal["fp32", "bf16", "fp16"]
# ColossalAI's sequence-parallel modes (HybridParallelPlugin's ``sequence_parallelism_mode``).
SequenceMode = Literal["all_to_all", "split_gather", "ring", "ring_attn"]
# ColossalAI's pipeline schedules (HybridParallelPlugin's ``pp_style``; zbv needs scheduler nodes, not offered).
PipelineStyle = Literal["1f1b", "interleaved"]


class PluginSection(_Section):
    """Checked here, at config load, so a run never starts on a combination that cannot train.

    Unset keys follow the ones that are set: ``precision`` is fp32 for ddp and bf16 otherwise; ``zero_stage``
    is 0 for ddp, 0 for hybrid_parallel in fp32 (its ZeRO needs bf16/fp16), 1 for hybrid_parallel with
    ``pp_size`` > 1 (ColossalAI's pipeline takes ZeRO 0 or 1 only) and 2 otherwise.
    """

    name: PluginName = Field(
        "hybrid_parallel",
        description="ColossalAI booster plugin (gemini is refused until verified on a GPU).",
    )
    zero_stage: Literal[0, 1, 2] = Field(
        2,
        description="ZeRO stage: 1 shards optimizer states, 2 also gradients. Default: 0 for ddp and fp32 "
        "hybrid_parallel, 1 with pp_size > 1, else 2.",
    )
    precision: Precision = Field("bf16", description="Training precision. Default: fp32 for ddp, else bf16.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree (hybrid_parallel only).")
    sp_size: int = Field(
        1,
        ge=1,
        description="Sequence-parallel degree (hybrid_parallel only): each of sp_size ranks runs 1/sp_size of "
        "every row's tokens through the decoder (docs/sequence_parallelism.md).",
    )
    sp_mode: SequenceMode | None = Field(
        None,
        description="Sequence-parallel mode, ColossalAI's names; default all_to_all when sp_size > 1 (the one "
        "admitted: split_gather, ring and ring_attn are refused with their reasons).",
    )
    pp_size: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree (hybrid_parallel only): the decoder layers split into pp_size "
        "stages, one per rank, each step's train.accumulation_steps micro-batches flowing through them "
        "(docs/pipeline_parallelism.md).",
    )
    pp_style: PipelineStyle = Field(
        "1f1b",
        description="Pipeline schedule, ColossalAI's names: 1f1b (one chunk of layers per stage) or interleaved "
        "(num_model_chunks chunks per stage: a smaller bubble, more transfers).",
    )
    num_model_chunks: int = Field(
        1,
        ge=1,
        description="Chunks of layers each pipeline stage holds: 1 for 1f1b, >= 2 for interleaved.",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep ZeRO's fp32 masters and optimizer states in host memory: needs ZeRO (zero_stage 1 or 2 "
        "on low_level_zero, or on hybrid_parallel in bf16 or fp16).",
    )

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _no_boolean_stage(cls, value: Any) -> Any:
        """pydantic reads true as 1 for a Literal of ints (the section's bool guard covers int and float fields)."""
        if isinstance(value, bool):
            raise ValueError("must be 0, 1 or 2, not a boolean")
        return value

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_name(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("name", "hybrid_parallel")
        data = dict(data)
        data.setdefault("precision", "fp32" if name == "ddp" else "bf16")
        if "zero_stage" not in data:
            no_zero = name == "ddp" or (name == "hybrid_parallel" and data["precision"] == "fp32")
            pipelined = pipeline_zero_stage(data)  # ColossalAI's pp takes ZeRO 0 or 1 only
            data["zero_stage"] = 0 if no_zero else 2 if pipelined is None else pipelined
        return data

    def _problems(self) -> list[str]:
        problems = []  # every one at once, a line each
        if self.name == "gemini":
            problems.append(GEMINI_REFUSAL)
        if self.name == "hybrid_parallel" and self.zero_stage >= 1 and self.precision == "fp32":
            problems.append(
                f"plugin.name hybrid_parallel with plugin.zero_stage {self.zero_stage} needs "
                "plugin.precision bf16 or fp16: set plugin.precision=bf16, or plugin.zero_stage=0 for fp32"
            )
        if self.tp_size > 1 and self.name != "hybrid_parallel":
            problems.append(f"plugin.tp_size {self.tp_size} needs hybrid_parallel, not {self.name}")
        if self.name == "ddp" and self.zero_stage != 0:
            problems.append("plugin.name ddp has no ZeRO: set plugin.zero_stage=0 (or use low_level_zero)")
        if self.name == "ddp" and self.precision != "fp32":
            problems.append(
                f"plugin.name ddp trains in fp32 here (got plugin.precision {self.precision}): set "
                "plugin.precision=fp32, or use low_level_zero / hybrid_parallel for bf16"
            )
        if self.name == "low_level_zero" and self.zero_stage == 0:
            problems.append("plugin.name low_level_zero needs plugin.zero_stage 1 or 2")
        problems += sequence_plugin_problems(self.name, self.tp_size, self.sp_size, self.sp_mode)
        return problems + self._offload_problems() + pipeline_plugin_problems(self)

    def _offload_problems(self) -> list[str]:
        """``cpu_offload`` at ZeRO stage 0: offload is ZeRO's (its optimizer keeps the masters and moments in host
        memory), so without ZeRO nothing moved and the key did nothing, in silence."""
        if not self.cpu_offload or self.zero_stage != 0 or self.name == "gemini":
            return []
        if self.name == "ddp":
            why, fix = "plugin.name ddp has none", "or use low_level_zero"
        elif self.precision == "fp32":
            why, fix = "hybrid_parallel in fp32 runs ZeRO 0", "or set plugin.precision=bf16"
        else:
            why, fix = "plugin.zero_stage is 0", "or set plugin.zero_stage=1"
        return [
            "plugin.cpu_offload needs ZeRO (plugin.zero_stage 1 or 2 on low_level_zero, or on hybrid_parallel in "
            f"bf16 or fp16), and {why}: set plugin.cpu_offload=false, {fix}"
        ]
