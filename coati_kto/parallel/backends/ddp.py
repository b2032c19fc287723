"""``plugin.name: ddp``: torch DistributedDataParallel through ColossalAI's TorchDDPPlugin, fp32, no ZeRO."""

from __future__ import annotations

from typing import Any

from torch import nn

from coati_kto.parallel import optimizer_path
from coati_kto.parallel.backends.base import ParallelBackend


class DDPBackend(ParallelBackend):
    """Every rank holds the whole model and its optimizer; gradients are all-reduced in DDP's buckets.

    The reference is the fp32 module on the device (nothing to shard or cast). The gradient norm is read from
    ``p.grad`` (the whole averaged gradient), and GradNorm clips: TorchDDPPlugin has no clipping. The checkpoint
    IO saves ``state_dict()`` as it is. On one data-parallel rank nothing is wrapped in DDP
    (``optimizer_path.single_rank_ddp_plugin``: the same values, bit for bit).
    """

    name = "ddp"
    plugin_class = "TorchDDPPlugin"

    @property
    def torch_ddp(self) -> bool:
        """Torch DDP wraps the policy, except on one data-parallel rank (nothing to reduce there)."""
        return self.plan.dp_size != 1

    def build_plugin(self) -> Any:
        """TorchDDPPlugin without the buffer broadcast.

        DDP runs the broadcast inside the forward after a gradient forward, a collective, while ranks run
        data-dependent numbers of no-grad forwards (a micro-batch whose KL pass folds into the gradient pass
        skips one): the ranks then entered different collectives (gloo aborted on a resumed cached-reference
        run). The buffers (rotary frequencies, scales) are equal on every rank.
        """
        from colossalai.booster.plugin import TorchDDPPlugin

        if self.plan.dp_size == 1:  # nothing to reduce: no DDP buckets (coati_kto.parallel.optimizer_path)
            return optimizer_path.single_rank_ddp_plugin(broadcast_buffers=False)
        return TorchDDPPlugin(broadcast_buffers=False)

    def ddp_settings(self, plugin: Any) -> dict[str, Any]:
        return plugin.ddp_kwargs

    def place_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The module on the device, in the working dtype (fp32 here)."""
        from colossalai.accelerator import get_accelerator

        return model.to(get_accelerator().get_current_device(), self.plan.dtype)
