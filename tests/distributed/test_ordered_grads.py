"""ZeRO's gradient reduction when a rank's backward leaves a trainable parameter without a gradient
(coati_kto.parallel.ordered_grads), 2 real gloo processes.

ColossalAI's ZeRO buckets each gradient as its backward hook fires and reduces the buckets flat: every rank must
reach the same parameters in the same order. An MoE whose tokens on one rank miss a parameter (LongCat-Flash's
identity experts: no token of a layer reached the routed experts) breaks that. Where the two ranks' buckets differ
in size gloo aborts (NCCL may hang); where they have the same size the reduction adds one parameter's gradient
to another's, silently. The toy model here does both, by which parameter each rank uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from coati_kto.testing.distributed import run_distributed

SIZE = 8


class RankDependent(nn.Module):
    """``always`` is used on every rank, ``first`` only on rank 0, ``second`` only where ``use_second``."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Parameter(torch.arange(SIZE, dtype=torch.float32))
        self.first = nn.Parameter(torch.ones(SIZE))
        self.second = nn.Parameter(torch.ones(SIZE))

    def forward(self, x: torch.Tensor, rank: int, use_second: bool) -> torch.Tensor:
        loss = (self.always * x).sum()
        if rank == 0:
            loss = loss + (self.first * x).square().sum()
        if use_second:
            loss = loss + (self.second * x).exp().sum()
        return loss


def _expected(x: list[torch.Tensor], used_second: list[bool]) -> dict[str, torch.Tensor]:
    """The gradients averaged over ranks, each rank's absent parameter counting 0, computed here in fp32."""
    model, total = RankDependent(), {}
    for rank, (xr, second) in enumerate(zip(x, used_second, strict=True)):
        model.zero_grad()
        model(xr, rank, second).backward()
        for name, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            total[name] = total.get(name, 0) + grad / len(x)
    return total


def _worker(stage: int, ordered: bool, second_on: str) -> dict:
    import torch.distributed as dist
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    from coati_kto.parallel import upstream
    from coati_kto.parallel.ordered_grads import install_ordered_reduction

    upstream.apply()
    rank = dist.get_rank()
    x = [torch.linspace(-1, 1, SIZE) * (r + 1) for r in range(2)]
    used_second = [second_on == "both", second_on in ("both", "rank1")]
    model = RankDependent()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    booster = Booster(
        plugin=LowLevelZeroPlugin(stage=stage, precision="fp32", **upstream.cpu.plugin_overrides())
    )
    model, optimizer, *_ = booster.boost(model, optimizer)
    installed = install_ordered_reduction(optimizer) if ordered else False
    before = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    booster.backward(model(x[rank], rank, used_second[rank]), optimizer)
    optimizer.step()
    after = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    return {
        "installed": installed,
        "update": {n: (before[n] - after[n]).tolist() for n in before},  # SGD at lr 1: the reduced gradient
        "expected": {n: g.tolist() for n, g in _expected(x, used_second).items()},
    }


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("second_on", ["both", "rank1"])
def test_a_parameter_missing_on_one_rank_reduces_as_zero(stage: int, second_on: str) -> None:
    """``second_on="both"``: rank 1 lacks ``first`` (bucket sizes differ). ``"rank1"``: rank 0 has ``first``,
    rank 1 ``second``, of the same size (upstream then sums them into each other without an error)."""
    results = run_distributed(_worker, 2, stage, True, second_on, timeout_s=300)
    for result in results:
        assert result["installed"]
        for name, expected in result["expected"].items():
            torch.testing.assert_close(
                torch.tensor(result["update"][name]), torch.tensor(expected), rtol=1e-6, atol=1e-6, msg=name
            )
    for name in results[0]["update"]:  # the replicas stay equal
        assert results[0]["update"][name] == results[1]["update"][name], name


