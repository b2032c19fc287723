"""Checkpoints on 2 gloo processes: exact fp32 and bf16 resume, atomic saves, pruning, resolve, HF export.

Each scenario trains the tiny Llama on a fixed per-rank token pool; every step picks its rows with the
global torch RNG, so a resume is only exact when the RNG states come back too.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coati_kto.testing.distributed import run_distributed

FP32 = {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"}
BF16 = {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}
# bf16_states: the bf16 ZeRO-2 run with AdamW's moments in bf16 (train.optimizer_state_dtype).
PLUGINS = {"fp32": FP32, "bf16": BF16, "bf16_states": BF16}


def _setup(
    model_dir: str, plugin_kw: dict, root: str, state_dtype: str = "fp32", mixed_step: bool = False
) -> dict[str, Any]:
    from colossalai.booster import Booster
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from coati_kto.config.schema import PluginSection
    from coati_kto.parallel import optimizers
    from coati_kto.parallel.distributed import ParallelLayout, seed_everything
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.trainer.checkpoint import CheckpointManager

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plugin = ParallelPlan.from_section(PluginSection(**plugin_kw), max_grad_norm=1.0).backend.build_plugin()
    layout = ParallelLayout.from_plugin(plugin)
    optimizer = optimizers.make_optimizer(
        model.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=state_dtype, mixed_step=mixed_step
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=10)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    if mixed_step:  # what ParallelPlan.boost installs (train.fused_optimizer)
        from coati_kto.parallel import optimizer_path

        optimizer_path.install_clipping(optimizer)
        optimizer_path.install_mixed_precision_step(optimizer)
        optimizer_path.install_fused_zero(optimizer)
    gen = torch.Generator().manual_seed(100 + layout.dp_rank)
    pool = torch.randint(3, model.unwrap().config.vocab_size, (8, 32), generator=gen)
    seed_everything(1234 + layout.rank)  # different RNG streams per rank
    manager = CheckpointManager(root, booster, layout, keep_last=2)
    return dict(
        model=model, opt=optimizer, sched=scheduler, booster=booster, layout=layout, pool=pool, mgr=manager
    )


def _train(s: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        ids = s["pool"][torch.randperm(8)[:4]]
        out = s["model"](input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        s["booster"].backward(out.loss, s["opt"])
        s["opt"].step()
        s["opt"].zero_grad()
        s["sched"].step()


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _snapshot(s: dict[str, Any]) -> dict[str, Any]:
    from coati_kto.trainer.checkpoint_state import master_shards

    # numpy, not tensors: torch's queue would share tensor storage with a process that is about to exit
    weights = {n: p.detach().float().numpy().copy() for n, p in s["model"].unwrap().named_parameters()}
    masters = {n: m.numpy() for n, m in master_shards(s["model"], s["opt"]).items()}
    moments = {str(v.dtype) for st in s["opt"].optim.state.values() for k, v in st.items() if k != "step"}
    return {"weights": weights, "lr": s["sched"].get_last_lr(), "masters": masters, "moments": moments}


def _reference(s: dict[str, Any]) -> dict[str, Any]:
    """Uninterrupted: 2 steps, save, 2 steps; then a save that fails part-way."""
    zero = s["layout"].dp_size > 1 and _zero_stage(s) > 0
    if zero:  # several optimizer shards, each written by rank 0 between upstream's gathers of the next
        save_optimizer = s["booster"].save_optimizer
        s["booster"].save_optimizer = lambda *a, **k: save_optimizer(*a, **k, size_per_shard=SHARD_MB)
    _train(s, 2)
    s["mgr"].save(2, s["model"], s["opt"], s["sched"], {"global_step": 2, "rank": s["layout"].rank})
    draws = _draws()
    _train(s, 2)
    result = {"draws": draws, **_snapshot(s)}
    result["optimizer_shards"] = len(list((s["mgr"].root / "step-2" / "optimizer").glob("pytorch_optim-*")))

    def broken_save(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full (simulated)")

    from coati_kto.trainer.checkpoint import CheckpointSaveError

    if zero:  # rank 0's disk fills at the optimizer's second shard, with gathers still ahead
        write, torch.save = torch.save, _full_from_second_shard(torch.save, s["layout"].rank)
    else:
        s["booster"].save_lr_scheduler = broken_save  # after model and optimizer are written
    try:
        s["mgr"].save(4, s["model"], s["opt"], s["sched"], {"global_step": 4})
    except CheckpointSaveError as err:  # on every rank, and the partial step-4.tmp is gone
        result["save_failed"], result["save_error"] = True, str(err)
    finally:
        if zero:
            torch.save = write
    result["tmp_left"] = sorted(p.name for p in s["mgr"].root.glob("*.tmp"))
    return result


SHARD_MB = 0.02  # the tiny Llama's Adam states are about 0.1 MB: several shards


def _zero_stage(s: dict[str, Any]) -> int:
    return int(getattr(s["booster"].plugin, "zero_stage", 0))


def _full_from_second_shard(save: Any, rank: int) -> Any:
    """torch.save, with rank 0's writes of optimizer shards failing from the second on (ENOSPC)."""
    import errno

    def full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        name = os.path.basename(str(f))
        if rank == 0 and name.startswith("pytorch_optim-") and not name.startswith("pytorch_optim-00001"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    return full


def _resume(s: dict[str, Any], model_dir: str, export_dir: str | None) -> dict[str, Any]:
    """Load the latest complete checkpoint (step 2) into a freshly built setup, train 2 steps."""
    import coati_kto.trainer.checkpoint as ckpt

    path = s["mgr"].resolve("auto")
    result: dict[str, Any] = {"resolved": path.name}
    if (
        export_dir is not None
    ):  # bf16: first the booster alone, which rebuilds the masters from the bf16 model
        restore, ckpt.restore_masters = ckpt.restore_masters, lambda *a, **k: None
        s["mgr"].load(path, s["model"], s["opt"], s["sched"])
        _train(s, 2)
        result["without_masters"] = _snapshot(s)["weights"]
        ckpt.restore_masters = restore
    result["trainer_state"] = s["mgr"].load(path, s["model"], s["opt"], s["sched"])
    result["draws"] = _draws()
    _train(s, 2)
    result.update(_snapshot(s))
    if export_dir is not None:
        from transformers import AutoTokenizer

        s["mgr"].export_hf(s["model"], AutoTokenizer.from_pretrained(model_dir), export_dir)
        result["failed_export"] = _failed_export(s, export_dir)
    return result


def _failed_export(s: dict[str, Any], export_dir: str) -> str:
    """Export again with the main rank's write failing (a full disk): every rank's error, the good export kept."""
    import errno

    import coati_kto.trainer.checkpoint as ckpt

    def full(module: Any, state: dict, tokenizer: Any, out: Path, fp32: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)  # write_final's own directory, made for it
        (out / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))

    write, ckpt.write_hf = ckpt.write_hf, full
    try:
        s["mgr"].export_hf(s["model"], None, export_dir)
    except ckpt.CheckpointSaveError as err:
        return str(err)
    finally:
        ckpt.write_hf = write
    return "no error"


