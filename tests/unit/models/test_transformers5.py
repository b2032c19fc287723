"""Single-process checks of what transformers 5 changed under the trainer: forwards taking ``**kwargs``, MoE
router jitter in training mode."""

from __future__ import annotations

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