def test_upstream_reduction_mixes_same_sized_gradients() -> None:
    """The hazard is real on the installed ColossalAI: without the ordered reduction, ZeRO-2 with rank 0 using
    ``first`` and rank 1 ``second`` (same size) reduces ``first``'s gradient into ``second``'s (a canary: once
    upstream buckets in parameter order, this fails and the ordered reduction may go)."""
    results = run_distributed(_worker, 2, 2, False, "rank1", timeout_s=300)
    wrong = [
        name
        for result in results
        for name, expected in result["expected"].items()
        if not torch.allclose(
            torch.tensor(result["update"][name]), torch.tensor(expected), rtol=1e-6, atol=1e-6
        )
    ]
    assert wrong, "upstream reduced the rank-dependent gradients correctly"


def _accumulated_worker() -> dict:
    """One ZeRO-1 rank with overlap_communication on (the CUDA default: ZeRO-1 then stores gradients from backward
    hooks), the project's gradient path, accumulation 2: micro-batch 1 (under no_sync) reaches ``second``,
    micro-batch 2 does not. SGD at lr 1: the update is the summed gradient."""
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    from coati_kto.parallel import optimizer_path, upstream
    from coati_kto.parallel.ordered_grads import install_ordered_reduction

    upstream.apply()
    model = RankDependent()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32", overlap_communication=True))
    model, optimizer, *_ = booster.boost(model, optimizer)
    optimizer_path.install_clipping(optimizer)
    optimizer_path.install_single_rank_zero(optimizer)
    installed = install_ordered_reduction(optimizer)
    x = torch.linspace(-1, 1, SIZE)
    before = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    with booster.no_sync(model, optimizer):
        booster.backward(model(x, 1, True), optimizer)
    booster.backward(model(x, 1, False), optimizer)
    optimizer.step()
    return {
        "installed": installed,
        "update": {n: (before[n] - p.detach()).tolist() for n, p in model.unwrap().named_parameters()},
    }


def test_one_zero_rank_keeps_the_accumulated_gradient_the_last_micro_batch_does_not_reach() -> None:
    """At one ZeRO-1 rank with overlap on (the GPU default), a parameter that only an earlier micro-batch of the
    step reached (a vision tower's image records, then a text-only micro-batch; an expert) had its accumulated
    gradient dropped: no backward hook of the last micro-batch stored it. Before: an update of 0."""
    (result,) = run_distributed(_accumulated_worker, 1, timeout_s=300)
    assert result["installed"]
    x = torch.linspace(-1, 1, SIZE)
    expected = {"always": 2 * x, "first": torch.zeros(SIZE), "second": (x * torch.exp(x))}
    for name, grad in expected.items():
        torch.testing.assert_close(torch.tensor(result["update"][name]), grad, rtol=1e-6, atol=1e-6, msg=name)


