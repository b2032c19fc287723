"""ColossalAI 0.5.0's bugs the project fixes on every device, each with why (CPU-only fixes: ``upstream.cpu``).

Which backend each concerns (``coati_kto.parallel.backends``): the hybrid backend's padded vocabularies (save
and tensor-parallel partition of the optimizer checkpoint) and its DDP on one data-parallel rank; the
low-level ZeRO backend's adapter lookup and its optimizer save of parameters without state.
"""

from __future__ import annotations

from typing import Any

import torch


def fix_bugs_on_every_device() -> None:
    """ColossalAI 0.5.0 bugs fixed on every device: padded vocabularies' save and tensor-parallel partition, the
    adapters' lookup of LoRA on parameters, DDP wrapped on one data-parallel rank, ZeRO's optimizer save of
    parameters without state, and the step counts its optimizer loads leave on the CPU."""
    _fix_unpadding_of_detached_copies()
    _fix_tp_partition_of_padded_vocabularies()
    _fix_lora_lookup_of_parameter_adapters()
    _fix_ddp_on_one_data_parallel_rank()
    _fix_zero_save_of_stateless_params()
    _fix_pipeline_backend_check()
    _fix_step_counts_left_on_cpu_by_optimizer_loads()


def _fix_pipeline_backend_check() -> None:
    """The pipeline's p2p picks its device with ``is_nccl_available() or is_hccl_available()``
    (``colossalai/pipeline/p2p.py:159``): torch 2.13 no longer has ``is_hccl_available``, so without NCCL (a CPU
    build) every pipeline send raised AttributeError. There is no HCCL in such a build: answer False."""
    import torch.distributed as dist

    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False  # type: ignore[attr-defined]


# Every ColossalAI checkpoint IO that loads optimizer states itself imports this by name and calls it last.
_OPTIMIZER_LOADERS = (
    "colossalai.checkpoint_io.general_checkpoint_io",
    "colossalai.checkpoint_io.hybrid_parallel_checkpoint_io",
    "colossalai.checkpoint_io.moe_checkpoint",
    "colossalai.booster.plugin.low_level_zero_plugin",
)


def _fix_step_counts_left_on_cpu_by_optimizer_loads() -> None:
    """ColossalAI 0.5.0 bug, on a GPU: its optimizer loads (``load_states_into_optimizer`` and the hybrid IO's
    own) leave every state's ``step`` on the CPU, a 2022 workaround for torch's non-fused Adam
    (pytorch#74424). Torch's fused and capturable AdamW keep ``step`` on the parameter's device in fp32, and
    ``_fused_adamw_`` refuses a CPU one: every resume on a GPU raised at its first step ("state_steps is on
    cpu", found by ``make gpu-check`` on an H200, 2026-11-30). Each loader's closing
    ``sharded_optimizer_loading_epilogue`` now first places the counts as torch's own ``load_state_dict``
    does (``_process_value_according_to_param_policy``); the other optimizers' counts stay where they are."""
    import importlib

    from colossalai.checkpoint_io import utils

    upstream = utils.sharded_optimizer_loading_epilogue

    def sharded_optimizer_loading_epilogue(optimizer: torch.optim.Optimizer) -> None:
        _place_step_counts(optimizer)
        upstream(optimizer)

    for name in _OPTIMIZER_LOADERS:
        module = importlib.import_module(name)
        assert module.sharded_optimizer_loading_epilogue is upstream, name  # a new ColossalAI: look again
        module.sharded_optimizer_loading_epilogue = sharded_optimizer_loading_epilogue
    utils.sharded_optimizer_loading_epilogue = sharded_optimizer_loading_epilogue


def _place_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's ``step`` state as torch's ``Optimizer.load_state_dict`` leaves it: for a fused or
    capturable group, an fp32 tensor on the parameter's device; otherwise unchanged. Any rank, local."""
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor) and (
                step.device != param.device or step.dtype != torch.float32
            ):
                optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


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
