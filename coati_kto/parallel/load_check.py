"""Whether each node's free host memory holds what its ranks read while they load the model.

Every rank reads the whole model into host memory in fp32 before the plugin moves its share to the GPU
(``memory_plan.load_host_bytes``: 4 bytes per parameter, 6 for a checkpoint stored in fp32 trained in bf16). A
node of 8 ranks loading a 32B model needs about 1 TB free at once; short of it, the kernel's OOM killer ends a
rank (or another process on the node) with SIGKILL partway through the load, and the job dies with no word of
why. :func:`refuse_a_load_no_node_holds` says it in one line on every rank, before any weight is read.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from coati_kto.config.schema import Config
from coati_kto.errors import UserError

GIB = 1 << 30


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available to new allocations without swapping (``MemAvailable``);
    None where there is no /proc/meminfo (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def load_refusal(needed_per_rank: int, ranks_on_node: int, available: int | None) -> str | None:
    """The one line when ``ranks_on_node`` ranks each needing ``needed_per_rank`` bytes at load do not fit in
    ``available`` bytes of this node's host memory; None when they fit or nothing is known."""
    needed = needed_per_rank * ranks_on_node
    if available is None or needed <= available:
        return None
    return (
        f"host memory: each rank reads the whole model into host memory in fp32 as it loads "
        f"({_size(needed_per_rank)} per rank), {_size(needed)} for the {ranks_on_node} rank(s) on "
        f"{socket.gethostname()}, which has {_size(available)} available (MemAvailable): start fewer ranks per "
        "node or free host memory (`coati-kto plan CONFIG --gpus N --nodes M` shows the need)"
    )


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def needed_per_rank(config: Config) -> int | None:
    """What one rank of ``config`` (a validated Config) holds at its load peak; None when the model's
    config.json cannot be read here (a Hub id not cached yet: the load says why later)."""
    from coati_kto.parallel.activations import Workload
    from coati_kto.parallel.memory_plan import load_host_bytes
    from coati_kto.parallel.model_shape import cast_rounds, model_shape

    path = config.model.path
    try:
        shape = model_shape(path)
        rounds = cast_rounds(path, config.plugin.precision)
    except UserError:
        return None
    work = Workload.from_config(config)
    return load_host_bytes(shape, work, rounds)


def refuse_a_load_no_node_holds(config: Config) -> None:
    """UserError on every rank, before any weight is read, when one node's available host memory cannot hold
    what its ranks (``LOCAL_WORLD_SIZE``) read at load. Every rank calls it (one all_reduce when distributed:
    one node short stops every rank, not only its own, whose peers would wait in the next collective)."""
    need = needed_per_rank(config)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    why = load_refusal(need, ranks, available_host_bytes()) if need is not None else None
    if dist.is_initialized():
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        vote = torch.tensor([why is not None], dtype=torch.int32, device=on)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if vote.item() and why is None:
            why = (
                "host memory: another node cannot hold what its ranks read while they load the model (its ranks "
                "say how much)"
            )
    if why is not None:
        raise UserError(why)
