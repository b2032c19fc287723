"""The fused rotary embedding (coati_kto.models.rotary): transformers' Llama ``apply_rotary_pos_emb`` within fp32
rounding, forward and backward (its backward the exact adjoint: gradcheck in float64); fused only in the attention
of a model that asked for it, only where a family's formula is Llama's, and only for the arguments it covers; on by
default in every load, off with ``model.fused_rotary: false`` and under ``model.compile``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from coati_kto.models import rotary
from coati_kto.models.rotary import fuse_rotary, fused_rotary, fused_rotary_modules


def _inputs(layout: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [2, 4, 7, 16] and grouped k [2, 2, 7, 16] (``layout`` "bhsd"; "bshd": the same data [2, 7, heads, 16]),
    cos/sin [2, 7, 16] from random angles, as transformers' rotary embedding makes them (halves repeated)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 7, 4, 16, generator=gen), torch.randn(2, 7, 2, 16, generator=gen)
    if layout == "bhsd":  # the attention's transposed views of [B, S, heads, D] projections
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.randn(2, 7, 8, generator=gen).repeat(1, 1, 2)
    return tuple(t.to(dtype) for t in (q, k, angles.cos(), angles.sin()))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fused_rotary_equals_llamas_forward_and_backward(layout: str) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    unsqueeze_dim = 1 if layout == "bhsd" else 2
    q, k, cos, sin = _inputs(layout)
    grads = [torch.randn(q.shape, generator=torch.Generator().manual_seed(1)), torch.randn(k.shape)]
    results = []
    for function in (apply_rotary_pos_emb, fused_rotary):
        leaves = [q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()]
        outs = function(*leaves, cos, sin, unsqueeze_dim=unsqueeze_dim)
        torch.autograd.backward(outs, grads)
        results.append((*outs, leaves[0].grad, leaves[1].grad))
    for expected, got in zip(*results, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


def test_fused_rotary_backward_is_the_adjoint() -> None:
    q, k, cos, sin = (t.double() for t in _inputs("bhsd"))
    q, k = q.requires_grad_(), k.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fused_rotary(a, b, cos, sin), (q, k))


def test_only_llama_style_rotary_is_fused() -> None:
    """Llama's and Qwen3's functions pass the check; Cohere's interleaved rotation and a scaled variant do not."""
    from transformers.models.cohere import modeling_cohere
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    def scaled(q, k, cos, sin, unsqueeze_dim=1):
        q2, k2 = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return q2 * 1.01, k2

    assert rotary._computes_llama_rotary(modeling_llama.apply_rotary_pos_emb)
    assert rotary._computes_llama_rotary(modeling_qwen3.apply_rotary_pos_emb)
    assert not rotary._computes_llama_rotary(modeling_cohere.apply_rotary_pos_emb)
    assert not rotary._computes_llama_rotary(scaled)


def _dispatch(q, k, cos, sin, *args, **kwargs):
    """Call the dispatcher around Llama's function as a fused attention's forward would."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    original = getattr(apply_rotary_pos_emb, "__wrapped__", apply_rotary_pos_emb)
    token = rotary._INSIDE_FUSED_ATTENTION.set(True)
    try:
        return rotary._dispatcher(original)(q, k, cos, sin, *args, **kwargs)
    finally:
        rotary._INSIDE_FUSED_ATTENTION.reset(token)


def test_the_dispatcher_leaves_uncovered_calls_to_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotary dimension shorter than the head (partial rotary), mixed dtypes, differentiable cos/sin or an
    unknown argument run the original function; covered calls run the fused one."""
    fused_calls = []
    monkeypatch.setattr(rotary, "fused_rotary", lambda *a: fused_calls.append(1) or (a[0], a[1]))
    q, k, cos, sin = _inputs("bhsd")
    uncovered = [
        ((q, k, cos[..., :8], sin[..., :8]), {}),
        ((q, k, cos.double(), sin.double()), {}),
        ((q, k, cos.clone().requires_grad_(), sin), {}),
        ((q, k, cos, sin, torch.arange(7)), {}),
        ((q, k, cos, sin), {"unsqueeze_dim": 1, "position_ids": None}),
        ((q, k, cos, sin), {"unsqueeze_dim": 2}),  # cos [2, 7, 1, 16] against q [2, 4, 7, 16]: no broadcast
        ((q[:1], k[:1], cos, sin), {}),  # q and k of batch 1: the result would be larger than q
    ]
    for args, kwargs in uncovered:
        with contextlib.suppress(
            RuntimeError, TypeError
        ):  # the original's answer to arguments it does not take
            _dispatch(*args, **kwargs)
    assert not fused_calls
    for args, kwargs in [
        ((q, k, cos, sin), {}),
        ((q, k, cos, sin, 1), {}),
        ((q, k, cos, sin), {"unsqueeze_dim": 1}),
    ]:
        _dispatch(*args, **kwargs)
    assert len(fused_calls) == 3


