"""ColossalAI 0.5.0 on a machine without CUDA: the accelerator, the ZeRO device check and the fused gather.

ColossalAI picks its accelerator cuda -> npu -> cpu. Its CPU accelerator raises on stream, synchronize and
RNG calls that ZeRO and shardformer make, and the ZeRO optimizer asserts a cuda/npu device. On CPU we
install an accelerator whose stream calls are no-ops (CPU work is synchronous, so there is nothing to order)
and relax the device assertion while keeping the dtype check. With CUDA present nothing here is installed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def cuda_available() -> bool:
    """Whether this process trains on CUDA (the GPU path runs ColossalAI untouched by this module)."""
    return torch.cuda.is_available()


def plugin_overrides() -> dict[str, Any]:
    """Extra plugin kwargs for this device: CPU ZeRO cannot overlap communication (no streams)."""
    return {} if cuda_available() else {"overlap_communication": False}


def install_cpu_support() -> None:
    """The synchronous CPU accelerator, ZeRO's dtype check without its device assertion, and the host gather of
    split fused projections. Call once, without CUDA."""
    from colossalai.accelerator import set_accelerator
    from colossalai.zero.low_level import low_level_optim

    set_accelerator(_sync_cpu_accelerator())

    def _sanity_checks_without_device(self: Any) -> None:
        # Upstream first asserts a cuda/npu accelerator; the dtype check below is the part that matters.
        for group in self.optim.param_groups:
            for param in group["params"]:
                if not getattr(param, "skip_zero_check", False) and param.dtype != self._dtype:
                    raise TypeError(f"ZeRO expects parameters of dtype {self._dtype}, got {param.dtype}")

    low_level_optim.LowLevelZeroOptimizer._sanity_checks = _sanity_checks_without_device
    _gather_fused_projections_on_the_host()
    _randomizer_states_without_reseeding()


def _sync_cpu_accelerator() -> Any:
    """An instance of ColossalAI's CPU accelerator whose stream calls are no-ops and whose RNG is torch's."""
    from colossalai.accelerator import CpuAccelerator

    class _SyncCpuAccelerator(CpuAccelerator):
        """CPU ops run synchronously: streams collapse to the calling thread, RNG is torch's CPU RNG."""

        def synchronize(self, device: Any = None) -> None:
            return None

        def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:  # noqa: N802
            return None

        def current_stream(self, device: Any = None) -> None:
            return None

        def default_stream(self, device: Any = None) -> None:
            return None

        def stream(self, stream_: Any) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

        def get_rng_state(self, device: Any = None) -> torch.Tensor:
            return torch.get_rng_state()

        def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
            torch.set_rng_state(new_state)

        # The CPU generator alone: torch.manual_seed also queues a seed for CUDA, MTIA and XPU, formatting the
        # caller's stack for each (a millisecond or more per call; shardformer calls it per parallel layer).
        def manual_seed(self, seed: int) -> None:
            torch.default_generator.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.default_generator.manual_seed(seed)

        def empty_cache(self) -> None:
            return None

    return _SyncCpuAccelerator()


def _gather_fused_projections_on_the_host() -> None:
    """ColossalAI 0.5.0 on CPU: gathering a part-by-part split fused projection (``FusedLinear1D_Col``: Phi-3's
    qkv_proj and gate_up_proj under tensor parallelism; state_dict, checkpoints, export) calls ``.cuda()``. The
    same gather where the tensor lies: all-gather [q_r | k_r | v_r] from every rank, then reorder the parts to
    [q_0 q_1 | k_0 k_1 | v_0 v_1], transformers' layout."""
    import torch.distributed as dist
    from colossalai.shardformer.layer import qkv_fused_linear

    def gather(
        qkv: torch.Tensor, split_sizes: list[int], group: Any, is_transposed: bool = False
    ) -> torch.Tensor:
        world = dist.get_world_size(group=group)
        parts = [torch.empty_like(qkv) for _ in range(world)]
        dist.all_gather(parts, qkv.contiguous(), group=group)
        dim = -1 if is_transposed else 0
        local = [size // world for size in split_sizes]
        pieces = [part.split(local, dim=dim) for part in parts]  # pieces[rank][part]
        return torch.cat([pieces[r][i] for i in range(len(split_sizes)) for r in range(world)], dim=dim)

    qkv_fused_linear.gather_fused_qkv_in_gpt2_style = gather


def _randomizer_states_without_reseeding() -> None:
    """ColossalAI's ``Randomizer`` (one per tensor-parallel layer) reads the RNG state a seed gives by seeding the
    global generator, reading it and putting the old state back, for the accelerator and the CPU: two
    ``torch.manual_seed`` calls, each formatting the stack three times for devices this machine lacks (1.6% of the
    test pool's CPU). On CPU both states are what a new generator seeded with it holds: the same bytes, and the
    global generator is not touched."""
    from colossalai.shardformer.layer.utils import Randomizer

    def __init__(self: Any, seed: int) -> None:  # noqa: N807 - the method it replaces
        self.seed = seed
        state = torch.Generator().manual_seed(seed).get_state()
        self.device_rng_state, self.cpu_rng_state = state, state.clone()

    Randomizer.__init__ = __init__
