"""ZeRO's gradient reduction in parameter order, for models whose backward depends on the data (MoE).

ColossalAI 0.5.0's ZeRO optimizers (low_level_zero, hybrid_parallel zero_stage 1-2) put each gradient into a
bucket when its backward hook fires, and reduce a bucket as one flat tensor (all-reduce, or reduce-scatter under
ZeRO-2) when it fills. So every data-parallel rank must reach the same trainable parameters in the same order.
A mixture of experts can break that: on LongCat-Flash a layer whose tokens on one rank all went to the identity
("zero") experts leaves the routed experts without a gradient there. The ranks' buckets then differ: in size
(gloo aborts, NCCL may hang) or, worse, only in which parameter sits where (the reduction adds one parameter's
gradient to another's without an error; ``tests/distributed/test_ordered_grads.py`` shows both on the installed
ColossalAI). Upstream guards only its own MoE tensors, and only under ZeRO-1 without overlap.

Here (:func:`install_ordered_reduction`) the hooks go: gradients stay in ``param.grad`` through the backward, and
after it every trainable parameter that some rank of the ZeRO group reached enters the buckets in the optimizer's
parameter order (the same on every rank), with zeros where this rank's backward left none (its share of the
average is 0). A parameter no rank reached stays out, as one process, torch DDP and upstream's step leave a
parameter without a gradient: not updated, its AdamW moments not advanced (a text-only step does not move a
trained vision tower on its stale momentum). The reduced values are upstream's; the cost is a one-flag-per-parameter
all-reduce, and that the reduction no longer overlaps the backward and the whole gradient is held until it ends
(2 bytes per parameter in bf16, where ZeRO-2 holds 2 / N), as under upstream's ZeRO-1 without overlap.

At one ZeRO rank there is nothing to order, but ZeRO-1's hooks (attached where ``overlap_communication`` is on,
the CUDA default) store a gradient only when its parameter's hook fires in the step's last micro-batch: the
gradient that ``no_sync`` accumulation left in ``param.grad`` for a parameter only earlier micro-batches reached
was dropped. The walk after the backward stores it.

So it is installed only where a parameter can go unreached (:func:`data_dependent_graph`, and a vision tower
trained on text and image records mixed: the backend's ``boost``): dense models and transformers 5's fused-expert
MoEs (Mixtral, Qwen3-MoE: the same parameters in the same order whatever the routing,
``tests/distributed/test_ordered_grads.py``) keep upstream's overlapped buckets.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from coati_kto.parallel.optimizer_path import zero_bucket_store


def data_dependent_graph(model: nn.Module) -> bool:
    """Whether a rank's backward may leave a trainable parameter without a gradient depending on its tokens:
    identity ("zero") experts (LongCat-Flash's ``zero_expert_num``), or experts kept as separate modules (an
    ``experts`` ModuleList). transformers 5's fused expert tensors get a gradient (zeros for the experts no
    token reached) on every rank in one order, so Mixtral-style MoEs keep upstream's overlapped buckets."""
    for name, sub in model.named_modules():  # a peft or plugin wrapper's too: names keep their last part
        if getattr(sub, "zero_expert_num", None):
            return True
        if isinstance(sub, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts":
            return True
    return False


def install_ordered_reduction(optimizer: Any) -> bool:
    """Reduce ``optimizer``'s gradients after each synchronized backward, in parameter order, zeros for the ones
    only this rank missed (see the module), where it is a ZeRO optimizer of one ZeRO group (any number of ranks).
    Every rank calls after ``booster.boost`` (after ``install_single_rank_zero``), alike. Returns whether it did."""
    if zero_bucket_store(optimizer) is None:
        return False
    for handle in optimizer.grad_handles:
        handle.remove()
    optimizer.grad_handles = []
    optimizer.zero_filled_grads = 0  # gradients this rank's backwards left out, filled with zeros (a count)
    optimizer.unreached_grads = 0  # parameters no rank's backward reached, left out of the step (a count)
    optimizer._reduce_grad = types.MethodType(_reduce_in_parameter_order, optimizer)
    return True


def _reduce_in_parameter_order(self: Any, partition_grad: bool) -> None:
    """``LowLevelZeroOptimizer._reduce_grad`` over every trainable parameter some rank reached, in order; upstream's
    buckets then reduce (all-reduce, or reduce-scatter when ``partition_grad``) and store them as they would. Every
    rank of the ZeRO group calls it (from ``backward``), so the flags' all-reduce lines up."""
    params = [
        (group_id, param)
        for group_id in range(self.num_param_groups)
        for param in self._working_param_groups[group_id]
        if param.requires_grad
    ]
    if not params:
        return
    store = zero_bucket_store(self)
    reached = torch.tensor([param.grad is not None for _, param in params], dtype=torch.int32)
    if store.world_size > 1:
        reached = reached.to(params[0][1].device)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=store.torch_pg)
    for (group_id, param), anywhere in zip(params, reached.tolist(), strict=True):
        if not anywhere:
            self.unreached_grads += 1
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
            self.zero_filled_grads += 1
        self._add_to_bucket(param, group_id)
    self._run_reduction()
