"""``output.merge_lora``'s copy (``coati_kto.models.lora._save_merged``): made on the host tensor by tensor, never
a deep copy of the weights where they live (on a GPU, twice the model there at the end of a run), the training
model left as it is, the merged weights base + (alpha / r) B A."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from coati_kto.models import lora


def test_the_merged_export_copies_each_weight_to_the_host_once_and_leaves_the_model(
    monkeypatch, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    peft = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # zero at init: the merge would change nothing
    base = layer.base_layer.weight.detach().clone()
    expected = base + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    originals = {id(t) for t in [*peft.parameters(), *peft.buffers()]}
    deep_copied: list[int] = []

    def recorder(upstream: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def recorded(self: torch.Tensor, memo: dict) -> torch.Tensor:
            deep_copied.append(id(self))
            return upstream(self, memo)

        return recorded

    for cls in (torch.Tensor, torch.nn.Parameter):
        monkeypatch.setattr(cls, "__deepcopy__", recorder(cls.__deepcopy__))
    lora._save_merged(peft, tmp_path / "merged")
    assert not originals & set(
        deep_copied
    )  # every weight reached the copy through the host, none by deepcopy
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    assert "lm_head.weight" not in merged  # the tie survived the copy: saved once
    assert torch.equal(layer.base_layer.weight, base) and "default" in layer.lora_A  # the model is unchanged
