"""The fp32 master weights a mixed-precision optimizer keeps: started from the loaded fp32 values, and gathered
whole (for an fp32 export).

ZeRO (low_level_zero, hybrid zero_stage >= 1) keeps on each rank one chunk of every parameter's flattened,
padded fp32 copy; the hybrid plugin's AMP optimizer (zero_stage 0) keeps whole fp32 copies; fp32 training keeps
none (the working weights are the masters). These layouts are ColossalAI 0.5.0's, read here and nowhere else.

The plugins cast the model to the working dtype (``module.to(bf16)``, after tensor-parallel sharding) and then
build the masters from the cast weights, so a checkpoint stored in fp32 started training from its bf16 rounding:
the fp32 export of a run differed from the model it started from everywhere, by up to 2**-9 of each weight, far
more than the updates of a KTO learning rate. :func:`fp32_through_the_cast` keeps the fp32 values the cast
rounds, and :func:`start_masters_from` writes them into the masters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from coati_kto.parallel.distributed import comm_device


def working_to_master(optimizer: Any) -> dict[int, torch.Tensor]:
    """id(working parameter) -> its fp32 master (a whole tensor or this rank's ZeRO chunk); {} without masters."""
    get = getattr(optimizer, "get_working_to_master_map", None)
    return (get() if get is not None else None) or {}


def gathered_masters(model: Any, optimizer: Any, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of the boosted ``model`` as fp32 on the CPU, by parameter name: its master where the
    optimizer keeps one, else the working weight. Every rank calls, with the same parameters in the same order
    (one all-gather per ZeRO-sharded parameter over its ZeRO group); ``keep`` False: a rank whose copy nobody
    reads takes part in the gathers and gets ``{}`` (each whole fp32 copy is 4 bytes per parameter of host
    memory). Tensor-parallel size 1 only (the config refuses an fp32 export under tensor parallelism)."""
    mapping = working_to_master(optimizer)
    groups = getattr(optimizer, "param_to_pg", {})
    out: dict[str, torch.Tensor] = {}
    for name, param in model.unwrap().named_parameters():
        master = mapping.get(id(param))
        if master is None:
            if keep:
                out[name] = param.detach().float().cpu()
            continue
        if master.numel() != param.numel():  # a ZeRO chunk: gather the flat copy, drop the padding
            group = groups[param]
            # cpu_offload keeps the chunks in host memory, which NCCL does not take: through the GPU, one at a time
            chunk = master.detach().to(comm_device()).contiguous()
            chunks = [torch.empty_like(chunk) for _ in range(dist.get_world_size(group))]
            dist.all_gather(chunks, chunk, group=group)
            master = torch.cat(chunks)[: param.numel()]
        if keep:
            out[name] = master.detach().float().view(param.shape).cpu()
    return out


@contextlib.contextmanager
def fp32_through_the_cast(
    model: nn.Module, dtype: torch.dtype, rounds: bool
) -> Iterator[dict[int, torch.Tensor]]:
    """Within it, the plugin's ``model.to(dtype)`` first records the fp32 values (as sharded at that moment) of
    each trainable fp32 parameter, by ``id`` of the parameter: the mapping yielded. Only where the cast ``rounds``
    the checkpoint's values (``model_shape.cast_rounds``: stored in another dtype than ``dtype``); nothing for an
    fp32 run or a checkpoint stored in ``dtype``. Held until :func:`start_masters_from` (host memory: 4 bytes per
    trainable parameter of this rank's shard, beside the cast's copy)."""
    kept: dict[int, torch.Tensor] = {}
    if dtype == torch.float32 or not rounds:
        yield kept
        return
    cast = model.to

    def recording_to(*args: Any, **kwargs: Any) -> nn.Module:
        if not kept:
            kept.update(
                {id(p): p.data for p in model.parameters() if p.requires_grad and p.dtype == torch.float32}
            )
        return cast(*args, **kwargs)

    model.to = recording_to  # an instance attribute: the plugins call model.to(dtype) on this object
    try:
        yield kept
    finally:
        del model.to


def start_masters_from(optimizer: Any, kept: dict[int, torch.Tensor]) -> int:
    """Write the fp32 values :func:`fp32_through_the_cast` kept into the boosted ``optimizer``'s masters (this
    rank's ZeRO chunk of the flattened, padded parameter, or the whole master), then drop them; the number of
    parameters written. A value whose shape is not its working parameter's is left out. Every rank calls, before
    the first step; no collective."""
    mapping = working_to_master(optimizer)
    zero_groups = {id(p): (p, g) for p, g in getattr(optimizer, "param_to_pg", {}).items()}
    whole = {id(p): p for p in getattr(optimizer, "working_to_master_map", {}) if isinstance(p, torch.Tensor)}
    written = 0
    for key, values in kept.items():
        master = mapping.get(key)
        param, group = zero_groups.get(key, (whole.get(key), None))
        if master is None or param is None or master.dtype != torch.float32 or values.shape != param.shape:
            continue  # not trained on this rank (another pipeline stage), no fp32 master, or not this shard
        flat = values.reshape(-1)
        if group is not None:  # this rank's chunk of the padded flat copy
            size, rank = master.numel(), dist.get_rank(group)
            flat = torch.nn.functional.pad(flat, [0, size * dist.get_world_size(group) - flat.numel()])
            flat = flat[rank * size : (rank + 1) * size]
        with torch.no_grad():
            master.view(-1).copy_(flat.to(master.device))
        written += 1
    kept.clear()
    return written
