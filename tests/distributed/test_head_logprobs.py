"""Chunked LM-head log-probs (no [B, S, V] logits) against the logits path: values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.logprobs import head_token_logps, hidden_sequence_logps, sequence_logps
from coati_kto.testing.tiny import random_causal_lm


def _mask(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        prompt = int(torch.randint(1, seq // 2, (1,), generator=g))
        end = int(torch.randint(prompt + 1, seq + 1, (1,), generator=g))
        mask[b, prompt:end] = True
    return mask


@pytest.mark.parametrize("vocab_chunk", [None, 1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_hidden_path_equals_logits_path_fp32(vocab_chunk, with_bias):
    g = torch.Generator().manual_seed(3)
    batch, seq, hid, vocab = 3, 14, 16, 61
    hidden = torch.randn(batch, seq, hid, generator=g)
    weight = torch.randn(vocab, hid, generator=g) / 2
    bias = torch.randn(vocab, generator=g) if with_bias else None
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = _mask(batch, seq, g)
    leaves_a = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    leaves_b = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    ba = leaves_a[2] if with_bias else None
    bb = leaves_b[2] if with_bias else None
    got = hidden_sequence_logps(leaves_a[0], leaves_a[1], ba, ids, mask, vocab_chunk)
    ref = sequence_logps(torch.nn.functional.linear(leaves_b[0], leaves_b[1], bb), ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    w = torch.tensor([1.0, -2.0, 0.5])
    (got * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in zip(leaves_a, leaves_b, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [7, 61])  # online chunks; the whole vocabulary (kept log-probs)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(monkeypatch, dtype, chunk):
    """Small heads keep their logits for backward instead of recomputing them: same values, same grads."""
    import coati_kto.models.logprobs as logprobs

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 16, generator=g).to(dtype)
    weight = (torch.randn(61, 16, generator=g) / 2).to(dtype)
    bias = torch.randn(61, generator=g).to(dtype)
    targets = torch.randint(0, 61, (40,), generator=g)
    upstream = torch.randn(40, generator=g)
    results = []
    for budget in (0, 1 << 24):  # recompute, keep
        monkeypatch.setattr(logprobs, "_KEEP_LOGITS_ELEMENTS", budget)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        out = head_token_logps(*leaves, targets, vocab_chunk=chunk)
        (out * upstream).sum().backward(retain_graph=True)
        first = [t.grad.clone() for t in leaves]
        (out * upstream).sum().backward()  # a second backward (retain_graph) sees the same kept logits
        assert all(torch.equal(2 * f, t.grad) for f, t in zip(first, leaves, strict=True))
        results.append((out.detach(), first))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_bf16_within_stated_tolerance():
    """bf16 logits are identical per chunk; only summation order differs: values within 1e-3 nats per token."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 32, generator=g).bfloat16()
    weight = (torch.randn(300, 32, generator=g) / 4).bfloat16()
    targets = torch.randint(0, 300, (40,), generator=g)
    got = head_token_logps(hidden, weight, None, targets, vocab_chunk=50)
    logits = torch.nn.functional.linear(hidden, weight).float()
    ref = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)


def _tiny(cls, config_cls, vocab=200, seed=0, **extra):
    return random_causal_lm(cls, config_cls, seed, vocab_size=vocab, max_position_embeddings=64, **extra)


@pytest.mark.parametrize(
    "cls,config_cls,tied",
    [(LlamaForCausalLM, LlamaConfig, False), (Qwen2ForCausalLM, Qwen2Config, True)],
)
def test_model_path_equals_logits_path_with_parameter_grads(cls, config_cls, tied):
    model = _tiny(cls, config_cls, tie_word_embeddings=tied)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (3, 12), generator=g)
    mask = _mask(3, 12, g)
    attention = torch.ones_like(ids)
    attention[0, 10:] = 0
    mask[0, 10:] = False
    head = LMHead.find(model)
    assert head is not None and head.weight.shape == (200, 32)
    got = model_sequence_logps(model, ids, attention, mask, head)
    got.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model_sequence_logps(model, ids, attention, mask, None)
    ref.sum().backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padded_rows", [0, 56])
