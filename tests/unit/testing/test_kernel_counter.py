"""coati_kto.testing.kernels and .syncs on computations small enough to count by hand: kernels, bytes read and
written, categories by context, multi-tensor launches, step windows, attention paths, and every construct that
makes CUDA's host wait."""

from __future__ import annotations

import pytest
import torch

from coati_kto.testing.kernels import (
    GRADS,
    LOSS,
    MATMUL,
    NORM,
    OPTIMIZER,
    OTHER,
    POINTWISE,
    KernelCounter,
)
from coati_kto.testing.op_cost import _launches
from coati_kto.testing.syncs import HostSyncCounter

F32 = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU())


def test_linear_forward_backward_exact() -> None:
    """x [4, 3] -> Linear(3, 5) -> ReLU -> sum, backward, all fp32: every kernel and byte by hand."""
    model, x = _model(), torch.randn(4, 3, requires_grad=True)
    with KernelCounter() as count:
        model(x).sum().backward()
    x_b, w_b, b_b, y_b = 12 * F32, 15 * F32, 5 * F32, 20 * F32
    # forward addmm: reads x, W, b, writes y; backward: grad_x = gy @ W (reads gy, W, writes x-sized), grad_W =
    # gy^T @ x (reads gy, x, writes W-sized): 3 matmul kernels.
    assert count.kernels[MATMUL] == 3
    assert count.read[MATMUL] == (x_b + w_b + b_b) + (y_b + w_b) + (y_b + x_b)
    assert count.written[MATMUL] == y_b + x_b + w_b
    # ReLU forward (model: pointwise), its backward (threshold_backward: gy and y), the bias gradient (sum over
    # rows of gy); the test's own .sum() and its backward expand (a view): other; the backward's seed (ones_like,
    # written only): the loss's.
    assert count.kernels[POINTWISE] == 3
    # (the incoming gradient of the .sum() is its 0-dim seed broadcast: read once, 4 bytes)
    assert count.read[POINTWISE] == y_b + (F32 + y_b) + y_b
    assert count.written[POINTWISE] == y_b + y_b + b_b
    assert count.kernels[OTHER] == 1 and count.kernels[LOSS] == 1
    assert (count.read[OTHER], count.written[OTHER]) == (y_b, F32)
    assert (count.read[LOSS], count.written[LOSS]) == (0, F32)
    # first backward: gradients are assigned, not accumulated (no kernel); no other category saw anything
    assert sum(count.kernels.values()) == 8 and count.syncs.total == 0


def test_accumulation_optimizer_and_norm_categories() -> None:
    """A second backward accumulates into .grad (gradient category: read both, write one), SGD steps per
    parameter (reads param and grad, writes param), clip_grad_norm_ is the gradient norm."""
    model, x = _model(), torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    model(x).sum().backward()
    with KernelCounter() as count:
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
    params = (15 + 5) * F32
    assert count.kernels[GRADS] == 2 and count.read[GRADS] == 2 * params and count.written[GRADS] == params
    # clip: a norm kernel per parameter, one over the norms, then (foreach=None on CPU: per tensor) the scale
    assert count.kernels[NORM] > 0 and count.read[NORM] >= 2 * params
    assert count.kernels[OPTIMIZER] == 2
    assert (count.read[OPTIMIZER], count.written[OPTIMIZER]) == (2 * params, params)


def test_views_casts_and_gathers() -> None:
    x, table, ids = torch.randn(8, 4), torch.randn(100, 6), torch.tensor([1, 5, 5, 7])
    with KernelCounter(log=True) as count:
        x.reshape(32).view(4, 8)[1:].t()  # views: no kernel
        x.to(torch.float64)  # a cast: reads 128 bytes, writes 256
        torch.nn.functional.embedding(ids, table)  # reads ids (32) and 4 rows (96), writes 96: not the table
        torch.randn(3).expand(5, 3).contiguous()  # a broadcast input is read once (12 bytes), writes 60
    assert [(op, k, r, w) for op, _, k, r, w in count.log] == [
        ("aten._to_copy.default", 1, 128, 256),
        ("aten.embedding.default", 1, 32 + 96, 96),
        ("aten.randn.default", 1, 0, 12),
        ("aten.clone.default", 1, 12, 60),
    ]


def test_multi_tensor_launches() -> None:
    """CUDA's multi_tensor_apply: 110 tensors per launch for one list, 64 for two; 320 chunks of 65536."""
    small = [torch.empty(10, device="meta") for _ in range(200)]
    assert _launches((small, 2.0)) == 2
    assert _launches((small, small)) == 4  # 64 per launch: 64 + 64 + 64 + 8
    assert _launches(([torch.empty(320 * 65536 + 1, device="meta")], 2.0)) == 2
    assert _launches(([torch.empty(110 * 65536, device="meta")], 2.0)) == 1  # 110 chunks, 110 tensors: one
    grads = [torch.ones(10) for _ in range(200)]
    with KernelCounter() as count:
        torch._foreach_mul_(grads, 2.0)
    assert count.kernels[OTHER] == 2 and count.read[OTHER] == count.written[OTHER] == 200 * 10 * F32


