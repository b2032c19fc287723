"""A vision-language model's processor files reach its exports when ``model.path`` is a Hub id (read from the hub
cache, offline), as they do for a folder: final/ (``write_hf``), adapter/ and merged/ (``write_lora``, through the
same ``copy_processor_files``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants
from peft import LoraConfig, get_peft_model
from transformers import AutoProcessor

from coati_kto.models.hf import copy_processor_files
from coati_kto.models.lora import write_lora
from coati_kto.testing.tiny import build_family_model
from coati_kto.testing.tiny_processors import gemma3_processor
from coati_kto.trainer.export import write_hf

HUB_ID = "org/tiny-gemma3-vl"
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The tiny Gemma 3 VL model as ``from_pretrained(HUB_ID)`` leaves it (its ``_name_or_path`` the Hub id),
    its processor only in a hub cache (refs/main -> snapshots/SHA) under tmp_path."""
    processor = gemma3_processor()
    snapshot = tmp_path / "hub" / "models--org--tiny-gemma3-vl" / "snapshots" / SHA
    processor.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no folder named like the Hub id
    model = build_family_model("gemma3_vl", processor.tokenizer, 0)
    model.config._name_or_path = HUB_ID
    return model, processor, snapshot


def test_a_hub_ids_processor_files_reach_final(hub_model, tmp_path: Path) -> None:
    model, processor, snapshot = hub_model
    out = tmp_path / "final"
    write_hf(model, model.state_dict(), processor.tokenizer, out, fp32=False)
    assert (out / "processor_config.json").read_text() == (snapshot / "processor_config.json").read_text()
    reloaded = AutoProcessor.from_pretrained(out)
    assert type(reloaded).__name__ == "Gemma3Processor"
    assert reloaded.image_seq_length == processor.image_seq_length


def test_each_lora_folder_gets_them_too(hub_model, tmp_path: Path) -> None:
    model, processor, snapshot = hub_model
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=r".*language_model.*\.q_proj"))
    write_lora(peft, None, processor.tokenizer, tmp_path / "final", merge=True)
    for name in ("adapter", "merged"):
        folder = tmp_path / "final" / name
        assert (folder / "processor_config.json").read_bytes() == (
            snapshot / "processor_config.json"
        ).read_bytes()
        assert type(AutoProcessor.from_pretrained(folder)).__name__ == "Gemma3Processor"


def test_nothing_is_copied_from_an_unknown_source(hub_model, tmp_path: Path) -> None:
    """A Hub id not in the cache, or no name at all (not the working directory), copies nothing and raises
    nothing."""
    model, processor, _ = hub_model
    processor.save_pretrained(tmp_path)  # processor files in the working directory
    out = tmp_path / "out"
    out.mkdir()
    assert copy_processor_files("org/absent", model.config, out) == []
    assert copy_processor_files("", model.config, out) == []
    assert list(out.iterdir()) == []
