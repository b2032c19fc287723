"""The reference by content, which a resume compares with the checkpoint's: the same weights at another path are
the same reference; weights saved over the same path (same size, a new SFT run) are another one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import MINIMAL, write_config
from transformers import AutoModelForCausalLM

from coati_kto.config.load import load_config
from coati_kto.config.resume import check_reference_weights
from coati_kto.errors import ConfigError
from coati_kto.reference.weights import reference_weights_digest


def _config(tmp_path: Path, model: Path, *overrides: str):
    prepared = f"data.prepared_dir={tmp_path / 'prepared'}"  # the hashes' memo lives there
    return load_config(write_config(tmp_path, MINIMAL), [f"model.path={model}", prepared, *overrides])


def _digest(config) -> str | None:
    return reference_weights_digest(config.model, config.kto.reference)


def test_reference_digest_follows_the_weights_not_the_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    before = _digest(_config(tmp_path, tiny_model_dir))
    assert before is not None and len(before) == 64
    assert _digest(_config(tmp_path, copy)) == before
    model = AutoModelForCausalLM.from_pretrained(copy)
    size = (copy / "model.safetensors").stat().st_size
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(copy)  # a new SFT run saved over the same directory: same shapes, same size
    assert (copy / "model.safetensors").stat().st_size == size
    after = _digest(_config(tmp_path, copy))
    assert after not in (None, before)
    # A prepared_dir this run cannot write (a read-only share): read all the same (nothing is kept there).
    (tmp_path / "a-file").write_text("")
    unwritable = "data.prepared_dir=" + str(tmp_path / "a-file" / "prepared")
    assert _digest(_config(tmp_path, copy, unwritable)) == after
    # LoRA with an online reference: the reference is the checkpoint's own base (adapters off), not the disk's.
    assert _digest(_config(tmp_path, copy, "model.lora={rank: 4}")) is None


def test_changed_reference_weights_are_refused_in_one_line() -> None:
    check_reference_weights(None, "b" * 64, "step-2")  # a checkpoint saved before the digest: not known
    check_reference_weights("a" * 64, "a" * 64, "step-2")
    with pytest.raises(ConfigError) as err:
        check_reference_weights("a" * 64, "b" * 64, "step-2")
    assert str(err.value).splitlines() == [
        "train.resume step-2: the reference model's weights changed since the checkpoint (the files under "
        f"model.reference_path / model.path: {'a' * 16} -> {'b' * 16}): cannot change on resume (the rewards "
        "so far were measured against another reference)",
        "(start a new run in another output.dir, or restore the weights)",
    ]


def test_files_below_the_model_directory_are_not_its_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """output.dir under model.path (models/sft and models/sft/kto): the run's own checkpoints (model shards,
    optimizer, trainer state) changed the digest at every save, and every resume was refused as "the reference
    model's weights changed". from_pretrained reads the directory's top level only."""
    copy = shutil.copytree(tiny_model_dir, tmp_path / "sft")
    before = _digest(_config(tmp_path, copy))
    step = copy / "kto" / "checkpoints" / "step-6"
    (step / "model").mkdir(parents=True)
    shutil.copy(copy / "model.safetensors", step / "model" / "model-00001.safetensors")
    torch.save({"trainer_state": {}}, step / "rank-0.pt")
    assert _digest(_config(tmp_path, copy)) == before
