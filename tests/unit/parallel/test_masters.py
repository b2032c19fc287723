"""``coati_kto.parallel.masters.gathered_masters`` without a process group: what it hands ZeRO's all-gather."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from coati_kto.parallel import masters


def test_zero_chunks_go_through_the_collective_on_its_device(monkeypatch) -> None:
    """With ``plugin.cpu_offload`` ZeRO keeps each rank's fp32 chunk in host memory; NCCL takes only CUDA tensors,
    so an fp32 export of such a run on 2 GPUs raised after the whole training. The chunk is now moved to the
    collectives' device first (``meta`` stands in for the GPU here: the stand-in all-gather checks where it is
    handed the chunk, then returns the peers' chunks), and the result is the whole fp32 weight, on the CPU."""
    weight = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))  # no master: the working weight, as fp32
    whole = torch.arange(6, dtype=torch.float32)
    chunks = [
        torch.cat([whole, torch.zeros(2)])[i * 4 : (i + 1) * 4] for i in range(2)
    ]  # padded to 8, 2 ranks
    handed: list[torch.device] = []

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: object = None) -> None:
        handed.append(tensor.device)
        out[:] = [c.clone() for c in chunks]

    monkeypatch.setattr(masters, "comm_device", lambda: torch.device("meta"), raising=False)
    monkeypatch.setattr(masters.dist, "all_gather", all_gather)
    monkeypatch.setattr(masters.dist, "get_world_size", lambda group=None: 2)
    module = torch.nn.Module()
    module.weight, module.bias = weight, bias
    model = SimpleNamespace(unwrap=lambda: module)
    optimizer = SimpleNamespace(
        get_working_to_master_map=lambda: {id(weight): chunks[0].clone()},  # rank 0's chunk, in host memory
        param_to_pg={weight: "zero group"},
    )
    out = masters.gathered_masters(model, optimizer)
    assert handed == [torch.device("meta")]
    assert out["weight"].dtype == torch.float32 and out["weight"].device.type == "cpu"
    assert torch.equal(out["weight"], whole.view(2, 3))
    assert torch.equal(out["bias"], torch.ones(3))
    # a rank whose copy nobody reads: the same all-gather (a collective: its peers wait in it), nothing kept
    assert masters.gathered_masters(model, optimizer, keep=False) == {}
    assert handed == [torch.device("meta")] * 2
