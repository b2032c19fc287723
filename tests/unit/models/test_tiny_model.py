"""``coati-kto tiny-model DIR``: the README example's model, written in seconds with no hub (issue 50: the tiny
builder lived only in coati_kto.testing, which no user doc names)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coati_kto.cli import main


def test_it_writes_a_chatml_llama_that_loads_and_rewrites_its_own_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0
    written = capsys.readouterr()
    assert (
        "Writing" not in written.err
    )  # transformers' progress bar for a file of a few hundred KB (a CLI audit)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    assert written.out.splitlines()[-1] == (
        f"wrote {out}: a random Llama ({params / 1e6:.2f}M parameters, hidden size 64, 2 layers) and a "
        f"{len(tokenizer)}-token ChatML tokenizer; use it as model.path={out}"
    )
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [
        {"role": "user", "content": "What comes after Monday?"},
        {"role": "assistant", "content": "Tuesday."},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nWhat comes after Monday?<|im_end|>\n<|im_start|>assistant\nTuesday.<|im_end|>\n"
    )
    # Its own folder is rewritten (the README's commands can be run again); the same seed, the same weights.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert main(["tiny-model", str(out), "--seed", "3"]) == 0
    again = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(before[k], again[k]) for k in before)


def test_it_never_writes_into_a_folder_of_someone_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert main(["tiny-model", str(mine)]) == 2
    assert capsys.readouterr().err == (
        f"error: coati-kto tiny-model: {mine} is not empty and was not written by coati-kto tiny-model: name a new "
        "folder (nothing was written)\n"
    )
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]
    assert main(["tiny-model", str(tmp_path / "new"), "--hidden-size", "30"]) == 2
    assert capsys.readouterr().err == (
        "error: coati-kto tiny-model: --hidden-size must be a positive multiple of 4 (got 30) and --layers >= 1 "
        "(got 2)\n"
    )
    assert not (tmp_path / "new").exists()