def _two_steps_worker(stage: int) -> dict:
    """ZeRO on 2 ranks, AdamW with decay, the ordered reduction: step 1 every rank reaches ``second``, step 2
    none does (rank 1 never reaches ``first``). Each parameter's value after each step."""
    import torch.distributed as dist
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    from coati_kto.parallel import upstream
    from coati_kto.parallel.ordered_grads import install_ordered_reduction

    upstream.apply()
    rank = dist.get_rank()
    model = RankDependent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    booster = Booster(
        plugin=LowLevelZeroPlugin(stage=stage, precision="fp32", **upstream.cpu.plugin_overrides())
    )
    model, optimizer, *_ = booster.boost(model, optimizer)
    install_ordered_reduction(optimizer)
    x = torch.linspace(-1, 1, SIZE) * (rank + 1)
    values = []
    for use_second in (True, False):
        booster.backward(model(x, rank, use_second), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        values.append({n: p.detach().tolist() for n, p in model.unwrap().named_parameters()})
    counts = {k: getattr(optimizer, f"{k}_grads", None) for k in ("unreached", "zero_filled")}
    return {"values": values, "unreached": counts["unreached"], "filled": counts["zero_filled"]}


def _two_steps_expected() -> list[dict[str, list[float]]]:
    """torch's AdamW on one process over the ranks' averaged gradients (a rank that missed a parameter adds 0);
    no gradient (None) where no rank reached it: not updated, its moments not advanced."""
    model = RankDependent()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    x = [torch.linspace(-1, 1, SIZE) * (r + 1) for r in range(2)]
    values = []
    for use_second in (True, False):
        optimizer.zero_grad()
        for rank, xr in enumerate(x):
            (model(xr, rank, use_second) / len(x)).backward()
        optimizer.step()
        values.append({n: p.detach().tolist() for n, p in model.named_parameters()})
    return values


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_no_rank_reached_is_not_stepped(stage: int) -> None:
    """A parameter no rank's backward reached in a step (a vision tower in a text-only step) was filled with
    zeros on every rank and stepped: AdamW moved it on its earlier momentum and decay, where one process, torch
    DDP and upstream's ZeRO leave it. Before: ``second`` moved in step 2."""
    results = run_distributed(_two_steps_worker, 2, stage, timeout_s=300)
    expected = _two_steps_expected()
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["values"], expected, strict=True)):
            for name in want:
                torch.testing.assert_close(
                    torch.tensor(got[name]),
                    torch.tensor(want[name]),
                    rtol=1e-6,
                    atol=1e-6,
                    msg=f"{name} {step}",
                )
        assert result["values"][0]["second"] == result["values"][1]["second"]
        assert result["unreached"] == 1  # ``second`` in step 2
        assert result["filled"] == 2 * rank  # ``first``, which rank 1 never reaches, in each step


# ------------------------------------------------------------------ a real MoE through the trainer
ZERO_EXPERTS = 256  # beside 4 routed experts: a layer's tokens on one rank often all miss the routed ones


