"""Single-process checks of what transformers 5 changed under the trainer: forwards taking ``**kwargs``, MoE
router jitter in training mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from coati_kto.models.hf import disable_dropout
from coati_kto.models.lm_head import _forward_accepts, model_sequence_logps
from coati_kto.testing.tiny import random_causal_lm


class _NoLogitsToKeep(nn.Module):
    """A causal LM whose forward takes ``**kwargs`` but refuses ``logits_to_keep`` (as a forward that hands its
    keywords on to the attention would fail deeper down)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        if "logits_to_keep" in kwargs:
            raise TypeError("unexpected keyword logits_to_keep")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_a_forward_without_logits_to_keep_gets_full_logits() -> None:
    """Detected by the signature's names, not by a ``**kwargs`` catch-all; the log-probs are the same."""
    inner = random_causal_lm(LlamaForCausalLM, LlamaConfig).eval()
    wrapped = _NoLogitsToKeep(inner)
    assert _forward_accepts(inner, "logits_to_keep") and not _forward_accepts(wrapped, "logits_to_keep")
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    with torch.no_grad():
        expected = model_sequence_logps(inner, ids, mask, loss_mask, None)
        got = model_sequence_logps(wrapped, ids, mask, loss_mask, None)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)  # same logits, fewer or more rows per matmul


def test_moe_router_jitter_is_off_in_training() -> None:
    """Mixtral's router jitter (0.1) multiplies the router input by noise in training mode; the trainer turns it
    off like dropout, so the policy (train mode) equals the reference (eval mode) at step 0."""
    model = random_causal_lm(
        MixtralForCausalLM, MixtralConfig, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1
    )
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.eval()(input_ids=ids).logits
        model.train()
        torch.manual_seed(0)
        noisy = model(input_ids=ids).logits
        disable_dropout(model)
        torch.manual_seed(0)
        trained = model(input_ids=ids).logits
    assert not torch.equal(noisy, reference)  # the jitter is live before
    assert torch.equal(trained, reference)


def _dropout_families() -> list[tuple[type, type, dict]]:
    """Families whose dropout lives in float attributes disable_dropout once missed (Starcoder2's and
    Seed-OSS's residual/embedding dropout), and GPT-2's nn.Dropout layers, all at probability 0.1."""
    import transformers

    out = [
        (
            transformers.Starcoder2ForCausalLM,
            transformers.Starcoder2Config,
            dict(attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1),
        ),
        (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config,
            dict(n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        ),
    ]
    if hasattr(transformers, "SeedOssForCausalLM"):
        out.append(
            (
                transformers.SeedOssForCausalLM,
                transformers.SeedOssConfig,
                dict(attention_dropout=0.1, residual_dropout=0.1),
            )
        )
    return out


@pytest.mark.parametrize(("model_class", "config_class", "dropout"), _dropout_families())
def test_dropout_attributes_of_other_families_are_off_in_training(model_class, config_class, dropout) -> None:
    """Starcoder2 kept its residual and embedding dropout in training mode: rewards were not 0 at step 1 and a
    resumed run differed from the uninterrupted one. The policy (train mode) equals the reference (eval mode)."""
    model = random_causal_lm(model_class, config_class, **dropout)
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.eval()(input_ids=ids).logits
        model.train()
        noisy = model(input_ids=ids).logits
        disable_dropout(model)
        trained = model(input_ids=ids).logits
    assert not torch.equal(noisy, reference)  # the dropout is live before
    assert torch.equal(trained, reference)


def test_moe_config_asking_for_router_logits_runs_the_passes(tmp_path) -> None:
    """Mixtral with output_router_logits: true crashed in every padded pass (transformers' load-balancing loss
    reads a 2D mask; the passes give 4D ones). The passes run without router logits: the same log-probs as the
    config without them, and one note says the auxiliary loss is not added."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.families import router_loss_note
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.packing import padded_attention

    moe = dict(num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)
    asking = random_causal_lm(MixtralForCausalLM, MixtralConfig, output_router_logits=True, **moe).eval()
    plain = random_causal_lm(MixtralForCausalLM, MixtralConfig, **moe).eval()
    rows = [list(range(3, 3 + n)) for n in (12, 9)]  # two lengths: the shorter row is padded
    features = [
        dict(input_ids=r, completion_start=5, label=True, kl_input_ids=r, kl_completion_start=5) for r in rows
    ]
    view = KTOCollator(0)(features).example
    with torch.no_grad():
        got, expected = (
            model_sequence_logps(
                m,
                view.input_ids,
                padded_attention(m, view),
                view.loss_mask,
                LMHead.find(m),
                view.keep,
                view.targets(),
            )
            for m in (asking, plain)
        )
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    asking.save_pretrained(tmp_path / "asking")
    plain.save_pretrained(tmp_path / "plain")
    assert router_loss_note(str(tmp_path / "plain")) is None
    assert "load-balancing loss is not added" in router_loss_note(str(tmp_path / "asking"))
