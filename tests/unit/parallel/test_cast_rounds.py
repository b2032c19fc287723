"""model_shape.cast_rounds reads the dtypes the checkpoint's safetensors store (their headers: no weights read)
before config.json, which can name another dtype than its tensors: a consolidated or converted checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from coati_kto.parallel.model_shape import cast_rounds, stored_float_dtypes


def _checkpoint(folder: Path, config_dtype: str, shards: list[dict[str, torch.Tensor]]) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": config_dtype}))
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors")
        return str(folder)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


def test_the_stored_tensors_decide_not_what_config_json_says(tmp_path: Path) -> None:
    fp32 = {
        "w": torch.ones(3),
        "steps": torch.zeros(2, dtype=torch.int64),
    }  # an integer buffer is not rounded
    bf16 = {"w": torch.ones(3, dtype=torch.bfloat16), "steps": torch.zeros(2, dtype=torch.int64)}
    says_bf16_holds_fp32 = _checkpoint(tmp_path / "a", "bfloat16", [fp32])
    assert stored_float_dtypes(says_bf16_holds_fp32) == {"F32"}
    assert cast_rounds(says_bf16_holds_fp32, "bf16") and cast_rounds(says_bf16_holds_fp32, "fp16")
    says_fp32_holds_bf16 = _checkpoint(tmp_path / "b", "float32", [bf16])
    assert (cast_rounds(says_fp32_holds_bf16, "bf16"), cast_rounds(says_fp32_holds_bf16, "fp16")) == (
        False,
        True,
    )
    assert not cast_rounds(says_fp32_holds_bf16, "fp32")  # no cast at all


def test_every_shard_of_a_sharded_checkpoint_is_read(tmp_path: Path) -> None:
    """One shard in fp32 (a norm or router kept in fp32) rounds in a bf16 run: its masters keep the fp32 values."""
    mixed = _checkpoint(
        tmp_path / "a", "bfloat16", [{"a": torch.ones(2, dtype=torch.bfloat16)}, {"b": torch.ones(2)}]
    )
    assert stored_float_dtypes(mixed) == {"BF16", "F32"} and cast_rounds(mixed, "bf16")
    half = torch.ones(2, dtype=torch.bfloat16)
    even = _checkpoint(tmp_path / "b", "float32", [{"a": half}, {"b": half}])
    assert stored_float_dtypes(even) == {"BF16"} and not cast_rounds(even, "bf16")


def test_without_safetensors_config_json_decides(tmp_path: Path) -> None:
    """A missing shard (a partial download) or no safetensors at all: config.json's dtype, as before."""
    partial = _checkpoint(tmp_path / "a", "bfloat16", [{"a": torch.ones(2)}, {"b": torch.ones(2)}])
    (Path(partial) / "model-00002-of-00002.safetensors").unlink()
    assert stored_float_dtypes(partial) is None and not cast_rounds(partial, "bf16")
    bare = tmp_path / "b"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    assert stored_float_dtypes(str(bare)) is None and not cast_rounds(str(bare), "bf16")
