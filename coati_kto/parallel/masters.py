"""The fp32 master weights a mixed-precision optimizer keeps, gathered whole (for an fp32 export).

ZeRO (low_level_zero, hybrid zero_stage >= 1) keeps on each rank one chunk of every parameter's flattened,
padded fp32 copy; the hybrid plugin's AMP optimizer (zero_stage 0) keeps whole fp32 copies; fp32 training keeps
none (the working weights are the masters). These layouts are ColossalAI 0.5.0's, read here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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
