"""ColossalAI 0.5.0 compatibility: its bugs we fix and the CPU (no CUDA) support, in one place.

ColossalAI picks its accelerator cuda -> npu -> cpu. Its CPU accelerator raises on stream, synchronize and
RNG calls that ZeRO and shardformer make, and the ZeRO optimizer asserts a cuda/npu device. On CPU we
install an accelerator whose stream calls are no-ops (CPU work is synchronous, so there is nothing to order)
and relax the device assertion while keeping the dtype check. On every device ``apply()`` also fixes the
unpadding of padded vocabularies at save time (``_fix_unpadding_of_detached_copies``); with CUDA present that
is all it changes.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from typing import Any

import torch

_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


# Third-party notices that say nothing about the user's run, printed on every rank (and every step for the
# torch deprecations ColossalAI 0.5.0 triggers): optional kernels absent on CPU, renamed torch collectives.
_KNOWN_NOISE = (
    (UserWarning, r"Please install (the latest tensornvme|apex from source)"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    (FutureWarning, r"`broadcast_buffers` is deprecated"),
)


# The same, sent through ColossalAI's DistributedLogger rather than warnings.warn. Its ``warning`` logs two
# records, "<file>:<line> <function>" and then the message, so a logging.Filter on the message alone would
# leave the location line behind: the message is dropped before either is logged. The hybrid plugin warns
# "Use Zero Optimizer when data parallel size is 1 ..." on a 1-process run that keeps ZeRO (cpu_offload).
_KNOWN_LOG_NOISE = (re.compile(r"Use Zero Optimizer when data parallel size is 1"),)

# Python loggers of third-party modules, by logger name: the records to drop. bitsandbytes (imported by
# ColossalAI's GaLore, at import time) 0.50 warns on CPUs with AVX512-BF16 that the optional `kernels` package
# for its 4-bit CPU GEMM is absent; nothing here quantizes.
_KNOWN_LOGGER_NOISE = {
    "bitsandbytes.backends.cpu.ops": re.compile(
        r"Failed to load CPU gemm_4bit_forward from kernels-community"
    ),
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_known_warnings() -> None:
    """Silence only the notices listed above; every other warning still shows. Idempotent."""
    for category, message in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in _KNOWN_LOGGER_NOISE.items():
        logger = logging.getLogger(name)  # the module's own logger, before it is imported
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))


def quiet_known_logs() -> None:
    """Drop ColossalAI's DistributedLogger warnings listed in _KNOWN_LOG_NOISE; every other one still shows,
    with its caller's location as upstream prints it. Idempotent; imports colossalai.logging."""
    from colossalai.logging import DistributedLogger

    if getattr(DistributedLogger.warning, "_coati_quiet", False):
        return

    def warning(self: DistributedLogger, message: str, ranks: list[int] | None = None) -> None:
        if any(p.match(str(message)) for p in _KNOWN_LOG_NOISE):
            return
        caller = sys._getframe(1)  # upstream's prefix: the caller's file, line and function
        code = caller.f_code
        self._log("warning", f"{code.co_filename}:{caller.f_lineno} {code.co_name}", ranks)
        self._log("warning", message, ranks)

    warning._coati_quiet = True  # type: ignore[attr-defined]
    DistributedLogger.warning = warning


def apply() -> None:
    """Fix ColossalAI's bugs (``_fix_bugs_on_every_device``); without CUDA, also install the CPU accelerator and
    the ZeRO patch (the GPU path runs ColossalAI otherwise untouched). Idempotent; every rank."""
    global _applied
    quiet_known_warnings()
    quiet_known_logs()
    if _applied:
        return
    _fix_bugs_on_every_device()
    _route_policies_to_the_project()
    _applied = True
    if cuda_available():
        return
    from colossalai.accelerator import CpuAccelerator, set_accelerator
    from colossalai.zero.low_level import low_level_optim

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

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def empty_cache(self) -> None:
            return None

    set_accelerator(_SyncCpuAccelerator())

    def _sanity_checks_without_device(self: Any) -> None:
        # Upstream first asserts a cuda/npu accelerator; the dtype check below is the part that matters.
        for group in self.optim.param_groups:
            for param in group["params"]:
                if not getattr(param, "skip_zero_check", False) and param.dtype != self._dtype:
                    raise TypeError(f"ZeRO expects parameters of dtype {self._dtype}, got {param.dtype}")

    low_level_optim.LowLevelZeroOptimizer._sanity_checks = _sanity_checks_without_device
    _gather_fused_projections_on_the_host()


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


