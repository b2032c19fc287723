"""The KL pass continued from the examples' KV cache (coati_kto.models.continuation) equals a separate pass over
[x_i, y_j] (fp32 1e-5 per sequence) in every family that admits it, under the plugins' wrappers too; the example
pass that fills the cache keeps its log-probs and gradients; what a cache cannot reproduce is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from continuation_sweep import check_type
from helpers import CORPUS
from test_packing import FAMILIES, _model, _rows, _separate
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from coati_kto.data.collator import KTOCollator
from coati_kto.families.continuation import CONTINUATION_FAMILIES
from coati_kto.models.continuation import can_continue, continuation_refusal, continued_logps
from coati_kto.models.lm_head import LMHead, model_sequence_logps

# Layers with a window (or a window per layer type) keep separate KL passes: the cache would hold keys the
# window hides, and transformers' sliding caches drop columns.
WINDOWED = {"mistral_window4", "qwen2_window4", "qwen2_mixed_windows", "gemma3"}
CASES = {**FAMILIES, "mistral_no_window": (MistralForCausalLM, MistralConfig, {"sliding_window": None})}


def _continued(model, batch):
    with torch.no_grad():
        return continued_logps(model, batch.example, batch.kl_continuation, LMHead.find(model))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(CASES))
def test_continued_kl_pass_equals_a_separate_pass_fp32(attn: str, family: str) -> None:
    cls, config_cls, config = CASES[family]
    model = _model(cls, config_cls, attn, **config)
    assert can_continue(model) == (family not in WINDOWED)
    if family in WINDOWED:
        return
    batch = KTOCollator(0)(_rows(5, 6))
    example, kl = _continued(model, batch)
    ref_example, ref_kl = _separate(model, batch)
    assert torch.equal(example, ref_example)  # the example pass itself is the padded pass
    torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=0)


def test_no_continuation_where_a_row_prompt_differs() -> None:
    assert KTOCollator(0)(_rows(5, 6, mismatched=(3,))).kl_continuation is None
    assert KTOCollator(0, padding_free="bins")(_rows(5, 6)).kl_continuation is None  # packed rows: no cache


def test_example_gradients_unchanged_and_kl_without_gradient() -> None:
    """The cache the gradient pass fills changes none of its gradients; the KL log-probs carry none."""
    model = _model(LlamaForCausalLM, LlamaConfig, "sdpa").train()
    plain = copy.deepcopy(model)
    batch = KTOCollator(0)(_rows(6, 5))
    weights = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.5])
    example, kl = continued_logps(model, batch.example, batch.kl_continuation, LMHead.find(model))
    assert example.requires_grad and not kl.requires_grad
    (weights * example).sum().backward()
    view = batch.example
    ref = model_sequence_logps(plain, view.input_ids, view.attention_mask, view.loss_mask, LMHead.find(plain))
    (weights * ref).sum().backward()
    torch.testing.assert_close(example, ref, atol=1e-6, rtol=0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_refused_under_recompute_compile_and_flash_attention() -> None:
    from coati_kto.models.compile import compile_layers

    model = _model(LlamaForCausalLM, LlamaConfig, "sdpa")
    assert can_continue(model)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert not can_continue(checkpointed)  # recomputed layers drop the cache
    compiled = copy.deepcopy(model)
    compile_layers(compiled)
    assert not can_continue(compiled)
    model.config._attn_implementation = "flash_attention_2"
    assert not can_continue(model)


def test_continued_bf16_within_the_bf16_error_of_one_pass() -> None:
    """bf16: the same rounding bound as the packed pass (test_packing): 2e-3 nats per completion token."""
    model = _model(LlamaForCausalLM, LlamaConfig, "sdpa").bfloat16()
    batch = KTOCollator(0)(_rows(3, 16))
    _, kl = _continued(model, batch)
    _, ref_kl = _separate(model, batch)
    per_token = ((kl - ref_kl).abs() / batch.kl.loss_mask.sum(1)).max()
    assert float(per_token) <= 2e-3


def _through_plugins() -> dict[str, float]:
    """Continued vs separate KL passes through each plugin's model wrapper (one gloo process)."""
    from coati_kto.parallel.plan import ParallelPlan

    out = {}
    for family in ("llama", "qwen2", "smollm3"):
        cls, config_cls, config = FAMILIES[family]
        for plugin, precision in (("hybrid_parallel", "fp32"), ("low_level_zero", "bf16")):
            name = f"{cls.__module__}.{cls.__qualname__}"
            plan = ParallelPlan(plugin, precision, 0 if plugin == "hybrid_parallel" else 2, model_class=name)
            backend = plan.backend
            wrapped = backend.build_reference(
                backend.build_plugin(), _model(cls, config_cls, "sdpa", **config)
            )
            assert hasattr(wrapped, "unwrap") and can_continue(wrapped)
            batch = KTOCollator(0)(_rows(4, 6))
            _, kl = _continued(wrapped, batch)
            _, ref_kl = _separate(wrapped, batch)
            out[f"{family} {plugin} {precision}"] = float(
                ((kl - ref_kl).abs() / batch.kl.loss_mask.sum(1)).max()
            )
    return out


def test_continued_through_plugin_wrappers_equals_a_separate_pass() -> None:
    """Shardformer's forwards (hybrid_parallel) and LowLevelZeroModel pass the cache, the 4D mask and the
    positions through (a wrapper casting its inputs leaves the cache object as it is)."""
    from coati_kto.testing.distributed import run_distributed

    (diffs,) = run_distributed(_through_plugins, 1)
    for cell, per_token in diffs.items():
        assert per_token <= (1e-6 if "fp32" in cell else 2e-3), (cell, per_token)


@pytest.fixture(scope="module")
def tokenizer():
    from coati_kto.testing.tiny import build_tokenizer

    return build_tokenizer(CORPUS, vocab_size=300)


# The families people align today, an MLA and two MoE; the sweep marker runs every admitted type.
REPRESENTATIVE = ["llama", "qwen3", "phi3", "gemma", "deepseek_v3", "mixtral", "qwen2_moe", "gpt2"]


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_admitted_families_continue_exactly(model_type: str, tokenizer) -> None:
    assert model_type in CONTINUATION_FAMILIES
    verdict, diff = check_type(model_type, tokenizer)
    assert verdict == "exact", (verdict, diff)


@pytest.mark.slow
@pytest.mark.sweep
def test_every_admitted_family_continues_exactly(tokenizer) -> None:
    bad = {}
    for model_type in sorted(CONTINUATION_FAMILIES - {"mistral"}):  # mistral's default has a window
        verdict, diff = check_type(model_type, tokenizer)
        if verdict != "exact":
            bad[model_type] = (verdict, diff)
    assert not bad, bad


@pytest.mark.parametrize("model_type", ["mpt", "doge"])
def test_families_whose_continuation_differs_are_not_admitted(model_type: str, tokenizer) -> None:
    """MPT (ALiBi) and Doge continue structurally but not exactly: the sweep sees it, the list leaves them out,
    and their KL passes run apart."""
    verdict, diff = check_type(model_type, tokenizer)
    assert verdict == "differs" and diff > 1e-2, (verdict, diff)
    assert model_type not in CONTINUATION_FAMILIES
    from coati_kto.families import auto_model_class
    from coati_kto.testing.tiny_types import tiny_config

    config = tiny_config(model_type, tokenizer)
    assert "not proven" in continuation_refusal(auto_model_class(config).from_config(config))
