"""kto_loss, apo_zero_unpaired (preference_loss) and estimate_kl against hand computations, closed-form
gradients and a real 2-process gloo group."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coati_kto.trainer.loss import (
    estimate_kl,
    estimate_kl_raw,
    implied_reward,
    kto_loss,
    log_ratio,
    needs_kl,
    preference_loss,
)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _hand(policy, ref, labels, kl, beta, wd, wu):
    """Eq. 7 with python floats: (losses, rewards, d loss / d policy_logp by Prop. 4.1)."""
    losses, rewards, grads = [], [], []
    for p, q, y in zip(policy, ref, labels, strict=True):
        r = p - q
        z = beta * (r - kl) if y else beta * (kl - r)
        lam = wd if y else wu
        losses.append(lam * (1.0 - _sig(z)))
        rewards.append(beta * r)
        grads.append((-1.0 if y else 1.0) * lam * beta * _sig(z) * _sig(-z))
    return losses, rewards, grads


CASES = [
    # policy, reference, labels, kl, beta, desirable_weight, undesirable_weight
    ([-10.0, -12.5, -3.0, -40.0], [-11.0, -12.0, -5.0, -38.0], [1, 0, 1, 0], 0.0, 0.1, 1.0, 1.0),
    ([-10.0, -12.5, -3.0, -40.0], [-11.0, -12.0, -5.0, -38.0], [1, 0, 0, 1], 0.7, 0.5, 1.33, 0.75),
    ([-1.0, -2.0, -30.0], [-4.0, -2.0, -10.0], [1, 1, 1], 1.5, 0.1, 2.0, 1.0),  # all desirable
    ([-1.0, -2.0, -30.0], [-4.0, -2.0, -10.0], [0, 0, 0], 1.5, 0.2, 1.0, 3.0),  # all undesirable
    ([-5.0], [-5.0], [0], 0.25, 1.0, 1.0, 1.0),  # batch of one
]


@pytest.mark.parametrize("policy,ref,labels,kl,beta,wd,wu", CASES)
@pytest.mark.parametrize("kl_as_tensor", [False, True])
def test_kto_loss_matches_hand_computation(policy, ref, labels, kl, beta, wd, wu, kl_as_tensor):
    p = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    kl_t = torch.tensor(kl, requires_grad=True) if kl_as_tensor else kl
    lab = torch.tensor(labels).bool()
    losses, rewards = kto_loss(p, torch.tensor(ref), lab, kl_t, beta, wd, wu)
    exp_losses, exp_rewards, exp_grads = _hand(policy, ref, labels, kl, beta, wd, wu)

    assert losses.dtype == rewards.dtype == torch.float32
    assert torch.isfinite(losses).all() and torch.isfinite(rewards).all()
    assert losses.tolist() == pytest.approx(exp_losses, abs=1e-6)
    assert rewards.tolist() == pytest.approx(exp_rewards, abs=1e-5)
    assert not rewards.requires_grad

    losses.sum().backward()
    assert p.grad.tolist() == pytest.approx(exp_grads, abs=1e-6)
    if kl_as_tensor:  # z0 is a constant of the update: no gradient into it
        assert kl_t.grad is None or float(kl_t.grad.abs().sum()) == 0.0


def _hand_apo(policy, ref, labels, beta, wd, wu):
    """APO-zero unpaired (arXiv 2408.06266 Eq. 7 unpaired; TRL loss_type="apo_zero_unpaired") in fp64 floats:
    desirable wd * (1 - sigmoid(beta r)), undesirable wu * sigmoid(beta r); d/d policy_logp by hand."""
    losses, rewards, grads = [], [], []
    for p, q, y in zip(policy, ref, labels, strict=True):
        x = beta * (p - q)
        if y:
            losses.append(wd * (1.0 - _sig(x)))
            grads.append(-wd * beta * _sig(x) * (1.0 - _sig(x)))
        else:
            losses.append(wu * _sig(x))
            grads.append(wu * beta * _sig(x) * (1.0 - _sig(x)))
        rewards.append(x)
    return losses, rewards, grads


@pytest.mark.parametrize("policy,ref,labels,kl,beta,wd,wu", CASES)
def test_apo_zero_unpaired_matches_hand_computation(policy, ref, labels, kl, beta, wd, wu):
    p = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    lab = torch.tensor(labels).bool()
    losses, rewards = preference_loss("apo_zero_unpaired", p, torch.tensor(ref), lab, None, beta, wd, wu)
    exp_losses, exp_rewards, exp_grads = _hand_apo(policy, ref, labels, beta, wd, wu)
    assert losses.dtype == rewards.dtype == torch.float32
    assert losses.tolist() == pytest.approx(exp_losses, abs=1e-6)
    assert rewards.tolist() == pytest.approx(exp_rewards, abs=1e-5)
    losses.sum().backward()
    assert p.grad.tolist() == pytest.approx(exp_grads, abs=1e-6)
    # It is not KTO with this case's z0 (where z0 != 0): the reference point is gone, not just moved.
    if kl != 0.0:
        kto = kto_loss(p.detach(), torch.tensor(ref), lab, kl, beta, wd, wu)[0]
        assert not torch.allclose(kto, losses)


def test_apo_undesirable_loss_rises_with_its_log_ratio():
    # An undesirable completion made more likely than under the reference costs more; a desirable one less.
    ref = torch.zeros(3)
    up = torch.tensor([-1.0, 0.0, 1.0])
    und = preference_loss("apo_zero_unpaired", up, ref, torch.zeros(3, dtype=torch.bool), None)[0]
    des = preference_loss("apo_zero_unpaired", up, ref, torch.ones(3, dtype=torch.bool), None)[0]
    assert und[0] < und[1] < und[2] and des[0] > des[1] > des[2]
    assert float(und[1]) == float(des[1]) == 0.5


def test_preference_loss_checks_its_reference_point():
    p, lab = torch.zeros(2), torch.tensor([True, False])
    with pytest.raises(ValueError, match="kl must be None"):
        preference_loss("apo_zero_unpaired", p, p, lab, 0.0)
    with pytest.raises(ValueError, match="kl must be given"):
        preference_loss("kto", p, p, lab, None)
    with pytest.raises(ValueError, match="not in"):
        needs_kl("dpo")
    assert needs_kl("kto") and not needs_kl("apo_zero_unpaired")
    assert torch.equal(preference_loss("kto", p, p, lab, 0.3)[0], kto_loss(p, p, lab, 0.3)[0])


def test_labels_as_ints_and_bools_agree():
    p, q = torch.tensor([-3.0, -4.0, -5.0]), torch.tensor([-3.5, -3.0, -6.0])
    a = kto_loss(p, q, torch.tensor([1, 0, 1]), 0.2)[0]
    b = kto_loss(p, q, torch.tensor([True, False, True]), 0.2)[0]
    assert torch.equal(a, b)


def test_bf16_inputs_are_upcast():
    p = torch.tensor([-100.0, -200.0], dtype=torch.bfloat16, requires_grad=True)
    q = torch.tensor([-101.0, -198.0], dtype=torch.bfloat16)
    losses, rewards = kto_loss(p, q, torch.tensor([True, False]), torch.tensor(0.5))
    exp_losses, exp_rewards, exp_grads = _hand([-100.0, -200.0], [-101.0, -198.0], [1, 0], 0.5, 0.1, 1, 1)
    assert losses.dtype == torch.float32 and rewards.dtype == torch.float32
    assert losses.tolist() == pytest.approx(exp_losses, abs=1e-6)
    losses.sum().backward()
    assert p.grad.dtype == torch.bfloat16
    assert p.grad.float().tolist() == pytest.approx(exp_grads, rel=1e-2)


def test_empty_batch_gives_empty_tensors():
    empty = torch.zeros(0, requires_grad=True)
    losses, rewards = kto_loss(empty, torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.3)
    assert losses.shape == rewards.shape == (0,)
    losses.sum().backward()  # still a graph: every rank can call backward
    assert empty.grad.shape == (0,)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        kto_loss(torch.zeros(3), torch.zeros(3), torch.ones(2, dtype=torch.bool), 0.0)


@pytest.mark.parametrize(
    "policy,ref,expected",
    [
        ([-3.0, 1.0], [0.0, 0.0], 0.0),  # mean -1 -> clamped after averaging
        ([3.0, -1.0], [0.0, 0.0], 1.0),  # clamp per element would give 1.5
        ([-10.0, -20.0, -30.0], [-12.0, -19.0, -30.5], 0.5),
        ([], [], 0.0),
    ],
)
def test_estimate_kl_single_process(policy, ref, expected):
    p = torch.tensor(policy, requires_grad=True)
    kl = estimate_kl(p, torch.tensor(ref))
    assert kl.shape == () and kl.dtype == torch.float32 and not kl.requires_grad
    assert float(kl) == pytest.approx(expected, abs=1e-6)


def test_estimate_kl_raw_is_the_unclamped_mean():
    raw = estimate_kl_raw(torch.tensor([-3.0, 1.0]), torch.zeros(2))
    assert float(raw) == -1.0 and float(estimate_kl(torch.tensor([-3.0, 1.0]), torch.zeros(2))) == 0.0
    assert float(estimate_kl_raw(torch.zeros(0), torch.zeros(0))) == 0.0


def test_estimate_kl_bf16_inputs_return_fp32():
    kl = estimate_kl(torch.tensor([2.0, 4.0], dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16))
    assert kl.dtype == torch.float32 and float(kl) == 3.0


# (rank 0 diffs, rank 1 diffs): the reference point is over the union, never the mean of per-rank means.
DIST_CASES = [
    ([4.0], [0.0, 0.0, 0.0]),  # global mean 1.0; mean of means would be 2.0
    ([], [1.0, 2.0, 6.0]),  # rank 0 holds no KL pair: 3.0; a naive mean would hit 0/0
    ([-8.0], [1.0, 2.0, 1.0]),  # global -1 -> 0; rank 1 alone would say 1.33
    ([], []),  # nobody holds any pair -> 0
]


def _dist_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])  # an explicit (data-parallel) group, not the default one
        results = []
        for case in DIST_CASES:
            diffs = case[rank]
            ref = torch.full((len(diffs),), -5.0, dtype=torch.bfloat16)
            pol = (ref.float() + torch.tensor(diffs)).to(torch.bfloat16)  # bf16 in: fp32 on the wire
            kl = estimate_kl(pol, ref, group=group)
            results.append((float(kl), str(kl.dtype), tuple(kl.shape)))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_estimate_kl_two_gloo_ranks_uneven_batches(tmp_path):
    mp.spawn(_dist_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    expected = []
    for r0, r1 in DIST_CASES:
        both = r0 + r1
        expected.append(max(0.0, sum(both) / len(both)) if both else 0.0)
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert [v for v, _, _ in results] == pytest.approx(expected, abs=1e-6)
        assert all(dtype == "torch.float32" and shape == () for _, dtype, shape in results)


def test_the_rewards_are_the_implied_reward_of_the_log_ratio() -> None:
    """kto_loss's rewards and the evaluation samples' (coati_kto.trainer.samples) are one formula: beta * r,
    r the fp32 log-ratio, detached."""
    policy = torch.tensor([-3.0, -7.5, -1.25], dtype=torch.bfloat16, requires_grad=True)
    reference = torch.tensor([-2.0, -8.0, -1.0])
    _, rewards = kto_loss(policy, reference, torch.tensor([True, False, True]), 0.1, beta=0.3)
    r = log_ratio(policy, reference)
    assert r.dtype == torch.float32 and r.requires_grad
    assert torch.equal(rewards, implied_reward(r, 0.3)) and not rewards.requires_grad
    assert torch.equal(rewards, 0.3 * (policy.float() - reference).detach())
