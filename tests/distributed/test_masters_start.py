"""The fp32 master weights of a bf16 / fp16 run start from the checkpoint's fp32 values, not from their rounding to
the working dtype (coati_kto.parallel.masters.fp32_through_the_cast / start_masters_from).

ColossalAI casts the model and then builds the masters from the cast weights: a checkpoint stored in fp32 trained
from its bf16 rounding, and its fp32 export differed from it everywhere by up to 2**-9 of each weight. Checked on 2
gloo ranks right after boosting, on every plugin path that keeps masters: ZeRO-2 and ZeRO-1 chunks of the hybrid
plugin, low_level_zero's (fp16 builds the same masters: its loss scaler needs a GPU), the AMP optimizer's whole copies (zero_stage 0), pipeline stages, and
tensor-parallel shards and LoRA's adapters (against the same build in fp32: shardformer's own split, the adapters
as the seed initialised them, over a base model stored in fp32 and one stored in bf16).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import _build, _config

from coati_kto.testing.distributed import run_distributed

LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (plugin section, train section)
    "hybrid_zero2_bf16_dp2": ({"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}, {}),
    "hybrid_zero1_bf16_dp2": ({"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"}, {}),
    "low_level_zero2_bf16_dp2": ({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, {}),
    "hybrid_zero0_bf16_dp2": ({"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"}, {}),
    "pp2_zero1_bf16": (
        {"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16", "pp_size": 2},
        {"accumulation_steps": 2},
    ),
}
# name -> (plugin section without precision, other sections): checked against the same build in fp32 (its
# working weights: the tensor-parallel shards; LoRA's adapters as initialised from the seed)
AGAINST_FP32: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tp2_zero0_bf16": ({"name": "hybrid_parallel", "zero_stage": 0, "tp_size": 2}, {}),
    "lora_zero0_bf16_dp2": ({"name": "hybrid_parallel", "zero_stage": 0}, {"model": {"lora": {"rank": 4}}}),
    # the base model stored in bf16: its cast rounds nothing, but peft makes the adapters in fp32
    "lora_zero0_bf16_dp2_stored_bf16": (
        {"name": "hybrid_parallel", "zero_stage": 0},
        {"model": {"lora": {"rank": 4}}},
    ),
}
STORED_BF16 = {"lora_zero0_bf16_dp2_stored_bf16"}


def _masters_worker(model_dir: str, bf16_dir: str, out_dir: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from coati_kto.parallel.masters import gathered_masters, working_to_master

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    out: dict[str, Any] = {}
    for name, (plugin, train) in LAYOUTS.items():
        parts, _ = _build(_config(model_dir, f"{out_dir}/{name}", plugin=plugin, train=train), total_steps=1)
        masters = gathered_masters(parts.policy, parts.optimizer)
        compared = [n for n in masters if n in loaded]
        out[name] = {
            "compared": len(compared),
            "differ": [n for n in compared if not torch.equal(masters[n], loaded[n])],
            "rounded": sum(not torch.equal(loaded[n].bfloat16().float(), loaded[n]) for n in compared),
        }
    for name, (plugin, sections) in AGAINST_FP32.items():
        source = bf16_dir if name in STORED_BF16 else model_dir
        built = {}
        for precision in ("fp32", "bf16"):
            section = {**plugin, "precision": precision}
            torch.manual_seed(0)  # LoRA's A is drawn from the torch RNG: the same draw in both builds
            parts, _ = _build(_config(source, f"{out_dir}/{name}_{precision}", plugin=section, **sections), 1)
            mapping = working_to_master(parts.optimizer)
            named = [(n, p) for n, p in parts.policy.unwrap().named_parameters() if p.requires_grad]
            built[precision] = {
                n: mapping.get(id(p), p).detach().float().view(p.shape).clone() for n, p in named
            }
        ours = built["fp32"]
        out[name] = {
            "compared": len(ours),
            "differ": [n for n in ours if not torch.equal(built["bf16"][n], ours[n])],
            "rounded": sum(not torch.equal(v.bfloat16().float(), v) for v in ours.values()),
        }
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("masters")
    bf16_dir = _stored_in_bf16(tiny_model_dir, root / "stored_bf16")
    return run_distributed(_masters_worker, 2, str(tiny_model_dir), str(bf16_dir), str(root))


def _stored_in_bf16(model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` whose weights and config.json are bf16 (as most Hub checkpoints are)."""
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    save_file(
        {n: t.bfloat16() for n, t in weights.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return out


@pytest.mark.parametrize("layout", [*LAYOUTS, *AGAINST_FP32])
def test_the_masters_are_the_loaded_fp32_values(runs: list[dict[str, Any]], layout: str) -> None:
    for rank in runs:
        found = rank[layout]
        assert found["compared"] >= 4 and found["rounded"] >= 2  # not vacuous: the cast rounds these weights
        assert found["differ"] == []
