"""``output.export_dtype: fp32``: after bf16 training, final/ holds the optimizer's fp32 master weights, gathered
whole from the ZeRO chunks of every rank; the default export is the bf16 working weights, and says so."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import preference_records
from safetensors.torch import load_file

from coati_kto.data.files import write_jsonl
from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "low_level_zero_zero2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}


def _train(config_path: str) -> None:
    from coati_kto.config.load import load_config
    from coati_kto.train import train

    train(load_config(config_path))


def _train_fp32_export(model_dir: Path, tmp_path: Path, plugin: str) -> None:
    """2 steps on 2 processes with ``plugin``, exporting fp32 to ``tmp_path/out/final``."""
    config = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), tmp_path / "train.jsonl"))],
            "prepared_dir": str(tmp_path / "prepared"),
            "max_length": 48,
        },
        "train": {"micro_batch_size": 4, "max_steps": 2, "lr": 1e-2, "warmup_steps": 0},
        "plugin": PLUGINS[plugin],
        "output": {"dir": str(tmp_path / "out"), "export_dtype": "fp32"},
        "logging": {"tensorboard": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_distributed(_train, 2, str(path))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_fp32_export_is_the_gathered_masters(plugin: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    _train_fp32_export(tiny_model_dir, tmp_path, plugin)
    out = tmp_path / "out"
    final = load_file(out / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.float32}
    saved = yaml.safe_load((out / "final" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "float32"
    # The checkpoint of the last step: each rank's fp32 master chunks, and the bf16 working weights.
    step = out / "checkpoints" / "step-2"
    shards = [torch.load(step / "master_weights" / f"rank-{r}.pt") for r in range(2)]
    working = {}
    for file in sorted((step / "model").glob("*.safetensors")):
        working.update(load_file(file))
    checked = 0
    for name, weight in final.items():
        if name in shards[0]:  # a parameter ZeRO holds as two chunks of its flattened fp32 copy
            whole = torch.cat([shards[0][name], shards[1][name]])[: weight.numel()].view(weight.shape)
            assert torch.equal(weight, whole), name
            checked += 1
        if name in working:  # the working copy is the master rounded to bf16
            assert torch.equal(weight.to(working[name].dtype), working[name]), name
    assert checked >= len(final) - 1  # every parameter (a tied head is stored once)
    card = (out / "final" / "README.md").read_text()
    assert (
        "final/ holds the optimizer's fp32 master weights (trained in bf16; output.export_dtype fp32)" in card
    )


def test_fp32_export_of_a_vision_language_model_keeps_its_frozen_tower_as_loaded(
    tmp_path: Path, tiny_family_dir: Callable[..., Path]
) -> None:
    """Gemma 3 vision-language: the frozen tower has no fp32 master, so the fp32 export took its bf16 working copy
    (1.9e-3 off the loaded weights). The tower is now exported as loaded, the language model as its masters."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_family_dir("gemma3_vl")
    _train_fp32_export(model_dir, tmp_path, "low_level_zero_zero2_bf16")
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "final", dtype=torch.float32
    ).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    tower = [k for k in loaded if "vision" in k or "multi_modal" in k]
    assert tower and all(torch.equal(exported[k], loaded[k]) for k in tower)
    text = [k for k in loaded if k not in tower]
    changed = [k for k in text if not torch.equal(exported[k], loaded[k])]
    assert len(changed) > len(text) // 2  # the language model trained
    assert any(not torch.equal(exported[k], exported[k].bfloat16().float()) for k in changed)  # fp32 masters
