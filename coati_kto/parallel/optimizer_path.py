"""The gradient path of ColossalAI 0.5.0's optimizers after the backward, where the project runs its own.

Clipping and unscaling (every plugin optimizer; ``install_clipping``): upstream computes the norm again in fp64
(``grad.double().norm()`` per gradient and an all-reduce) and then multiplies every gradient by ``1.0 /
div_scale`` even when there is no loss scale (bf16, fp32) and no clipping. Here the step is handed the norm the
trainer already took (``coati_kto.parallel.grad_norm``, read at the step's one sync) and multiplies the gradients
once, with ``torch._foreach_mul_``, only when the coefficient is not 1: ``torch.nn.utils.clip_grad_norm_``'s
``max_norm / (norm + 1e-6)`` (at most 1) times ``1 / loss_scale`` (fp16).

ZeRO at one data-parallel rank (``install_single_rank_zero``, low_level_zero on one process, or a ZeRO group of
one): upstream still flattens each bucket of gradients into one tensor, divides it by 1, "reduces" it over one
rank and views it back, and after the update casts each fp32 master to a new bf16 tensor, flattens those into a
bucket, all-gathers it over one rank and copies it back. Here each gradient goes straight into the ZeRO gradient
store (the same values: dividing by 1 and reducing over one rank change no bit), and each master is cast once
into its working parameter. The optimizer's state, its checkpoints and its ``step`` contract are upstream's.

The AMP optimizer (``install_mixed_precision_step``: hybrid ZeRO-0 in bf16 / fp16, which a hybrid run at one
data-parallel rank uses) and the one-rank ZeRO step cast the working gradients to fp32 and the updated masters
into the working weights with one ``torch._foreach_copy_`` each, where upstream launches a kernel per parameter.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from coati_kto.parallel.loss_scale import gradient_scale, gradient_scale_held

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s and ColossalAI's


def clip_coefficient(norm: float, max_norm: float, loss_scale: float | None) -> float:
    """What every gradient is multiplied by: ``1 / loss_scale`` times clip_grad_norm_'s clamped coefficient for the
    true norm ``norm / loss_scale`` (``max_norm`` 0: no clipping). ``norm`` is of the (loss-scaled) gradients."""
    scale = loss_scale or 1.0
    coef = 1.0 / scale
    if max_norm > 0:
        clip = max_norm / (norm / scale + CLIP_EPS)
        if clip < 1.0:
            coef *= clip
    return coef


def scale_grads(grads: list[torch.Tensor], coef: float) -> None:
    """Multiply ``grads`` in place by ``coef`` (one multi-tensor op), nothing when it is 1."""
    if coef != 1.0 and grads:
        torch._foreach_mul_(grads, coef)


@contextlib.contextmanager
def given_norm(optimizer: Any, norm: float) -> Iterator[None]:
    """Within it ``optimizer.step()`` uses ``norm`` instead of computing it (``install_clipping`` must have run).

    ZeRO's step asks once per parameter group and combines the answers as sqrt(sum of squares); the hybrid
    zero-0 optimizers ask once. Answering ``norm`` first and 0 afterwards gives ``norm`` in both.
    """
    optimizer._coati_norms = iter([norm])
    optimizer._coati_norm = norm
    try:
        with gradient_scale_held(optimizer):
            yield
    finally:
        optimizer._coati_norms = optimizer._coati_norm = None


def install_clipping(optimizer: Any) -> None:
    """Replace, on this optimizer object only, upstream's norm and unscale / clip methods (see the module).

    Outside ``given_norm`` the norm is upstream's own computation; the multiplication is the project's either way.
    Idempotent; an optimizer without those methods (TorchDDPPlugin's wrapper) is left alone.
    """
    if not hasattr(optimizer, "_compute_grad_norm") or getattr(optimizer, "_coati_norms", 0) is None:
        return
    optimizer._coati_norms = optimizer._coati_norm = None
    upstream_norm = type(optimizer)._compute_grad_norm

    def compute_grad_norm(self: Any, *args: Any, **kwargs: Any) -> float:
        if self._coati_norms is None:
            return upstream_norm(self, *args, **kwargs)
        return next(self._coati_norms, 0.0)

    optimizer._compute_grad_norm = types.MethodType(compute_grad_norm, optimizer)
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    if isinstance(optimizer, LowLevelZeroOptimizer):

        def zero_unscale_and_clip(self: Any, grads: list[torch.Tensor], total_norm: float) -> None:
            scale_grads(grads, clip_coefficient(total_norm, self._clip_grad_norm, gradient_scale(self)))

        optimizer._unscale_and_clip_grads = types.MethodType(zero_unscale_and_clip, optimizer)
    elif hasattr(optimizer, "_unscale_and_clip_grads"):  # the AMP optimizer (hybrid zero 0, bf16 / fp16)

        def amp_unscale_and_clip(self: Any, total_norm: float) -> None:
            # Upstream passes 0.0 when it does not clip; only the loss scale applies then.
            norm = self._coati_norm if self._coati_norm is not None else total_norm
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            scale_grads(grads, clip_coefficient(norm, self.max_norm, gradient_scale(self)))

        optimizer._unscale_and_clip_grads = types.MethodType(amp_unscale_and_clip, optimizer)
    elif hasattr(optimizer, "_clip_grad_norm"):  # the naive optimizer (hybrid zero 0, fp32): called to clip

        def naive_clip(self: Any, total_norm: float) -> None:
            grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
            scale_grads(grads, clip_coefficient(total_norm, self.max_norm, None))

        optimizer._clip_grad_norm = types.MethodType(naive_clip, optimizer)


def zero_bucket_store(optimizer: Any) -> Any | None:
    """The bucket store of a ZeRO optimizer with one ZeRO group (its ``world_size``: the group's ranks); None for
    any other optimizer (DDP's, AMP's, several groups)."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    if not isinstance(optimizer, LowLevelZeroOptimizer) or len(optimizer.pg_to_bucket_store) != 1:
        return None
    return next(iter(optimizer.pg_to_bucket_store.values()))


def single_rank_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ZeRO optimizer whose one ZeRO group has a single rank, with masters on the device
    (no cpu_offload), fp32 masters and no asynchronous all-gather: where ``install_single_rank_zero`` applies."""
    store = zero_bucket_store(optimizer)
    return (
        store is not None
        and store.world_size == 1
        and not optimizer._cpu_offload
        and optimizer._master_weights
        and not optimizer._overlap_allgather
    )


def install_single_rank_zero(optimizer: Any) -> bool:
    """At one ZeRO rank, give this optimizer object the direct gradient store and write-back (see the module).
    Returns whether it did; every rank calls after ``booster.boost``. Idempotent."""
    if not single_rank_zero(optimizer):
        return False
    optimizer._add_to_bucket = types.MethodType(_store_gradient, optimizer)
    optimizer.step = types.MethodType(_single_rank_step, optimizer)
    return True


def _store_gradient(self: Any, param: torch.nn.Parameter, group_id: int) -> None:
    """``_add_to_bucket`` at one rank: the gradient itself (flat view) into the store, or added to the one there
    (accumulation), as upstream's bucket reduction leaves it, without the flat copy, the division and the views."""
    grad = param.grad.detach().view(-1)
    param.grad = None
    self._add_grad(grad, 1, group_id, id(param))


def _steps(self: Any, closure: Any) -> bool:
    """Whether a ZeRO ``step`` updates now, as upstream decides: not inside accumulation (no gradient sync), not
    when the fp16 loss scale skips the step (its gradients are then dropped)."""
    if closure is not None:
        raise ValueError("closure is not supported by step()")
    if not self.require_grad_sync:
        return False
    if self.mixed_precision_mixin is not None and self.mixed_precision_mixin.should_skip_step():
        self.zero_grad()
        return False
    return True


def _single_rank_step(self: Any, closure: Any = None) -> None:
    """``LowLevelZeroOptimizer.step`` at one rank: the same gradients, norm, clipping and update; each updated fp32
    master cast once into its working parameter instead of through a flattened all-gather bucket."""
    from colossalai.zero.low_level._utils import calculate_global_norm_from_list

    if not _steps(self, closure):
        return
    store = next(iter(self.pg_to_grad_store.values()))
    live: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
    norms, sources = [], []
    for group_id in range(self.num_param_groups):
        pairs = []
        masters = self._master_param_groups_of_current_rank[group_id]
        for working, master in zip(self._working_param_groups[group_id], masters, strict=True):
            grads = store.get_partitioned_gradients_by_param_id(group_id, id(working))
            if grads:  # a parameter without gradient (a dropped layer) is not updated, as upstream
                sources.append((master, grads[0]))  # cast below, all at once
                pairs.append((working, master))
        live[group_id] = pairs
        gradients = store.get_working_grads_by_group_id(group_id)
        norms.append(self._compute_grad_norm(dp_pg=store.torch_pg, gradients=gradients))
        self.optim.param_groups[group_id]["params"] = [master for _, master in pairs]
    _set_master_grads(sources)
    total = calculate_global_norm_from_list(norm_list=norms)
    self._current_grad_norm = total
    self._unscale_and_clip_grads([m.grad for pairs in live.values() for _, m in pairs], total)
    self.optim.step()
    with torch.no_grad():
        done = [pair for pairs in live.values() for pair in pairs]
        # the cast upstream's master.to(dtype) does, as one multi-tensor copy
        _foreach_copy([w.data for w, _ in done], [m.view_as(w) for w, m in done])
        for group_id, pairs in live.items():
            for _, master in pairs:
                master.grad = None
            self.optim.param_groups[group_id]["params"] = self._master_param_groups_of_current_rank[group_id]


def _foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``t.copy_(s)`` for each pair (casting), as one multi-tensor copy (CUDA: one launch per ~64 tensors)."""
    if targets:
        torch._foreach_copy_(targets, sources)


def _set_master_grads(sources: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``master.grad = grad.to(master.dtype)`` for each (master, working-dtype gradient of the same numel): one
    multi-tensor copy into new tensors for those that need the cast, the gradient itself for the others."""
    cast = [(m, g) for m, g in sources if g.dtype != m.dtype]
    grads = [torch.empty_like(m) for m, _ in cast]
    _foreach_copy(grads, [g.view_as(m) for m, g in cast])
    for (master, _), grad in zip(cast, grads, strict=True):
        master.grad = grad
    for master, grad in sources:
        if grad.dtype == master.dtype:
            master.grad = grad


def fused_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ZeRO optimizer over ``MixedAdamW`` that ``install_fused_zero`` applies to: one
    ZeRO group, fp32 masters on the device, no asynchronous all-gather, no fp8 communication."""
    return (
        zero_bucket_store(optimizer) is not None
        and _fused(optimizer)
        and not optimizer._cpu_offload
        and optimizer._master_weights
        and not optimizer._overlap_allgather
        and not optimizer._fp8_communication
    )


def install_fused_zero(optimizer: Any) -> bool:
    """Give this ZeRO optimizer the one-pass mixed-precision step (``_fused_zero_step``) where ``fused_zero``
    says so; returns whether it did. Every rank calls after ``booster.boost`` (after ``install_single_rank_zero``,
    whose gradient store it keeps). Idempotent."""
    if not fused_zero(optimizer):
        return False
    optimizer.step = types.MethodType(_fused_zero_step, optimizer)
    return True


def _fused_zero_step(self: Any, closure: Any = None) -> None:
    """``LowLevelZeroOptimizer.step`` with ``MixedAdamW``: the same gradient partitions, norm and clipping (its
    coefficient folded into the update); each master updated from its working-dtype gradient in one pass that
    writes the working weight (one ZeRO rank) or the working-dtype partition upstream all-gathers (several)."""
    from colossalai.zero.low_level._utils import calculate_global_norm_from_list

    if not _steps(self, closure):
        return
    store = next(iter(self.pg_to_grad_store.values()))
    single = store.world_size == 1
    triples, gathers, norms = [], [], []
    for group_id in range(self.num_param_groups):
        masters = self._master_param_groups_of_current_rank[group_id]
        for working, master in zip(self._working_param_groups[group_id], masters, strict=True):
            grads = store.get_partitioned_gradients_by_param_id(group_id, id(working))
            if grads:  # a parameter without gradient (a dropped layer) is not updated, as upstream
                grad = grads[0 if self._partition_grads else store.local_rank]
                target = working.data if single else torch.empty_like(master, dtype=self._dtype)
                triples.append((master, grad, target))
                gathers.append((working, target))
        gradients = store.get_working_grads_by_group_id(group_id)
        norms.append(self._compute_grad_norm(dp_pg=store.torch_pg, gradients=gradients))
    total = calculate_global_norm_from_list(norm_list=norms)
    self._current_grad_norm = total
    with self.optim.mixed(triples, clip_coefficient(total, self._clip_grad_norm, gradient_scale(self))):
        self.optim.step()
    if not single:
        _gather_partitions(self, gathers)


def _gather_partitions(self: Any, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Each (working parameter, this rank's updated working-dtype partition) all-gathered into the parameter
    through upstream's buckets, in the same order and sizes as ``LowLevelZeroOptimizer.step`` (every rank)."""
    from colossalai.zero.low_level._utils import all_gather_into_flat_tensor_nd
    from colossalai.zero.low_level.bookkeeping import TensorBucket

    buckets = {
        pg: TensorBucket(self.pg_to_bucket_store[pg].reduce_bucket_size) for pg in self.pg_to_param_list
    }
    self.pg_to_tensor_bucket = buckets
    for working, part in pairs:
        pg = self.param_to_pg[working]
        if part.numel() > buckets[pg].max_size:
            all_gather_into_flat_tensor_nd(self._working_param_to_padded_working_param[working], part, pg)
            continue
        try:
            buckets[pg].add_to_bucket(part, write_back_tensor=working)
        except RuntimeError:  # full: upstream gathers it and starts the next
            buckets[pg].all_gather(pg, fp8_communication=False)
            buckets[pg].add_to_bucket(part, write_back_tensor=working)
    for pg, bucket in buckets.items():
        if not bucket.is_empty():
            bucket.all_gather(pg, fp8_communication=False)


def install_mixed_precision_step(optimizer: Any) -> bool:
    """Give the AMP optimizer (hybrid zero 0, bf16 / fp16: ``MixedPrecisionOptimizer``) a step whose two casts,
    working gradients to fp32 and updated masters to working weights, are one multi-tensor copy each instead of
    one kernel per parameter; the same values, norm and clipping. Returns whether it did. Idempotent."""
    from colossalai.amp.naive_amp.mixed_precision_optimizer import MixedPrecisionOptimizer

    if not isinstance(optimizer, MixedPrecisionOptimizer):
        return False
    optimizer.step = types.MethodType(_mixed_precision_step, optimizer)
    return True


def _mixed_precision_step(self: Any, *args: Any, **kwargs: Any) -> None:
    """``MixedPrecisionOptimizer.step`` (ColossalAI 0.5.0) with multi-tensor casts; with ``MixedAdamW`` (the
    project's one-pass mixed-precision AdamW) no cast at all: it reads the working gradients and writes the
    working weights."""
    if self.mixed_precision.should_skip_step():
        self.zero_grad()
        return
    pairs = [(m, self.master_to_working_map[m]) for g in self.optim.param_groups for m in g["params"]]
    triples = [
        (m, w.grad.data, w.data) for m, w in pairs if w.grad is not None
    ]  # fp32 ones: their own masters
    for master, working in pairs:
        if master is not working:
            working.grad = None
    fused = _fused(self)
    if not fused:
        _set_master_grads([(m, g) for m, g, w in triples if m is not w])
    total_norm = 0.0
    if self.max_norm > 0:  # the norm handed over by given_norm (install_clipping), or upstream's
        grads = [(self.master_to_working_map[m], g) for m, g, _ in triples] if fused else [
            (self.master_to_working_map[p], p.grad) for g in self.param_groups for p in g["params"]]  # fmt: skip
        total_norm = self._compute_grad_norm([(w, grad) for w, grad in grads if grad is not None])
        self._current_grad_norm = total_norm
    if fused:  # the clipping coefficient amp_unscale_and_clip would multiply by, folded into the update
        norm = self._coati_norm if getattr(self, "_coati_norm", None) is not None else total_norm
        with self.optim.mixed(triples, clip_coefficient(norm, self.max_norm, gradient_scale(self))):
            self.optim.step(*args, **kwargs)
        return
    self._unscale_and_clip_grads(total_norm)
    self.optim.step(*args, **kwargs)
    with torch.no_grad():
        done = [(w, m) for m, w in pairs if m is not w]
        _foreach_copy([w.data for w, _ in done], [m.data for _, m in done])


def _fused(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a plugin's) steps with the one-pass mixed-precision AdamW (``train.fused_optimizer``)."""
    from coati_kto.parallel.mixed_adamw import MixedAdamW

    return isinstance(getattr(optimizer, "optim", None), MixedAdamW)


def single_rank_ddp_plugin(**kwargs: Any) -> Any:
    """TorchDDPPlugin for one data-parallel rank: the model is not wrapped in ``DistributedDataParallel``.

    At one rank DDP still copies every gradient into its buckets, multiplies them by 1 / 1, all-reduces them
    over one rank and copies them back (per parameter, every backward): the same values, bit for bit, as
    leaving the gradients where autograd put them. The boosted model keeps TorchDDPPlugin's interface
    (``unwrap``, ``no_sync``, its checkpoint IO), so checkpoints are interchangeable with DDP's.
    """
    from colossalai.booster.plugin import TorchDDPPlugin
    from colossalai.booster.plugin.torch_ddp_plugin import TorchDDPModel
    from colossalai.interface import ModelWrapper, OptimizerWrapper

    class _Local(torch.nn.Module):
        """Where DDP would sit: ``.module`` is the model, forward is the model's, no_sync has nothing to skip."""

        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: Any, **kw: Any) -> Any:
            return self.module(*args, **kw)

        def no_sync(self) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    class _LocalModel(TorchDDPModel):
        def __init__(self, module: torch.nn.Module) -> None:
            ModelWrapper.__init__(self, module)
            self.module = _Local(module)

    class SingleRankDDPPlugin(TorchDDPPlugin):
        def configure(self, model: Any, optimizer: Any = None, criterion: Any = None, dataloader: Any = None,
                      lr_scheduler: Any = None) -> tuple:  # fmt: skip
            from colossalai.accelerator import get_accelerator

            model = _LocalModel(model.to(get_accelerator().get_current_device()))
            if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
                optimizer = OptimizerWrapper(optimizer)
            return model, optimizer, criterion, dataloader, lr_scheduler

    return SingleRankDDPPlugin(**kwargs)
