"""One shared-prompt reference pass for an example and its KL pair equals two separate passes (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from coati_kto.data.collator import KTOCollator
from coati_kto.data.packed import shared_prompt_lengths
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.packing import can_pack, pair_logps
from coati_kto.testing.tiny import random_causal_lm


def _model(cls, config_cls, attn: str, **config):
    return random_causal_lm(cls, config_cls, vocab_size=120, attn_implementation=attn, **config).eval()


def _rows(seed: int, n: int, mismatched: tuple[int, ...] = (), vocab: int = 120) -> list[dict]:
    """``n`` rows of random ids below ``vocab``; the KL prompts of rows ``mismatched`` cut differently."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    rows = []
    for i in range(n):
        prompt = draw(2, 12)
        kl_prompt = prompt[1:] if i in mismatched else prompt  # truncation cut the KL prompt differently
        rows.append(
            {
                "input_ids": prompt + draw(1, 9),
                "completion_start": len(prompt),
                "label": bool(i % 2),
                "kl_input_ids": kl_prompt + draw(1, 9),
                "kl_completion_start": len(kl_prompt),
            }
        )
    return rows


def _separate(model, batch):
    head = LMHead.find(model)
    with torch.no_grad():
        a = model_sequence_logps(
            model, batch.example.input_ids, batch.example.attention_mask, batch.example.loss_mask, head
        )
        b = model_sequence_logps(model, batch.kl.input_ids, batch.kl.attention_mask, batch.kl.loss_mask, head)
    return a, b


FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    # Sliding windows shorter than the rows: the packed 4D mask must apply them (it was 0.22 nats off before).
    "mistral_window4": (MistralForCausalLM, MistralConfig, {"sliding_window": 4}),
    "qwen2_window4": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
    ),
    # transformers 5 decides per layer (config.layer_types): with max_window_layers at its default (28) no layer
    # of this 2-layer model slides, so the window must not be applied (reading config.sliding_window alone, as
    # transformers 4 did, was 0.08 nats off per sequence here).
    "qwen2_window_unused": (Qwen2ForCausalLM, Qwen2Config, {"use_sliding_window": True, "sliding_window": 4}),
    # Sliding and full layers mixed: one mask per layer type (transformers 5 takes a mapping).
    "qwen2_mixed_windows": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    # Gemma 3: sliding then full layer (window 4), scaled tied embeddings, q/k norms, (1 + w) norms.
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        {
            "head_dim": 8,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    # Layers without RoPE (no_rope_layers: position ids reach only the other layers), tied embeddings.
    "smollm3": (
        SmolLM3ForCausalLM,
        SmolLM3Config,
        {
            "no_rope_layers": [1, 0],
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def test_mixed_windows_pack_where_the_family_takes_a_mask_per_layer_type():
    """Sliding and full layers need different masks: families whose decoder takes a mapping {layer type: mask}
    get one each (the mixed cases of FAMILIES); a family that takes one mask keeps separate passes."""
    from types import SimpleNamespace

    from coati_kto.families import packed_masks

    mixed = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}
    assert packed_masks(SimpleNamespace(model_type="qwen2", **mixed)) == {
        "full_attention": None,
        "sliding_attention": 4,
    }
    assert packed_masks(SimpleNamespace(model_type="llama", **mixed)) is None
    assert packed_masks(SimpleNamespace(model_type="llama", sliding_window=None)) == {"": None}
    chunked = {"layer_types": ["full_attention", "chunked_attention"], "sliding_window": None}
    assert packed_masks(SimpleNamespace(model_type="qwen2", **chunked)) is None


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_equals_two_passes_fp32(attn, family, seed):
    cls, config_cls, config = FAMILIES[family]
    model = _model(cls, config_cls, attn, **config)
    assert can_pack(model)
    batch = KTOCollator(0)(_rows(seed, 5, mismatched=(2,)))
    shared = shared_prompt_lengths(batch.example, batch.kl)
    assert shared[2] == 0 and bool((shared[[0, 1, 3, 4]] > 0).all())
    with torch.no_grad():
        example, kl, shared_run = pair_logps(model, batch)
    assert torch.equal(shared_run, shared)
    ref_example, ref_kl = _separate(model, batch)
    torch.testing.assert_close(example, ref_example, atol=1e-5, rtol=0)
    torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=0)
    full = int(batch.example.attention_mask.sum() + batch.kl.attention_mask.sum())
    assert int((batch.pairs.document >= 0).sum()) == full - int(shared.sum())  # real tokens, prompt once


def test_flash_attention_falls_back_to_two_passes():
    model = _model(LlamaForCausalLM, LlamaConfig, "eager")
    model.config._attn_implementation = "flash_attention_2"
    assert not can_pack(model)
    model.config._attn_implementation = "sdpa"
    assert can_pack(model)


def _through_plugins() -> dict[str, list[float]]:
    """Packed vs two passes through each plugin's reference wrapper (one gloo process), every family."""
    from coati_kto.parallel.plan import ParallelPlan

    out = {}
    for family, (cls, config_cls, config) in FAMILIES.items():
        for plugin, precision in (("hybrid_parallel", "fp32"), ("low_level_zero", "bf16")):
            name = f"{cls.__module__}.{cls.__qualname__}"
            plan = ParallelPlan(plugin, precision, 0 if plugin == "hybrid_parallel" else 2, model_class=name)
            backend = plan.backend
            wrapped = backend.build_reference(
                backend.build_plugin(), _model(cls, config_cls, "sdpa", **config)
            )
            assert hasattr(wrapped, "unwrap") and can_pack(wrapped)
            batch = KTOCollator(0)(_rows(4, 6, mismatched=(1,)))
            with torch.no_grad():
                example, kl, _ = pair_logps(wrapped, batch)
            ref_example, ref_kl = _separate(wrapped, batch)
            tokens = torch.cat([batch.example.loss_mask.sum(1), batch.kl.loss_mask.sum(1)]).float()
            diff = (torch.cat([example - ref_example, kl - ref_kl]).abs() / tokens).max()
            out[f"{family} {plugin} {precision}"] = float(diff)
    return out


def test_packed_through_plugin_wrappers_equals_two_passes():
    """Shardformer's forwards (hybrid_parallel) and LowLevelZeroModel take the packed 4D mask and positions."""
    from coati_kto.testing.distributed import run_distributed

    (diffs,) = run_distributed(_through_plugins, 1)
    for cell, per_token in diffs.items():
        # fp32: summation order only; bf16: the packed pass is within bf16's own rounding (see below)
        assert per_token <= (1e-6 if "fp32" in cell else 2e-3), (cell, per_token)


def test_packed_bf16_within_the_bf16_error_of_one_pass():
    """bf16: packed and separate passes differ by summation order only, i.e. by bf16's own rounding.

    The bound, 2e-3 nats per completion token, is the size of that rounding here: the separate bf16 pass
    itself is 3e-3 nats per sequence away from fp64 on these rows (measured while writing this test).
    """
    model = _model(LlamaForCausalLM, LlamaConfig, "sdpa").bfloat16()
    batch = KTOCollator(0)(_rows(3, 16, mismatched=(5,)))
    with torch.no_grad():
        example, kl, _ = pair_logps(model, batch)
    ref_example, ref_kl = _separate(model, batch)
    for got, ref, mask in ((example, ref_example, batch.example.loss_mask), (kl, ref_kl, batch.kl.loss_mask)):
        assert got.dtype == torch.float32
        assert bool(((got - ref).abs() <= 2e-3 * mask.sum(1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_sdpa_masks_give_the_2d_mask_log_probs_bit_for_bit(family: str, dtype: torch.dtype) -> None:
    """The padded passes' sdpa masks built from the host's plan (no device read) against transformers' own from
    the 2D mask: the same log-probs to the bit, with and without padding, in fp32 and bf16, windows included."""
    from coati_kto.models.packing import padded_attention

    cls, config_cls, config = FAMILIES[family]
    model = _model(cls, config_cls, "sdpa", **config).to(dtype)
    head = LMHead.find(model)
    padded = KTOCollator(0)(_rows(7, 6)).example  # rows of 3-20 tokens: padded, longer than the windows
    fit = [r for r in _rows(9, 24) if len(r["input_ids"]) >= 9 and r["completion_start"] < 8][:3]
    even = KTOCollator(0)([{**r, "input_ids": r["input_ids"][:9]} for r in fit]).example  # 9 tokens each
    assert padded.padded and not even.padded and even.input_ids.shape[1] == 9
    for view in (padded, even):
        with torch.no_grad():
            own = model_sequence_logps(model, view.input_ids, view.attention_mask, view.loss_mask, head)
            planned = padded_attention(model, view)
            assert planned is not view.attention_mask  # the plan's masks, not the 2D mask
            ours = model_sequence_logps(model, view.input_ids, planned, view.loss_mask, head)
        assert torch.equal(own, ours), (family, view.padded, own, ours)
