"""A LoRA config saved and read back means what it meant: a checkpoint's state and output.dir/config.yaml write the
default ``target_modules`` out, and export and resume rebuild the config from them. Decided by which keys were set,
the default became the user's on a Gemma 3 vision-language model, and its SigLIP tower's q_proj/k_proj/v_proj were
refused: ``coati-kto export`` and ``train.resume=auto`` of such a run failed."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import pytest
import yaml
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.lora import peft_targets, tower_refusal
from coati_kto.config.schema import Config
from coati_kto.runtime.preflight import _lora_problems
from coati_kto.testing.tiny import build_family_model, build_tokenizer

LANGUAGE_MODEL = r".*model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj)"


@pytest.fixture(scope="module")
def gemma3_vl():
    return build_family_model("gemma3_vl", build_tokenizer(["a b c d"] * 5, vocab_size=280))


def _written(tmp_path: Path, model_dir: Path, lora: str) -> Config:
    text = MINIMAL.replace("path: some/model", f"path: {model_dir}\n  lora: {lora}")
    return load_config(write_config(tmp_path, text))


def test_default_targets_survive_the_checkpoints_dump_and_config_yaml(tmp_path: Path, gemma3_vl) -> None:
    model_dir = tmp_path / "model"
    gemma3_vl.config.save_pretrained(model_dir)  # config.json: the preflight builds the meta model from it
    written = _written(tmp_path, model_dir, "{rank: 4, alpha: 8}")
    dumped = Config.model_validate(written.model_dump(mode="json"))  # the checkpoint's state, read by export
    (tmp_path / "saved").mkdir()
    saved = load_config(
        write_config(tmp_path / "saved", written.to_yaml())
    )  # output.dir/config.yaml (resume)
    assert dumped.model.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    for config in (written, dumped, saved):
        assert peft_targets(config.model.lora, gemma3_vl) == LANGUAGE_MODEL
        assert tower_refusal(config.model.lora, gemma3_vl) is None
        assert _lora_problems(config.model) == []
    adapted = peft.get_peft_model(
        copy.deepcopy(gemma3_vl), peft.LoraConfig(target_modules=peft_targets(dumped.model.lora, gemma3_vl))
    )
    names = [n for n, m in adapted.named_modules() if hasattr(m, "lora_A")]
    assert len(names) == 8 and all(".language_model.layers." in n for n in names), names


def test_a_users_tower_target_is_still_refused_after_the_dump(tmp_path: Path, gemma3_vl) -> None:
    written = _written(tmp_path, tmp_path / "none", "{rank: 4, target_modules: [q_proj, gate_proj]}")
    dumped = Config.model_validate(yaml.safe_load(written.to_yaml()))
    assert peft_targets(dumped.model.lora, gemma3_vl) == ["q_proj", "gate_proj"]
    assert tower_refusal(dumped.model.lora, gemma3_vl) == (
        "model.lora.target_modules: q_proj (model.vision_tower.encoder.layers.0.self_attn.q_proj) in the vision "
        "tower or projector of Gemma3ForConditionalGeneration, which stay frozen; name language-model modules "
        "only, or leave target_modules unset (its q_proj, k_proj, v_proj, o_proj in the language model)"
    )
