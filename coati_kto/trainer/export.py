"""The trained model as a Hugging Face directory: the weights ``export_hf`` gathered (or their fp32 masters) with
the config and tokenizer, written by the main rank only (``trainer.checkpoint.CheckpointManager.export_hf``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def write_hf(module: Any, state: dict, tokenizer: Any, out: Path, fp32: bool) -> None:
    """``module`` with ``state`` and ``tokenizer`` as a Hugging Face model directory ``out`` (replaced)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # save_pretrained drops tied duplicates that safetensors refuses, and writes config's dtype.
    module.save_pretrained(out, state_dict=state, safe_serialization=True)
    if fp32:  # config.json names the module's (working) dtype: say what is stored
        config = json.loads((out / "config.json").read_text())
        config["dtype" if "dtype" in config else "torch_dtype"] = "float32"
        write_atomic(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def fp32_state(state: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every parameter replaced by its fp32 master and other floats cast to fp32; tied entries
    (one tensor under two names) stay one tensor."""
    by_storage = {state[name].data_ptr(): master for name, master in masters.items() if name in state}
    out = {}
    for key, value in state.items():
        replaced = by_storage.get(value.data_ptr())
        out[key] = (
            replaced if replaced is not None else (value.float() if value.is_floating_point() else value)
        )
    return out


def write_atomic(path: Path, text: str) -> None:
    """``text`` as ``path``, renamed into place once on disk (a reader sees the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
