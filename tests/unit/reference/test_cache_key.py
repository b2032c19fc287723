"""The reference cache's key: a full bf16 run rounds the fp32 parameters it trains (MoE routers) and so does the
reference precompute loads, while a LoRA run keeps them in fp32 (models.hf.load_reference). The key left this
out, so a LoRA run reused a full run's cache and its step-1 rewards were off 0 (1.4e-5, 6.2e-5 on the tiny
DeepSeek-V3 in bf16)."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.reference.cache import cache_key
from coati_kto.reference.settings import ReferenceSettings


def _key(tmp_path: Path, dtype: torch.dtype, *overrides: str) -> str:
    config = load_config(write_config(tmp_path, MINIMAL), list(overrides))
    settings = ReferenceSettings(config.model, config.data, config.kto, dtype)
    return cache_key(settings, "data-digest", "weights-digest")["digest"]


def test_lora_and_full_runs_in_bf16_get_their_own_caches(tmp_path: Path) -> None:
    lora = ["model.lora.rank=4"]
    assert _key(tmp_path, torch.bfloat16) != _key(tmp_path, torch.bfloat16, *lora)
    assert _key(tmp_path, torch.float16) != _key(tmp_path, torch.float16, *lora)
    # in fp32 nothing is rounded: one cache serves both
    assert _key(tmp_path, torch.float32) == _key(tmp_path, torch.float32, *lora)
    # what does not change the values still reuses it
    assert _key(tmp_path, torch.bfloat16) == _key(tmp_path, torch.bfloat16, "kto.beta=0.3", "train.lr=1e-4")


def test_a_whole_cache_another_job_wrote_meanwhile_is_kept(tmp_path: Path) -> None:
    """Two jobs sharing prepared data that compute one key at once: the second deleted the first's cache before
    renaming its own in, pulling the files from under the first job's readers. A whole one is kept; a damaged
    one is set aside, replaced, then deleted."""
    import numpy as np

    from coati_kto.reference.cache import _read, _write

    key = {"version": 1, "digest": "k"}
    directory = tmp_path / "reference_cache" / "k"
    first = {"train": np.ones((3, 2), np.float32), "eval": np.zeros((1, 2), np.float32)}
    _write(directory, key, first, 1.0)
    inode = (directory / "train.npy").stat().st_ino
    _write(directory, key, {s: v + 1 for s, v in first.items()}, 1.0)  # the same key, computed again
    assert (directory / "train.npy").stat().st_ino == inode
    assert (_read(directory, key, {"train": 3, "eval": 1})["train"] == 1).all()
    (directory / "train.npy").write_bytes(b"damaged")
    _write(directory, key, {s: v + 1 for s, v in first.items()}, 1.0)
    assert (_read(directory, key, {"train": 3, "eval": 1})["train"] == 2).all()
    assert sorted(p.name for p in directory.parent.iterdir()) == ["k"]  # nothing left aside