def test_the_heads_weight_is_sliced_only_past_the_vocabulary(padded_rows: int) -> None:
    """A head whose rows are the vocabulary hands out its weight itself: a slice of all rows still had a backward
    that zero-filled a weight-sized gradient and copied into it, every gradient pass. Padded rows (shardformer's
    PaddingLMHead) are cut off, and their gradient is 0."""
    vocab, hidden = 200, 16
    module = torch.nn.Linear(hidden, vocab + padded_rows, bias=True)
    head = LMHead(module, vocab)
    assert head.weight.shape == (vocab, hidden) and head.bias.shape == (vocab,)
    assert (head.weight is module.weight) == (padded_rows == 0)
    assert (head.bias is module.bias) == (padded_rows == 0)
    targets = torch.randint(0, vocab, (24,))
    head_token_logps(torch.randn(24, hidden), head.weight, head.bias, targets).sum().backward()
    assert module.weight.grad.shape == (vocab + padded_rows, hidden)
    assert module.weight.grad[vocab:].eq(0).all() and module.weight.grad[:vocab].ne(0).any()


def test_unknown_family_keeps_the_logits_path():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert LMHead.find(model) is None


def _plugin_step(plugin_name: str, use_head: bool) -> dict:
    """One boosted optimizer step on a Llama with vocabulary 200 (ColossalAI's own Llama policy padded its head
    to 256; the project's policy swaps nothing at tp_size 1, coati_kto.families.shardformer.base)."""
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    from coati_kto.parallel.upstream.cpu import plugin_overrides

    extra = plugin_overrides()
    plugin = {
        "hybrid_parallel": lambda: HybridParallelPlugin(
            tp_size=1, pp_size=1, precision="fp32", zero_stage=0, **extra
        ),
        "low_level_zero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", **extra),
        "ddp": TorchDDPPlugin,
    }[plugin_name]()
    model = _tiny(LlamaForCausalLM, LlamaConfig)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    head = LMHead.find(model) if use_head else None
    assert (head is not None) == use_head
    if head is not None and plugin_name == "hybrid_parallel":  # no padded rows to mistake for tokens
        assert type(head.module) is torch.nn.Linear and head.module.weight.shape[0] == 200
    g = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    ids = torch.randint(0, 200, (2, 10), generator=g)
    mask = _mask(2, 10, g)
    logps = model_sequence_logps(model, ids, torch.ones_like(ids), mask, head)
    booster.backward(-logps.sum(), optimizer)
    optimizer.step()
    inner = model.unwrap()
    return {
        "logps": logps.detach(),
        "head": inner.get_output_embeddings().weight.detach()[:200].clone(),
        "embed": inner.get_input_embeddings().weight.detach().clone(),
    }


def _compare_paths_under_plugins() -> list[str]:
    checked = []
    for name in ("hybrid_parallel", "low_level_zero", "ddp"):
        torch.manual_seed(0)
        a, b = _plugin_step(name, True), _plugin_step(name, False)
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5, msg=f"{name} {key}")
        checked.append(name)
    return checked


def test_head_path_equals_logits_path_under_plugins_two_processes():
    """Log-probs and the weights after one step equal the logits path's under ColossalAI's wrappers."""
    from coati_kto.testing.distributed import run_distributed

    assert (
        run_distributed(_compare_paths_under_plugins, 2) == [["hybrid_parallel", "low_level_zero", "ddp"]] * 2
    )


