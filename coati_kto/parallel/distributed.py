"""Process groups, launch and reductions: which rank holds what (``ParallelLayout``), and the few collective
patterns the rest of the code uses (sums and counts, barrier, gather, broadcast, ``on_rank0``).

Launch: under torchrun / ``colossalai run`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK set) or
as a single process with no launcher. The loss and model code get their groups from a ``ParallelLayout``
(built from the plugin by ``ParallelPlan``'s caller), never the default group by accident.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from coati_kto.errors import UserError, rebuild_user_error
from coati_kto.parallel import upstream
from coati_kto.parallel.advice import next_step
from coati_kto.parallel.store_waits import (
    DEFAULT_TIMEOUT_S,
    FileWaitTimeoutError,
    PeerFailedError,
    begin,
    from_rank0,
    peer_failed,
    set_timeout,
)
from coati_kto.parallel.upstream.cpu import cuda_available

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(timeout_s: float = 600.0, file_wait_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join (or create) the default process group; every process calls it once, before any plugin.

    gloo on CPU, nccl on CUDA. ``timeout_s`` (train.dist_timeout) bounds how long a rank waits in a collective
    for a peer that died, instead of torch's 30-minute default; ``file_wait_timeout_s``
    (train.file_wait_timeout) how long it waits for another rank's file work (``store_waits``). Without
    launcher variables this starts a world of one.
    """
    upstream.apply()
    set_timeout(file_wait_timeout_s)
    begin()  # this command's store waits: keys of their own
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if cuda_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class ParallelLayout:
    """Which ranks hold which data and which weights.

    Ranks of one data-parallel group see different batches; metric sums and KTO's reference point are
    reduced over it. Ranks of one tensor-parallel group hold slices of the same weights and see the same
    batches. Ranks of one sequence-parallel group (all_to_all) hold the same weights, see the same batches and
    each run a slice of every row's columns; their gradients are averaged with the data-parallel ranks' (the
    plugin's gradient group is dp x sp). ``dp_group is None`` means the default (world) group.
    """

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    dp_group: ProcessGroup | None
    tp_size: int = 1
    tp_group: ProcessGroup | None = None
    sp_size: int = 1
    sp_group: ProcessGroup | None = None
    # Pipeline parallelism: this rank holds one stage's layers; the last stage alone ends a pass (its log-probs,
    # losses and step sums), the others pass hidden states on.
    pp_size: int = 1
    pp_group: ProcessGroup | None = None
    is_last_stage: bool = True

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0 without tensor parallelism)."""
        return dist.get_rank(self.tp_group) if self.tp_size > 1 else 0

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group: which column slice of every row it runs (0 without)."""
        return dist.get_rank(self.sp_group) if self.sp_size > 1 else 0

    @property
    def counts_sums(self) -> bool:
        """Whether this rank adds its step sums to a world reduction: tensor- and sequence-parallel peers hold
        the same rows' sums, so only the group's rank 0 of each adds them (a row counts once); under pipeline
        parallelism only the last stage holds them."""
        return self.tp_rank == 0 and self.sp_rank == 0 and self.is_last_stage

    def sums_group(self) -> tuple[ProcessGroup | None, bool]:
        """(the group step and evaluation sums reduce over, whether this rank adds its sums): the data-parallel
        group, or under tensor, sequence or pipeline parallelism the world with ``counts_sums`` (one rank per row).
        """
        if self.tp_size > 1 or self.sp_size > 1 or self.pp_size > 1:
            return None, self.counts_sums
        return self.dp_group, True

    @property
    def gradient_replicas(self) -> int:
        """How many ranks the plugin averages each gradient over (DDP's or ZeRO's group: dp x sp)."""
        return self.dp_size * self.sp_size

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only writer of shared files (logs, checkpoints' metadata, exports)."""
        return self.rank == 0

    @classmethod
    def from_plugin(cls, plugin: Any) -> ParallelLayout:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dp_group = getattr(plugin, "dp_group", None)
        if dp_group is None:  # DDP, low-level ZeRO, Gemini: every rank is a data-parallel rank
            return cls(rank, world, local_rank, rank, world, None)
        tp_group = getattr(plugin, "tp_group", None)
        # all_to_all: a group of its own; split_gather and ring (refused at config load) would share the tp group.
        sequence = getattr(plugin, "enable_sequence_parallelism", False) and plugin.sp_size > 1
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            dp_rank=dist.get_rank(dp_group),
            dp_size=dist.get_world_size(dp_group),
            dp_group=dp_group,
            tp_size=dist.get_world_size(tp_group) if tp_group is not None else 1,
            tp_group=tp_group,
            sp_size=plugin.sp_size if sequence else 1,
            sp_group=plugin.sp_group if sequence else None,
            **_pipeline_fields(plugin),
        )


