"""Model FLOPs parameter count and the MFU peak table (the per-step counts are checked in test_trainer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coati_kto.testing.tiny import random_causal_lm
from coati_kto.trainer.throughput import FlopParams, flop_params, mfu, resolve_peak_flops, table_peak_flops


def _llama(tied: bool) -> LlamaForCausalLM:
    return random_causal_lm(
        LlamaForCausalLM,
        LlamaConfig,
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_flop_params_leave_out_the_embedding_lookup_only(tied):
    model = _llama(tied)
    total = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    embed = 100 * 16
    # Untied: the lookup table is not multiply-adds. Tied: the one matrix is the head's, and counts.
    assert flop_params(model).total == (total if tied else total - embed)
    assert flop_params(model).frozen == 0  # every parameter trains: 6 per parameter and token


def test_peak_table_and_config():
    assert table_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert table_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert table_peak_flops("NVIDIA L40S") == 362e12 and table_peak_flops("NVIDIA L4") == 121e12
    assert table_peak_flops("Some CPU") is None
    assert resolve_peak_flops(5e12, "fp32") == (5e12, "train.peak_flops")
    if not torch.cuda.is_available():
        assert resolve_peak_flops(None, "bf16")[0] is None  # CPU: only when the user sets it
    assert mfu(50.0, 100.0, 2) == 0.25 and mfu(50.0, None, 2) is None


def test_an_moe_token_runs_through_its_routed_share_of_the_experts() -> None:
    """From a throughput audit: every expert was counted, so a Qwen3-30B-A3B's MFU was about ten times too high.
    4 experts, 2 per token: each layer's experts hold 4 x 3 x hidden 32 x width 16 = 6,144 weights, half of them
    run per token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = random_causal_lm(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    total = sum(p.numel() for p in moe.parameters())
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    assert experts == 2 * 6_144
    assert flop_params(moe).total == total - 200 * 32 - experts // 2  # the embedding lookup, half the experts


def test_jetmoe_experts_are_routed_and_its_routers_run_for_every_token() -> None:
    """From an audit: JetMoE's experts (``input_linear`` / ``output_linear`` of its MoE and attention-expert
    blocks) hold no ``experts`` in their names and counted whole, while its attention router (under
    ``experts``) was scaled. 8 experts, 2 per token: a quarter of the experts' weights run per token."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    moe = random_causal_lm(
        JetMoeForCausalLM, JetMoeConfig, num_local_experts=8, num_experts_per_tok=2, kv_channels=8,
        tie_word_embeddings=False,
    )  # fmt: skip
    names = dict(moe.named_parameters())
    experts = sum(
        p.numel() for n, p in names.items() if n.endswith(("input_linear.weight", "output_linear.weight"))
    )
    routers = [n for n in names if ".router." in n]
    assert experts > 0 and len(routers) == 2 * moe.config.num_hidden_layers  # the MLP's and the attention's
    total = sum(p.numel() for p in moe.parameters()) - moe.get_input_embeddings().weight.numel()
    assert flop_params(moe).total == total - experts + experts // 4


def test_a_vision_tower_is_not_charged_to_text_tokens(tmp_path) -> None:
    """A vision-language model's tower and projector were counted per text token (Gemma 3's tiny model 1.5x)."""
    from transformers import AutoModelForImageTextToText

    from coati_kto.testing.tiny_processors import write_vl

    model = AutoModelForImageTextToText.from_pretrained(write_vl(tmp_path / "vl", "gemma3_vl"))
    text = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    tower = sum(p.numel() for p in model.parameters() if id(p) not in text)
    assert tower > 0 and model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert (
        flop_params(model).total == sum(p.numel() for p in model.parameters()) - tower
    )  # the tied head counts


def test_lora_charges_4_per_frozen_and_6_per_adapter_weight_and_its_reference_no_adapter() -> None:
    """The frozen base took 6N per trained token though it has no weight gradient (1.45x on the tiny Llama)."""
    from peft import LoraConfig, get_peft_model

    from coati_kto.models.lora import AdapterFreeReference

    base = _llama(tied=False)
    frozen = sum(p.numel() for p in base.parameters()) - 100 * 16
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    assert adapters == 2 * 4 * (16 + 16)  # q_proj and v_proj: A [4, 16], B [16, 4]
    assert flop_params(policy) == FlopParams(trainable=adapters, frozen=frozen)
    assert flop_params(policy).train(10) == (6 * adapters + 4 * frozen) * 10
    boosted = SimpleNamespace(
        unwrap=lambda unwrap_peft=True: policy
    )  # a plugin's wrapper, as the run holds it
    assert flop_params(AdapterFreeReference(boosted)) == FlopParams(trainable=0, frozen=frozen)


def test_the_head_counts_at_the_configs_vocabulary_not_its_padded_rows() -> None:
    """shardformer pads the LM head's rows to a multiple of 64 x tp: a vocabulary of 100 counted 128 rows under
    hybrid_parallel, and model FLOPs depended on the layout (1.14x on a tiny Llama of 300 at tp 2)."""
    model = _llama(tied=False)
    before = flop_params(model).total
    model.resize_token_embeddings(128)  # as the plugin pads the embedding and the head
    model.config.vocab_size = 100
    assert model.get_output_embeddings().weight.shape[0] == 128
    assert flop_params(model).total == before
