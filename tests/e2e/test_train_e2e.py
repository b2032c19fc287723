"""``coati-kto train`` end to end on 2 gloo processes: JSONL -> prepare -> HybridParallelPlugin ZeRO-2 bf16 with
gradient checkpointing -> KTO on a small learnable preference set (the reward margin must rise) -> TensorBoard,
W&B offline, checkpoints, HF export; then ``train.resume=auto`` through the CLI continues the step axis in the
same directories.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli
from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.tensorboard import read_scalars, read_texts


def _train_worker(config_path: str, overrides: list[str]) -> dict:
    from coati_kto.config.load import load_config
    from coati_kto.train import train

    trainer = train(load_config(config_path, overrides))
    return {"history": trainer.history, "dp_size": trainer.layout.dp_size, "step": trainer.global_step}


def _cli_worker(argv: list[str]) -> int:
    from coati_kto.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("e2e")
    config = {
        "model": {"path": str(tiny_model_dir), "gradient_checkpointing": True},
        "data": {
            "train_files": [str(write_jsonl(preference_records(48, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(preference_records(9, 100), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 96,
            "max_prompt_length": 48,
        },
        "kto": {"beta": 0.1},
        "train": {
            "micro_batch_size": 4,
            "accumulation_steps": 2,
            "max_epochs": 5,
            "max_steps": 9,
            "lr": 5e-3,
            "warmup_steps": 1,
            "eval_interval": 3,
        },
        "plugin": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
        "output": {"dir": str(root / "out"), "save_interval": 3, "keep_last": 2},
        "logging": {"tensorboard": True, "wandb": True, "wandb_mode": "offline"},
    }
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    first = run_distributed(_train_worker, 2, str(config_path), [])
    tb_first = read_scalars(root / "out" / "tensorboard")
    # Continue from the last checkpoint (step 9) to step 12 through the CLI, in a fresh set of processes: the
    # resume reads everything from disk, nothing from the first run's processes (so not on the worker pool's
    # ranks). W&B off: its service costs ~10 s per run and was checked above.
    argv = ["train", str(config_path), "train.max_steps=12", "train.resume=auto", "logging.wandb=false"]
    codes = run_distributed(_cli_worker, 2, argv, fresh=True)
    return {"root": root, "first": first, "tb_first": tb_first, "codes": codes}


def test_zero2_bf16_two_processes_learns_preferences(run: dict) -> None:
    history = run["first"][0]["history"]
    assert run["first"][0]["dp_size"] == 2 and run["first"][0]["step"] == 9
    # Every rank holds the same reduced metrics (timings aside: each rank times itself).
    timeless = [
        [{k: v for k, v in h.items() if "per_second" not in k} for h in r["history"]] for r in run["first"]
    ]
    assert timeless[0] == timeless[1]
    train = [h for h in history if "train/loss" in h]
    assert [int(h["step"]) for h in train] == list(range(1, 10))
    for h in train:  # every step: both labels, exact global counts (8 examples x 2 ranks), finite numbers
        assert h["train/count/chosen"] + h["train/count/rejected"] == 16
        assert all(math.isfinite(v) for v in h.values())
        assert h["train/grad_norm"] > 0 and h["train/tokens_per_second"] > 0
    lrs = [h["train/lr"] for h in train]  # warmup over 1 step (from lr/2, not 0), then cosine decay
    assert (
        lrs[0] == pytest.approx(5e-3 / 2) and lrs[1] == pytest.approx(5e-3) and lrs[1] > lrs[2] > lrs[-1] > 0
    )
    margins = [h["train/rewards/margins"] for h in train]
    assert sum(margins[-3:]) / 3 > margins[0] + 0.05, margins
    evals = [h for h in history if "eval/loss" in h]
    assert [int(h["step"]) for h in evals] == [0, 3, 6, 9]  # the step-0 baseline, then every 3 steps
    assert all(h["eval/count/chosen"] + h["eval/count/rejected"] == 9 for h in evals)
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"]


def test_outputs_tensorboard_wandb_config_and_final_model(run: dict) -> None:
    out = run["root"] / "out"
    tb = run["tb_first"]
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 10))
    assert {"train/kl", "train/rewards/margins", "train/count/rejected", "eval/loss", "train/lr"} <= set(tb)
    assert list((out / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["plugin"]["zero_stage"] == 2 and saved["train"]["lr"] == 5e-3
    # The run card reports the imbalance of the layout that trained (2 ranks), not prepare's 1-replica view.
    for _, card in read_texts(out / "tensorboard")["run/data"]:  # the first run's, then the resumed one's
        assert "micro_batch_size 4, 2 ranks)" in card and "1 rank)" not in card

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").eos_token == "<|im_end|>"
    assert sum(p.numel() for p in model.parameters()) > 0


def test_cli_resume_auto_continues_step_axis(run: dict) -> None:
    out = run["root"] / "out"
    assert run["codes"] == [0, 0]
    tb = read_scalars(out / "tensorboard")
    steps = [s for s, _ in tb["train/loss"]]
    assert steps == list(range(1, 13)), steps  # 1-9 kept, 10-12 appended: one axis, no duplicates
    assert dict(tb["train/loss"])[9] == dict(run["tb_first"]["train/loss"])[9]
    # The resumed run does not repeat the evaluation of step 9 (its checkpoint's step was evaluated).
    assert [s for s, _ in tb["eval/loss"]] == [0, 3, 6, 9, 12]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == ["step-12", "step-9"]  # keep_last 2
    # Each save names its run's previous checkpoint (resume=auto's lineage: run_dir._newest_after).
    meta = {n: json.loads((out / "checkpoints" / n / "meta.json").read_text()) for n in checkpoints}
    assert meta["step-12"]["previous"] == meta["step-9"]["id"] != meta["step-12"]["id"]


def test_export_writes_a_checkpoint_as_the_final_model_and_only_reads_the_run(run: dict) -> None:
    """``coati-kto export``: the last checkpoint (step 12) on its own layout gives final/'s tensors bit for bit,
    under output.dir/exports/step-12; an earlier one on another layout (1 process) loads with transformers and
    holds other weights; an existing target is refused in one line; nothing else in output.dir changes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, config = run["root"] / "out", str(run["root"] / "config.yaml")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*") if "wandb" not in p.parts)
    saved_config = (out / "config.yaml").read_text()
    latest = (out / "checkpoints" / "latest").read_text()
    # The exports and refusals below are the CLI's code path: on worker ranks (coati_kto.testing.cli).
    assert run_cli(["export", config, "train.max_steps=12"], 2).returncodes == [0, 0]
    final = load_file(out / "final" / "model.safetensors")
    exported = load_file(out / "exports" / "step-12" / "model.safetensors")
    assert final.keys() == exported.keys()
    assert all(torch.equal(final[k], exported[k]) for k in final)
    assert "12 optimizer steps" in (out / "exports" / "step-12" / "README.md").read_text()

    nine = run["root"] / "step-9-export"
    argv = ["export", "--checkpoint", str(out / "checkpoints" / "step-9"), "--out", str(nine), config]
    # data.prepared_dir rebuilt for other settings since: the export rebuilt it back in place (a write the run's
    # directory, and the other build's reference caches, did not expect); it now prepares beside its target.
    prepared = run["root"] / "prepared" / "fingerprint.json"
    assert run_cli(["prepare", config, "train.seed=5"]).returncode == 0
    other = prepared.read_text()
    proc = run_cli(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert prepared.read_text() == other
    assert not [
        p for p in nine.parent.iterdir() if p.name.startswith(f".{nine.name}.")
    ]  # its scratch is gone
    scratch = rf"export prepares it in {re.escape(str(nine.parent))}/\.{nine.name}\.coati-kto-data-[0-9a-f]{{8}}/prepared"
    assert re.search(scratch + " and removes it at the end", proc.stdout), proc.stdout
    # An export trains nothing: no KTO weights' report, no word of RNG states on another layout.
    assert "kto weights" not in proc.stdout and "RNG" not in proc.stdout + proc.stderr
    # An earlier checkpoint's export moved the run's `latest` pointer to it: resume=auto then lost 3 steps.
    assert (out / "checkpoints" / "latest").read_text() == latest
    model = AutoModelForCausalLM.from_pretrained(nine)
    assert any(
        not torch.equal(p.detach(), final[n].to(p.dtype)) for n, p in model.named_parameters() if n in final
    )
    proc = run_cli(argv)
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        f"error: coati-kto export: {nine} exists; remove it or name another with --out",
    )
    missing = str(out / "checkpoints" / "step-3")  # pruned by keep_last 2
    proc = run_cli(["export", "--checkpoint", missing, config])
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        f"error: coati-kto export --checkpoint: {missing} is not a complete checkpoint (a checkpoints/step-N "
        "directory with its COMPLETE marker)",
    )
    after = sorted(str(p.relative_to(out)) for p in out.rglob("*") if "wandb" not in p.parts)
    assert [p for p in after if not p.startswith("exports")] == before
    assert (out / "config.yaml").read_text() == saved_config


