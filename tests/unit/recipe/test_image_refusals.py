"""What a run on image records refuses, one line each, and what it turns off with one note
(coati_kto.recipe.images; issue 49). The configs validate without touching the disk (helpers.MINIMAL): the
refusals read the config alone. Through the CLI they come right after prepare, before any model loads
(tests/distributed/test_image_train.py runs that path)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.recipe.images import image_collator, image_refusal

REFUSALS = {
    "data.padding_free=true": "data.padding_free true: image records cannot run with packed rows: their masks have "
    "no image block; set it to false",
    "kto.pack_policy=true": "kto.pack_policy true: image records cannot run with a packed pass: its mask has no "
    "image block; set it to auto",
    "kto.pack_reference=true": "kto.pack_reference true: image records cannot run with a packed pass: its mask has "
    "no image block; set it to false",
    "plugin.sp_size=2": "plugin.sp_size 2: image records cannot run with padding-free rows sliced per rank; set it "
    "to 1",
    "model.compile=true": "model.compile true: image records cannot run with compiled layers; set it to false",
}


def _config(tmp_path: Path, *overrides: str):
    return load_config(write_config(tmp_path, MINIMAL), list(overrides))


IMAGES = object()  # the build's images (coati_kto.data.image_table.PreparedImages): the collator gets them


def _data(*columns: str) -> types.SimpleNamespace:
    train = types.SimpleNamespace(column_names=["input_ids", *columns])
    return types.SimpleNamespace(train=train, images=IMAGES if "images" in columns else None)


@pytest.mark.parametrize("override", list(REFUSALS))
def test_each_setting_images_cannot_run_with_is_one_line(tmp_path: Path, override: str) -> None:
    extra = ["data.padding_free=true"] if override == "plugin.sp_size=2" else []  # sp needs padding-free rows
    config = _config(tmp_path, override, *extra)
    assert image_refusal(config) == REFUSALS[override]
    with pytest.raises(ConfigError) as err:
        image_collator(config, _data("images"))
    assert str(err.value) == REFUSALS[override]
    assert image_collator(config, _data()) == ({}, None)  # text rows: nothing refused, no processor loaded


def test_pipeline_is_refused_and_evaluation_samples_are_not(tmp_path: Path) -> None:
    pipeline = _config(tmp_path, "plugin.pp_size=2", "train.accumulation_steps=2")
    assert image_refusal(pipeline) == (
        "plugin.pp_size 2: image records cannot run with micro-batches split along rows (pixel values are not "
        "rows); set it to 1"
    )
    # Generated from the prompts with their images (coati_kto.trainer.sample_images; tests/distributed/
    # test_image_train.py reads the logged images back).
    assert image_refusal(_config(tmp_path, "eval.samples=2", "data.eval_fraction=0.25")) is None


def test_the_defaults_run_and_the_continuation_falls_back_with_one_note(tmp_path: Path, monkeypatch) -> None:
    from coati_kto.recipe import images

    monkeypatch.setattr(images, "collator_images", lambda model: {"image_processor": model.path})
    assert image_refusal(_config(tmp_path)) is None
    assert image_collator(_config(tmp_path), _data("images")) == (
        {"image_processor": "some/model", "image_table": IMAGES},
        "kto.kl_continuation: off for image records (the KL pairs run their own padded pass with the images)",
    )
    cached = _config(tmp_path, "kto.reference=cached", "kto.kl_continuation=false")
    assert image_collator(cached, _data("images"))[1] == (
        "kto.pack_policy auto: off for image records (the KL pairs run their own padded pass with the images)"
    )
    unpaired = _config(tmp_path, "kto.loss_type=apo_zero_unpaired")
    assert image_collator(unpaired, _data("images"))[1] is None  # no KL pass to fall back


def test_a_processor_of_another_family_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Gemma 3, Gemma 4 and Qwen 3.5 are proven; another family's processor (a stand-in: Qwen3-VL's, which
    AutoProcessor gives where torchvision is installed) is one line, not a KeyError in the first batch."""
    from coati_kto.data import image_store

    class Qwen3VLProcessor:
        tokenizer = None

    monkeypatch.setattr(image_store, "model_processor", lambda model: Qwen3VLProcessor())
    with pytest.raises(ConfigError) as err:
        image_collator(_config(tmp_path), _data("images"))
    assert str(err.value) == (
        "model.path some/model: image records train on Gemma 3, Gemma 4 and Qwen 3.5 vision-language models "
        "only (Qwen3VLProcessor is not one of their processors)"
    )