def test_step_windows() -> None:
    """steps=True: a window per optimizer step, cut at its end; steady windows count the same."""
    model, x = _model(), torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    with KernelCounter(steps=True) as count:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert len(count.windows) == 3  # after steps 1, 2, 3
    first, second = count.windows[0].summary(1), count.windows[1].summary(1)
    assert first["kernels"] == second["kernels"] > 0 and count.windows[2].summary(1)["kernels"] == 0


class _Attend(torch.nn.Module):
    def __init__(self, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)


def test_attention_path_per_pass() -> None:
    q = torch.randn(1, 2, 8, 4)
    with KernelCounter() as count:
        _Attend(None)(q)
        _Attend(torch.ones(8, 8, dtype=torch.bool))(q)
    assert count.summary(1)["attention"] == ["sdpa no mask x1", "sdpa dense mask x1"]


SYNCS = {
    "item": lambda t, m: t[0].item(),
    "float": lambda t, m: float(t[0]),
    "int": lambda t, m: int(t[0]),
    "bool": lambda t, m: bool(t[0] > 0),
    "if": lambda t, m: 1 if t.sum() else 0,
    "tolist": lambda t, m: t.tolist(),
    "cpu": lambda t, m: t.cpu(),
    "numpy": lambda t, m: t.numpy(),
    "to_cpu": lambda t, m: t.to("cpu"),
    "nonzero": lambda t, m: m.nonzero(),
    "masked_select": lambda t, m: t.masked_select(m),
    "bool_index": lambda t, m: t[m],
    "bool_index_put": lambda t, m: t.clone().__setitem__(m, 0.0),
    "unique": lambda t, m: torch.unique(t),
    "unique_consecutive": lambda t, m: torch.unique_consecutive(t),
    "equal": lambda t, m: torch.equal(t, t),
    "repeat_interleave": lambda t, m: torch.repeat_interleave(torch.tensor([1, 2])),
    "pageable_copy_in": lambda t, m: torch.tensor([1.0, 2.0], device=t.device),
    "synchronize": lambda t, m: _accelerator().synchronize(),
}
NOT_SYNCS = {
    "non_blocking": lambda t, m: t.to(t.device, non_blocking=True),
    "to_device_object": lambda t, m: t.to(t.device),  # a training-device move, not a read to the host
    "fill": lambda t, m: torch.full((), 2.0, device=t.device),
    "host_tensor": lambda t, m: torch.tensor([1.0, 2.0]),
    "where": lambda t, m: torch.where(m, t, 0.0).sum(),
    "scalar_where": lambda t, m: torch.where(m, 1.0, 2.0),
}


def _accelerator():
    from colossalai.accelerator import get_accelerator

    from coati_kto.parallel import upstream

    upstream.apply()  # the CPU accelerator: synchronize is a no-op there, yet CUDA's would wait
    return get_accelerator()


@pytest.mark.parametrize("name", list(SYNCS))
@pytest.mark.parametrize("counter", [HostSyncCounter, KernelCounter])
def test_each_cuda_sync_is_counted(name: str, counter: type) -> None:
    t, m = torch.tensor([3.0, -1.0, 2.0]), torch.tensor([True, False, True])
    if name == "synchronize":
        _accelerator()
    with counter() as count:
        SYNCS[name](t, m)
    syncs = count if counter is HostSyncCounter else count.syncs
    assert syncs.total == 1, dict(syncs.by_op)


@pytest.mark.parametrize("name", list(NOT_SYNCS))
def test_what_does_not_sync(name: str) -> None:
    t, m = torch.tensor([3.0, -1.0, 2.0]), torch.tensor([True, False, True])
    with HostSyncCounter() as count:
        NOT_SYNCS[name](t, m)
    assert count.total == 0, dict(count.by_op)


