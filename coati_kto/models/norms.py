"""RMSNorm as one kernel forward and one backward (``model.fused_norms``), where a family's norm is Llama's.

transformers' Llama-style RMSNorm runs as eager ops: a cast to fp32, ``pow``, ``mean``, ``add``, ``rsqrt``, two
multiplies and a cast back (7-9 kernels forward, about 20 backward, each a pass over the activations). torch's
``aten::_fused_rms_norm`` computes the same ``weight * x / sqrt(mean(x^2) + eps)`` in one kernel (fp32
accumulation, the output in the input's dtype), and its autograd formula calls ``aten::_fused_rms_norm_backward``,
one kernel on CUDA. Here both are two custom ops (``coati_kto::rms_norm`` and its backward): torch's fused
kernels on CUDA; on the CPU, where torch 2.13 decomposes the forward and has no backward, the same formulas in
fewer passes (four forward, five backward). The kernel counter sees one op each way on any device, as CUDA runs one.

Which modules: :func:`fuse_rms_norms` checks each norm class once, numerically (:func:`_computes_llama_rms_norm`:
its forward against the fused op on a random input and a random weight, fp32), so a family whose norm differs
(Gemma's ``1 + weight``, an offset, a norm without weight) keeps its own forward. Values: fp32 equal within
rounding; in bf16 the weight multiplies in fp32 before the one rounding (transformers rounds, then multiplies in
bf16), so outputs differ by at most about one bf16 step. Policy and reference load alike (``load_causal_lm``), so
step-1 rewards stay exactly 0. Off with ``model.compile`` (inductor fuses the norms itself).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

_aten = torch.ops.aten


@torch.library.custom_op("coati_kto::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, rstd fp32 [..., 1]): torch's fused kernel on CUDA and for low precision; fp32 on the CPU
    the same formula in four passes (torch's composite there takes six: two more multiplies and casts)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        y, rstd = _aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd
    rstd = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return torch.mul(x, rstd).mul_(weight), rstd


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("coati_kto::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/dx in x's dtype, d/dweight in weight's, empty unless ``weight_grad``) of ``weight * x * rstd``: torch's
    fused kernel on CUDA; on the CPU (torch 2.13 has none there) its formula in fp32, rearranged for fewer passes:
    with d = sum over H of grad * weight * x (a matrix-vector product of grad * x and the weight),
    dx = rstd * grad * weight - x * rstd^3 * d / H and dweight = sum over rows of rstd * grad * x (a
    vector-matrix product): five passes over the activations where the textbook form takes nine."""
    if grad.is_cuda:
        mask = [True, weight_grad]
        dx, dw = _aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, mask)
        return dx, dw if weight_grad else weight.new_empty(0)
    size = x.shape[-1]
    xf, gf, wf = x.float(), grad.float(), weight.float()  # no copies in fp32
    grad_x = (gf * xf).reshape(-1, size)  # [N, H]
    rows = rstd.reshape(-1)  # [N]
    coef = (grad_x @ wf).mul_(rows.pow(3)).div_(size).reshape(rstd.shape)
    dx = (gf * wf).mul_(rstd).addcmul_(xf, coef, value=-1).to(x.dtype)
    if not weight_grad:
        return dx, weight.new_empty(0)
    return dx, (rows @ grad_x).to(weight.dtype)


@_rms_norm_backward.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight) if weight_grad else weight.new_empty(0)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # rstd's gradient stays None: no zeros kernel


def _backward(ctx: Any, grad_y: torch.Tensor | None, grad_rstd: torch.Tensor | None) -> tuple:
    if grad_y is None:
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]  # frozen under LoRA and in the reference: no reduction for it
    dx, dw = _rms_norm_backward(grad_y.contiguous(), x, rstd, weight, weight_grad)
    return dx, dw if weight_grad else None, None


_rms_norm.register_autograd(_backward, setup_context=_setup)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2, -1) + eps)`` as one op forward and one backward (x [..., H], weight [H],
    both one dtype)."""
    return _rms_norm(x, weight, eps)[0]


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A swapped norm's forward: the fused op where input and weight share a dtype, else the class's own."""
    if args or kwargs or hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return fused_rms_norm(hidden_states, self.weight, self._fused_eps)


@functools.cache
def _computes_llama_rms_norm(cls: type, size: int, eps: float) -> bool:
    """Whether ``cls``'s forward is Llama's RMSNorm (fp32, a random input and weight, within 1e-5 relative);
    checked once per class, size and eps on an instance built like the model's (its first argument: the size)."""
    try:
        norm = cls(size, eps=eps)
    except Exception:  # a constructor of another shape: leave the class alone
        return False
    if not isinstance(getattr(norm, "weight", None), nn.Parameter) or norm.weight.shape != (size,):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, size, generator=gen)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=gen))
        try:
            expected = norm.float()(x)
        except Exception:
            return False
        if not isinstance(expected, torch.Tensor) or expected.shape != x.shape:
            return False
        got = _aten._fused_rms_norm(x, [size], norm.weight.float(), eps)[0]
    return bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-6))


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every Llama-style RMSNorm of ``model`` the fused forward (its class checked numerically); returns
    how many modules. Parameters, state-dict keys and hooks are untouched. Every rank calls, alike."""
    swapped = 0
    for module in model.modules():
        weight, eps = getattr(module, "weight", None), _eps(module)
        if (
            not type(module).__name__.endswith("RMSNorm")
            or eps is None
            or not isinstance(weight, nn.Parameter)
        ):
            continue
        if weight.dim() != 1 or not _computes_llama_rms_norm(type(module), weight.shape[0], eps):
            continue
        module._fused_eps = eps
        module.forward = types.MethodType(_fused_forward, module)
        swapped += 1
    return swapped


def fused_norms(model: nn.Module) -> int:
    """How many of ``model``'s modules run the fused RMSNorm."""
    return sum(getattr(m.forward, "__func__", None) is _fused_forward for m in model.modules())
