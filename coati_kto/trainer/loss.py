"""The KTO loss as a pure function of per-example log-probs (Ethayarajh et al. 2024, arXiv 2402.01306).

For an example (x, y) with sequence log-probs summed over completion tokens only, let
``r = log pi_theta(y|x) - log pi_ref(y|x)`` and ``z0`` the reference point (see :func:`estimate_kl`).
Eq. 7 gives the per-example loss

    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))

and, z0 being a constant (detached), Prop. 4.1 gives its gradient with respect to ``log pi_theta(y|x)``

    desirable:    -lambda_D * beta * sigmoid(z) * sigmoid(-z),   z = beta * (r - z0)
    undesirable:  +lambda_U * beta * sigmoid(z) * sigmoid(-z),   z = beta * (z0 - r)

so examples already far on the right side of z0 (|z| large) stop pulling on the policy.

``loss_type="apo_zero_unpaired"``: the unpaired variant of APO-zero (D'Oosterlinck et al. 2024, arXiv
2408.06266, Eq. 7; TRL's KTOTrainer ``loss_type="apo_zero_unpaired"``) has no reference point:

    desirable:    lambda_D * (1 - sigmoid(beta * r))     (push every desirable log-ratio up)
    undesirable:  lambda_U * sigmoid(beta * r)           (push every undesirable log-ratio down)

which is Eq. 7 above with z0 fixed at 0 (1 - sigmoid(-x) = sigmoid(x)), so it shares the code path and
gradient, and needs no KL pairs at all.
"""

from __future__ import annotations

import typing

import torch
import torch.distributed as dist

from coati_kto.config.kto import LossType

LOSS_TYPES: tuple[str, ...] = typing.get_args(LossType)  # the config's list, not a copy


def needs_kl(loss_type: str) -> bool:
    """Whether ``loss_type`` uses the reference point z0 (and so the KL-pair passes and their collective)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} not in {LOSS_TYPES}")
    return loss_type == "kto"


def preference_loss(
    loss_type: str,
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: float | torch.Tensor | None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example (losses, rewards) of ``loss_type``: "kto" (needs ``kl`` = z0) or "apo_zero_unpaired"
    (``kl`` must be None: the loss has no reference point). Same shapes and dtypes as :func:`kto_loss`."""
    if needs_kl(loss_type) == (kl is None):
        raise ValueError(f"loss_type {loss_type!r}: kl must be {'given' if kl is None else 'None'}")
    # APO-zero unpaired is Eq. 7 with the reference point pinned at 0 (see the module docstring).
    z0 = 0.0 if kl is None else kl
    return kto_loss(policy_logps, reference_logps, labels, z0, beta, desirable_weight, undesirable_weight)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: float | torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO losses and rewards.

    Args:
        policy_logps: [B] summed completion log-probs under the policy (any float dtype; grad flows here).
        reference_logps: [B] the same under the reference model (treated as a constant).
        labels: [B] bool (or 0/1 ints): True = desirable.
        kl: the reference point z0, a python float or 0-dim tensor; detached here, so no gradient reaches it.
        beta, desirable_weight, undesirable_weight: beta, lambda_D, lambda_U of Eq. 7.

    Returns:
        (losses [B] fp32, rewards [B] fp32 = beta * r, detached). Reduce (sum / count) in the caller.

    The label picks the branch through ``torch.where`` instead of splitting the batch into chosen and
    rejected lists, so micro-batches holding one label (or none: B == 0 gives empty tensors) need no special
    case and every rank runs the same ops with the same dtypes.
    """
    if policy_logps.shape != reference_logps.shape or policy_logps.shape != labels.shape:
        raise ValueError(
            f"kto_loss: shapes differ: policy {tuple(policy_logps.shape)}, "
            f"reference {tuple(reference_logps.shape)}, labels {tuple(labels.shape)}"
        )
    device = policy_logps.device
    r = log_ratio(policy_logps, reference_logps)
    z0 = torch.as_tensor(kl, dtype=torch.float32, device=device).detach()
    desirable = labels.to(device).bool()
    z = beta * torch.where(desirable, r - z0, z0 - r)
    # Python scalars, not torch.tensor(x, device=...): a pageable host-to-device copy syncs on CUDA.
    weight = torch.where(desirable, float(desirable_weight), float(undesirable_weight))
    # sigmoid(-z) == 1 - sigmoid(z), without the cancellation when sigmoid(z) is close to 1.
    losses = weight * torch.sigmoid(-z)
    return losses, implied_reward(r, beta)


def log_ratio(policy_logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """r = log pi_theta(y|x) - log pi_ref(y|x), [B] fp32 on the policy's device; gradient flows through the
    policy's log-probs only."""
    # fp32 whatever the model dtype: bf16 log-ratios of long sequences lose whole units.
    return policy_logps.float() - reference_logps.detach().to(policy_logps.device, torch.float32)


def implied_reward(r: torch.Tensor, beta: float) -> torch.Tensor:
    """The reward KTO's loss pushes up for desirable completions, beta * r (``r``: :func:`log_ratio`), detached:
    the rewards :func:`kto_loss` returns and the evaluation samples show (coati_kto.trainer.samples)."""
    return beta * r.detach()


def estimate_kl(
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The reference point z0 = max(0, global mean of (policy_kl_logps - reference_kl_logps)).

    Same contract as :func:`estimate_kl_raw`, clamped at 0 after averaging.
    """
    return estimate_kl_raw(policy_kl_logps, reference_kl_logps, group).clamp(min=0.0)


def estimate_kl_raw(
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unclamped KL estimate: global mean of (policy_kl_logps - reference_kl_logps); z0 is its max with 0.

    Args:
        policy_kl_logps, reference_kl_logps: [N] log-probs of the mismatched (x', y'') KL pairs; N may be 0.
        group: the data-parallel process group; every rank of it must call this (it is a collective).
            None: no reduction (one process, or the caller reduces).
        valid: [N] bool, the pairs that count (False on evaluation padding rows); None: all of them.

    Returns:
        0-dim fp32 tensor, detached; 0 when no rank holds any pair.

    The mean is sum / count over all ranks, not the mean of per-rank means (wrong with uneven batches);
    :func:`estimate_kl` clamps it after averaging, as in the paper. One all_reduce of a [sum, count] fp64 tensor:
    the same shape and dtype on every rank whatever its batch, so no rank can desynchronise the collective.
    """
    diff = policy_kl_logps.detach().float() - reference_kl_logps.detach().to(policy_kl_logps.device).float()
    if valid is None:
        count = torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device)
    else:  # masked sums, not boolean indexing: no data-dependent shape, so no host sync on a GPU
        diff = torch.where(valid, diff, 0.0)
        count = valid.sum(dtype=torch.float64)
    # Summed in fp64: an fp32 sum's last bit depends on how the pairs split over ranks and micro-batches, and
    # z0 enters every example's loss (Adam then makes that bit visible in the weights).
    stats = torch.stack([diff.sum(dtype=torch.float64), count])
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    # With count 0 the sum is 0 too, so clamping the divisor at 1 returns 0 without a branch (no sync).
    return (stats[0] / stats[1].clamp(min=1.0)).float()
