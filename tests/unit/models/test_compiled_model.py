"""model.compile (coati_kto.models.compile): a compiled tiny Llama against its eager twin (log-probs, gradients,
fp32), no recompile on new lengths and batch sizes, and the kernel counter counting what the compiled layers
launch (each generated kernel once, from the generated code), not their eager ops and not zero.

Marker ``compile``: inductor builds C++ kernels with gcc (tens of seconds cold on 2 cores)."""

from __future__ import annotations

import copy
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coati_kto.models import logprobs
from coati_kto.models.compile import CompiledForward, compile_layers, compiled_graphs, compiled_layers
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.testing.kernels import COPIES, HEAD, MATMUL, POINTWISE, KernelCounter

pytestmark = pytest.mark.compile
LAYERS = 2


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _batch(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (rows, length), generator=g)
    attention = torch.ones_like(ids)
    attention[0, length // 2 :] = 0  # a padded row: sdpa takes the dense mask
    loss = attention.clone()
    loss[:, : length // 3] = 0
    return ids, attention, loss


def _logps_and_grads(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids, attention, loss = batch
    logps = model_sequence_logps(model, ids, attention, loss, LMHead.find(model))
    (logps * torch.linspace(-1.0, 2.0, len(logps))).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_equals_eager_within_fp32_rounding_and_does_not_recompile() -> None:
    eager = _model()
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled) == LAYERS and compiled_layers(compiled) == LAYERS
    start, graphs = compiled_graphs(), []
    for step, (rows, length) in enumerate([(3, 11), (3, 17), (5, 23), (1, 9), (1, 14)]):
        batch = _batch(rows, length, step)
        want, want_grads = _logps_and_grads(eager, batch)
        got, got_grads = _logps_and_grads(compiled, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
        graphs.append(compiled_graphs() - start)
    # The same graphs (the layers share theirs; the head's two chunk functions) for every length and batch
    # size; batch 1 (a padding-free row: dynamo specializes size 1) compiles its own once
    assert graphs[0] == graphs[1] == graphs[2] and graphs[3] == graphs[4] <= 2 * graphs[0]


def test_compiled_under_activation_checkpointing_equals_eager() -> None:
    """Compiled after checkpointing is enabled (coati_kto.train's order): the recompute runs the compiled layer."""
    eager = _model()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing runs in training mode only
    compile_layers(compiled)
    batch = _batch(4, 15, 3)
    want, want_grads = _logps_and_grads(eager, batch)
    got, got_grads = _logps_and_grads(compiled, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _call_sites(source: str) -> Counter:
    """Generated kernel name -> calls in the generated ``call`` function."""
    body = source[source.index("def call(") :]
    return Counter(re.findall(r"^\s+(cpp_fused_\w+)\(", body, re.M))


def test_counter_counts_the_generated_kernels_not_the_eager_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.codecache import PyCodeCache

    model = _model()
    batch = _batch(3, 13, 0)
    with KernelCounter(log=True) as eager_count:
        _logps_and_grads(model, batch)
    torch._dynamo.reset()  # this test's generated modules alone in PyCodeCache (from inductor's disk cache)
    PyCodeCache.cache_clear()
    compile_layers(model)
    model.lm_head.coati_compiled_chunks = False  # the layers alone first (the head below)
    _logps_and_grads(model, batch)  # compiles (forward and backward graphs)
    generated = list(PyCodeCache.modules)
    sites = sum((_call_sites(Path(m.__file__).read_text()) for m in generated), Counter())
    assert sites and isinstance(model.model.layers[0].forward, CompiledForward)
    with KernelCounter(log=True) as count:
        _logps_and_grads(model, _batch(3, 19, 1))
    fused = Counter(op for op, *_ in count.log if op.startswith("cpp_fused_"))
    # Every generated kernel call of forward and backward, once per layer; each with its bytes
    assert fused == Counter({name: n * LAYERS for name, n in sites.items()})
    assert all(r + w > 0 for op, _, _, r, w in count.log if op.startswith("cpp_fused_"))
    assert {cat for op, cat, *_ in count.log if op.startswith("cpp_fused_")} <= {POINTWISE, COPIES}
    # The layers' matmuls are the generated code's extern calls (aten.mm.out), counted as matmuls
    matmuls = sum(k for op, cat, k, *_ in count.log if cat == MATMUL)
    assert matmuls == sum(k for op, cat, k, *_ in eager_count.log if cat == MATMUL)
    # Fewer kernels than eager: the layers' pointwise work is fused, not counted op by op
    assert count.summary(1)["kernels"] < eager_count.summary(1)["kernels"]
    assert count.summary(1)["attention"] == ["compiled x2"]
    # The LM head over several vocabulary chunks (a large vocabulary's; 3 of 32 here) compiled: each chunk's
    # log-softmax and gradient fused, as HEAD, fewer kernels than the eager chunks. One chunk takes torch's
    # log-softmax compiled or not (one kernel already; test_head_logprobs counts it).
    monkeypatch.setattr(logprobs, "_vocab_chunk", lambda positions, vocab, chunk, device: 32)
    heads = []
    for compiled in (False, True):
        model.lm_head.coati_compiled_chunks = compiled
        _logps_and_grads(model, batch)
        with KernelCounter(log=True) as head_count:
            _logps_and_grads(model, _batch(3, 19, 1))
        heads.append([(op, k) for op, cat, k, *_ in head_count.log if cat == HEAD])
    eager_head, head = heads
    assert any(op.startswith("cpp_fused_") for op, _ in head)
    assert not any(op.startswith("cpp_fused_") for op, _ in eager_head)
    assert sum(k for _, k in head) < sum(k for _, k in eager_head)
