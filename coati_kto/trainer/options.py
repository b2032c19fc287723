"""``KTOOptions``: the run's settings that steer KTOTrainer, one frozen object instead of a keyword list.

The recipe builds it from the config's sections (``coati_kto.recipe.components.trainer_options``). ColossalChat's
positional signature (``max_epochs``, ``beta``, the weights, ``accumulation_steps``, ``save_interval``...) and
keywords such as ``loss_type=...`` reach the same object through ``options_from`` (KTOTrainer calls it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from coati_kto.trainer.loss import needs_kl


@dataclass(frozen=True)
class KTOOptions:
    """Settings of the loss, the step and the loops (not the collaborators: layout, plan, checkpoints, signals).

    beta, desirable_weight, undesirable_weight: beta, lambda_D and lambda_U of the KTO loss (Eq. 7).
    loss_type: "kto" or "apo_zero_unpaired" (no reference point: no KL-pair passes, no z0 collective).
    apply_loss_mask: score the completion's tokens only (False: every non-padding token, as ColossalChat can).
    max_epochs: epochs to run. accumulation_steps: micro-batches per optimizer step.
    save_interval: checkpoint every N optimizer steps (0: only at the end of ``fit``).
    kl_scope: "step" (z0 over the whole optimizer step, all ranks) or "micro_batch".
    max_steps: stop after this many optimizer steps (None: ``max_epochs`` epochs).
    eval_interval: evaluate every N optimizer steps (0: none between epoch ends).
    eval_at_start: evaluate before the first update of ``fit`` (the step-0 baseline; on resume, only when the
        checkpoint's step was not evaluated yet).
    eval_at_epoch_end: evaluate after each epoch's last step, unless that step was just evaluated.
    log_interval: write train metrics every N steps, exact over the interval.
    on_nonfinite: "stop" (raise NonFiniteLossError) or "skip" (zero the gradients, no update, counted), when the
        loss or the global gradient norm is NaN/inf on any rank.
    max_grad_norm: clip the global gradient norm to this (0: off) where the plugin does not clip (torch DDP); the
        other plugins' optimizers clip with their own max_norm (``ParallelBackend.build_plugin`` sets it alike).
    peak_flops: peak FLOP/s per device; when set, ``train/mfu`` is logged (coati_kto.trainer.throughput).
    pack_reference: score an example and its KL pair in one shared-prompt reference pass where the model allows
        it. Equal to two passes only within rounding (fp32 ~1e-7, bf16 ~1e-3 nats), so step-0 rewards are no
        longer exactly 0 (the policy's passes are separate).
    pack_policy: the policy's passes in one packed row too: in evaluation always; in training where a z0 group
        is one micro-batch and ``models.packing.fold_pays`` (long prompts, short completions), folding its KL
        pass into the gradient pass (never under torch DDP: ``ParallelBackend.forward_collectives``). Same rounding caveat.
    kl_continuation: in training where a z0 group is one micro-batch, the policy's KL pass (and the online
        reference's) continues from its examples' KV cache (``coati_kto.models.continuation``); before folding.
    reference_is_policy_weights: the online reference loads the policy's checkpoint (no ``model.reference_path``):
        a batch's image features, computed once by the policy's frozen tower, serve the reference too.
    router_aux_loss_coef: ``kto.router_aux_loss_coef``: "auto" (an MoE's own ``router_aux_loss_coef`` when its config
        asks for router logits) or the coefficient of the router load-balancing loss (0: off;
        ``coati_kto.models.router``).
    wandb_project, wandb_mode, wandb_dir: W&B settings when ``fit(use_wandb=True)``.
    keep_last: checkpoints kept when the trainer builds its own CheckpointManager (``save_dir``).
    samples, sample_max_new_tokens, sample_seed: eval prompts decoded at every evaluation (0: none), tokens
        each at most, and the seed of their choice (coati_kto.trainer.samples).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"
    apply_loss_mask: bool = True
    max_epochs: int = 1
    accumulation_steps: int = 1
    save_interval: int = 0
    kl_scope: Literal["step", "micro_batch"] = "step"
    max_steps: int | None = None
    eval_interval: int = 0
    eval_at_start: bool = False
    eval_at_epoch_end: bool = True
    log_interval: int = 1
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_grad_norm: float = 0.0
    peak_flops: float | None = None
    pack_reference: bool = False
    pack_policy: bool = False
    kl_continuation: bool = True
    reference_is_policy_weights: bool = True
    router_aux_loss_coef: float | str = "auto"
    wandb_project: str = "coati-kto"
    wandb_mode: str = "online"
    wandb_dir: str | None = None
    keep_last: int = 2
    samples: int = 0
    sample_max_new_tokens: int = 64
    sample_seed: int = 0

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1 or self.save_interval < 0:
            raise ValueError("accumulation_steps must be >= 1, save_interval >= 0")
        if self.log_interval < 1 or self.eval_interval < 0:
            raise ValueError("log_interval must be >= 1, eval_interval >= 0")
        if self.kl_scope not in ("step", "micro_batch") or self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(
                f"kl_scope={self.kl_scope!r} / on_nonfinite={self.on_nonfinite!r} not understood"
            )
        needs_kl(self.loss_type)  # ValueError on an unknown loss type

    @property
    def needs_kl(self) -> bool:
        return needs_kl(self.loss_type)


def options_from(options: KTOOptions | None, given: dict[str, Any]) -> KTOOptions:
    """KTOTrainer's one options object: ``options``, or one built from ColossalChat's positional settings and the
    keywords in ``given`` (None: not passed). Both at once raises TypeError: one of them would be dropped."""
    given = {name: value for name, value in given.items() if value is not None}
    if options is None:
        return KTOOptions(**given)
    if given:
        raise TypeError(f"KTOTrainer: settings both in options and as arguments: {', '.join(sorted(given))}")
    return options
