"""ColossalAI 0.5.0's pipeline transport on 2 real gloo processes (issue 48's groundwork,
docs/pipeline_parallelism_plan.md §6): ``PipelineP2PCommunication`` (colossalai/pipeline/p2p.py) under
``OneForwardOneBackwardSchedule`` and ``InterleavedSchedule``, driving a toy fp64 MLP split by hand across a
``PipelineStageManager``. Each stage's parameter gradients and the last stage's loss and outputs must equal one process
running the whole model over the same micro-batches. No project code is involved: the test pins the upstream behaviour
the pipeline plan builds on (the transport works on CPU/gloo, so pp can be tested on CI).

One launch for every case (the suite's time budget): ``_worker`` runs them all and returns numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from coati_kto.testing.distributed import run_distributed

PP = 2
WIDTH = 6
BLOCKS = 8  # Linear + tanh blocks of the whole toy model
BATCH = 8  # rows of one pipeline batch
MICRO = (
    4  # micro-batches per batch (>= PP, as 1F1B asserts; a multiple of PP, as the interleaved one asserts)
)


def _whole() -> nn.ModuleList:
    """The same seeded blocks on every rank and in the one-process reference."""
    gen = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, dtype=torch.float64) for _ in range(BLOCKS))
    with torch.no_grad():
        for p in blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return blocks


class _Stage(nn.Module):
    """A slice of the blocks. The first one reads the micro-batch's ``x``; the others read ``hidden`` from the
    previous stage (the schedule passes it as a keyword next to the micro-batch's own keys)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor, hidden: Any = None
    ) -> dict[str, Any]:
        h = x if hidden is None else hidden
        for block in self.blocks:
            h = torch.tanh(block(h))
        return {"hidden": h}


