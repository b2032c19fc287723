"""tp_size 2 equals tp_size 1 (fp32) under the project's shardformer policies: per-head norms, fused projections.

Qwen3 and Gemma 3 normalise every query / key head with one shared weight (``q_norm``, ``k_norm``). At tp_size 2 each rank
holds half of the heads, so each rank's gradient of those weights covers only its heads; the policy sums them
over the tensor-parallel group (coati_kto.families.shardformer.base). Checked on 2 gloo processes: three SGD
steps of the tp_size 2 model against an unsharded copy trained on the same batches (tp_size 1) on each rank:
the per-head norms' gradients and every weight after the steps agree within fp32 rounding; with the sum turned
off the same comparison fails (1e-3 or more), so the test sees the bug it guards against.

Phi-3 fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``): split part by part, each rank holds its own
heads and MLP slice. Checked the same way, with the gradient of every decoder parameter on each rank equal to the
matching slice of the unsharded gradient, and the export (the gathered weights in a fresh transformers model)
giving the unsharded model's log-probs; split contiguously instead (the bug: heads mixed), it fails.

Gemma 4 (sliding and full layers with their own head_dim and key-value heads, values = keys, kv-shared layers,
per-layer inputs, soft-capping) is checked like Gemma 3 (its q/k norms' sum turned off fails). Qwen 3.5's
Gated DeltaNet layers are checked on every per-head parameter (fused in_proj_qkv, conv1d, z/b/a projections,
A_log, dt_bias, the gated norm, out_proj); with in_proj_qkv and conv1d split contiguously (heads mixed) it fails.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import CORPUS, step_all, weight_diffs

from coati_kto.testing.distributed import run_distributed

STEPS = 3
# Gemma 3 (scaled tied embeddings) at lr 1 amplifies fp32 rounding ~25x per step: a 1e-7 relative perturbation of
# one unsharded copy reached 1.1e-4 in the logits after two steps (Qwen3: 4.8e-6). At 0.1 rounding stays rounding.
LR = 0.1
# Gemma 4's tiny model (attention scaling 1, scaled tied embeddings, per-layer inputs) is more sensitive still: an
# unsharded copy whose weights are perturbed by 1e-7 (relative) differs in its gradients by 4.6e-6 at step 0 and
# 3.2e-3 after two steps at lr 0.1 (Gemma 3: 5.8e-7), and at lr 0.01 by 1.7e-4, with log-probs 5.0e-5 apart after
# three steps. At lr 0.01 tp_size 2 stays within that rounding floor.
FAMILY_LR = {"gemma4": 0.01}
EXPORT_TOLERANCE = {"gemma4": 5e-5}
GRAD_TOLERANCE = {
    "gemma4": 5e-5
}  # relative to the gradients' scale (measured 1.1e-5 at step 3; 1e-5 elsewhere)
NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# The parameters whose gradients are compared at every step: those that act on a rank's own heads.
PER_HEAD = {
    "qwen3": NORMS,
    "gemma3": NORMS,
    "olmo3": ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.q_proj.weight"),
    "gemma4": NORMS + ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight"),
    "qwen3_5": NORMS
    + (
        "self_attn.q_proj.weight",
        "linear_attn.norm.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.conv1d.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
        "linear_attn.A_log",
        "linear_attn.dt_bias",
        "linear_attn.out_proj.weight",
    ),
    "qwen3_5_vl": (),  # filled below: the text model's
    "gemma4_vl": (),
    "phi3": (
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
    ),
}

PER_HEAD["qwen3_5_vl"], PER_HEAD["gemma4_vl"] = PER_HEAD["qwen3_5"], PER_HEAD["gemma4"]
FAMILY_LR["gemma4_vl"], EXPORT_TOLERANCE["gemma4_vl"] = FAMILY_LR["gemma4"], EXPORT_TOLERANCE["gemma4"]
GRAD_TOLERANCE["gemma4_vl"] = GRAD_TOLERANCE["gemma4"]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _break(policy_class: type, family: str) -> None:
    """The bug each family's check guards against."""
    if family == "phi3":  # fused projections split contiguously: rank 0 gets all of q, rank 1 k and v
        policy_class.column_parallel = tuple(policy_class.fused_column)
        policy_class.fused_column = {}
    elif family.startswith(
        "qwen3_5"
    ):  # linear attention's fused qkv and its conv1d split contiguously: heads mixed
        from colossalai.tensor.d_tensor.api import shard_rowwise, sharded_tensor_to_existing_param

        from coati_kto.families.shardformer import qwen3_5

        policy_class.column_parallel += tuple(policy_class.fused_column)
        policy_class.fused_column = {}
        qwen3_5._split_part_by_part = lambda param, sizes, group: sharded_tensor_to_existing_param(
            shard_rowwise(param.data, group), param
        )
    elif (
        family == "olmo3"
    ):  # whole-projection norms without the reduction: each rank normalises its slice alone
        from coati_kto.families.shardformer.olmo3 import RMSNormAcrossRanks

        def local(self: Any, x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            return (
                self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            ).to(x.dtype)

        RMSNormAcrossRanks.forward = local
    else:  # per-head norms' gradients left per rank
        policy_class.per_head_replicated = ()


def _expected_shard(
    name: str, full: torch.Tensor, shard: torch.Tensor, policy: Any, config: Any
) -> torch.Tensor:
    """This rank's slice of the unsharded ``full`` as the policy lays it out (``shard``'s shape)."""
    import torch.distributed as dist
    from colossalai.shardformer.layer.qkv_fused_linear import split_fused_qkv_in_gpt2_style

    if full.shape == shard.shape:
        return full
    fused_column = dict(policy.fused_column)
    if "linear_attn.in_proj_qkv" in fused_column:  # Qwen 3.5's conv1d channels are in_proj_qkv's outputs
        fused_column["linear_attn.conv1d"] = fused_column["linear_attn.in_proj_qkv"]
    fused = next((sizes for suffix, sizes in fused_column.items() if name.endswith(f"{suffix}.weight")), None)
    if fused is not None:
        return split_fused_qkv_in_gpt2_style(full, fused(config), None)
    dim = next(d for d in range(full.dim()) if full.shape[d] != shard.shape[d])
    return full.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _tp_vs_tp1(family: str, summed: bool) -> dict[str, Any]:
    from colossalai.booster import Booster

    from coati_kto.families.shardformer import policy_for
    from coati_kto.models.hf import freeze_vision_tower
    from coati_kto.parallel import upstream
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    upstream.apply()
    tokenizer = build_tokenizer(CORPUS, vocab_size=300, style="chatml")
    model = build_family_model(family, tokenizer, seed=1)
    freeze_vision_tower(model)  # as training does: the text passes never reach it
    policy_class = type(policy_for(type(model).__name__, 2))
    if not summed:
        _break(policy_class, family)
    exported = copy.deepcopy(model)  # receives the gathered weights: the export
    single = copy.deepcopy(model)  # tp_size 1: the unsharded model, same batches, same optimizer
    plan = ParallelPlan("hybrid_parallel", "fp32", 0, tp_size=2, model_class=type(model).__name__)
    booster = Booster(plugin=plan.backend.build_plugin())
    lr = FAMILY_LR.get(family, LR)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=lr)
    model, optimizer, _ = plan.backend.boost(booster, model, optimizer, None)
    generator = torch.Generator().manual_seed(0)
    grad_diffs, grad_scale, per_head = [], 0.0, PER_HEAD[family]
    for _ in range(STEPS):
        ids = torch.randint(0, len(tokenizer), (2, 12), generator=generator)
        booster.backward(_loss(model(input_ids=ids).logits, ids), optimizer)
        _loss(single(input_ids=ids).logits, ids).backward()
        sharded = dict(model.unwrap().named_parameters())
        for name, param in single.named_parameters():
            if name.endswith(per_head) and param.requires_grad:
                expected = _expected_shard(
                    name, param.grad, sharded[name].grad, policy_class, single.config.get_text_config()
                )
                grad_diffs.append(float((sharded[name].grad - expected).abs().max()))
                grad_scale = max(grad_scale, float(param.grad.abs().max()))
        step_all(optimizer, single_optimizer)
    trained = model.unwrap().state_dict()  # gathered: a collective under tensor parallelism
    expected = single.state_dict()
    diffs = weight_diffs(trained, expected)
    exported.load_state_dict(trained)
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=generator)
    with torch.no_grad():
        logps = [torch.log_softmax(m(input_ids=ids).logits.float(), -1) for m in (exported, single)]
    return {
        "export_logps_diff": float((logps[0] - logps[1]).abs().max()),
        "grad_diff": max(grad_diffs),
        "grad_scale": grad_scale,
        "weight_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.get),
        "norm_weight_diff": max(v for k, v in diffs.items() if k.endswith(per_head)),
        "missing": sorted(set(expected) - set(trained)),
    }


