"""``coati_kto.parallel.upstream.fixes``: the changes to ColossalAI 0.5.0 that need no process group."""

from __future__ import annotations

import torch.distributed as dist

from coati_kto.parallel.upstream import fixes


def test_the_pipeline_backend_check_gets_the_function_torch_dropped(monkeypatch) -> None:
    """colossalai/pipeline/p2p.py:159 asks ``is_nccl_available() or is_hccl_available()``; torch 2.13 has no
    ``is_hccl_available``, so on a CPU build every pipeline send raised AttributeError. The fix answers False (no
    HCCL in such a build) and leaves a torch that has the function alone."""
    monkeypatch.delattr(dist, "is_hccl_available", raising=False)
    fixes._fix_pipeline_backend_check()
    assert dist.is_hccl_available() is False

    def own() -> bool:
        return True

    monkeypatch.setattr(dist, "is_hccl_available", own, raising=False)
    fixes._fix_pipeline_backend_check()
    assert dist.is_hccl_available is own
