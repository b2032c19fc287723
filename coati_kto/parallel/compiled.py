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
    """A function and its compiled twin; calls the compiled one (through ``REGION_HOOKS``). ``context``: "model"
    (a decoder layer), "head" (the LM head's chunks) or "optimizer" (the AdamW step). ``dynamic``: True for
    inputs whose shapes change between calls (a batch's rows and length run the same graph); False for the
    optimizer, whose tensors keep their shapes for a whole run (a static graph compiles in 40-60% of the time
    of a symbolic one); new float-tensor values never recompile either way."""

    def __init__(self, forward: Callable[..., Any], context: str = "model", dynamic: bool = True) -> None:
        self.eager, self.context = forward, context
        self.compiled = torch.compile(forward, dynamic=dynamic)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if REGION_HOOKS:
            return REGION_HOOKS[-1](self, args, kwargs)
        return self.compiled(*args, **kwargs)
