"""Preflight: mistakes that would surface only after the model loaded are one line before anything heavy."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.runtime.preflight import _attention_problems, _lora_problems


def _model_dir(tmp_path: Path, config) -> Path:
    out = tmp_path / "model"
    config.save_pretrained(out)  # config.json only: preflight builds the model on the meta device
    return out


def _lora_config(tmp_path: Path, model_dir: Path, targets: str | None = None):
    text = MINIMAL.replace("path: some/model", f"path: {model_dir}\n  lora:\n    rank: 4")
    if targets:
        text = text.replace("rank: 4", f"rank: 4\n    target_modules: {targets}")
    return load_config(write_config(tmp_path, text))


def test_lora_targets_missing_from_the_model_are_named_with_its_linear_layers(tmp_path: Path) -> None:
    """GPT-2 has no q_proj: the default targets failed in peft after the model loaded (issue 17)."""
    from transformers import GPT2Config

    model_dir = _model_dir(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    assert _lora_problems(_lora_config(tmp_path, model_dir)) == [
        f"model.lora.target_modules: q_proj, k_proj, v_proj, o_proj match no module of GPT2LMHeadModel "
        f"({model_dir}); its linear layers: c_attn, c_fc, c_proj"
    ]
    assert _lora_problems(_lora_config(tmp_path, model_dir, "[c_attn, attn.c_proj]")) == []


def test_lora_on_a_vision_language_model_is_refused(tmp_path: Path) -> None:
    """q_proj also names the SigLIP tower's projections: adapters there get no gradient (the tower is frozen)."""
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    model = build_family_model("gemma3_vl", build_tokenizer(["a b c d"] * 5, vocab_size=280))
    model_dir = _model_dir(tmp_path, model.config)
    assert _lora_problems(_lora_config(tmp_path, model_dir)) == [
        f"model.lora with {model_dir}, a vision-language model (gemma3): train it in full"
    ]


@pytest.mark.parametrize("targets", [None, "[q_proj, gate_proj, down_proj]"])
def test_lora_targets_of_a_llama_pass(tmp_path: Path, targets: str | None) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    assert _lora_problems(_lora_config(tmp_path, _model_dir(tmp_path, config), targets)) == []


def test_flex_attention_is_refused_for_training_on_cpu(tmp_path: Path) -> None:
    """torch has no FlexAttention backward on CPU: the first gradient pass raised NotImplementedError."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU trains with flex_attention")
    path = write_config(tmp_path, MINIMAL)
    (line,) = _attention_problems(load_config(path, ["model.attn_implementation=flex_attention"]))
    assert line.startswith("model.attn_implementation flex_attention: torch ") and "use sdpa" in line
    assert _attention_problems(load_config(path, ["model.attn_implementation=sdpa"])) == []


def test_resume_auto_over_a_run_without_checkpoints_says_what_to_do(tmp_path: Path) -> None:
    """A run killed before its first checkpoint left events only: train.resume=auto was refused with 'continue it
    with train.resume=auto', the setting the user had just given."""
    from coati_kto.runtime.preflight import _output_problems

    out = tmp_path / "out"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    text = MINIMAL.replace("dir: out", f"dir: {out}")
    fresh = load_config(write_config(tmp_path, text))
    assert _output_problems(fresh) == [
        f"output.dir: {out} already holds a run (tensorboard/ events): continue it with train.resume=auto, or "
        "start over with output.overwrite=true (deletes its checkpoints, events and final model)"
    ]
    auto = load_config(write_config(tmp_path, text + "train:\n  resume: auto\n"))
    assert _output_problems(auto) == [
        f"output.dir: {out} holds a run (tensorboard/ events) with no complete checkpoint, so train.resume=auto "
        "has nothing to continue: start over with output.overwrite=true (deletes its events and final model), or "
        "use another output.dir"
    ]
