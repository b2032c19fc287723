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


def test_the_cpu_randomizer_holds_the_seeded_states_without_seeding_torch(monkeypatch) -> None:
    """A shardformer ``Randomizer`` on CPU (coati_kto.parallel.upstream.cpu) holds, for the accelerator and the
    CPU, the bytes ColossalAI's own constructor reads after ``torch.manual_seed(seed)``, and leaves the global
    generator where it was, without calling ``torch.manual_seed`` (it formatted the stack for CUDA, MTIA and XPU)."""
    import torch
    from colossalai.shardformer.layer.utils import Randomizer

    from coati_kto.parallel.upstream import cpu

    monkeypatch.setattr(Randomizer, "__init__", Randomizer.__init__)  # put back after the test
    torch.manual_seed(3)
    torch.randn(5)  # a global state no seed gives
    before = torch.get_rng_state()
    torch.manual_seed(1024)
    seeded = torch.get_rng_state()
    torch.set_rng_state(before)
    cpu._randomizer_states_without_reseeding()
    monkeypatch.setattr(torch, "manual_seed", None)  # any call would raise
    randomizer = Randomizer(1024)
    assert torch.equal(randomizer.cpu_rng_state, seeded) and torch.equal(randomizer.device_rng_state, seeded)
    assert torch.equal(torch.get_rng_state(), before) and randomizer.seed == 1024


def test_optimizer_loads_put_fused_step_counts_on_the_parameters_device(monkeypatch) -> None:
    """ColossalAI's optimizer loads leave ``step`` on the CPU; torch's fused AdamW on a GPU then refused it at the
    resumed run's first step (``make gpu-check``, H200). After the fix every loader's epilogue moves a fused
    group's counts to the parameter's device in fp32, as ``torch.optim.Optimizer.load_state_dict`` does, and
    leaves a non-fused group's where the loader put them. A ``meta`` parameter stands in for a GPU one here."""
    import importlib

    import torch
    from colossalai.checkpoint_io.utils import load_states_into_optimizer

    from coati_kto.parallel import upstream

    upstream.apply()  # the CPU accelerator's synchronize, which the loader calls
    for name in (*fixes._OPTIMIZER_LOADERS, "colossalai.checkpoint_io.utils"):
        module = importlib.import_module(name)
        monkeypatch.setattr(
            module, "sharded_optimizer_loading_epilogue", module.sharded_optimizer_loading_epilogue
        )
    fixes._fix_step_counts_left_on_cpu_by_optimizer_loads()
    saved = {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}}
    for name in fixes._OPTIMIZER_LOADERS:
        epilogue = importlib.import_module(name).sharded_optimizer_loading_epilogue
        for fused in (True, False):
            param = torch.nn.Parameter(torch.zeros(3, device="meta"))
            optimizer = torch.optim.AdamW([param], fused=fused, foreach=False if not fused else None)
            load_states_into_optimizer(optimizer, saved, {0: param})
            assert optimizer.state[param]["step"].device.type == "cpu"  # what upstream's loader leaves
            epilogue(optimizer)
            step = optimizer.state[param]["step"]
            assert (step.device.type, step.dtype) == (("meta" if fused else "cpu"), torch.float32), (
                name,
                fused,
            )
            assert optimizer.state[param]["exp_avg"].device.type == "meta"
