"""A LoRA run on a Gemma 3 vision-language model with ``target_modules`` unset exports and resumes through the CLI:
the checkpoint's state and out/config.yaml write the default targets out, which once read back as the user's and
were refused for the SigLIP tower's q_proj/k_proj/v_proj ("... or leave target_modules unset")."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from helpers import CORPUS, preference_records
from safetensors.torch import load_file

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli
from coati_kto.testing.tiny import save_tiny_family


def test_a_default_target_vision_language_lora_run_exports_and_resumes(tmp_path: Path) -> None:
    save_tiny_family(tmp_path / "model", "gemma3_vl", CORPUS)
    config = {
        "model": {"path": str(tmp_path / "model"), "lora": {"rank": 4, "alpha": 8}},
        "data": {
            "train_files": [str(write_jsonl(preference_records(16, 0), tmp_path / "train.jsonl"))],
            "prepared_dir": str(tmp_path / "prepared"),
            "max_length": 64,
        },
        "train": {"micro_batch_size": 4, "max_steps": 1, "lr": 1e-3},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(tmp_path / "out"), "save_interval": 1, "save_final": False},
        "logging": {"tensorboard": False},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    first = run_cli(["train", tmp_path / "cfg.yaml"])
    assert first.returncode == 0, first.stderr[-3000:]
    step = tmp_path / "out" / "checkpoints" / "step-1"
    export = run_cli(["export", tmp_path / "cfg.yaml", "--checkpoint", step, "--out", tmp_path / "export"])
    assert export.returncode == 0, export.stderr[-3000:]
    adapter = tmp_path / "export" / "adapter"
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert targets == r".*model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj)"
    names = list(load_file(adapter / "adapter_model.safetensors"))
    assert len(names) == 16 and all(".language_model.layers." in n for n in names), (
        names
    )  # 2 layers x q, k, v, o x A, B
    resumed = run_cli(["train", tmp_path / "out" / "config.yaml", "train.resume=auto", "train.max_steps=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "resume: 1 setting(s) differ from step-1's config, applied: train.max_steps 1 -> 2" in resumed.stdout
    )
    assert (tmp_path / "out" / "checkpoints" / "step-2" / "COMPLETE").is_file()
