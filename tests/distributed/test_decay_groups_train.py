"""Weight decay leaves biases and norm weights out (coati_kto.parallel.optimizers.parameter_groups) on the plugin
paths that rebuild the optimizer's parameter groups: ZeRO-2's per-rank master chunks (bf16, 2 data-parallel
ranks), tensor parallelism (tp 2) and pipeline stages (pp 2), each through ``coati-kto train`` on 2 gloo ranks.

Each layout trains one AdamW step twice from the same weights and batches, at weight decays ``DECAY`` and
``DECAY / 2``: the gradients, and so Adam's update, are the same (the same groups: ZeRO's buckets, and so its
reduction order, follow them), so a parameter left out of the decay ends bit for bit where the other run put it,
and a decayed one ``lr x DECAY / 2`` times its initial value lower (fp32 rounding).
The left-out names must be transformers' Trainer's. A ZeRO-2 run with the two groups resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import preference_records
from safetensors.torch import load_file

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli

LR, DECAY = 1e-2, 10.0  # one step multiplies each decayed weight by 1 - LR x DECAY = 0.9 before Adam's update
LAYOUTS = {  # name -> (family, plugin section, train section)
    "zero2_bf16_dp2": ("qwen2", {"zero_stage": 2, "precision": "bf16"}, {}),
    "tp2_fp32": ("qwen2", {"zero_stage": 0, "precision": "fp32", "tp_size": 2}, {}),
    "pp2_fp32": ("llama", {"zero_stage": 0, "precision": "fp32", "pp_size": 2}, {"accumulation_steps": 2}),
}


def _config(root: Path, model_dir: Path, layout: str, out: str, steps: int, **train: Any) -> Path:
    family, plugin, layout_train = LAYOUTS[layout]
    config = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(32, 0), root / "train.jsonl"))],
            "prepared_dir": str(root / f"prepared_{family}"),
            "max_length": 48,
        },
        "train": {
            "micro_batch_size": 4,
            "max_steps": steps,
            "lr": LR,
            "warmup_steps": 0,
            "eval_at_start": False,
            **layout_train,
            **train,
        },
        "plugin": {"name": "hybrid_parallel", **plugin},
        "output": {"dir": str(root / out), "save_interval": 1, "keep_last": 2},
    }
    if plugin["precision"] == "bf16":
        config["output"]["export_dtype"] = "fp32"  # the fp32 masters, not their bf16 rounding
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path) -> dict[str, torch.Tensor]:
    proc = run_cli(["train", str(config)], 2)
    assert proc.returncode == 0, proc.ranks[-1].stdout[-3000:] + proc.ranks[-1].stderr[-3000:]
    final = Path(yaml.safe_load(config.read_text())["output"]["dir"]) / "final"
    return {k: v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def runs(
    tiny_family_dir: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Trainer

    root = tmp_path_factory.mktemp("decay_groups")
    out: dict[str, Any] = {}
    for layout, (family, _, _) in LAYOUTS.items():
        model_dir = (
            tiny_model_dir if family == "llama" else tiny_family_dir(family)
        )  # llama: 2 layers, 2 stages
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        decayed = set(Trainer.get_decay_parameter_names(None, model))
        plain = _train(_config(root, model_dir, layout, f"{layout}_half", 1, weight_decay=DECAY / 2))
        decay = _train(_config(root, model_dir, layout, f"{layout}_decay", 1, weight_decay=DECAY))
        out[layout] = {"initial": initial, "decayed": decayed, "plain": plain, "decay": decay}
    layout, model_dir = "zero2_bf16_dp2", tiny_family_dir("qwen2")
    whole = _train(_config(root, model_dir, layout, "zero2_whole", 2, weight_decay=DECAY))
    step1 = str(root / f"{layout}_decay" / "checkpoints" / "step-1")
    resumed = _train(_config(root, model_dir, layout, "zero2_resumed", 2, weight_decay=DECAY, resume=step1))
    # At weight decay 0 either grouping trains the same: the two-group checkpoint resumes (it was refused)
    undecayed = _train(
        _config(root, model_dir, layout, "zero2_resumed_at_0", 2, weight_decay=0.0, resume=step1)
    )
    # Its checkpoint says weight_decay 0 and holds two groups (recorded in its trainer state): resumed again at 0,
    # and exported, each builds the two groups its optimizer state loads into
    step2 = root / "zero2_resumed_at_0" / "checkpoints" / "step-2"
    chained = _config(root, model_dir, layout, "zero2_chained_at_0", 3, weight_decay=0.0, resume=str(step2))
    _train(chained)
    argv = ["export", "--checkpoint", str(step2), "--out", str(root / "export_at_0"), str(chained)]
    exported = run_cli(argv, 2)
    assert exported.returncode == 0, exported.ranks[0].stderr[-3000:]
    out["resume"] = {
        "whole": whole,
        "resumed": resumed,
        "at_0": undecayed,
        "decayed": set(
            Trainer.get_decay_parameter_names(None, AutoModelForCausalLM.from_pretrained(model_dir))
        ),
    }
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_biases_and_norms_step_undecayed_and_the_rest_decays(runs: dict[str, Any], layout: str) -> None:
    run = runs[layout]
    initial, plain, decay = run["initial"], run["plain"], run["decay"]
    assert plain.keys() == decay.keys() and plain.keys() <= initial.keys()
    left_out = {name for name in plain if name not in run["decayed"]}
    assert any("norm" in name for name in left_out)
    if layout != "pp2_fp32":
        assert any(name.endswith("bias") for name in left_out)  # Qwen2's q/k/v biases
    for name in plain:
        if name in left_out:
            assert torch.equal(decay[name], plain[name]), name
        else:
            expected = (
                plain[name] - LR * DECAY / 2 * initial[name]
            )  # bf16: the masters start from fp32 values
            scale = float(initial[name].abs().max())
            assert float((decay[name] - expected).abs().max()) <= 1e-6 * max(scale, 1.0), name
            assert not torch.equal(decay[name], plain[name]), name  # not vacuous


def test_a_zero2_run_with_both_groups_resumes_bit_for_bit(runs: dict[str, Any]) -> None:
    whole, resumed = runs["resume"]["whole"], runs["resume"]["resumed"]
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_two_group_checkpoint_resumes_at_weight_decay_0(runs: dict[str, Any]) -> None:
    """From an audit: a checkpoint of two groups (weight_decay 0.1) could not be resumed at weight_decay 0 (the
    config gave one group at 0, and no setting gave two), though both groupings train the same at 0. Its second
    step: the biases and norm weights as at 0.1 (undecayed in both), every other weight not decayed."""
    resumed, at_0, decayed = runs["resume"]["resumed"], runs["resume"]["at_0"], runs["resume"]["decayed"]
    assert resumed.keys() == at_0.keys()
    assert all(torch.equal(resumed[k], at_0[k]) for k in resumed if k not in decayed)
    assert all(
        not torch.equal(resumed[k], at_0[k]) for k in resumed if k in decayed and resumed[k].dim() == 2
    )
