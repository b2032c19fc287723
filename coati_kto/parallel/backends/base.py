"""What every parallel backend answers: the questions the rest of the code would otherwise ask a plugin's name.

A backend is built from the run's ``ParallelPlan`` (the settings, identical on every rank) and owns what differs
between ColossalAI plugins: building the plugin and boosting the policy, where the frozen reference is placed,
where the gradient norm is read, whether accumulation may skip the gradient reduction, whether the chunked LM
head can run, and what it refuses and why. Callers ask it a question; none compares plugin names.

The checkpoint IO is the plugin's own (``booster.save_model`` / ``save_optimizer`` reach it): building the plugin
chooses it, and the fixes ColossalAI 0.5.0's IO needs are in ``coati_kto.parallel.upstream.fixes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch import nn

from coati_kto.parallel import optimizer_path
from coati_kto.parallel.distributed import reduce_sums
from coati_kto.parallel.fp32_kept import fp32_kept, restore
from coati_kto.parallel.grad_norm import GradNorm
from coati_kto.parallel.masters import fp32_through_the_cast, start_masters_from
from coati_kto.parallel.ordered_grads import data_dependent_graph, install_ordered_reduction
from coati_kto.parallel.unused import unreached_parameters

if TYPE_CHECKING:
    import torch

    from coati_kto.config.schema import PluginSection
    from coati_kto.parallel.distributed import ParallelLayout


class Settings(Protocol):
    """What a backend reads of the run's ``coati_kto.parallel.plan.ParallelPlan`` (which builds the backend)."""

    precision: str
    zero_stage: int
    tp_size: int
    sp_size: int
    cpu_offload: bool
    max_grad_norm: float
    model_class: str | None
    dp_size: int | None

    @property
    def dtype(self) -> torch.dtype: ...