def _llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, attn_implementation=attention,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("attention", "padded", "path"),
    [
        ("eager", False, "eager x2"),
        ("sdpa", False, "sdpa causal no mask x2"),
        ("sdpa", True, "sdpa dense mask x2"),
    ],
)
def test_attention_path_of_a_model_pass(attention: str, padded: bool, path: str) -> None:
    """A Llama pass (2 layers): the path per layer; eager attention's matmuls and softmax count as attention,
    its projections as model matmuls (7 Linear per layer and the LM head: 15 matmul kernels forward)."""
    from coati_kto.testing.kernels import ATTENTION

    ids, mask = torch.randint(0, 32, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    with torch.no_grad(), KernelCounter(log=True) as count:
        _llama(attention)(input_ids=ids, attention_mask=mask if padded else None)
    assert count.summary(1)["attention"] == [path]
    assert count.kernels[MATMUL] == 2 * 7 + 1
    # eager: q k^T, softmax, (attention) v per layer; sdpa: one kernel per layer (the rest: mask building)
    kernels = [op.split(".")[1] for op, category, *_ in count.log if category == ATTENTION]
    expected = (
        ["bmm", "_softmax", "bmm"] * 2
        if attention == "eager"
        else ["_scaled_dot_product_flash_attention_for_cpu"] * 2
    )
    assert [k for k in kernels if k in ("bmm", "_softmax") or k.startswith("_scaled")] == expected
    assert len(kernels) == 2 if not padded and attention == "sdpa" else len(kernels) > len(expected)


def test_flex_attention_pass_is_one_attention_kernel_per_layer() -> None:
    """flex_attention (transformers compiles it; under the counter its operator runs as it is): the path is the
    block mask's, one attention kernel per layer reading q, k, v and the block mask, and no dense mask built."""
    from coati_kto.testing.kernels import ATTENTION

    ids, mask = torch.randint(0, 32, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # a right-padded row: transformers' BlockMask, not a [2, 1, 6, 6] tensor
    try:
        with torch.no_grad(), KernelCounter(log=True) as count:
            _llama("flex_attention")(input_ids=ids, attention_mask=mask)
    finally:
        # Dynamo cached what it made of flex_attention under the counter's dispatch mode; a later compiled
        # flex_attention in this process (tests/distributed/test_padding_free.py) must not reuse it.
        torch._dynamo.reset()
    assert count.summary(1)["attention"] == ["flex block mask x2"]
    flex = [(op, read) for op, category, _, read, _ in count.log if category == ATTENTION and "flex" in op]
    assert len(flex) == 2 and all(read >= 3 * 2 * 2 * 6 * 8 * 4 for _, read in flex)  # q, k, v fp32


def test_backward_of_a_composite_takes_its_context() -> None:
    """A Linear on a 3D input is view -> mm -> view: the backward's matmuls are the model's, not 'other'
    (the autograd nodes behind the output's node are tagged too)."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(3, 5), torch.randn(2, 4, 3, requires_grad=True)
    with KernelCounter(log=True) as count:
        linear(x).sum().backward()
    matmuls = [(op, category) for op, category, *_ in count.log if op.startswith("aten.mm")]
    assert matmuls and all(category == MATMUL for _, category in matmuls), matmuls
    assert count.kernels[MATMUL] == 3, count.log


def test_fused_adamw_writes_its_gradients_only_when_it_unscales_them() -> None:
    """torch.optim.AdamW(fused=True), a steady step: the step count's increment and one fused kernel reading the
    parameter, gradient and moments and writing the parameter and moments (ATen stores the gradients only when
    it unscales them: grad_scale given)."""
    param = torch.nn.Parameter(torch.randn(100))
    param.grad = torch.randn(100)
    opt = torch.optim.AdamW([param], lr=1e-2, fused=True)
    opt.step()  # the states' creation
    with KernelCounter() as count:
        opt.step()
    tensor = 100 * F32
    assert count.kernels[OPTIMIZER] == 2
    assert count.read[OPTIMIZER] == F32 + 4 * tensor + F32  # step increment; param, grad, moments, step
    assert count.written[OPTIMIZER] == F32 + 3 * tensor
    state = opt.state[param]
    lists = ([param.detach()], [param.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]])
    kwargs = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8}
    with KernelCounter() as unscaling:
        torch._fused_adamw_(*lists, amsgrad=False, maximize=False, grad_scale=torch.tensor(2.0), **kwargs)
    assert unscaling.written[OTHER] == 4 * tensor  # the gradients too


def test_the_lm_head_is_counted_in_a_gpus_chunks_on_a_cpu() -> None:
    """The CPU runs the chunked LM head in 32 MiB blocks, a GPU in 256 MiB ones: counted on a CPU, the head's
    kernels are the GPU's (one chunk here), not the CPU's 2."""
    from coati_kto.models.logprobs import _vocab_chunk, head_token_logps

    cpu = torch.device("cpu")
    positions, vocab = 4096, 4096
    assert _vocab_chunk(positions, vocab, None, cpu) == 2048
    hidden, weight = torch.randn(positions, 8), torch.randn(vocab, 8)
    targets = torch.randint(0, vocab, (positions,))
    with KernelCounter(log=True) as counter:
        assert _vocab_chunk(positions, vocab, None, cpu) == vocab
        head_token_logps(hidden, weight, None, targets)
    assert _vocab_chunk(positions, vocab, None, cpu) == 2048  # restored on exit
    matmuls = [op for op, *_ in counter.log if op.split(".")[1] in ("mm", "addmm")]
    assert len(matmuls) == 1, counter.log
