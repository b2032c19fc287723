"""TRL's learning-rate schedule flags, which read each other: what each is here.

The schedule here is a linear warmup over ``train.warmup_steps``, then a decay (``train.lr_schedule``: cosine or
linear) to ``lr x train.min_lr_ratio`` (``coati_kto.trainer.schedule``): ``cosine`` is a floor of 0, ``linear`` the
linear decay to 0, ``constant_with_warmup`` a floor of 1.
transformers' ``constant`` has no warmup (a ``--warmup_steps`` given with it is ignored there), and
``cosine_with_min_lr`` takes its floor from ``--lr_scheduler_kwargs`` (``min_lr_rate``, or ``min_lr`` over
``--learning_rate``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from coati_kto.config.trl_argv import as_float

SCHEDULE = (
    "the schedule here: linear warmup over train.warmup_steps, then train.lr_schedule (cosine or linear) to "
    "lr x train.min_lr_ratio"
)
Translation = tuple[list[str], str]


def schedule_translation(
    name: str, value: str | None, flags: Sequence[tuple[str, str | None]]
) -> Translation | None:
    """What ``--name value`` means here among the other ``flags``, for ``lr_scheduler_type``, and for
    ``warmup_steps`` and ``lr_scheduler_kwargs`` where the schedule reads them; None for the rest."""
    given = dict(flags)
    kind, rate = given.get("lr_scheduler_type"), _floor(given)
    if name == "lr_scheduler_type":
        return _schedule_type(value, rate)
    if name == "warmup_steps" and kind == "constant" and (as_float(value) or 0) >= 1:
        return [], "is ignored, as transformers' constant schedule ignores it (train.warmup_steps=0 above)"
    if name == "lr_scheduler_kwargs" and kind == "cosine_with_min_lr" and rate is not None:
        return [], "is read into --lr_scheduler_type cosine_with_min_lr's train.min_lr_ratio"
    return None


def _schedule_type(value: str | None, rate: float | None) -> Translation:
    if value == "constant":
        overrides = ["train.min_lr_ratio=1.0", "train.warmup_steps=0"]
        return overrides, f"is {' '.join(overrides)} (transformers' constant has no warmup)"
    if value == "cosine_with_min_lr":
        if rate is None:
            return (
                [],
                "has no equivalent without its floor (--lr_scheduler_kwargs min_lr_rate, or min_lr with --learning_rate)",
            )
        overrides = ["train.lr_schedule=cosine", f"train.min_lr_ratio={rate:g}"]
        return overrides, f"is {' '.join(overrides)} ({SCHEDULE})"
    if value in (
        "linear",
        "cosine",
    ):  # the decay's shape named: the config's train.lr_schedule may be the other
        overrides = [f"train.lr_schedule={value}", "train.min_lr_ratio=0.0"]
        return overrides, f"is {' '.join(overrides)} ({SCHEDULE})"
    if value == "constant_with_warmup":  # a floor of 1: no decay, whatever its shape
        return ["train.min_lr_ratio=1.0"], f"is train.min_lr_ratio=1.0 ({SCHEDULE})"
    return [], f"has no equivalent ({SCHEDULE})"


def _floor(given: dict[str, Any]) -> float | None:
    """The floor ``--lr_scheduler_kwargs`` gives cosine_with_min_lr, as a ratio of the peak (None: none)."""
    try:
        extra = json.loads(given.get("lr_scheduler_kwargs") or "{}")
    except json.JSONDecodeError:
        return None
    if not isinstance(extra, dict) or not set(extra) <= {"min_lr_rate", "min_lr"}:
        return None
    rate, lr = extra.get("min_lr_rate"), as_float(given.get("learning_rate"))
    if rate is None and isinstance(extra.get("min_lr"), int | float) and lr:
        rate = extra["min_lr"] / lr
    return float(rate) if isinstance(rate, int | float) and 0 <= rate <= 1 else None
