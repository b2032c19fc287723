"""The ``train`` section: steps, batches, the optimizer and its schedule, evaluation timing, resume and waits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coati_kto.config.limits import Seconds, Seed, Text
from coati_kto.config.section import Section


def separates_no_decay(
    weight_decay: float, decay_norms_and_biases: bool, lora: bool = False, resumed_apart: bool = False
) -> bool:
    """Whether the optimizer holds biases and norm weights in a group of their own at weight decay 0. Under LoRA
    only the adapters train (no bias, no norm; model.train_vision is refused with it): one group. At weight decay
    0 either grouping trains the same, so a resume keeps its checkpoint's (``resumed_apart``: it held them
    apart): its optimizer state loads only into the grouping it was saved from."""
    if decay_norms_and_biases or lora:
        return False
    return weight_decay > 0 or resumed_apart


class TrainSection(Section):
    seed: Seed = Field(42, ge=0, description="Seed of weights' RNG, data order and KL pairing.")
    micro_batch_size: int = Field(
        4, ge=2, description="Per rank; >= 2 so each micro-batch holds both labels."
    )
    eval_micro_batch_size: int | None = Field(
        None, ge=1, description="Per rank, for evaluation (needs eval data); defaults to micro_batch_size."
    )
    accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step on each rank.")
    max_epochs: int = Field(1, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    lr: float = Field(5e-7, gt=0.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        description="AdamW's decoupled weight decay. Biases and norm weights are left out (a group of their own "
        "at 0), as transformers' Trainer and so TRL leave them, unless train.decay_norms_and_biases.",
    )
    decay_norms_and_biases: bool = Field(
        False,
        description="Decay biases and norm weights too, every parameter in one optimizer group (what coati-kto "
        "did before 2026-12-02: a checkpoint saved then resumes with it true).",
    )
    optimizer_state_dtype: Literal["fp32", "bf16"] = Field("fp32", description="dtype of AdamW's moments")
    fused_optimizer: bool = Field(False, description="bf16: AdamW and its two casts in one compiled pass.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup steps; step k of them uses lr * k / (warmup_steps + 1)."
    )
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="The decay after the warmup, to lr * min_lr_ratio (TRL's default is linear)."
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="The decay ends at lr * min_lr_ratio.")
    max_grad_norm: float = Field(
        1.0, ge=0.0, description="Clip the global gradient norm to this (0: no clipping)."
    )
    eval_interval: int = Field(
        0,
        ge=0,
        description="Evaluate every N optimizer steps (0: never between epochs); needs data.eval_files or "
        "data.eval_fraction.",
    )
    eval_at_start: bool = Field(
        True, description="Evaluate before the first update (step 0): the baseline of every eval/ curve."
    )
    eval_at_epoch_end: bool = Field(
        True, description="Evaluate after each epoch's last step (and the run's last step)."
    )
    resume: Text | None = Field(
        None, description="'auto' (latest checkpoint in output.dir) or a checkpoint path."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/inf loss or gradient norm (fp16: the loss scaler takes an overflowing gradient): stop "
        "before updating, or skip the step (counted).",
    )
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    log_interval: int = Field(
        1, ge=1, description="Write train/ metrics every N steps (exact over the interval)."
    )
    dist_timeout: Seconds = Field(
        600.0, gt=0.0, description="Seconds a rank waits in a collective for a dead peer before failing."
    )
    file_wait_timeout: Seconds = Field(
        7200.0,
        gt=0.0,
        description="Seconds the ranks wait for file work before failing: global rank 0 preparing the data or "
        "writing final/ or the reference cache (not bounded by train.dist_timeout).",
    )
    heartbeat_timeout: Seconds = Field(
        60.0,
        ge=0.0,
        description="Seconds without a heartbeat from a rank (gone process or node) before the job stops; 0: off.",
    )
    peak_flops: float | None = Field(
        None,
        gt=0.0,
        description="Peak FLOP/s per device for train/mfu; default: a table of GPUs (bf16/fp16 only).",
    )
