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
after it every trainable parameter enters the buckets in the optimizer's parameter order (the same on every
rank), with zeros where this rank's backward left none (its share of the average is 0). The reduced values are
upstream's; the cost is that the reduction no longer overlaps the backward and the whole gradient is held until
it ends (2 bytes per parameter in bf16, where ZeRO-2 holds 2 / N), as under upstream's ZeRO-1 without overlap. So
it is installed, at more than one ZeRO rank, only where a parameter can go unreached (:func:`data_dependent_graph`,
and a vision tower trained on text and image records mixed: the backend's ``boost``):
dense models and transformers 5's fused-expert MoEs (Mixtral, Qwen3-MoE: the same parameters in the same order
whatever the routing, ``tests/distributed/test_ordered_grads.py``) keep upstream's overlapped buckets.
"""

from __future__ import annotations

import types
from typing import Any

import torch
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
    """Reduce ``optimizer``'s gradients after each synchronized backward, in parameter order, zeros for the
    missing ones (see the module), where it is a ZeRO optimizer of one group of more than one rank. Every rank
    calls after ``booster.boost``, alike. Returns whether it did."""
    store = zero_bucket_store(optimizer)
    if store is None or store.world_size == 1:
        return False
    for handle in optimizer.grad_handles:
        handle.remove()
    optimizer.grad_handles = []
    optimizer.zero_filled_grads = 0  # gradients this rank's backwards left out, filled with zeros (a count)
    optimizer._reduce_grad = types.MethodType(_reduce_in_parameter_order, optimizer)
    return True


def _reduce_in_parameter_order(self: Any, partition_grad: bool) -> None:
    """``LowLevelZeroOptimizer._reduce_grad`` over every trainable parameter in order; upstream's buckets then
    reduce (all-reduce, or reduce-scatter when ``partition_grad``) and store them as they would."""
    for group_id in range(self.num_param_groups):
        for param in self._working_param_groups[group_id]:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                self.zero_filled_grads += 1
            self._add_to_bucket(param, group_id)
    self._run_reduction()