def _housekeeping(s: dict[str, Any]) -> dict[str, Any]:
    """Saves that replace a stale .tmp and prune to keep_last; resolve on odd directories."""
    from coati_kto.errors import UserError
    from coati_kto.parallel.distributed import barrier

    mgr, root, out = s["mgr"], s["mgr"].root, {}
    if s["layout"].is_main:  # what a save killed mid-way (SIGKILL, power loss) leaves behind
        (root / "step-4.tmp" / "model").mkdir(parents=True)
    barrier()
    out["stale_before"] = sorted(p.name for p in root.glob("*.tmp"))
    for step in (4, 5):
        mgr.save(step, s["model"], s["opt"], s["sched"], {"global_step": step})
    out["listing"] = sorted(p.name for p in root.iterdir())
    out["latest"] = (root / "latest").read_text()
    mgr.save(3, s["model"], s["opt"], s["sched"], {"global_step": 3})  # as after resuming from an older step
    out["older_listing"] = sorted(p.name for p in root.iterdir())
    out["older_latest"] = (root / "latest").read_text()
    if s["layout"].is_main:
        (root / "step-9").mkdir()  # a crashed save without its COMPLETE marker
        (root / "latest").write_text("step-9")  # even a pointer to it must be ignored
        out["auto"] = mgr.resolve("auto").name
        out["none"] = mgr.resolve(None)
        for bad in (root / "step-9", root / "missing"):
            try:
                mgr.resolve(str(bad))
            except UserError as err:
                out[f"error {bad.name}"] = str(err)
    return out