def _fix_bugs_on_every_device() -> None:
    """ColossalAI 0.5.0 bugs fixed on every device: padded vocabularies' save and tensor-parallel partition, the
    adapters' lookup of LoRA on parameters, DDP wrapped on one data-parallel rank, and ZeRO's optimizer save of
    parameters without state."""
    _fix_unpadding_of_detached_copies()
    _fix_tp_partition_of_padded_vocabularies()
    _fix_lora_lookup_of_parameter_adapters()
    _fix_ddp_on_one_data_parallel_rank()
    _fix_zero_save_of_stateless_params()


def _fix_ddp_on_one_data_parallel_rank() -> None:
    """ColossalAI 0.5.0 bug, on every device: hybrid_parallel with ZeRO on one data-parallel rank (``cpu_offload``,
    or any ZeRO stage built as written) counts gradients twice under accumulation (README Status, "1.5x norm").

    ``configure`` wraps the module in torch DDP whenever ``dp_size == 1`` (``use_ddp``), ZeRO or not. ZeRO's own
    hooks move each gradient into its bucket and set ``p.grad = None`` when the bucket fills mid-backward; DDP's
    end-of-backward callback then writes its own copy of that gradient back into ``p.grad``. The next
    micro-batch accumulates onto that stale copy, so ZeRO's store holds g1 + (g1 + g2): about 1.5x the norm
    (and the update) at accumulation 2. It shows only once the model exceeds the reduce bucket (12M elements),
    hence on the GPU's 551M model and not on the tiny CPU models. With dp_size > 1 upstream already skips DDP
    under ZeRO; this makes one data-parallel rank do the same (ZeRO reduces, DDP has nothing to add).

    Without ZeRO (zero 0, the stage a hybrid run on one data-parallel rank runs) DDP at one rank still copies
    each gradient into its buckets, divides it by 1 and all-reduces it over one rank (4 bytes per parameter
    each, every backward) and broadcasts the buffers every forward: the same values, bit for bit, as no DDP
    (``tests/distributed/test_optimizer_path.py``). So one data-parallel rank never gets DDP.
    """
    from colossalai.booster.plugin import hybrid_parallel_plugin as hpp

    upstream = hpp.HybridParallelPlugin.configure
    module_class = hpp.HybridParallelModule

    def without_ddp(*args: Any, **kwargs: Any) -> Any:
        return module_class(*args, **{**kwargs, "use_ddp": False})

    def configure(self: Any, model: Any, optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.dp_size > 1 or optimizer is None:
            return upstream(self, model, optimizer, *args, **kwargs)
        hpp.HybridParallelModule = without_ddp  # the name configure looks up when it wraps the model
        try:
            return upstream(self, model, optimizer, *args, **kwargs)
        finally:
            hpp.HybridParallelModule = module_class

    hpp.HybridParallelPlugin.configure = configure


def _fix_zero_save_of_stateless_params() -> None:
    """ColossalAI 0.5.0 bug, on every device: low_level_zero's sharded optimizer save raises KeyError
    (``local_states[param_idx]``, low_level_optim.py:884) when AdamW holds no state for a parameter: one no
    gradient reached yet (cross-attention without an encoder, a sparse indexer, an expert never routed to).

    Such a parameter is saved with no state, torch's convention (absent from the checkpoint's ``state``; the
    loader, upstream's, then leaves it stateless and AdamW starts it at its first gradient, as an uninterrupted
    run does). Upstream's generator reads ``optim.state_dict()`` once: it is given one holding ``{}`` for those
    parameters (no collective is entered for them, on any rank: they are stateless on every rank, their
    gradients having been reduced alike), and their entries, and the blocks left empty, are dropped."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    upstream = LowLevelZeroOptimizer.state_dict_shard

    def state_dict_shard(self: Any, *args: Any, **kwargs: Any) -> Any:
        packed = self.optim.state_dict()
        count = sum(len(group["params"]) for group in self.optim.param_groups)
        stateless = {i for i in range(count) if i not in packed["state"]}
        packed["state"].update({i: {} for i in stateless})
        self.optim.state_dict = lambda: packed  # the instance's, over the class's, for upstream's one call
        try:
            for block, size in upstream(self, *args, **kwargs):
                kept = {i: state for i, state in block.items() if i not in stateless}
                if kept:
                    yield kept, size
        finally:
            del self.optim.state_dict

    LowLevelZeroOptimizer.state_dict_shard = state_dict_shard


def _fix_lora_lookup_of_parameter_adapters() -> None:
    """ColossalAI 0.5.0 bug, on every device: ``LowLevelZeroPlugin.configure`` looks each adapter's base weight up
    as ``<module>.base_layer.weight``, which peft's ``ParamWrapper`` (LoRA on an MoE's fused expert parameters,
    ``target_modules: [gate_proj, up_proj, down_proj]`` under transformers 5) does not have: KeyError. The lookup
    only serves to add adapters missing from the optimizer, and the project builds its optimizer from every
    parameter after ``enable_lora``: skip it when none is missing."""
    from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroPlugin

    upstream = LowLevelZeroPlugin.add_lora_params_to_optimizer

    def add_lora_params_to_optimizer(self: Any, model: Any, optimizer: Any) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        adapters = [p for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]
        if any(id(p) not in held for p in adapters):
            upstream(self, model, optimizer)

    LowLevelZeroPlugin.add_lora_params_to_optimizer = add_lora_params_to_optimizer


def _fix_unpadding_of_detached_copies() -> None:
    """ColossalAI 0.5.0 bug, on every device: saving a padded vocabulary crashes (``'Tensor' object has no
    attribute '_unpad_detach'``).

    HybridParallelPlugin pads the embedding and LM head to a multiple of ``make_vocab_size_divisible_by``
    (64: faster kernels) and marks the parameter as padded, replacing its ``detach``/``clone`` with versions
    whose results carry the padding marks. ``state_dict`` and the checkpoint sharder detach the parameter,
    then ``to_unpadded_tensor`` slices the copy and "un-hijacks" it, restoring a ``_unpad_detach`` that only
    the parameter has. The copy's own detach/clone were never replaced, so there is nothing to restore: the
    slice is right, only the restoration must be skipped. Patched in the api module, whose global every
    caller of ``to_unpadded_tensor`` goes through.
    """
    from colossalai.tensor.padded_tensor import api

    restore = api._hijack_back_detach_and_clone

    def restore_if_hijacked(ptensor: torch.Tensor) -> torch.Tensor:
        return restore(ptensor) if hasattr(ptensor, "_unpad_detach") else ptensor

    api._hijack_back_detach_and_clone = restore_if_hijacked


def _fix_tp_partition_of_padded_vocabularies() -> None:
    """ColossalAI 0.5.0 bug, on every device: under tensor parallelism the optimizer checkpoint of a padded
    vocabulary cannot be saved (``The parameter isn't evenly distributed among tensor parallel group``).

    ``search_tp_partition_dim`` finds the sharded dimension of an optimizer state by comparing the parameter's
    shape before sharding (the real vocabulary, e.g. 300 rows) with its shard (384 padded rows / 2 = 192) and
    asserts ``300 == 2 x 192``. The callers already handle padding right after (gather, then unpad on save; pad,
    then split on load): the check only has to accept a last shard that holds padding, i.e.
    ``(tp - 1) x shard < original <= tp x shard``.
    """
    from colossalai.checkpoint_io import hybrid_parallel_checkpoint_io, utils

    def search_tp_partition_dim(current_shape: Any, original_shape: Any, tp_size: int) -> int | None:
        for dim, length in enumerate(original_shape):
            if length > current_shape[dim]:
                shard = current_shape[dim]
                if not (tp_size - 1) * shard < length <= tp_size * shard:
                    raise AssertionError(
                        f"parameter of shape {tuple(original_shape)} is not split over {tp_size} tensor-parallel "
                        f"ranks as a shard of shape {tuple(current_shape)} (even with vocabulary padding)"
                    )
                return dim
        return None

    utils.search_tp_partition_dim = search_tp_partition_dim
    hybrid_parallel_checkpoint_io.search_tp_partition_dim = search_tp_partition_dim


def plugin_overrides() -> dict[str, Any]:
    """Extra plugin kwargs for this device: CPU ZeRO cannot overlap communication (no streams)."""
    return {} if cuda_available() else {"overlap_communication": False}


def make_optimizer(
    params: Any,
    lr: float,
    weight_decay: float,
    fused_ok: bool = True,
    state_dtype: str = "fp32",
    cpu_offload: bool = False,
    mixed_step: bool = False,
) -> torch.optim.Optimizer:
    """The run's AdamW: ``torch.optim.AdamW(fused=True)`` on every device (one ``_fused_adamw_`` kernel per step
    over each device and dtype group: the same op on CPU and CUDA, so the CPU's kernel count is the GPU's).

    ``cpu_offload`` on CUDA: ColossalAI's HybridAdam (upstream's optimizer for offload: its CPU Adam for the
    CPU-side masters). ``fused_ok`` False: the single-tensor ``torch.optim.AdamW`` (the reference update).
    ``state_dtype`` bf16: the project's AdamW with bf16 moments on every device (coati_kto.parallel.adamw).
    ``mixed_step`` (``train.fused_optimizer``): ``MixedAdamW``, torch's fused AdamW whose plugin step is one
    compiled mixed-precision pass (coati_kto.parallel.mixed_adamw).
    """
    if mixed_step:
        from coati_kto.parallel.mixed_adamw import MixedAdamW

        return MixedAdamW(params, lr=lr, weight_decay=weight_decay)
    if state_dtype == "bf16":
        from coati_kto.parallel.adamw import AdamWLowPrecisionStates

        return AdamWLowPrecisionStates(params, lr=lr, weight_decay=weight_decay)
    if cpu_offload and cuda_available() and fused_ok:
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, lr=lr, weight_decay=weight_decay, adamw_mode=True)
    if fused_ok:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)


def optimizer_for(params: Any, train: Any, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """``make_optimizer`` with the ``train`` section's lr, weight_decay and optimizer_state_dtype."""
    return make_optimizer(
        params, train.lr, train.weight_decay, state_dtype=train.optimizer_state_dtype, cpu_offload=cpu_offload,
        mixed_step=train.fused_optimizer,
    )  # fmt: skip


def _route_policies_to_the_project() -> None:
    """Shardformer's automatic policy choice (a plugin built without ``custom_policy``) picks the project's
    policy (coati_kto.families.shardformer): the family's tensor-parallel one where it has one, else the one that
    swaps nothing, which refuses tensor parallelism in one line. ColossalAI 0.5.0's own policies replace forwards
    with transformers-4.51 code that fails, or computes wrong, under transformers 5.
    """
    from colossalai.shardformer.shard import sharder

    from coati_kto.families.shardformer import policy_for

    def project_policy(model: torch.nn.Module) -> Any:
        return policy_for(type(model).__name__, tp_size=2) or policy_for(type(model).__name__)

    sharder.get_autopolicy = project_policy