def test_a_model_loads_with_fused_rotary_and_other_models_keep_transformers(tiny_model_dir: Path) -> None:
    """load_causal_lm fuses each attention (2 layers) unless model.fused_rotary is off or the layers are compiled;
    logits and gradients within fp32 rounding of the unfused model; a plain model of the same family loaded
    afterwards in the same process still computes transformers' function bit for bit."""
    from transformers import AutoModelForCausalLM

    from coati_kto.config.schema import ModelSection
    from coati_kto.models.hf import load_causal_lm

    path = str(tiny_model_dir)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(4))
    before = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        before_logits = before(input_ids=ids).logits
    fused = load_causal_lm(path, ModelSection(path=path, fused_norms=False), torch.float32)
    plain = load_causal_lm(
        path, ModelSection(path=path, fused_norms=False, fused_rotary=False), torch.float32
    )
    compiled = load_causal_lm(path, ModelSection(path=path, compile=True), torch.float32)
    assert (fused_rotary_modules(fused), fused_rotary_modules(plain), fused_rotary_modules(compiled)) == (
        2,
        0,
        0,
    )
    assert list(fused.state_dict()) == list(plain.state_dict())
    for model in (fused, plain):
        model.model.embed_tokens.weight.grad = None
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, before_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(plain(input_ids=ids).logits, before_logits)
        after = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert torch.equal(after(input_ids=ids).logits, before_logits)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert fuse_rotary(fused) == 2  # idempotent: the family's dispatcher is installed once


def test_a_compiled_layer_traces_the_dispatcher_without_a_graph_break(tiny_model_dir: Path) -> None:
    """Once a fused load installed the dispatcher, a compiled model of the same family (model.compile: never
    fused) still traces it as one graph, to transformers' function (a context-variable read broke the graph)."""
    from transformers.models.llama import modeling_llama

    from coati_kto.config.schema import ModelSection
    from coati_kto.models.hf import load_causal_lm

    load_causal_lm(str(tiny_model_dir), ModelSection(path=str(tiny_model_dir)), torch.float32)
    dispatcher = modeling_llama.apply_rotary_pos_emb
    assert getattr(dispatcher, "coati_fused_rotary_dispatcher", False)
    q, k, cos, sin = _inputs("bhsd")
    compiled = torch.compile(
        lambda *a: modeling_llama.apply_rotary_pos_emb(*a), fullgraph=True, backend="eager"
    )
    for got, expected in zip(compiled(q, k, cos, sin), dispatcher.__wrapped__(q, k, cos, sin), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_rotary_in_bf16_is_as_near_the_exact_values_as_transformers(device: str) -> None:
    """bf16 outputs and gradients: mean error against a float64 computation no larger than transformers' own
    bf16 computation (two roundings per element where transformers' takes three)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(4, 8, 6, 64, generator=gen), torch.randn(4, 2, 6, 64, generator=gen)
    angles = (torch.randn(4, 6, 32, generator=gen) * 3).repeat(1, 1, 2)
    grads = (torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen))

    def run(function, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k)]
        cos, sin = (t.to(device, dtype) for t in (angles.cos(), angles.sin()))
        outs = function(*leaves, cos, sin)
        torch.autograd.backward(outs, [g.to(device, dtype) for g in grads])
        return [t.detach().double() for t in (*outs, *(leaf.grad for leaf in leaves))]

    truth = run(apply_rotary_pos_emb, torch.float64)
    eager, fused = run(apply_rotary_pos_emb, torch.bfloat16), run(fused_rotary, torch.bfloat16)
    for e, f, t in zip(eager, fused, truth, strict=True):
        assert (f - t).abs().mean() <= (e - t).abs().mean() * 1.05