def _first_run(model_dir: str, roots: dict[str, str]) -> dict[str, Any]:
    return {
        prec: _reference(_setup(model_dir, PLUGINS[prec], root, _state_dtype(prec)))
        for prec, root in roots.items()
    }


def _state_dtype(prec: str) -> str:
    return "bf16" if prec == "bf16_states" else "fp32"


def _second_run(model_dir: str, roots: dict[str, str], export_dir: str) -> dict[str, Any]:
    """A fresh process group: resume both precisions; fp32 then exercises saving, pruning and resolve."""
    fp32 = _setup(model_dir, FP32, roots["fp32"])
    out = {"fp32": _resume(fp32, model_dir, None)}
    out["housekeeping"] = _housekeeping(fp32)
    out["bf16"] = _resume(_setup(model_dir, BF16, roots["bf16"]), model_dir, export_dir)
    states = _setup(model_dir, BF16, roots["bf16_states"], "bf16")
    out["bf16_states"] = _resume(states, model_dir, None)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("checkpoints")
    roots = {prec: str(base / prec) for prec in PLUGINS}
    first = run_distributed(_first_run, 2, str(tiny_model_dir), roots)
    fp32_root = base / "fp32"
    after_failed_save = {"latest": (fp32_root / "latest").read_text(), "dirs": sorted(os.listdir(fp32_root))}
    second = run_distributed(_second_run, 2, str(tiny_model_dir), roots, str(base / "export"))
    return {
        "first": first,
        "second": second,
        "after_failed_save": after_failed_save,
        "export": base / "export",
        "roots": roots,
    }


def _max_diff(ref: dict[str, Any], res: dict[str, Any], key: str = "weights") -> float:
    return max(float(np.abs(ref["weights"][n] - res[key][n]).max()) for n in ref["weights"])


def _check_exact_resume(runs: dict[str, Any], prec: str) -> None:
    refs = [r[prec] for r in runs["first"]]
    assert refs[0]["draws"] != refs[1]["draws"]  # per-rank RNG streams, each restored to its own rank
    for rank, (ref, res) in enumerate(zip(refs, (r[prec] for r in runs["second"]), strict=True)):
        assert res["resolved"] == "step-2"
        assert res["trainer_state"] == {"global_step": 2, "rank": rank}
        assert res["draws"] == ref["draws"]
        assert res["lr"] == ref["lr"]
        for name, w in ref["weights"].items():
            assert np.array_equal(w, res["weights"][name]), name


def test_fp32_resume_is_bit_identical(runs: dict[str, Any]) -> None:
    _check_exact_resume(runs, "fp32")
    assert all(r["fp32"]["masters"] == {} for r in runs["first"])  # fp32: the model checkpoint is the master


def test_bf16_zero2_resume_is_bit_identical_with_master_weights(runs: dict[str, Any]) -> None:
    _check_exact_resume(runs, "bf16")
    for ref, res in zip((r["bf16"] for r in runs["first"]), (r["bf16"] for r in runs["second"]), strict=True):
        drift = _max_diff(ref, res, "without_masters")
        print(
            f"bf16 max abs weight diff 2 steps after resume: booster only {drift:.3e}, "
            f"with master shards {_max_diff(ref, res):.3e}"
        )
        assert drift > 0.0  # the booster alone rebuilds fp32 masters from the bf16 model ...
        assert ref["masters"].keys() == res["masters"].keys() and len(ref["masters"]) > 0
        for name, m in ref["masters"].items():  # ... our per-rank master shards come back exactly
            assert m.dtype == np.float32 and np.array_equal(m, res["masters"][name]), name


def test_bf16_optimizer_states_resume_bit_identical(runs: dict[str, Any]) -> None:
    """train.optimizer_state_dtype bf16: the moments are stored (and saved) in bf16 and a resume is exact; they
    moved the weights otherwise than fp32 moments (they are in use)."""
    _check_exact_resume(runs, "bf16_states")
    for ref, res, fp32_states in zip(
        (r["bf16_states"] for r in runs["first"]),
        (r["bf16_states"] for r in runs["second"]),
        (r["bf16"] for r in runs["first"]),
        strict=True,
    ):
        assert ref["moments"] == res["moments"] == {"torch.bfloat16"}
        assert fp32_states["moments"] == {"torch.float32"}
        for name, m in ref["masters"].items():
            assert np.array_equal(m, res["masters"][name]), name
        assert _max_diff(fp32_states, ref) > 0.0


