"""model.path as a Hub id (``org/name``): the checkpoint's generation_config.json and config.json EOS ids are read
from the hub cache, as for a local directory. Before, a Hub id gave no stop ids, so a Llama-3.1-style turn ending
with ``<|eom_id|>`` (a generation EOS beside ``<|eot_id|>``) got ``<|eot_id|>`` appended after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CORPUS

from coati_kto.data.endings import checkpoint_eos, generation_eos_ids
from coati_kto.data.tokenize import encode
from coati_kto.testing.tiny import build_tokenizer

REPO = "org/llama31-tiny"
# Llama 3.1's shape: a tool-call turn ends with <|eom_id|> (the model waits for the tool), any other with <|eot_id|>
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}{{ '<|eom_id|>' if message.get('ipython') else '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION = [{"role": "assistant", "content": "search(capital of France)", "ipython": True}]


def llama31_tokenizer():
    tok = build_tokenizer([*CORPUS] * 2, 400, style="llama3")  # EOS <|eot_id|>
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})
    tok.chat_template = TEMPLATE
    return tok


def hub_cache(root: Path, files: dict[str, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """REPO's ``files`` in a hub cache at ``root`` as ``hf download`` leaves it (HF_HUB_CACHE patched)."""
    from huggingface_hub import constants

    folder = root / f"models--{REPO.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name, raw in files.items():
        (snapshot / name).write_text(json.dumps(raw))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_stops_where_the_same_local_checkpoint_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = llama31_tokenizer()
    eot, eom = tok.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    files = {"generation_config.json": {"eos_token_id": [eom, eot]}, "config.json": {"model_type": "llama"}}
    local = tmp_path / "local"
    local.mkdir()
    for name, raw in files.items():
        (local / name).write_text(json.dumps(raw))
    hub_cache(tmp_path / "hub", files, monkeypatch)

    assert generation_eos_ids(REPO) == generation_eos_ids(local) == sorted([eot, eom])
    by_dir = encode(tok, PROMPT, COMPLETION, True, stop_ids=generation_eos_ids(local))
    by_hub = encode(tok, PROMPT, COMPLETION, True, stop_ids=generation_eos_ids(REPO))
    assert by_hub == by_dir
    assert tok.convert_ids_to_tokens(by_hub[1][-1]) == "<|eom_id|>"  # no <|eot_id|> after it
    assert by_hub[1].count(eot) == 0


def test_checkpoint_eos_of_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_cache(tmp_path / "hub", {"config.json": {"model_type": "llama", "eos_token_id": [7, 9]}}, monkeypatch)
    assert checkpoint_eos(REPO) == (7, "config.json")
    assert generation_eos_ids(REPO) == []  # no generation_config.json cached
    assert checkpoint_eos("org/not-cached") is None and generation_eos_ids("org/not-cached") == []
    assert checkpoint_eos(tmp_path / "missing" / "dir") is None
