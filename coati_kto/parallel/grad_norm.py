"""Where the step's gradient norm comes from: the global pre-clipping norm, taken BEFORE the optimizer steps.

The trainer needs the norm before stepping: a NaN/inf gradient under a finite loss must stop or skip the step
on every rank (ColossalAI's clip test ``clip > 1`` is False for a NaN norm, so the plugins would apply it).
Where the averaged gradients live depends on the boosted optimizer:

* ``TorchDDPPlugin`` (a plain ``OptimizerWrapper``) and ``HybridParallelPlugin`` zero 0 (Naive fp32 / AMP
  bf16 optimizers): every data-parallel rank holds the whole averaged gradient in ``p.grad`` of the working
  parameters; under tensor parallelism a distributed parameter holds its slice, the others a replica.
* ZeRO (``LowLevelZeroOptimizer`` and its subclass ``HybridParallelZeroOptimizer``): each data-parallel rank
  holds its partition of the averaged gradient in the optimizer's gradient store (``p.grad`` is empty).

``GradNorm.local_share()`` is this rank's share of the squared global norm: summed over the data-parallel
group (the step's one metric all-reduce does that) it is the squared norm. Replicas count on one rank only and
are multiplied by 0 on the others, so a NaN/inf on any rank still poisons the sum: the non-finite vote.
``GradNorm.step(norm)`` clips with ``torch.nn.utils.clip_grad_norm_`` semantics (coefficient
``max_norm / (norm + 1e-6)``, at most 1) and steps, handing the plugin's optimizer the norm instead of letting
it compute the norm (and its all-reduce) a second time. Plugin-side clipping (ZeRO, hybrid) keeps clipping
the fp32 gradients itself; only DDP, which has no clipping, is clipped here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from coati_kto.parallel.distributed import ParallelLayout, comm_device
from coati_kto.parallel.loss_scale import loss_scale
from coati_kto.parallel.optimizer_path import clip_coefficient, given_norm, install_clipping, scale_grads


class GradNorm:
    """The global gradient norm of the step and the clipped step, for one boosted optimizer. Every rank builds one.

    ``max_norm`` 0 disables clipping (the norm is still taken: it is logged and votes). ``zero_store``: where the
    backend says the gradients are (``ParallelBackend.gradients_in_zero_store``); ValueError when the optimizer
    keeps them elsewhere (a norm read from the wrong place would be 0 and vote nothing). None: the optimizer's.
    """

    def __init__(
        self, optimizer: Any, max_norm: float, layout: ParallelLayout, zero_store: bool | None = None
    ) -> None:
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.layout = layout
        self._zero = _is_zero(optimizer)
        if zero_store is not None and zero_store != self._zero:
            where = {True: "ZeRO's gradient store", False: "p.grad"}
            raise ValueError(
                f"the backend reads gradients from {where[zero_store]}, but {type(optimizer).__name__} keeps "
                f"them in {where[self._zero]}"
            )
        if self._zero and len(optimizer.pg_to_grad_store) != 1:
            raise NotImplementedError(
                "ZeRO with several data-parallel groups (MoE) is not supported by the gradient-norm vote"
            )
        self._tp_rank = dist.get_rank(layout.tp_group) if layout.tp_size > 1 else 0
        self._weight_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._elsewhere: frozenset[int] = frozenset()  # ids of parameters another pipeline stage counts
        install_clipping(optimizer)

    def counted_elsewhere(self, params: list[torch.nn.Parameter]) -> None:
        """``params`` count 0 here: another pipeline stage holds the same (tied, synchronised) parameter."""
        self._elsewhere = frozenset(id(p) for p in params)
        self._weight_cache = {}

    # ---- the norm ---------------------------------------------------------------------------------------
    def local_share(self) -> torch.Tensor:
        """0-dim fp64 on the device: this rank's share of the squared global norm (summed over tensor-parallel
        ranks). Nothing is read back here: the trainer reads it with the step's metric sums (one sync).

        One fp32 ``torch._foreach_norm`` over every gradient (fp32 accumulation, no fp64 copy of each gradient
        as ColossalAI's ``grad.double().norm()``), squared and weighted in fp64 (one value per tensor). Call
        after the step's last backward, before the step's data-parallel all-reduce; every rank calls (a
        tensor-parallel all-reduce happens here when tp_size > 1, a sequence-parallel one under ZeRO when sp_size > 1, a
        pipeline one when pp_size > 1).
        Loss-scaled (fp16) gradients give the scaled
        norm, as the clipping expects; ``unscaled`` divides it out for logging.
        """
        pairs = list(self._param_grads())
        if not pairs:  # a rank or stage without gradients: on the device its peers' collectives run on
            share = torch.zeros((), dtype=torch.float64, device=comm_device())
        else:
            norms = torch._foreach_norm([g for _, g in pairs], 2, dtype=torch.float32)
            weights = self._weights([p for p, _ in pairs], norms[0].device)
            share = (torch.stack(norms).double().square() * weights).sum()  # 0 * NaN is NaN: any rank votes
        if self.layout.tp_size > 1:
            dist.all_reduce(share, op=dist.ReduceOp.SUM, group=self.layout.tp_group)
        # ZeRO shards over dp x sp: sp rank 0, the one the trainer's world sum counts, carries its peers' partitions.
        # Without ZeRO every sp peer holds the same whole gradient, counted once through sp rank 0 alone.
        if self.layout.sp_size > 1 and self._zero:
            dist.all_reduce(share, op=dist.ReduceOp.SUM, group=self.layout.sp_group)
        # Each pipeline stage holds its own parameters: the last stage, the one the world sum counts, gets them all.
        if self.layout.pp_size > 1:
            dist.all_reduce(share, op=dist.ReduceOp.SUM, group=self.layout.pp_group)
        return share

    def _weights(self, params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
        """fp64 [len(params)]: 1 where this rank counts the parameter, 0 where another rank holds the same
        replica (cached per parameter list: one host-to-device copy the first time only)."""
        key = tuple(id(p) for p in params)
        cached = self._weight_cache.get(key)
        if cached is None:
            replica = 1.0 if self._zero else float(self.layout.dp_rank == 0)
            tp = self.layout.tp_size > 1
            keep = [
                replica
                * float(self._tp_rank == 0 or (tp and _is_distributed(p)))
                * float(id(p) not in self._elsewhere)
                for p in params
            ]
            cached = torch.tensor(keep, dtype=torch.float64, device=device)
            self._weight_cache = {key: cached}
        return cached

    @property
    def loss_scaled(self) -> bool:
        """fp16 with a dynamic loss scale: an inf gradient is an overflow the plugin's scaler skips and backs
        off from by itself (inside ``step``), not a fault to vote on."""
        return self._loss_scale() is not None

    def unscaled(self, norm: float) -> float:
        """The norm of the true gradient (fp16 loss scaling divided out)."""
        scale = self._loss_scale()
        return norm / scale if scale else norm

    def _loss_scale(self) -> float | None:
        return loss_scale(self.optimizer)

    def _param_grads(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(working parameter, this rank's averaged gradient or its ZeRO partition) for every parameter with one."""
        opt = self.optimizer
        if self._zero:
            for group_id in range(opt.num_param_groups):
                for param in opt._working_param_groups[group_id]:
                    store = opt.pid_to_grad_store[id(param)]
                    grads = store.get_partitioned_gradients_by_param_id(group_id, id(param))
                    if grads:
                        yield param, grads[0 if opt._partition_grads else store.local_rank]
            return
        working = getattr(opt, "master_to_working_map", None)  # AMP: param_groups hold fp32 masters
        for group in opt.param_groups:
            for param in group["params"]:
                param = working[param] if working is not None else param
                if param.grad is not None:
                    yield param, param.grad

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, norm: float) -> None:
        """Clip to ``max_norm`` with the global pre-clipping ``norm`` (finite, from ``local_share``), then step.

        The plugins' optimizers clip inside their ``step`` through the methods ``optimizer_path.install_clipping``
        replaced: they are handed ``norm`` (no second norm, no all-reduce) and multiply gradients only where the
        coefficient is not 1. TorchDDPPlugin has no clipping: it is done here.
        """
        opt = self.optimizer
        if hasattr(opt, "_compute_grad_norm"):  # ZeRO and the hybrid optimizers clip (in fp32) inside step()
            with given_norm(opt, norm):
                opt.step()
            return
        scale_grads([g for _, g in self._param_grads()], clip_coefficient(norm, self.max_norm, None))
        opt.step()


def global_norm(total_share: float) -> float:
    """The norm from the data-parallel sum of ``local_share`` (NaN stays NaN, inf stays inf)."""
    return math.sqrt(total_share) if total_share >= 0 else float("nan")


def _is_zero(optimizer: Any) -> bool:
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    return isinstance(optimizer, LowLevelZeroOptimizer)


def _is_distributed(param: torch.Tensor) -> bool:
    from colossalai.tensor.d_tensor import is_distributed_tensor

    return is_distributed_tensor(param)
