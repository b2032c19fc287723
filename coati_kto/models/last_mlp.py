"""The last decoder layer's MLP only at the positions the LM head reads (``model.skip_unread_mlp``).

A log-prob pass reads the final hidden states of the completion positions only (``logits_to_keep`` and the
collator's planned targets, ``TokenView.planned``). Every earlier layer's output at a prompt position is read
by later layers (their keys and values), but the last layer's is not: past its attention (whose keys and
values it still computes for every position), its MLP at a prompt or padding position feeds only that
position's final hidden state, which nothing reads, and gets a zero gradient. So within a log-prob pass the
last layer's MLP runs on the read positions alone, gathered as [N, H] rows, and writes zeros elsewhere: on the
step's fixture (prompts about half of each row) that is 5.1% of a cached step's FLOPs (60.6 -> 57.5 GFLOP).

The log-probs are the same: a row's MLP output does not depend on the other rows (on this CPU the fp32 and
bf16 matmuls give the same bits for a row whatever the batch; summed weight gradients may round apart), and
policy and reference take the same path, so step-0 rewards stay exactly 0. Only where that is proven: the
families ``tests/unit/models/test_last_mlp.py`` checks (:data:`PROVEN_TYPES`), a dense MLP (nothing but
linear layers and parameter-free activations: no experts, no router, no token shift) called with the hidden
states alone, and no compiled layers (inductor would break its graph at the context variable). Activation
checkpointing recomputes the layer in backward, outside the pass: the MLP then runs whole, which autograd's
recompute check would refuse for a different path, so a checkpointed model runs it whole in the pass too.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Model types whose last MLP the test proves position-local to the final hidden states (their tiny twins:
# coati_kto.testing.tiny.FAMILIES).
PROVEN_TYPES = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "gemma4_text", "phi3", "olmo3",
        "smollm3", "qwen3_5_text",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ReadPositions:
    """The positions a pass reads: ``rows`` and ``cols`` (long [N], on the device) of the kept grid, the
    last ``keep`` of an input of ``shape`` (B, S). The last layer sees all S positions, or the kept ones
    alone where the model slices to ``logits_to_keep`` before its last layers (Gemma 4's key-value-sharing
    layers)."""

    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    keep: int

    def at(self, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) in a [B, ``width``] input: the whole sequence or the kept grid; None for another."""
        if width == self.keep:
            return self.rows, self.cols
        return (self.rows, self.cols + (width - self.keep)) if width == self.shape[1] else None


_READ: contextvars.ContextVar[ReadPositions | None] = contextvars.ContextVar(
    "coati_read_positions", default=None
)


def _dense(mlp: nn.Module) -> bool:
    """Only linear layers and parameter-free modules (activations), no buffers: position-wise by
    construction."""
    if any(True for _ in mlp.buffers()):
        return False
    for module in mlp.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return False
        if not isinstance(module, nn.Linear) and any(True for _ in module.parameters(recurse=False)):
            return False
    return True


def _last_mlp(model: nn.Module) -> nn.Module | None:
    """The text decoder's last layer's MLP where it may run on read positions only, else None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = getattr(decoder, "config", None)
    layers = getattr(decoder, "layers", None)
    if getattr(config, "model_type", None) not in PROVEN_TYPES or not layers:
        return None
    mlp = getattr(layers[-1], "mlp", None)
    return mlp if isinstance(mlp, nn.Module) and _dense(mlp) else None


def _read_rows_forward(
    self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """The MLP's own forward, within :func:`reading` on the read rows alone (zeros elsewhere). Bound to the
    module (``types.MethodType``), so a deep copy of the model binds its copy, not this module."""
    whole = type(self).forward
    read = None if args or kwargs or torch.compiler.is_compiling() else _READ.get()
    where = None
    if read is not None and hidden_states.dim() == 3 and hidden_states.shape[0] == read.shape[0]:
        where = read.at(hidden_states.shape[1])
    if where is None:
        return whole(self, hidden_states, *args, **kwargs)
    rows = whole(self, hidden_states[where])  # [N, H]
    return hidden_states.new_zeros(hidden_states.shape).index_put(where, rows)


def skip_unread_mlp(model: nn.Module) -> bool:
    """Make ``model``'s last MLP run on the read positions within :func:`reading`; returns whether it does.
    Call on the model as loaded, before LoRA, checkpointing, compile and boosting; every rank."""
    mlp = _last_mlp(model)
    if mlp is None:
        return False
    current = mlp.__dict__.get("forward")
    if current is not None and getattr(current, "__func__", None) is not _read_rows_forward:
        return False  # another wrapper already replaced this module's forward: leave it as it is
    mlp.forward = types.MethodType(_read_rows_forward, mlp)
    model.coati_skips_unread_mlp = True
    return True


def skips_unread_mlp(model: nn.Module) -> bool:
    """Whether ``model``'s last MLP runs on the read positions within :func:`reading` (not while activation
    checkpointing recomputes layers: see the module docstring)."""
    return getattr(model, "coati_skips_unread_mlp", False) and not recomputes(model)


def recomputes(module: nn.Module) -> bool:
    """Whether activation checkpointing is on (transformers 5 names it ``is_activation_checkpointing``; the
    older name warns)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        flag = getattr(module, name, None)
        if flag is not None:
            return bool(flag)
    return False


@contextlib.contextmanager
def reading(rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int], keep: int) -> Iterator[None]:
    """Within: a forward over an input of ``shape`` (B, S) has its final hidden states read at (``rows``,
    ``cols``) of its last ``keep`` positions only (the last MLP of a model :func:`skip_unread_mlp` prepared
    runs there alone)."""
    token = _READ.set(ReadPositions(rows, cols, shape, keep))
    try:
        yield
    finally:
        _READ.reset(token)