def test_failed_save_keeps_last_good_checkpoint(runs: dict[str, Any]) -> None:
    assert all(r["fp32"]["save_failed"] for r in runs["first"])
    assert all(r[p]["tmp_left"] == [] for r in runs["first"] for p in PLUGINS)
    assert runs["after_failed_save"] == {"latest": "step-2", "dirs": ["latest", "step-2"]}
    assert runs["second"][0]["fp32"]["resolved"] == "step-2"  # and it loaded exactly (test above)


def test_a_write_failing_between_upstreams_gathers_is_agreed_on_at_once(runs: dict[str, Any]) -> None:
    """ZeRO's optimizer save gathers each shard's states over the data-parallel group before rank 0 writes it.
    Rank 0's write of the second of several shards fails: it stays in the remaining gathers, and every rank
    raises the same error (before, rank 0 left for the failure agreement while rank 1 went on into the next
    gather: mismatched collectives), and the runs after it in the same process group train and resume exactly
    (the tests above)."""
    for prec in ("bf16", "bf16_states"):
        ranks = [r[prec] for r in runs["first"]]
        assert ranks[0]["optimizer_shards"] >= 3, ranks[0]["optimizer_shards"]
        errors = {r["save_error"] for r in ranks}
        assert len(errors) == 1, errors
        (error,) = errors
        assert error.startswith(
            "checkpoint step-4 could not be written (rank 0: No space left on device: "
        ), error
        assert "pytorch_optim-00002" in error and error.endswith(
            "removed the partial step-4.tmp, the last complete checkpoint is "
            f"{Path(runs['roots'][prec]) / 'step-2'}"
        ), error


def test_pruning_latest_pointer_and_resolve(runs: dict[str, Any]) -> None:
    out = runs["second"][0]["housekeeping"]
    assert out["stale_before"] == ["step-4.tmp"]
    assert out["listing"] == ["latest", "step-4", "step-5"]  # step-2 pruned, the stale step-4.tmp replaced
    assert out["latest"] == "step-5"
    # the just-saved step is never pruned; the higher steps (an abandoned run's) are left alone and not counted
    assert out["older_listing"] == ["latest", "step-3", "step-4", "step-5"]
    assert out["older_latest"] == "step-3"
    assert out["auto"] == "step-5" and out["none"] is None
    assert "not a complete checkpoint" in out["error step-9"]
    assert "does not exist" in out["error missing"]


def test_export_hf_loads_with_trained_weights_and_tokenizer(
    runs: dict[str, Any], tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = runs["export"]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(export))
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    trained = runs["second"][0]["bf16"]["weights"]
    assert {n for n, _ in hf.named_parameters()} == set(trained)
    for name, p in hf.named_parameters():
        assert np.array_equal(p.detach().numpy(), trained[name]), name
    tok, orig = AutoTokenizer.from_pretrained(export), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok("Paris is the capital")["input_ids"] == orig("Paris is the capital")["input_ids"]
    assert tok.chat_template == orig.chat_template
    # A write that fails on the main rank (disk full): one error on every rank (was a traceback on rank 0 and a
    # hang or SIGTERM on the others), no partial directory, the export before it intact.
    errors = {r["bf16"]["failed_export"] for r in runs["second"]}
    last = export.parent / "bf16" / runs["second"][0]["bf16"]["resolved"]
    (error,) = errors  # the same on every rank
    # written in a directory of its own beside the export (runtime.durable), not a fixed export.tmp
    partial = re.escape(str(export.parent / f".{export.name}.coati-kto-new-"))
    assert re.fullmatch(
        re.escape(f"the final model could not be written to {export} (rank 0: No space left on device: ")
        + partial
        + r"[0-9a-f]{8}/model\.safetensors\); removed its partial copy; "
        + re.escape(f"train.resume=auto exports it again from {last}"),
        error,
    ), error
    assert sorted(p.name for p in export.parent.iterdir() if p.name.startswith(f".{export.name}")) == []
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"


# ---- one data-parallel rank: hybrid_parallel runs ZeRO stage 0 (parallel.plan.running_zero_stage) ----------


