"""The one config schema: a YAML file, checked by pydantic, with ``section.key=value`` overrides.

Every mistake is reported at once, one line each, naming the file and the key; unknown keys are
errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coati_kto.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    path: str = Field(description="Hugging Face model directory (or hub id on machines that reach the hub).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to model.path.")
    reference_path: str | None = Field(None, description="Reference model; defaults to model.path.")
    gradient_checkpointing: bool = False
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    trust_remote_code: bool = False


class DataSection(_Section):
    train_files: list[str] = Field(min_length=1)
    eval_files: list[str] = Field(default_factory=list)
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Held out of train when eval_files is empty."
    )
    prepared_dir: str
    max_length: int = Field(1024, ge=8)
    max_prompt_length: int = Field(512, ge=1)
    on_bad_record: Literal["error", "skip"] = "error"
    on_too_long: Literal["drop", "error"] = "drop"
    num_proc: int = Field(1, ge=1, description="Tokenization processes for `prepare`.")
    pad_to_multiple_of: int | None = Field(None, ge=1)
    group_by_length: bool = False

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataSection:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"data.max_prompt_length ({self.max_prompt_length}) must be smaller than data.max_length "
                f"({self.max_length}) to leave room for the completion"
            )
        return self


class KTOSection(_Section):
    beta: float = Field(0.1, gt=0.0)
    desirable_weight: float = Field(1.0, gt=0.0)
    undesirable_weight: float = Field(1.0, gt=0.0)
    auto_weights: bool = Field(False, description="Set the weights into the paper's [1, 4/3] guideline.")
    kl_scope: Literal["step", "micro_batch"] = "step"
    reference: Literal["online", "cached"] = Field(
        "online",
        description="online: the reference model scores each batch; cached: its log-probs are computed once "
        "(coati-kto precompute) and stored with the prepared data, and training never loads it.",
    )
    precompute_batch_size: int = Field(16, ge=1, description="Rows per reference forward when precomputing.")


class TrainSection(_Section):
    seed: int = 42
    micro_batch_size: int = Field(
        4, ge=2, description="Per rank; >= 2 so each micro-batch holds both labels."
    )
    eval_micro_batch_size: int | None = Field(None, ge=2)
    accumulation_steps: int = Field(1, ge=1)
    max_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    lr: float = Field(5e-7, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, ge=0.0, description="0 disables clipping.")
    eval_interval: int = Field(
        0, ge=0, description="Evaluate every N optimizer steps (0: at epoch ends only)."
    )
    resume: str | None = Field(
        None, description="'auto' (latest checkpoint in output.dir) or a checkpoint path."
    )
    on_nonfinite: Literal["stop", "skip"] = "stop"
    num_workers: int = Field(0, ge=0)
    log_interval: int = Field(1, ge=1)
    dist_timeout: float = Field(
        600.0, gt=0.0, description="Seconds a rank waits in a collective for a dead peer before failing."
    )
    peak_flops: float | None = Field(
        None,
        gt=0.0,
        description="Peak FLOP/s per device for train/mfu; default: a table of GPUs (bf16/fp16 only).",
    )


class PluginSection(_Section):
    name: Literal["hybrid_parallel", "low_level_zero", "gemini", "ddp"] = "hybrid_parallel"
    zero_stage: Literal[0, 1, 2] = 2
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    tp_size: int = Field(1, ge=1)
    cpu_offload: bool = False

    @model_validator(mode="after")
    def _combinations(self) -> PluginSection:
        if self.name == "hybrid_parallel" and self.zero_stage >= 1 and self.precision == "fp32":
            raise ValueError(
                f"plugin.name hybrid_parallel with plugin.zero_stage {self.zero_stage} needs "
                "plugin.precision bf16 or fp16: set plugin.precision=bf16, or plugin.zero_stage=0 for fp32"
            )
        if self.tp_size > 1 and self.name != "hybrid_parallel":
            raise ValueError(
                f"plugin.tp_size {self.tp_size} needs plugin.name hybrid_parallel (got {self.name})"
            )
        if self.name == "ddp" and self.zero_stage != 0:
            raise ValueError("plugin.name ddp has no ZeRO: set plugin.zero_stage=0 (or use low_level_zero)")
        if self.name == "low_level_zero" and self.zero_stage == 0:
            raise ValueError("plugin.name low_level_zero needs plugin.zero_stage 1 or 2")
        return self


class OutputSection(_Section):
    dir: str
    save_interval: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0: only at the end.")
    keep_last: int = Field(2, ge=1)
    save_final: bool = True


class LoggingSection(_Section):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "coati-kto"
    wandb_mode: Literal["online", "offline"] = "online"


class Config(_Section):
    model: ModelSection
    data: DataSection
    kto: KTOSection = Field(default_factory=KTOSection)
    train: TrainSection = Field(default_factory=TrainSection)
    plugin: PluginSection = Field(default_factory=PluginSection)
    output: OutputSection
    logging: LoggingSection = Field(default_factory=LoggingSection)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: cannot set {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["train.lr=1e-5", "data.train_files=[a.jsonl,b.jsonl]"]`` -> [(key, YAML-parsed value)]."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override {item!r}: value is not valid YAML ({err.__class__.__name__})"
            ) from None
        parsed.append((key.strip(), value))
    return parsed


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
    return "\n".join(lines)


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Read ``path``, apply ``overrides``, validate; raises ConfigError listing every problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        # The context mark (e.g. where an unclosed bracket opened) is nearer the mistake than the problem mark.
        mark = getattr(err, "context_mark", None) or getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value, f"{path} (override {key})")
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, str(path))) from None


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config (defaults filled in) next to the run's outputs. Call on one rank."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(config.to_yaml())
