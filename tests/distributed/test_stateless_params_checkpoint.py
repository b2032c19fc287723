"""Checkpoints of a model with a parameter that no gradient reached yet (2 gloo processes).

A decoder whose extra parameter its forward does not use at first (cross-attention without an encoder, a sparse
indexer, an MoE expert no token was routed to) leaves AdamW without state for it. ZeRO's sharded optimizer save
looked that state up and raised KeyError. The checkpoint must hold no state for it (torch's convention: absent),
and a resume must continue exactly, also once the parameter starts receiving gradients after the resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "lowlevel-zero1-bf16": {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"},
    "lowlevel-zero2-bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "lowlevel-zero2-fp32": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "hybrid-zero2-bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}
# Not here: ddp and hybrid_parallel at zero_stage 0 (torch DDP, torch's optimizer state_dict, which leaves a
# stateless parameter out natively): tests/distributed/test_unused_params_ddp.py trains such parameters there, and
# family_sweep.py --plugins ddp resumes bart, git, deepseek_v32 bit for bit.
EXTRA = "model.extra.weight"
# Saved at step 2; the extra parameter gets its first gradient at step 4, after the resume; 5 steps in all.
SAVE_AT, FIRST_USED, STEPS = 2, 4, 5


def _setup(model_dir: str, plugin_kw: dict, root: str) -> dict[str, Any]:
    """The tiny Llama with ``model.extra`` (64 x 64), added to the final norm's output only once ``used``."""
    from colossalai.booster import Booster
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from coati_kto.config.schema import PluginSection
    from coati_kto.parallel import optimizers
    from coati_kto.parallel.distributed import ParallelLayout
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.trainer.checkpoint import CheckpointManager

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hidden = model.config.hidden_size
    extra = torch.nn.Linear(hidden, hidden, bias=False)
    with torch.no_grad():
        extra.weight.copy_(0.05 * torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(7)))
    extra.used = False
    model.model.extra = extra
    model.model.norm.register_forward_hook(lambda _m, _a, out: out + extra(out) if extra.used else out)
    plugin = ParallelPlan.from_section(PluginSection(**plugin_kw), max_grad_norm=1.0).backend.build_plugin()
    layout = ParallelLayout.from_plugin(plugin)
    optimizer = optimizers.make_optimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=10)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    gen = torch.Generator().manual_seed(layout.rank)  # other rows on each rank: the gradients are reduced
    pool = torch.randint(3, model.unwrap().config.vocab_size, (8, 16), generator=gen)
    manager = CheckpointManager(root, booster, layout)
    return dict(
        model=model, opt=optimizer, sched=scheduler, booster=booster, pool=pool, extra=extra, mgr=manager
    )


def _train(s: dict[str, Any], first: int, last: int) -> None:
    """Steps ``first`` .. ``last`` (1-based); rows chosen by step, so a resumed run sees the same batches."""
    for step in range(first, last + 1):
        s["extra"].used = step >= FIRST_USED
        ids = s["pool"][(step % 2) * 4 : (step % 2) * 4 + 4]
        out = s["model"](input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        s["booster"].backward(out.loss, s["opt"])
        s["opt"].step()
        s["opt"].zero_grad()
        s["sched"].step()


def _snapshot(s: dict[str, Any]) -> dict[str, Any]:
    """Whole weights, this rank's masters, and every parameter's Adam state gathered whole (None: no state)."""
    import torch.distributed as dist

    from coati_kto.parallel.masters import working_to_master
    from coati_kto.trainer.checkpoint_state import master_shards

    mapping, optim = working_to_master(s["opt"]), s["opt"].optim
    named = list(s["model"].unwrap().named_parameters())
    states: dict[str, Any] = {}
    for name, param in named:
        state = optim.state.get(mapping.get(id(param), param))
        states[name] = None if not state else {}
        for key, value in (state or {}).items():
            value = value.detach()
            if key != "step" and value.numel() != param.numel():  # a ZeRO chunk: gather it whole
                chunks = [torch.empty_like(value) for _ in range(dist.get_world_size())]
                dist.all_gather(chunks, value.contiguous())
                value = torch.cat(chunks)[: param.numel()]
            states[name][key] = value.float().reshape(-1).numpy().copy()
    return {
        "weights": {n: p.detach().float().numpy().copy() for n, p in named},
        "masters": {n: m.numpy() for n, m in master_shards(s["model"], s["opt"]).items()},
        "states": states,
        "index": [n for n, _ in named].index(EXTRA),
    }


def _runs(model_dir: str, base: str) -> dict[str, Any]:
    """Per plugin: uninterrupted (save at SAVE_AT), then a fresh setup resumed from that save."""
    out = {}
    for key, plugin in PLUGINS.items():
        ref = _setup(model_dir, plugin, f"{base}/{key}")
        _train(ref, 1, SAVE_AT)
        at_save = _snapshot(ref)
        ref["mgr"].save(SAVE_AT, ref["model"], ref["opt"], ref["sched"], {"global_step": SAVE_AT})
        _train(ref, SAVE_AT + 1, STEPS)
        res = _setup(model_dir, plugin, f"{base}/{key}")
        res["mgr"].load(res["mgr"].resolve("auto"), res["model"], res["opt"], res["sched"])
        loaded = _snapshot(res)
        _train(res, SAVE_AT + 1, STEPS)
        out[key] = {"at_save": at_save, "loaded": loaded, "ref": _snapshot(ref), "resumed": _snapshot(res)}
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    base = tmp_path_factory.mktemp("stateless")
    return run_distributed(_runs, 2, str(tiny_model_dir), str(base)), base


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        return a == b
    return a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_saved_without_state_and_resumed_exactly(
    runs: tuple[list[dict[str, Any]], Path], plugin: str
) -> None:
    ranks, base = runs
    index = json.loads(
        (base / plugin / f"step-{SAVE_AT}" / "optimizer" / "pytorch_optim.bin.index.json").read_text()
    )
    for rank in ranks:
        r = rank[plugin]
        # At the save AdamW held state for every parameter but the unused one: the checkpoint leaves it out, the
        # others are in it, and the loaded optimizer has exactly the saved states.
        assert r["at_save"]["states"][EXTRA] is None
        assert sum(s is not None for s in r["at_save"]["states"].values()) == len(r["at_save"]["states"]) - 1
        assert sorted(map(int, index["weight_map"])) == [
            i for i in range(len(r["at_save"]["states"])) if i != r["at_save"]["index"]
        ]
        assert _same(r["loaded"]["states"], r["at_save"]["states"])
        assert _same(r["loaded"]["weights"], r["at_save"]["weights"])
        # Once used (steps 4 and 5) the parameter trained, with state, and the resumed run is the same bit for bit.
        assert r["ref"]["states"][EXTRA] is not None
        assert not np.array_equal(r["ref"]["weights"][EXTRA], r["at_save"]["weights"][EXTRA])
        assert _same(r["resumed"], r["ref"])
    assert _same(ranks[0][plugin]["ref"]["weights"], ranks[1][plugin]["ref"]["weights"])