def _pipeline_fields(plugin: Any) -> dict[str, Any]:
    """The layout's pipeline fields from a HybridParallelPlugin (its stage manager; none below pp_size 2)."""
    stages = getattr(plugin, "stage_manager", None)
    if stages is None or getattr(plugin, "pp_size", 1) <= 1:
        return {}
    return {
        "pp_size": plugin.pp_size,
        "pp_group": plugin.pp_group,
        "is_last_stage": stages.is_last_stage(True),
    }


def reduce_sums(
    values: dict[str, float | torch.Tensor],
    group: ProcessGroup | None,
    local: dict[str, torch.Tensor] | None = None,
    votes: dict[str, float] | None = None,
    count_values: bool = True,
) -> dict[str, float]:
    """Sum each value over ``group`` in one fp64 all-reduce; every rank of the group calls it with the same keys.
    ``local``: values returned as they are on this rank (not reduced), read back with the sums. ``votes``: host
    floats summed alike, also when ``count_values`` is False, which makes this rank add 0 for ``values`` (a
    tensor-parallel peer whose sums its tp rank 0 adds: one all-reduce over the world for sums and votes).

    Use it for exact metrics: reduce sums and counts, divide afterwards (never average per-rank means). One host
    sync: the result's read-back. Device tensors stay on the device until then; floats go over in one
    non-blocking copy (pinned on CUDA): a pageable copy would synchronize the stream.
    """
    local, votes = local or {}, votes or {}
    device = comm_device()
    host = sorted(k for k, v in values.items() if not isinstance(v, torch.Tensor))
    on_device = sorted(k for k in values if k not in host)
    parts = []
    if host or votes:
        floats = [float(values[k]) for k in host] + [float(votes[k]) for k in sorted(votes)]
        staged = torch.tensor(floats, dtype=torch.float64)
        staged = staged.pin_memory() if device.type == "cuda" else staged
        parts.append(staged.to(device, non_blocking=True))
    parts += [t.detach().reshape(1).to(device, torch.float64) for t in (values[k] for k in on_device)]
    parts += [local[k].detach().reshape(1).to(device, torch.float64) for k in local]
    flat = torch.cat(parts)
    summed = len(host) + len(votes) + len(on_device)
    if not count_values:
        flat[: len(host)].zero_()
        flat[len(host) + len(votes) : summed].zero_()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat[:summed], op=dist.ReduceOp.SUM, group=group)
    keys = [*host, *sorted(votes), *on_device, *local]
    return dict(zip(keys, flat.tolist(), strict=True))


