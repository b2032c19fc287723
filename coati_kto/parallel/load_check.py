"""Whether each node's free host memory holds what its ranks read while they load the model.

Every rank reads the whole model into host memory in fp32 before the plugin moves its share to the GPU
(``memory_plan.load_host_bytes``: 4 bytes per parameter; 6 per parameter of the rank's tensor- and
pipeline-parallel share for a checkpoint stored in fp32 trained in bf16, when that is more). A
node of 8 ranks loading a 32B model needs about 1 TB free at once; short of it, the kernel's OOM killer ends a
rank (or another process on the node) with SIGKILL partway through the load, and the job dies with no word of
why. :func:`refuse_a_load_no_node_holds` says it in one line on every rank, before any weight is read.

Ranks are grouped into nodes by host name (``socket.gethostname``, whatever the launcher: torchrun, srun,
mpirun), each node's need the sum of its ranks'. The estimate is a heuristic (``MemAvailable`` leaves out memory
the kernel could still free, and a container's limit may be lower): ``COATI_KTO_NO_HOST_MEMORY_CHECK=1`` in any
rank's environment turns the refusal off.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch.distributed as dist

from coati_kto.config.schema import Config
from coati_kto.errors import UserError

GIB = 1 << 30
NO_CHECK = "COATI_KTO_NO_HOST_MEMORY_CHECK"  # "1": refuse no load (module docstring)
FIX = (
    "start fewer ranks per node or free host memory (`coati-kto plan CONFIG --gpus N --nodes M` shows the need; "
    f"{NO_CHECK}=1 skips this check)"
)

HEAD = "host memory: each rank reads the whole model into host memory in fp32 as it loads"

# What one rank reports: its host name, its need at load (None: unknown), its host's available memory (None:
# unknown), whether its environment turns the check off.
Report = tuple[str, int | None, int | None, bool]


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


def load_refusal(
    needed_per_rank: int, ranks_on_node: int, available: int | None, host: str | None = None
) -> str | None:
    """:func:`nodes_refusal` of one node, ``host`` (None: this one), whose ``ranks_on_node`` ranks each need
    ``needed_per_rank`` bytes at load and have ``available`` bytes."""
    report: Report = (host or socket.gethostname(), needed_per_rank, available, False)
    return nodes_refusal([report] * ranks_on_node)


def _shortage(needed: int, ranks: int, available: int, host: str) -> str:
    return f"{_size(needed)} for the {ranks} rank(s) on {host}, which has {_size(available)} available"


def nodes_refusal(reports: list[Report]) -> str | None:
    """The one line naming every node whose ranks' summed need exceeds its available memory (the least any of
    its ranks read), from every rank's :data:`Report`; None when each fits, nothing is known, or a rank's
    environment sets :data:`NO_CHECK`. Every rank computes it from the same reports: the same answer."""
    if any(skip for *_, skip in reports):
        return None
    ranks: dict[str, int] = {}
    need: dict[str, int] = {}
    available: dict[str, int] = {}
    for host, needed, free, _ in reports:
        ranks[host] = ranks.get(host, 0) + 1
        need[host] = need.get(host, 0) + (needed or 0)
        if free is not None:
            available[host] = min(available.get(host, free), free)
    short = [h for h in ranks if h in available and need[h] > available[h]]
    if not short:
        return None
    per_rank = max(needed or 0 for _, needed, _, _ in reports)
    where = "; ".join(_shortage(need[h], ranks[h], available[h], h) for h in short)
    return f"{HEAD} ({_size(per_rank)} per rank), {where} (MemAvailable): {FIX}"


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def needed_per_rank(config: Config, world: int = 1) -> int | None:
    """What one rank of ``config`` (a validated Config) on ``world`` ranks holds at its load peak; None when a
    model's config.json cannot be read here (a Hub id not cached yet: the load says why later)."""
    from coati_kto.parallel.activations import Workload
    from coati_kto.parallel.layout_search import configured_layout
    from coati_kto.parallel.memory_plan import load_host_bytes
    from coati_kto.parallel.model_shape import cast_rounds, model_shape

    path = config.model.path
    try:
        shape = model_shape(path)
        rounds = cast_rounds(path, config.plugin.precision)
        work = Workload.from_config(config)
        # What shardformer splits before the cast: the tensor-parallel share and the pipeline stage.
        layout = configured_layout(config.plugin, world)
    except UserError:
        return None
    return load_host_bytes(shape, work, rounds, layout)


def refuse_a_load_no_node_holds(config: Config) -> None:
    """UserError on every rank, before any weight is read, when one node's available host memory cannot hold
    what its ranks read at load (:func:`nodes_refusal`). Every rank calls it: one all_gather_object of every
    rank's report when distributed (one node short stops every rank, whose peers would wait in the next
    collective), reached by every rank whatever it knows."""
    need = needed_per_rank(config, dist.get_world_size() if dist.is_initialized() else 1)
    report: Report = (socket.gethostname(), need, available_host_bytes(), os.environ.get(NO_CHECK) == "1")
    reports = [report]
    if dist.is_initialized():
        reports = [report] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    why = nodes_refusal(reports)
    if why is not None:
        raise UserError(why)
