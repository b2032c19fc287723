"""Rotary position embedding in fewer passes (``model.fused_rotary``), where a family's formula is Llama's.

transformers' ``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin`` for the queries and the keys:
per tensor a multiply, a negation, a concatenation, a multiply and an add forward (five passes over it), and
backward about ten (``rotate_half``'s concatenation and slices come back as zero-filled buffers, copies and a
second add). Here each half of the head dimension is written once: ``out1 = x1 c1 - x2 s1`` and
``out2 = x2 c2 + x1 s2`` (a multiply into the output and one ``addcmul_`` per half, four kernels per tensor), and
the backward is the transpose of that rotation in the same four kernels, with no zero fill. On the CPU fixture
of ``benchmarks/step_bench.py`` (8 x 226 tokens, 4 heads of 64) forward + backward of one layer's queries and
keys ran in 4.0 ms against 7.8 ms.

Which models: :func:`fuse_rotary` finds each attention class whose forward calls a module-level
``apply_rotary_pos_emb``, checks that function once, numerically, against the fused one (fp32 random inputs,
grouped-query shapes), and then (1) replaces that module's global with a dispatcher and (2) gives the attention
modules of this model a forward that marks its calls. The dispatcher runs the fused op only inside a marked
forward, so any other model of the same family in the process (a plain ``from_pretrained``, a test's twin) keeps
transformers' exact function; inside, anything it does not cover (a rotary dimension shorter than the head, mixed
dtypes, a differentiable cos/sin, other arguments) goes to the original too. Values: equal within fp32 rounding
(the products are summed in another order); policy and reference load alike (``load_causal_lm``), so step-1
rewards stay exactly 0. Off with ``model.compile`` (inductor fuses these ops itself).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_NAME = "apply_rotary_pos_emb"
_INSIDE_FUSED_ATTENTION = contextvars.ContextVar("coati_fused_rotary", default=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (or, ``transpose``, the adjoint map: the gradient of that in ``x``),
    written half by half into one new tensor with ``x``'s layout. cos/sin broadcast against ``x``."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    # Forward: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2. Adjoint: g1 c1 + g2 s2, g2 c2 - g1 s1.
    torch.mul(x1, c1, out=out[..., :half]).addcmul_(x2, s2 if transpose else s1, value=1 if transpose else -1)
    torch.mul(x2, c2, out=out[..., half:]).addcmul_(x1, s1 if transpose else s2, value=-1 if transpose else 1)
    return out


class _Rotary(torch.autograd.Function):
    """(q, k) rotated by (cos, sin); gradients for q and k only (cos and sin are constants of the positions)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq = None if grad_q is None or not ctx.needs_input_grad[0] else _rotate(grad_q, cos, sin, True)
        dk = None if grad_k is None or not ctx.needs_input_grad[1] else _rotate(grad_k, cos, sin, True)
        return dq, dk, None, None


def fused_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``apply_rotary_pos_emb``: q, k [..., D]; cos, sin [..., D] before ``unsqueeze(unsqueeze_dim)``,
    all one dtype. Returns the rotated (q, k), differentiable in q and k."""
    return _Rotary.apply(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def _covered(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int | None) -> bool:
    """Whether :func:`fused_rotary` computes what Llama's formula computes for these arguments: tensors of one
    dtype and one even last dimension, constant cos/sin of one shape that broadcast into q's and k's shapes."""
    tensors = (q, k, cos, sin)
    if unsqueeze_dim is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    dim = q.shape[-1]
    if dim % 2 or any(t.shape[-1] != dim or t.dtype != q.dtype for t in tensors) or cos.shape != sin.shape:
        return False
    if cos.requires_grad or sin.requires_grad:
        return False
    try:
        shape = cos.unsqueeze(unsqueeze_dim).shape
        return all(torch.broadcast_shapes(t.shape, shape) == t.shape for t in (q, k))
    except (IndexError, RuntimeError):  # no such dimension, or shapes that do not broadcast
        return False


def _unsqueeze_dim(args: tuple, kwargs: dict) -> int | None:
    """Llama's one optional argument, ``unsqueeze_dim`` (default 1), from a call's extra arguments; None for any
    other extra argument (an older signature's ``position_ids``, a family's own options)."""
    if not args and not kwargs:
        return 1
    if len(args) + len(kwargs) != 1:
        return None
    value = args[0] if args else kwargs.get("unsqueeze_dim")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dispatcher(original: Callable) -> Callable:
    """What a family module's ``apply_rotary_pos_emb`` becomes: the fused op inside a fused attention's forward
    for the arguments it covers, ``original`` everywhere else."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # A compiled layer (model.compile: never fused) traces the original, not the context variable.
        if not torch.compiler.is_compiling() and _INSIDE_FUSED_ATTENTION.get():
            unsqueeze_dim = _unsqueeze_dim(args, kwargs)
            if _covered(q, k, cos, sin, unsqueeze_dim):
                return fused_rotary(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.coati_fused_rotary_dispatcher = True
    return apply_rotary_pos_emb


@functools.cache
def _computes_llama_rotary(function: Callable) -> bool:
    """Whether ``function(q, k, cos, sin)`` is Llama's rotary formula: fp32 random queries [2, 4, 5, 8] and
    grouped keys [2, 2, 5, 8], cos/sin [2, 5, 8] from random angles, within 1e-6 of :func:`fused_rotary`."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    angles = torch.randn(2, 5, 4, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    try:
        with torch.no_grad():
            got = function(q, k, cos, sin)
    except Exception:  # another signature: leave it alone
        return False
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return False
    expected = fused_rotary(q, k, cos, sin)
    return all(
        a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6)
        for a, b in zip(got, expected, strict=True)
    )


def _marked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A fused attention's forward: the class's own, with its ``apply_rotary_pos_emb`` calls fused."""
    token = _INSIDE_FUSED_ATTENTION.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _INSIDE_FUSED_ATTENTION.reset(token)


def _family_globals(module: nn.Module) -> dict[str, Any] | None:
    """The globals of ``module``'s class's forward when it calls a module-level ``apply_rotary_pos_emb``."""
    forward = getattr(type(module), "forward", None)
    if forward is not None:
        forward = inspect.unwrap(forward)  # past transformers' decorators (deprecate_kwarg ...)
    code = getattr(forward, "__code__", None)
    if code is None or _NAME not in code.co_names:
        return None
    return forward.__globals__ if callable(forward.__globals__.get(_NAME)) else None


def fuse_rotary(model: nn.Module) -> int:
    """Fuse the rotary embedding of every attention module of ``model`` whose family computes Llama's formula
    (checked once per function); returns how many modules. Parameters, state-dict keys and hooks are untouched.
    Every rank calls, alike."""
    fused = 0
    for module in model.modules():
        namespace = _family_globals(module)
        if namespace is None:
            continue
        current = namespace[_NAME]
        original = (
            current.__wrapped__ if getattr(current, "coati_fused_rotary_dispatcher", False) else current
        )
        if not _computes_llama_rotary(original):
            continue
        if current is original:
            namespace[_NAME] = _dispatcher(original)
        module.forward = types.MethodType(_marked_forward, module)
        fused += 1
    return fused


def fused_rotary_modules(model: nn.Module) -> int:
    """How many of ``model``'s modules run the fused rotary embedding."""
    return sum(getattr(m.forward, "__func__", None) is _marked_forward for m in model.modules())