def test_vocabulary_chunks_few_on_a_gpu_cache_sized_on_cpu() -> None:
    """A GPU issues each chunk's kernels from the host: a micro-batch's positions take one or two chunks there
    (the bench's shapes, vocabulary 32000), while CPU keeps 32 MiB fp32 blocks
    (benchmarks/logprobs_bench.py --head-chunks)."""
    from coati_kto.models.logprobs import _vocab_chunk

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert _vocab_chunk(8 * 40, 32000, None, gpu) == 32000  # tool_use: 8 rows x ~40 completion tokens
    assert -(-32000 // _vocab_chunk(8 * 400, 32000, None, gpu)) == 2  # half: 8 x ~400
    assert _vocab_chunk(8 * 400, 32000, None, cpu) == (1 << 23) // 3200


@pytest.mark.parametrize("chunks", [1, 3])
def test_first_and_only_chunk_shortcuts_are_bit_exact(chunks: int) -> None:
    """The first chunk starts the running max, sum and target logit instead of updating them from (-inf, 0, 0),
    and a chunk holding the whole vocabulary gathers without a range test: the same bits as the general
    update, forward and gradient."""
    from coati_kto.models import logprobs

    g = torch.Generator().manual_seed(11)
    n, hid, vocab = 23, 8, 30
    hidden, weight = torch.randn(n, hid, generator=g), torch.randn(vocab, hid, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    size = vocab // chunks
    w = weight[:size]
    start = (torch.full((n,), float("-inf")), torch.zeros(n), torch.zeros(n))
    general = logprobs._chunk_logps(hidden, w, None, targets, 0, vocab + 1, *start)  # never "the only chunk"
    shortcut = logprobs._chunk_logps(hidden, w, None, targets, 0, vocab, None, None, None)
    assert all(torch.equal(a, b) for a, b in zip(general, shortcut, strict=True))
    lse, up = torch.randn(n, generator=g), torch.randn(n, generator=g)
    logits = general[0]
    assert torch.equal(
        logprobs._chunk_grad(logits, lse, up, targets, 0, vocab + 1, torch.float32),
        logprobs._chunk_grad(logits, lse, up, targets, 0, vocab, torch.float32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_chunk_head_is_torchs_log_softmax(dtype: torch.dtype) -> None:
    """The head over one vocabulary chunk (most micro-batches on a GPU): matmul, log-softmax, gather forward
    (and an upcast in bf16 on the CPU), 20 kernels before; values and gradients as the online chunks give
    them."""
    from coati_kto.testing.kernels import KernelCounter

    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(40, 8, generator=g).to(dtype), torch.randn(64, 8, generator=g).to(dtype)
    targets, upstream = torch.randint(0, 64, (40,), generator=g), torch.randn(40, generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    with KernelCounter(log=True) as counter:
        out = head_token_logps(*leaves, None, targets, vocab_chunk=64)
    assert sum(k for _, _, k, _, _ in counter.log) == (3 if dtype == torch.float32 else 4), counter.log
    (out * upstream).sum().backward()
    chunked = [t.clone().requires_grad_() for t in (hidden, weight)]
    ref = head_token_logps(*chunked, None, targets, vocab_chunk=24)  # three online chunks
    (ref * upstream).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(leaves, chunked, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_chunk_heads_backward_runs_in_the_weights_dtype(dtype: torch.dtype) -> None:
    """The one-chunk backward: the logits' gradient from the kept fp32 log-probs (exp, scale, scatter), rounded
    once to the weight's dtype, then the two matmuls in that dtype. Before: an fp32 accumulator (zeros, add_)
    and, in bf16, fp32 copies of that gradient and of the weight, and a cast back (14 kernels, 10 now; bytes
    -26%). The gradients stay those of the online chunks (the test above)."""
    from coati_kto.testing.kernels import KernelCounter

    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(40, 8, generator=g).to(dtype), torch.randn(64, 8, generator=g).to(dtype)
    targets, upstream = torch.randint(0, 64, (40,), generator=g), torch.randn(40, generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    loss = (head_token_logps(*leaves, None, targets, vocab_chunk=64) * upstream).sum()
    with KernelCounter(log=True) as counter:
        loss.backward()
    ops = [op.split(".")[1] for op, *_ in counter.log]
    cast = ["_to_copy"] if dtype == torch.bfloat16 else []
    assert ops == ["ones_like", "mul", "exp", "neg", "mul_", "scatter_add_", *cast, "mm", "mm"], ops
    assert all(t.grad.dtype == dtype for t in leaves)