def _tiny_longcat(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from coati_kto.testing.tiny import build_tokenizer
    from coati_kto.testing.tiny_types import tiny_config

    tokenizer = build_tokenizer([f"word{i} token{i % 7}" for i in range(400)], vocab_size=300)
    config = tiny_config("longcat_flash", tokenizer)
    config.zero_expert_num = ZERO_EXPERTS
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _longcat_step(model_dir: str, out_dir: str, plugin: str, zero_stage: int, precision: str) -> dict:
    """One optimizer step over the 4 micro-batches of test_router_aux (2 per rank, or 4 on one process); the
    parameters' change, and how many gradients the ordered reduction filled with zeros."""
    import numpy as np
    import torch.distributed as dist
    from test_router_aux import _micro_batches, built

    from coati_kto.config.schema import Config

    world = dist.get_world_size()
    cfg = Config.model_validate(
        {
            "model": {"path": model_dir},
            "data": {"train_files": ["unused.jsonl"], "prepared_dir": str(Path(out_dir) / "prepared")},
            "output": {"dir": out_dir},
            "train": {"lr": 1e-2, "accumulation_steps": 4 // world, "micro_batch_size": 3},
            "plugin": {"name": plugin, "precision": precision, "zero_stage": zero_stage},
        }
    )
    parts, trainer = built(cfg, accumulation_steps=4 // world)
    params = [p for p in parts.policy.unwrap().parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    trainer.fit(_micro_batches()[dist.get_rank() :: world])
    change = np.concatenate(
        [(p.detach().float() - b.float()).flatten().numpy() for p, b in zip(params, before, strict=True)]
    )
    ddp = getattr(parts.policy, "module", None)  # torch DDP under the ddp plugin
    return {
        "change": change,
        "filled": getattr(parts.optimizer, "zero_filled_grads", None),
        "find_unused": getattr(ddp, "find_unused_parameters", None),
    }


CASES = {  # name: (plugin, zero stage, precision, largest change apart relative to the largest change, share apart)
    # fp32: AdamW's first step divides each gradient by its own size, so rounding of the order of summation
    # shows on the gradients near 0 (the elements stay within 1e-3 of the largest change)
    "low_level_zero1_fp32": ("low_level_zero", 1, "fp32", 1e-3, 0.0),
    "low_level_zero2_fp32": ("low_level_zero", 2, "fp32", 1e-3, 0.0),
    # bf16 (hybrid ZeRO needs it): gradients rounded to bf16 in another order; AdamW's first step is about
    # lr * sign(gradient), so a tiny gradient's sign may differ: a few elements apart, most within rounding
    "hybrid_zero2_bf16": ("hybrid_parallel", 2, "bf16", 2.5, 0.01),
    "ddp_fp32": ("ddp", 0, "fp32", 1e-3, 0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_longcat_zero_experts_train_as_on_one_process(tmp_path: Path, case: str) -> None:
    """LongCat-Flash with 256 identity experts: before, the step aborted on 2 ranks under ZeRO (gloo: a
    gradient collective of mismatched sizes); DDP looked for unused parameters already. Now the 2-rank step equals the one-process step over the same
    micro-batches, and some rank's backward did leave a routed-expert parameter out."""
    plugin, zero_stage, precision, apart, share = CASES[case]
    _tiny_longcat(tmp_path / "model")
    model, out = str(tmp_path / "model"), str(tmp_path / "out")
    one = run_distributed(_longcat_step, 1, model, out + "1", plugin, zero_stage, precision)[0]
    two = run_distributed(_longcat_step, 2, model, out + "2", plugin, zero_stage, precision)
    assert one["filled"] in (None, 0)  # one rank: nothing to fill (DDP has no count)
    if plugin == "ddp":  # torch DDP's own answer: it looks for unused parameters (coati_kto.parallel.unused)
        assert all(r["find_unused"] is True for r in two)
    else:
        assert sum(r["filled"] for r in two) > 0, (
            "no rank left a parameter without a gradient: a vacuous test"
        )
    scale = float(abs(one["change"]).max())
    assert scale > 1e-4
    assert (two[0]["change"] == two[1]["change"]).all()  # the replicas stay equal
    diff = abs(two[0]["change"] - one["change"])
    assert float(diff.max()) <= apart * scale
    assert float((diff > 1e-3 * scale).mean()) <= share


def test_only_models_that_can_leave_a_parameter_out_take_the_ordered_reduction(tmp_path: Path) -> None:
    """Dense and fused-expert models keep upstream's overlapped buckets; identity experts and separate expert
    modules take the ordered reduction."""
    import transformers as tf

    from coati_kto.parallel.ordered_grads import data_dependent_graph
    from coati_kto.testing.tiny import random_causal_lm

    dense = random_causal_lm(tf.LlamaForCausalLM, tf.LlamaConfig)
    fused = random_causal_lm(
        tf.MixtralForCausalLM, tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2
    )
    _tiny_longcat(tmp_path / "longcat")
    longcat = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "longcat")
    separate = nn.Module()
    separate.experts = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert not data_dependent_graph(dense)
    assert not data_dependent_graph(fused)
    assert data_dependent_graph(longcat)
    assert data_dependent_graph(separate)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_experts_reach_the_same_parameters_in_one_order_whatever_the_routing(family: str) -> None:
    """Why fused-expert MoEs need no ordered reduction: over 30 random batches (1-3 rows of 1-11 tokens, routers
    far from uniform) every parameter gets a gradient, and the gradients' hooks fire in one order."""
    import transformers as tf

    from coati_kto.testing.tiny import random_causal_lm

    if family == "mixtral":
        model = random_causal_lm(
            tf.MixtralForCausalLM, tf.MixtralConfig, num_local_experts=8, num_experts_per_tok=2
        )
    else:
        model = random_causal_lm(
            tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, head_dim=8,
        )  # fmt: skip
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 2)
    order: list[str] = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
    orders = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        rows, length = (
            int(torch.randint(1, 4, (1,), generator=gen)),
            int(torch.randint(1, 12, (1,), generator=gen)),
        )
        order.clear()
        model.zero_grad(set_to_none=True)
        model(input_ids=torch.randint(3, 200, (rows, length), generator=gen)).logits.float().sum().backward()
        assert len(order) == len(names)
        orders.add(tuple(order))
    assert len(orders) == 1