def _export_while_pruned_worker(config: str, overrides: list[str]) -> str:
    """``coati-kto export``'s code, with the run's checkpoint deleted (a run still training there prunes it:
    output.keep_last) as the export starts loading it."""
    import shutil

    from coati_kto.config.load import load_config
    from coati_kto.recipe.export import export_checkpoint
    from coati_kto.trainer import checkpoint

    loaded = load_config(config, overrides)
    original = Path(loaded.output.dir) / "checkpoints" / "step-12"
    real = checkpoint.CheckpointManager.load

    def pruned_meanwhile(self: object, path: Path, *args: object, **kwargs: object) -> object:
        shutil.rmtree(original)
        return real(self, path, *args, **kwargs)

    checkpoint.CheckpointManager.load = pruned_meanwhile
    try:
        return str(export_checkpoint(loaded, "auto", None))
    finally:
        checkpoint.CheckpointManager.load = real


def test_an_export_keeps_its_checkpoint_while_the_run_prunes_it(run: dict, tmp_path: Path) -> None:
    """From an audit: a run still training in output.dir deleted the checkpoint an export had chosen (keep_last)
    while the export loaded it: a raw FileNotFoundError, or, mid-load, masters rebuilt from bf16 under a card
    that calls them fp32. The export pins it first (hard links) and exports it whole."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    shutil.copytree(run["root"] / "out" / "checkpoints", out / "checkpoints")
    overrides = ["train.max_steps=12", f"output.dir={out}"]
    (exported,) = run_distributed(_export_while_pruned_worker, 1, str(run["root"] / "config.yaml"), overrides)
    assert exported == str(out / "exports" / "step-12") and not (out / "checkpoints" / "step-12").exists()
    final = load_file(run["root"] / "out" / "final" / "model.safetensors")
    ours = load_file(out / "exports" / "step-12" / "model.safetensors")
    assert final.keys() == ours.keys() and all(torch.equal(final[k], ours[k]) for k in final)
    assert [p.name for p in (out / "exports").iterdir()] == ["step-12"]  # the pinned copy is gone


def test_an_export_on_another_layout_describes_the_run_not_itself(run: dict) -> None:
    """The card of a 1-process export of a 2-process run said "x 1 process(es)" and that ZeRO stage 2 ran as 0 on
    one data-parallel rank (the export's own layout), with the settings of the command line, not of the run,
    and the command printed "final model:" and "final/ holds"
    for a directory that is not final/."""
    out, config = run["root"] / "out", str(run["root"] / "config.yaml")
    target = run["root"] / "step-12-on-one-process"
    argv = ["export", "--checkpoint", str(out / "checkpoints" / "step-12"), "--out", str(target), config]
    proc = run_cli([*argv, "train.max_steps=12", "kto.beta=0.5", "train.lr=1e-4"])  # on a worker rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    card = (target / "README.md").read_text()
    assert (
        "micro-batch 4 x accumulation 2 x 2 data-parallel rank(s) = 16 examples per step, on 2 process"
        in card
    )
    # The run's settings, not the command line's: the card said beta 0.5 and lr 1e-4 for a run at 0.1 and 5e-3.
    assert "| beta | 0.1 |" in card and "12 optimizer steps; lr 0.005 " in card
    assert "runs as 0 on one data-parallel rank" not in card
    assert f"exported model: {target}" in proc.stdout.splitlines()
    assert "train/mfu" not in proc.stdout  # no line about how training would run
    assert f"- {target.name}/ holds the bf16 weights the run trained" in card
    assert "final model:" not in proc.stdout and "final/ holds" not in card
