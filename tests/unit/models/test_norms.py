"""The fused RMSNorm (coati_kto.models.norms): transformers' Llama-style RMSNorm within rounding, forward and
backward, in fp32 and bf16; one op each way for the kernel counter; swapped only where a family's norm is
Llama's; on by default in every load, off with ``model.fused_norms: false`` and under ``model.compile``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from coati_kto.models.norms import fuse_rms_norms, fused_norms, fused_rms_norm


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket.__name__ not in ("detach", "ones_like"):  # the counter skips views; the seed
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _llama_norm(size: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(size, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(size, generator=torch.Generator().manual_seed(seed)))
    return norm


def _grads(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor, fused: bool) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    norm.zero_grad(set_to_none=True)
    y = fused_rms_norm(x, norm.weight, norm.variance_epsilon) if fused else norm(x)
    y.backward(grad)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 4, 16)])  # hidden states; per-head q/k norms
def test_fp32_equals_transformers_within_rounding(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = _llama_norm(shape[-1], torch.float32)
    x, grad = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    eager, fused = _grads(norm, x, grad, False), _grads(norm, x, grad, True)
    for e, f in zip(eager, fused, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6)


def test_cpu_backward_against_float64_autograd() -> None:
    """The CPU backward's formula against autograd of the float64 definition (not against itself)."""
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(4, 9, 32, generator=gen), torch.randn(4, 9, 32, generator=gen)
    weight = torch.randn(32, generator=gen)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(grad.double())
    xf, wf = x.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_rms_norm(xf, wf, 1e-6).backward(grad)
    torch.testing.assert_close(xf.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wf.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_bf16_within_one_rounding_step_of_transformers_and_closer_to_fp32() -> None:
    """bf16: the weight multiplies before the one rounding (transformers rounds, then multiplies in bf16, and its
    backward rounds every intermediate): the output within one bf16 step of transformers'; output, input and
    weight gradients nearer the fp32 computation than transformers' on average, no farther at worst."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 8, 64, generator=gen) * 2).bfloat16()
    grad = torch.randn(4, 8, 64, generator=gen).bfloat16()
    eager = _grads(_llama_norm(64, torch.bfloat16), x, grad, False)
    fused = _grads(_llama_norm(64, torch.bfloat16), x, grad, True)
    truth = _grads(_llama_norm(64, torch.float32), x.float(), grad.float(), False)
    step = torch.finfo(torch.bfloat16).eps * eager[0].float().abs().clamp_min(1e-2)
    assert bool(((fused[0].float() - eager[0].float()).abs() <= step).all())
    for e, f, t in zip(eager, fused, truth, strict=True):
        fused_error, eager_error = (f.float() - t).abs(), (e.float() - t).abs()
        assert fused_error.mean() < eager_error.mean()
        assert fused_error.max() <= 1.1 * eager_error.max()


def test_one_op_each_way() -> None:
    """The counter sees what CUDA launches: one forward op, one backward op (was 7-9 and about 20)."""
    x = torch.randn(2, 3, 16, requires_grad=True)
    weight = torch.ones(16, requires_grad=True)
    with _Ops() as forward:
        y = fused_rms_norm(x, weight, 1e-6)
    with _Ops() as backward:
        y.backward(torch.ones_like(y))
    assert forward.ops == ["rms_norm"]
    assert backward.ops == ["rms_norm_backward"]


def test_frozen_weight_gets_no_gradient() -> None:
    x = torch.randn(2, 3, 16, requires_grad=True)
    weight = torch.randn(16)  # frozen (LoRA's base, the reference)
    fused_rms_norm(x, weight, 1e-6).sum().backward()
    assert weight.grad is None and x.grad is not None


def _families() -> dict[str, nn.Module]:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    class OffsetRMSNorm(nn.Module):  # Llama's attributes, another formula
        def __init__(self, size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(size)), eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (
                self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) + 0.1
            )

    return {
        "qwen2": Qwen2RMSNorm(16),
        "qwen3": Qwen3RMSNorm(16),
        "mistral": MistralRMSNorm(16),
        "gemma": GemmaRMSNorm(16),
        "gemma3": Gemma3RMSNorm(16),
        "offset": OffsetRMSNorm(16),
    }


def test_only_llama_style_norms_are_swapped() -> None:
    norms = nn.ModuleDict(_families())
    assert fuse_rms_norms(norms) == 3
    swapped = {name for name, module in norms.items() if fused_norms(module)}
    assert swapped == {"qwen2", "qwen3", "mistral"}


def test_a_model_loads_with_fused_norms_and_the_same_logits(tiny_model_dir: Path) -> None:
    """load_causal_lm swaps every norm (2 layers x 2 + the final one), unless model.fused_norms is off or the
    layers are compiled; logits within fp32 rounding of the unfused model; state-dict keys unchanged."""
    from coati_kto.config.schema import ModelSection
    from coati_kto.models.hf import load_causal_lm

    fused = load_causal_lm(str(tiny_model_dir), ModelSection(path=str(tiny_model_dir)), torch.float32)
    plain_cfg = ModelSection(path=str(tiny_model_dir), fused_norms=False)
    plain = load_causal_lm(str(tiny_model_dir), plain_cfg, torch.float32)
    compiled_cfg = ModelSection(path=str(tiny_model_dir), compile=True)
    assert fused_norms(fused) == 5
    assert fused_norms(plain) == 0
    assert fused_norms(load_causal_lm(str(tiny_model_dir), compiled_cfg, torch.float32)) == 0
    assert list(fused.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