def _dp1_runs(model_dir: str, base: str) -> dict[str, Any]:
    """One process, bf16: ZeRO-2 uninterrupted (4 steps, saving at 2), the running stage's AMP optimizer
    uninterrupted, and the ZeRO-2 checkpoint of step 2 resumed by the AMP optimizer (a run saved before the
    running stage changed)."""
    from coati_kto.config.schema import PluginSection
    from coati_kto.parallel.plan import ParallelPlan

    assert ParallelPlan.from_section(PluginSection(**BF16), dp_size=1).zero_stage == 0
    zero2 = _setup(model_dir, BF16, f"{base}/zero2")  # from_section without dp_size: ZeRO-2 as written
    zero0 = {**BF16, "zero_stage": 0}
    _train(zero2, 2)
    zero2["mgr"].save(2, zero2["model"], zero2["opt"], zero2["sched"], {"global_step": 2})
    _train(zero2, 2)
    amp = _setup(model_dir, zero0, f"{base}/amp")
    _train(amp, 4)
    resumed = _setup(model_dir, zero0, f"{base}/zero2")
    resumed["mgr"].load(resumed["mgr"].resolve("auto"), resumed["model"], resumed["opt"], resumed["sched"])
    _train(resumed, 2)
    kinds = {k: type(s["opt"]).__name__ for k, s in (("zero2", zero2), ("amp", amp))}
    return {
        "kinds": kinds,
        **{k: _snapshot(s) for k, s in (("zero2", zero2), ("amp", amp), ("resumed", resumed))},
    }


@pytest.fixture(scope="module")
def dp1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(_dp1_runs, 1, str(tiny_model_dir), str(tmp_path_factory.mktemp("dp1")))[0]


def test_one_rank_runs_without_zero_with_the_same_updates(dp1: dict[str, Any]) -> None:
    assert dp1["kinds"] == {"zero2": "HybridParallelZeroOptimizer", "amp": "HybridParallelAMPOptimizer"}
    assert _max_diff(dp1["zero2"], dp1["amp"]) == 0.0  # clipped bf16 Adam steps, bit for bit
    assert dp1["zero2"]["lr"] == dp1["amp"]["lr"]


def test_one_rank_zero2_checkpoint_resumes_exactly_without_zero(dp1: dict[str, Any]) -> None:
    # ZeRO's flat masters restore into the AMP optimizer's shaped ones (they failed with a shape error before).
    assert _max_diff(dp1["zero2"], dp1["resumed"]) == 0.0
    for name, m in dp1["zero2"]["masters"].items():
        assert np.array_equal(m.reshape(-1), dp1["resumed"]["masters"][name].reshape(-1)), name


def _adam_states(s: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every parameter's Adam exp_avg and exp_avg_sq, whole (ZeRO's chunks gathered over the data-parallel group)."""
    import torch.distributed as dist

    from coati_kto.parallel.masters import working_to_master

    mapping, optim = working_to_master(s["opt"]), s["opt"].optim
    out = {}
    for name, param in s["model"].unwrap().named_parameters():
        master = mapping[id(param)]
        for key in ("exp_avg", "exp_avg_sq"):
            value = optim.state[master][key].detach()
            if value.numel() != param.numel():  # a ZeRO chunk of the flattened, padded parameter
                chunks = [torch.empty_like(value) for _ in range(dist.get_world_size())]
                dist.all_gather(chunks, value.contiguous())
                value = torch.cat(chunks)[: param.numel()]
            out[f"{name}/{key}"] = value.float().reshape(-1).numpy().copy()
    return out


def _saves(model_dir: str, root: str, plugin: dict) -> dict[str, Any]:
    s = _setup(model_dir, plugin, root)
    _train(s, 2)
    s["mgr"].save(2, s["model"], s["opt"], s["sched"], {"global_step": 2, "epoch": 0})
    return {"kind": type(s["opt"]).__name__, "states": _adam_states(s)}


def _loads(model_dir: str, root: str, plugin: dict) -> dict[str, Any]:
    s = _setup(model_dir, plugin, root)
    s["mgr"].load(s["mgr"].resolve("auto"), s["model"], s["opt"], s["sched"])
    return {"kind": type(s["opt"]).__name__, "states": _adam_states(s)}


@pytest.mark.parametrize("saving,loading", [(1, 2), (2, 1)])
def test_optimizer_states_move_between_one_rank_and_two(
    saving: int, loading: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A run grown from one GPU (the AMP optimizer: running_zero_stage) to two (ZeRO-2), or shrunk back: Adam's
    moments come back whole and exact."""
    amp = {**BF16, "zero_stage": 0}
    plugins = {1: amp, 2: BF16}
    kinds = {1: "HybridParallelAMPOptimizer", 2: "HybridParallelZeroOptimizer"}
    saved = run_distributed(_saves, saving, str(tiny_model_dir), str(tmp_path), plugins[saving])[0]
    loaded = run_distributed(_loads, loading, str(tiny_model_dir), str(tmp_path), plugins[loading])
    assert saved["kind"] == kinds[saving]
    for rank in loaded:
        assert rank["kind"] == kinds[loading]
        assert rank["states"].keys() == saved["states"].keys()
        for key, value in saved["states"].items():
            assert np.abs(value).max() > 0, key
            assert np.array_equal(value, rank["states"][key]), key