def _batch() -> dict[str, torch.Tensor]:
    """``x`` the input, ``y`` the target, ``ref`` a per-row constant the criterion reads (KTO's reference log-probs
    ride this way); all split along dim 0 by the schedule."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)
    return {"x": x, "y": torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64), "ref": x[:, 0] * 0.1}


def _criterion(z0: float) -> Any:
    """A loss that is nonlinear in each row's sum and reads a batch-wide constant from its closure (z0 cannot ride in
    the micro-batch as a 0-dim tensor: the schedule slices every tensor along dim 0)."""

    def criterion(output: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = ((output["hidden"] - micro["y"]) ** 2).sum(-1) - micro["ref"]
        return torch.sigmoid(rows - z0).sum()

    return criterion


def _reference(z0: float) -> tuple[list[torch.Tensor], float, torch.Tensor]:
    """One process, the whole model: grads of sum over micro-batches of criterion / MICRO, the loss, the outputs."""
    blocks, batch, crit = _whole(), _batch(), _criterion(z0)
    whole = _Stage(list(blocks))
    loss = torch.zeros((), dtype=torch.float64)
    size = BATCH // MICRO
    for m in range(MICRO):
        micro = {k: v[m * size : (m + 1) * size] for k, v in batch.items()}
        loss = loss + crit(whole(**micro), micro) / MICRO
    loss.backward()
    with torch.no_grad():
        outputs = whole(**batch)["hidden"]
    return [p.grad.clone() for p in blocks.parameters()], float(loss.detach()), outputs


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


def _manager(interleave: bool) -> Any:
    from colossalai.cluster import ProcessGroupMesh
    from colossalai.pipeline.stage_manager import PipelineStageManager

    return PipelineStageManager(
        ProcessGroupMesh(PP),
        pipeline_axis=0,
        enable_interleave=interleave,
        num_model_chunks=2 if interleave else 1,
    )


def _run(schedule: Any, model: Any, z0: float, grad: bool) -> dict[str, Any]:
    from colossalai.interface import OptimizerWrapper

    params = list(model.parameters())
    optimizer = OptimizerWrapper(torch.optim.SGD(params, lr=0.0))
    with torch.set_grad_enabled(grad):
        result = schedule.forward_backward_step(
            model,
            iter([_batch()]),
            _criterion(z0),
            optimizer if grad else None,
            return_loss=True,
            return_outputs=True,
        )
    return {"result": result, "grads": [p.grad for p in params]}


def _one_f_one_b(rank: int, z0: float) -> dict[str, Any]:
    from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule

    blocks, per = _whole(), BLOCKS // PP
    own = list(range(rank * per, (rank + 1) * per))
    stage = _Stage([blocks[i] for i in own])
    schedule = OneForwardOneBackwardSchedule(_manager(False), num_microbatches=MICRO)
    train = _run(schedule, stage, z0, grad=True)
    fwd = _run(OneForwardOneBackwardSchedule(_manager(False), num_microbatches=MICRO), stage, z0, grad=False)
    return {"own": own, "train": train, "forward": fwd}


def _interleaved(rank: int, z0: float) -> dict[str, Any]:
    """Two chunks per rank: virtual stage v = chunk * PP + rank holds blocks [2v, 2v + 2).

    ``overlap_p2p=False``: with the default (True, HybridParallelPlugin's too) the schedule leaves its p2p requests
    in flight and waits later; on gloo that failed in 6 of 11 runs (a rank stuck in ``_wait_p2p``, its peer timing
    out in the next collective or closing the pair). With False every exchange is waited at once: 6 of 6 passed."""
    from colossalai.pipeline.schedule import InterleavedSchedule

    blocks, per = _whole(), BLOCKS // (2 * PP)
    own = [[(c * PP + rank) * per + i for i in range(per)] for c in range(2)]
    chunks = nn.ModuleList(_Stage([blocks[i] for i in ids]) for ids in own)
    schedule = InterleavedSchedule(
        _manager(True), num_model_chunks=2, num_microbatch=MICRO, overlap_p2p=False
    )
    return {"own": [i for ids in own for i in ids], "train": _run(schedule, chunks, z0, grad=True)}


def _changing_lengths(rank: int) -> float:
    """Two 1F1B training calls whose activations differ in length ([8, 3, 6] then [8, 5, 6], as padded KTO batches
    do between steps), with ``enable_metadata_cache=False``: the largest gradient difference from one process.

    With the cache on (the plugin's default), the receiver allocates the first call's shape and the second call
    aborts the process in gloo ("Received data size doesn't match expected size", 320 vs 192 bytes; a one-off run,
    not kept: the abort kills the rank)."""
    from colossalai.interface import OptimizerWrapper
    from colossalai.pipeline.schedule import OneForwardOneBackwardSchedule

    blocks, per = _whole(), BLOCKS // PP
    stage = _Stage([blocks[i] for i in range(rank * per, (rank + 1) * per)])
    schedule = OneForwardOneBackwardSchedule(
        _manager(False), num_microbatches=MICRO, enable_metadata_cache=False
    )
    optimizer = OptimizerWrapper(torch.optim.SGD(stage.parameters(), lr=0.0))
    worst = 0.0
    for length in (3, 5):
        gen = torch.Generator().manual_seed(length)
        x = torch.randn(BATCH, length, WIDTH, generator=gen, dtype=torch.float64)
        batch = {"x": x, "y": torch.zeros_like(x), "ref": torch.zeros(BATCH, dtype=torch.float64)}
        stage.zero_grad()
        schedule.forward_backward_step(
            stage, iter([batch]), lambda out, _: out["hidden"].square().sum(), optimizer
        )
        reference = _whole()
        (_Stage(list(reference))(**batch)["hidden"].square().sum() / MICRO).backward()
        want = [p.grad for i in range(rank * per, (rank + 1) * per) for p in reference[i].parameters()]
        worst = max(worst, _max_diff([p.grad for p in stage.parameters()], want))
    return worst


def _numbers(case: dict[str, Any], z0: float, last: bool) -> dict[str, Any]:
    grads, loss, outputs = _reference(z0)
    want = [g for i in case["own"] for g in grads[2 * i : 2 * i + 2]]  # weight, bias of each owned block
    out = {
        "grad_diff": _max_diff(case["train"]["grads"], want),
        "grad_scale": max(float(g.abs().max()) for g in want),
    }
    result = case["train"]["result"]
    if last:
        out["loss_diff"] = abs(float(result["loss"]) - loss)
        out["loss_dtype"] = str(result["loss"].dtype)
        out["output_diff"] = float((result["outputs"]["hidden"] - outputs).abs().max())
        if "forward" in case:
            fwd = case["forward"]["result"]
            out["forward_output_diff"] = float((fwd["outputs"]["hidden"] - outputs).abs().max())
            out["forward_loss_diff"] = abs(float(fwd["loss"]) - loss)
    else:
        out["loss_is_none"] = result["loss"] is None and result["outputs"] is None
    return out


def _scalar_in_batch() -> str:
    """What the schedule does with a 0-dim tensor in the batch (why z0 rides in the criterion's closure)."""
    from colossalai.pipeline.schedule._utils import get_micro_batch

    try:
        get_micro_batch({"x": torch.zeros(4, 2), "z0": torch.tensor(0.5)}, 0, 2)
    except IndexError as err:
        return f"IndexError: {err}"
    return "no error"


def _worker(z0: float) -> dict[str, Any]:
    """Every case on this rank. p2p.py:159 calls ``torch.distributed.is_hccl_available``, which torch 2.13 no longer
    has (AttributeError on a CPU build): ``coati_kto.parallel.upstream.apply()`` installs it, as every rank of a run
    does (``fixes._fix_pipeline_backend_check``)."""
    import torch.distributed as dist

    from coati_kto.parallel.upstream import apply

    apply()
    rank = dist.get_rank()
    last = rank == PP - 1
    out = {
        "one_f_one_b": _numbers(_one_f_one_b(rank, z0), z0, last),
        "interleaved": _numbers(_interleaved(rank, z0), z0, last),
    }
    out["changing_lengths"] = _changing_lengths(rank)
    out["scalar_in_batch"] = _scalar_in_batch()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, PP, 0.3)


@pytest.mark.parametrize("schedule", ["one_f_one_b", "interleaved"])
def test_pipeline_schedule_gradients_equal_one_process_on_gloo(
    ranks: list[dict[str, Any]], schedule: str
) -> None:
    """Each stage's parameter gradients equal the one-process ones (fp64, 4 micro-batches, a nonlinear per-row loss
    with a per-row constant from the micro-batch); the last stage's summed loss and merged outputs equal them too."""
    for rank in ranks:
        got = rank[schedule]
        assert got["grad_scale"] > 1e-3  # the comparison is not between zeros
        assert got["grad_diff"] < 1e-12, got
    assert ranks[0][schedule]["loss_is_none"]
    # The schedule accumulates the returned loss in a scalar of the default dtype (one_f_one_b.py:385), whatever the
    # loss's own dtype: fp32 here, so the summed loss is only fp32-close while the gradients are fp64-exact.
    assert ranks[-1][schedule]["loss_dtype"] == "torch.float32"
    assert ranks[-1][schedule]["loss_diff"] < 1e-6
    assert ranks[-1][schedule]["output_diff"] < 1e-12


def test_pipeline_forward_only_equals_one_process_on_gloo(ranks: list[dict[str, Any]]) -> None:
    """Under no_grad, forward_backward_step runs the forward-only schedule: the last stage's outputs and loss are the
    one-process ones (phase 1 of KTO under pp takes this path)."""
    assert ranks[-1]["one_f_one_b"]["forward_output_diff"] < 1e-12
    assert ranks[-1]["one_f_one_b"]["forward_loss_diff"] < 1e-6  # fp32 accumulator, as above


def test_zero_dim_tensor_in_a_pipeline_batch_fails(ranks: list[dict[str, Any]]) -> None:
    """The schedule slices every tensor of the batch along dim 0, so a batch-wide scalar cannot ride in it."""
    assert ranks[0]["scalar_in_batch"] == "IndexError: slice() cannot be applied to a 0-dim tensor."


def test_changing_lengths_without_the_metadata_cache_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    """Activations whose length changes between calls pass when the schedule's metadata cache is off (the project
    must build the plugin with ``enable_metadata_cache=False``): gradients equal one process's in fp64."""
    for rank in ranks:
        assert rank["changing_lengths"] < 1e-12, rank["changing_lengths"]
