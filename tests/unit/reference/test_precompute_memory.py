"""A cached reference no GPU of the run can score: said by ``coati-kto plan`` and refused before loading.

``coati-kto precompute`` (and ``train`` with ``kto.reference: cached`` and no cache yet) scores the whole reference
on each rank, with no plugin to split it. ``plan`` listed layouts for a 70B model with the cached reference (tp 2
x pp 4 x dp 4 on 32 x 80 GB, docs/plan.md) and said nothing of the cache: its 131 GiB of bf16 weights fit no
80 GB GPU, so the run would end in an out-of-memory after every rank had read the whole model into host memory.
Now the plan prints what computing the cache holds and whether it fits, and scoring refuses in one line first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import PLAN_CONFIG

from coati_kto.cli import main
from coati_kto.config.load import load_config
from coati_kto.errors import UserError
from coati_kto.recipe.setup import reference_settings
from coati_kto.reference import scoring
from coati_kto.reference.settings import ReferenceSettings

SHAPES = Path(__file__).resolve().parents[3] / "benchmarks" / "model_shapes"
LLAMA_70B_PARAMS = 70_553_706_496  # config.json's shape, as `coati-kto plan` counts it


def _config(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(PLAN_CONFIG.format(model=model))
    return path


def test_the_plan_says_a_70b_cache_fits_no_80gb_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, SHAPES / "llama-3.1-70b")
    argv = ["plan", str(path), "--gpus", "32", "--nodes", "4", "kto.reference=cached"]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("precompute:")]
    gib = LLAMA_70B_PARAMS * 2 / 2**30
    assert lines == [
        f"precompute: `coati-kto precompute` holds the whole reference on each GPU, no split: {gib:.2f} GiB of "
        "bf16 weights before its activations: does NOT fit in 90% of 80 GiB. The layouts below train from a "
        "cache; compute it where the whole reference fits one device, or use kto.reference: online (split as "
        "the policy)"
    ]
    # An 8B model's 15 GiB fit; the online reference has no cache to compute: no line.
    path = _config(tmp_path, SHAPES / "llama-3.1-8b")
    assert main(["plan", str(path), "--gpus", "8", "kto.reference=cached"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("precompute:")]
    assert len(said) == 1, said
    assert said[0].endswith(
        "14.96 GiB of bf16 weights before its activations: the weights fit in 90% of 80 GiB"
    )
    assert main(["plan", str(path), "--gpus", "8"]) == 0
    assert "precompute:" not in capsys.readouterr().out


def _settings(tmp_path: Path, model: Path, dtype: torch.dtype = torch.bfloat16) -> ReferenceSettings:
    config = load_config(_config(tmp_path, model), ["kto.reference=cached"])
    return dataclasses.replace(reference_settings(config), dtype=dtype)


def test_scoring_refuses_a_reference_its_gpu_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(tmp_path, SHAPES / "llama-3.1-70b")
    need = LLAMA_70B_PARAMS * 2
    assert (
        scoring.reference_over_device(settings, need) is None
    )  # exactly the weights: not refused on weights
    why = scoring.reference_over_device(settings, 80 * 2**30)
    assert why is not None and "131.4 GiB of bfloat16 weights, more than this GPU's 80.0 GiB" in why, why
    assert "\n" not in why and "kto.reference: online" in why
    # fp32 doubles it; a Hub id whose config.json is not cached yet is left to the load.
    fp32 = _settings(tmp_path, SHAPES / "llama-3.1-70b", torch.float32)
    assert "262.8 GiB of float32 weights" in scoring.reference_over_device(fp32, 80 * 2**30)
    hub = _settings(tmp_path, Path("some-org/not-in-the-cache"))
    assert scoring.reference_over_device(hub, 1) is None

    # On a (pretend) 80 GB GPU, before any weight is read: load_reference is never reached.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(scoring, "load_reference", lambda *_: pytest.fail("loaded the reference"))
    with pytest.raises(UserError, match="more than this GPU's 80.0 GiB"):
        scoring.score_splits(settings, {}, 0)
