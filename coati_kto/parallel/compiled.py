"""A ``torch.compile``'d region the kernel counter can see (``coati_kto.testing.compiled``): the model's decoder
layers and LM head chunks (``coati_kto.models.compile``) and the mixed-precision AdamW step
(``coati_kto.parallel.mixed_adamw``) are each one :class:`CompiledForward`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# The innermost hook wraps every compiled call: hook(region, args, kwargs) -> output. Testing code only (the
# kernel counter); empty in training.
REGION_HOOKS: list[Callable[[CompiledForward, tuple, dict], Any]] = []


class CompiledForward:
    """A function and its compiled twin (``torch.compile(dynamic=True)``: new shapes and new float-tensor values
    run the same graph); calls the compiled one (through ``REGION_HOOKS``). ``context``: "model" (a decoder
    layer), "head" (the LM head's chunks) or "optimizer" (the AdamW step)."""

    def __init__(self, forward: Callable[..., Any], context: str = "model") -> None:
        self.eager, self.context = forward, context
        self.compiled = torch.compile(forward, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if REGION_HOOKS:
            return REGION_HOOKS[-1](self, args, kwargs)
        return self.compiled(*args, **kwargs)