@pytest.fixture(scope="module", params=list(PER_HEAD))
def runs(request: pytest.FixtureRequest) -> dict[str, Any]:
    family = request.param
    return {"family": family, "summed": run_distributed(_tp_vs_tp1, 2, family, True)}


# The hub classes (``_vl``) run their text family's policy: its break is checked once, on the text class.
@pytest.fixture(scope="module", params=[f for f in PER_HEAD if not f.endswith("_vl")])
def broken_runs(request: pytest.FixtureRequest) -> dict[str, Any]:
    family = request.param
    return {"family": family, "unsummed": run_distributed(_tp_vs_tp1, 2, family, False)}


def test_tp2_equals_tp1(runs: dict[str, Any]) -> None:
    for rank in runs["summed"]:
        print(runs["family"], rank)
        assert rank["missing"] == []
        assert rank["grad_scale"] > 1e-3  # the norms' gradients are not trivially zero
        assert rank["grad_diff"] <= GRAD_TOLERANCE.get(runs["family"], 1e-5) * rank["grad_scale"], rank
        # SGD (lr 0.1): weight differences are 0.1 x gradient differences, summation order only (measured
        # 7.5e-9 Qwen3, 4.7e-8 Gemma 3); without the sum the norms miss by 3.6e-4 and 4.4e-4.
        assert rank["norm_weight_diff"] <= 1e-6 and rank["weight_diff"] <= 1e-5, rank
        assert rank["export_logps_diff"] <= EXPORT_TOLERANCE.get(runs["family"], 1e-5), rank


def test_without_the_sum_tp2_drifts(broken_runs: dict[str, Any]) -> None:
    """The comparison above catches the per-rank norm gradients: without the sum they miss by far more."""
    for rank in broken_runs["unsummed"]:
        print(broken_runs["family"], rank)
        assert rank["grad_diff"] > 1e-3 * rank["grad_scale"], rank
        assert rank["norm_weight_diff"] > 1e-4, rank