def _loads_rebuilt(model_dir: str, root: str, plugin: dict) -> dict[str, Any]:
    """``_loads``, and whether each rank's fp32 masters are its loaded bf16 weights (a ZeRO shard: its slice of the
    flattened, padded parameter)."""
    import torch.distributed as dist

    from coati_kto.parallel.masters import working_to_master

    s = _setup(model_dir, plugin, root)
    s["mgr"].load(s["mgr"].resolve("auto"), s["model"], s["opt"], s["sched"])
    mapping, same = working_to_master(s["opt"]), []
    for param in s["model"].unwrap().parameters():
        master, flat = mapping[id(param)].detach().float().reshape(-1), param.detach().float().reshape(-1)
        if master.numel() != flat.numel():
            padded = torch.nn.functional.pad(flat, (0, master.numel() * dist.get_world_size() - flat.numel()))
            flat = padded[dist.get_rank() * master.numel() :][: master.numel()]
        same.append(torch.equal(master, flat))
    return {"states": _adam_states(s), "masters_are_weights": all(same)}


@pytest.mark.parametrize("saved_stage,loaded_stage", [(2, 0), (0, 2)])
def test_a_zero_stage_change_over_two_ranks_resumes_with_masters_rebuilt(
    saved_stage: int, loaded_stage: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """From an audit: plugin.zero_stage 2 -> 0 (or 0 -> 2) on a bf16 run of 2 data-parallel ranks passed every
    check, then failed after loading with "checkpoint master shard of model.embed_tokens.weight has shape (16384,),
    this layout expects (512, 64)": ZeRO's flat shards and the AMP optimizer's whole masters do not fit each other.
    Now the masters are rebuilt from the loaded weights, as for any layout change, and Adam's moments come back."""
    saved = run_distributed(
        _saves, 2, str(tiny_model_dir), str(tmp_path), {**BF16, "zero_stage": saved_stage}
    )
    loaded = run_distributed(
        _loads_rebuilt, 2, str(tiny_model_dir), str(tmp_path), {**BF16, "zero_stage": loaded_stage}
    )
    for rank in loaded:
        assert rank["masters_are_weights"]
        assert rank["states"].keys() == saved[0]["states"].keys()
        for key, value in saved[0]["states"].items():
            assert np.array_equal(value, rank["states"][key]), key


def _kto_steps(model_dir: str, out_dir: str, zero_stage: int) -> dict[str, Any]:
    """Two KTO optimizer steps of 2 micro-batches each, 1 process, hybrid bf16 at ``zero_stage``."""
    from test_trainer import _build, _config, _rank_loader, full_weights

    plugin = {**BF16, "zero_stage": zero_stage}
    cfg = _config(model_dir, out_dir, plugin=plugin, train={"accumulation_steps": 2, "micro_batch_size": 4})
    parts, trainer = _build(cfg, 2)
    trainer.fit(_rank_loader(1, 0)[:4], None)
    records = [
        {k: v for k, v in h.items() if "second" not in k} for h in trainer.history if "train/loss" in h
    ]
    return {"kind": type(parts.optimizer).__name__, "records": records, "weights": full_weights(parts.policy)}


def test_one_rank_kto_steps_with_accumulation_are_the_zero2_steps(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With accumulation the AMP optimizer's micro-batches skip the (one-rank) reduction (no_sync), ZeRO-2's
    do not: the steps are the same all the same, every logged number and weight bit for bit."""
    zero2, amp = (
        run_distributed(_kto_steps, 1, str(tiny_model_dir), str(tmp_path / f"z{z}"), z)[0] for z in (2, 0)
    )
    assert (zero2["kind"], amp["kind"]) == ("HybridParallelZeroOptimizer", "HybridParallelAMPOptimizer")
    assert len(zero2["records"]) == 2 and zero2["records"] == amp["records"]
    assert np.array_equal(zero2["weights"], amp["weights"])