def mean_over_group(value: float, group: Any, device: torch.device) -> torch.Tensor:
    """0-dim fp32 on ``device``: ``value`` summed over ``group`` (None: this process alone) and divided by its
    size; one collective, no host sync. The trainer's step rows: every example of a step weighs the same."""
    # A fill, not torch.tensor(x, device=...): that is a pageable host-to-device copy, a sync on CUDA.
    total = torch.full((), value, device=device)
    if group is None:
        return total
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / dist.get_world_size(group)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small), in rank order, on every rank. Every rank calls."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (e.g. a path that only rank 0 chose)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def global_rank() -> int:
    """This process's rank in the default group (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def on_rank0(compute: Callable[[], T], what: str) -> T:
    """Rank 0 decides, every rank follows: ``compute()`` runs on global rank 0 only, and its result is returned
    on every rank. Every rank calls, and enters exactly one wait whatever happens on rank 0, so nobody is left
    waiting. The wait goes through the store, bounded by train.file_wait_timeout, not train.dist_timeout:
    ``compute`` may be hours of file work (``prepare the data``). A UserError on rank 0 is raised on every rank with the same one-line message
    (rank 0 raises its own; the others a copy of the same class and attributes, or a plain UserError where the
    class cannot be sent), marked ``same_on_every_rank`` so that only rank 0 prints it. Any other exception is
    re-raised on rank 0 (its traceback) and raised on the others as a PeerFailedError (a RuntimeError): one line
    naming rank 0's error and ``what`` ("prepare the data"), as a store wait that a failed rank ended.
    """
    outcome: tuple[str, Any, Any] = ("ok", None, None)
    failure: BaseException | None = None
    if global_rank() == 0:
        try:
            outcome = ("ok", compute(), None)
        except UserError as err:
            err.same_on_every_rank = True  # raised on every rank: printed once (cli.main)
            outcome, failure = ("user", _portable(err), str(err)), err
        except Exception as err:
            # one line: the others print it as theirs (cli.main), rank 0 its traceback
            line = (f"{type(err).__name__}: {err}".strip().splitlines() or [type(err).__name__])[0][:300]
            outcome, failure = ("internal", None, f"{line} (its traceback is in its log)"), err
    kind, value, message = from_rank0(outcome, what)
    if failure is not None:
        raise failure
    if kind == "user":
        raise _received(value, message)
    if kind == "internal":  # not a traceback per rank: rank 0 prints its own
        raise peer_failed(f"rank 0: {message}", f"global rank 0 to {what}")
    return value


def _portable(err: UserError) -> bytes | None:
    """``err`` pickled for the other ranks, if it survives the round trip here (a class defined in a function,
    an attribute that cannot be pickled do not); else the class alone; else None. Checked before the broadcast:
    pickling inside it would fail on rank 0 alone and leave the others waiting."""
    for state in (err.__dict__, {}):
        try:
            data = pickle.dumps((type(err), str(err), dict(state)))
            pickle.loads(data)
            return data
        except Exception:  # noqa: BLE001 - any pickling failure: try the next, simpler form
            continue
    return None


def _received(data: bytes | None, message: str) -> UserError:
    """Rank 0's UserError on another rank: its class and attributes when they arrived, and always its message."""
    err: UserError = UserError(message)
    try:
        cls, sent, state = pickle.loads(data) if data is not None else (UserError, message, {})
        err = rebuild_user_error(cls, sent, state)
    except Exception:  # noqa: BLE001 - a class this rank cannot import: the message still arrives
        pass
    if not isinstance(err, UserError) or str(err) != message:
        err = UserError(message)
    err.same_on_every_rank = True
    return err


_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
_PEER_CAUSES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def peer_failure(err: BaseException) -> str | None:
    """One line for a collective that failed because another rank or node went away; None for other errors.

    gloo reports it as a RuntimeError naming the peer's address (``Connection closed by peer [10.0.0.2]:4810``);
    NCCL and the store as torch.distributed.DistError.
    """
    if isinstance(err, FileWaitTimeoutError | PeerFailedError):
        return str(err)
    text = str(err)
    address, cause = _PEER_ADDRESS.search(text), next((c for c in _PEER_CAUSES if c in text), None)
    first_line = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
    if cause is not None and address is not None:
        cause = f"{cause}: {address.group(1)}"
    elif (
        "Timed out" in text
        and "gloo" in text
        or isinstance(err, dist.DistError)
        and "timed out" in text.lower()
    ):
        # A timeout cannot tell a dead peer from a live one stuck elsewhere (a hang, another collective).
        return (
            f"a collective timed out after train.dist_timeout ({first_line}): another rank or node is gone or "
            f"stuck; its own error, if any, is reported above; {next_step()}"
        )
    elif isinstance(err, dist.DistError):
        cause = first_line
    else:
        return None
    return (
        f"a collective failed because another rank or node is gone ({cause}); its own error, if any, is "
        f"reported above; {next_step()}"
    )


def comm_device() -> torch.device:
    """Where a tensor must be to go through this run's collectives: NCCL (a GPU) takes only CUDA tensors, gloo
    (no GPU) CPU ones. Any rank, local."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