class ParallelBackend:
    """One ColossalAI plugin's behaviour; subclasses override what their plugin does differently."""

    name: ClassVar[str]  # plugin.name in the config
    plugin_class: ClassVar[str]  # ColossalAI's class name (``ParallelPlan.from_plugin``)

    def __init__(self, plan: Settings) -> None:
        self.plan = plan

    # ---- the settings that run ---------------------------------------------------------------------------
    @classmethod
    def running_zero_stage(cls, section: PluginSection, dp_size: int | None) -> int:
        """The ZeRO stage the run uses for ``section`` at ``dp_size`` data-parallel ranks: the configured one."""
        return section.zero_stage

    # ---- capabilities -------------------------------------------------------------------------------------
    @property
    def torch_ddp(self) -> bool:
        """Whether the policy gets wrapped in torch DDP (``boost`` then tells DDP whether to look for parameters
        a backward does not reach: ``coati_kto.parallel.unused``)."""
        return False

    @property
    def forward_collectives(self) -> bool:
        """Whether the policy's gradient forward enters a collective of the data-parallel group: torch DDP's does
        (its bucket rebuild at the second gradient forward, its buffer broadcast). There no rank may order that
        forward and the z0 all-reduce otherwise than the others, so the KL pass neither folds into the gradient
        pass nor continues from its cache: both are each rank's own decision from its batch (a fold from its
        lengths, a continuation from its prompt truncation), and either runs the forward before z0. A
        tensor-parallel forward's collectives stay inside its tp group, whose ranks see the same batch and so
        decide alike."""
        return self.torch_ddp

    @property
    def no_sync_accumulation(self) -> bool:
        """Whether micro-batches before a step's last may skip the gradient reduction (``booster.no_sync``).

        DDP and ZeRO-0/1 support it. ZeRO-2 asserts against it: there every backward reduce-scatters and
        gradients accumulate in the ZeRO buffers.
        """
        return self.plan.zero_stage != 2

    @property
    def chunked_head(self) -> bool:
        """Whether the LM head's weight is resident during the forward, so the chunked head may read it
        (``coati_kto.models.lm_head.LMHead.find`` still checks the head itself: a vocabulary slice under tensor
        parallelism uses the logits)."""
        return True

    @property
    def gradients_in_zero_store(self) -> bool:
        """Where the step's gradient norm is read: ZeRO's gradient store (each rank's partition) or ``p.grad``
        (the whole averaged gradient on every data-parallel rank)."""
        return self.plan.zero_stage > 0

    # ---- building -----------------------------------------------------------------------------------------
    def build_plugin(self) -> Any:
        """The ColossalAI plugin; every rank calls, after ``init_distributed``."""
        raise NotImplementedError

    def grad_norm(self, optimizer: Any, layout: ParallelLayout, max_norm: float | None = None) -> GradNorm:
        """Where the step's global gradient norm comes from, and who clips (the clipping / non-finite vote hook).

        The norm is always taken before the optimizer steps (coati_kto.parallel.grad_norm), from the place
        ``gradients_in_zero_store`` names. A plugin with clipping of its own clips inside its step with
        ``max_grad_norm`` (``build_plugin``), handed the norm already taken; GradNorm clips the others.
        """
        limit = self.plan.max_grad_norm if max_norm is None else max_norm
        return GradNorm(optimizer, limit, layout, zero_store=self.gradients_in_zero_store)

    def boost(
        self,
        booster: Any,
        policy: nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        unreached_by_data: bool = False,
        cast_rounds: bool = True,
    ) -> tuple[Any, Any, Any]:
        """``booster.boost`` the policy (loaded in fp32), start the fp32 masters from the loaded values, give what
        runs in fp32 (``fp32_kept``) its values back, and install the project's gradient path on the boosted
        optimizer. ``unreached_by_data``: the data can leave a trainable parameter without a gradient on one rank
        and not its peer (a vision tower trained on text and image records mixed): ZeRO reduces in parameter order
        then, as for the MoEs that can. ``cast_rounds``: the cast to the working dtype rounds the loaded values
        (``model_shape.cast_rounds``), so the masters are written from them."""
        kept = fp32_kept(policy, self.plan.dtype)
        self.prepare_policy(booster, policy)
        if self.torch_ddp:  # before DDP is built around the policy: it reads the setting once
            # Any rank's answer holds on all (one all-reduce, every rank is here): DDP's used-flags are all-reduced
            # only where it looks for unused parameters, so ranks built apart would hang at the first backward.
            unused = float(unreached_parameters(policy) != [])
            found = reduce_sums({"unused": unused}, None)["unused"] > 0
            self.ddp_settings(booster.plugin)["find_unused_parameters"] = found
        # The masters start from the loaded fp32 values, not from the cast's bf16 rounding of them (masters.py).
        with fp32_through_the_cast(policy, self.plan.dtype, cast_rounds) as loaded:
            policy, optimizer, _, _, lr_scheduler = booster.boost(
                policy, optimizer, lr_scheduler=lr_scheduler
            )
        start_masters_from(optimizer, loaded)
        restore(kept)
        # The project's gradient path after the backward (coati_kto.parallel.optimizer_path): no second norm, no
        # multiply by 1, and at one ZeRO rank no bucket flatten / divide / all-gather.
        optimizer_path.install_clipping(optimizer)
        optimizer_path.install_single_rank_zero(optimizer)
        optimizer_path.install_mixed_precision_step(optimizer)
        optimizer_path.install_fused_zero(optimizer)  # train.fused_optimizer (MixedAdamW) under ZeRO
        if data_dependent_graph(policy) or unreached_by_data:  # ranks may reach different parameters
            install_ordered_reduction(optimizer)
        return policy, optimizer, lr_scheduler

    def prepare_policy(self, booster: Any, policy: nn.Module) -> None:
        """What the plugin must know of the policy before boosting it (nothing, unless a backend says so)."""

    def ddp_settings(self, plugin: Any) -> dict[str, Any]:
        """The keyword arguments the plugin hands torch DDP (only asked where ``torch_ddp``)."""
        raise NotImplementedError(f"{self.name} wraps no torch DDP")

    def build_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The frozen reference, built the way ``boost`` builds the policy but without an optimizer, so that at
        step 0 both give identical log-probs. ``model`` is loaded in fp32 like the policy; every rank calls."""
        kept = fp32_kept(model, self.plan.dtype)
        wrapped = self.place_reference(plugin, model)
        restore(kept)
        return wrapped.eval().requires_grad_(False)

    def place_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The reference wrapped and placed as the plugin places the policy (same dtype cast, same sharding)."""
        raise NotImplementedError
