"""``merged_over_stages`` (the pipeline export's merge of each stage's weights) on 2 real gloo processes: every
rank gets the whole state, bit for bit and in each tensor's dtype, the tied alias dropped, or with ``keep`` False
nothing (the export's ranks that do not write); no tensor goes through an object collective (on NCCL those stage
every rank's pickle in GPU memory at once)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from coati_kto.testing.distributed import run_distributed


def _stage_state(stage: int) -> dict[str, torch.Tensor]:
    """What stage ``stage`` of a 2-stage tied model holds: the embedding on the first, the head on the last."""
    gen = torch.Generator().manual_seed(stage)
    if stage == 0:
        return {
            "model.embed_tokens.weight": torch.randn(11, 4, generator=gen).to(torch.bfloat16),
            "model.layers.0.mlp.weight": torch.randn(4, 4, generator=gen),
            "model.layers.0.position_ids": torch.arange(7),
            "model.layers.0.mask": torch.tensor([True, False, True]),
        }
    return {
        "model.layers.1.mlp.weight": torch.randn(4, 4, generator=gen, dtype=torch.float64),
        "model.layers.1.empty": torch.zeros(0, 3),
        "lm_head.weight": torch.randn(11, 4, generator=gen).to(torch.bfloat16),
    }


def _merge(_: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from coati_kto.trainer.export import merged_over_stages

    objects: list[Any] = []
    gather_object = dist.all_gather_object

    def recorded(out: list, obj: Any, group: Any = None) -> None:
        objects.append(obj)
        gather_object(out, obj, group=group)

    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(tie_word_embeddings=True))
    module = SimpleNamespace(
        _tied_weights_keys={"lm_head.weight": "model.embed_tokens.weight"}, config=config
    )
    dist.all_gather_object = recorded
    try:
        merged = merged_over_stages(_stage_state(dist.get_rank()), module, dist.group.WORLD)
    finally:
        dist.all_gather_object = gather_object
    # the export's call: only the rank that writes keeps the merge
    kept = merged_over_stages(
        _stage_state(dist.get_rank()), module, dist.group.WORLD, keep=dist.get_rank() == 0
    )
    return {"merged": merged, "objects": objects, "kept": kept}


def _tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors(v) for v in obj)
    return 0


def test_stages_merge_bit_for_bit_without_tensors_in_object_collectives() -> None:
    whole = {**_stage_state(0), **_stage_state(1)}
    del whole["lm_head.weight"]  # tied to the embedding: saved once, as save_pretrained does
    ranks = run_distributed(_merge, 2, None)
    for rank in ranks:
        merged = rank["merged"]
        assert list(merged) == list(whole)
        for name, tensor in whole.items():
            got = merged[name]
            assert (got.dtype, got.shape, got.device.type) == (tensor.dtype, tensor.shape, "cpu"), name
            assert torch.equal(got, tensor), name
        assert rank["objects"] and _tensors(rank["objects"]) == 0
    writer, sender = ranks[0]["kept"], ranks[1]["kept"]
    assert sender == {} and list(writer) == list(whole)
    assert all(torch.equal(writer[name], tensor) for name, tensor in whole.items())
