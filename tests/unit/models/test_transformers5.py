"""Single-process checks of what transformers 5 changed under the trainer: forwards taking ``**kwargs``, MoE
router jitter in training mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from coati_kto.models.hf import disable_dropout
from coati_kto.models.lm_head import forward_accepts, model_sequence_logps
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
    assert forward_accepts(inner, "logits_to_keep") and not forward_accepts(wrapped, "logits_to_keep")
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
    reads a 2D mask; the passes give 4D ones). The passes run without transformers' router logits (the same
    log-probs as the config without them; coati_kto.models.router records them itself), and one note says whether
    the load-balancing loss joins the KTO loss."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.families import model_notes
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.packing import padded_logps

    moe = dict(num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)
    asking = random_causal_lm(MixtralForCausalLM, MixtralConfig, output_router_logits=True, **moe).eval()
    plain = random_causal_lm(MixtralForCausalLM, MixtralConfig, **moe).eval()
    rows = [list(range(3, 3 + n)) for n in (12, 9)]  # two lengths: the shorter row is padded
    features = [
        dict(input_ids=r, completion_start=5, label=True, kl_input_ids=r, kl_completion_start=5) for r in rows
    ]
    view = KTOCollator(0)(features).example
    with torch.no_grad():
        got, expected = (padded_logps(m, view, LMHead.find(m)) for m in (asking, plain))
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    asking.save_pretrained(tmp_path / "asking")
    plain.save_pretrained(tmp_path / "plain")
    (silent,) = model_notes(str(tmp_path / "plain"))
    assert "load-balancing loss is not added (its config sets no output_router_logits)" in silent
    (note,) = model_notes(str(tmp_path / "asking"))
    assert note.startswith("note: ") and "load-balancing loss x 0.001 (router_aux_loss_coef) joins" in note
    assert model_notes(str(tmp_path / "asking"), 0.0)[0].endswith("not added (kto.router_aux_loss_coef 0); "
                                                               "kto.router_aux_loss_coef=<weight> adds it")  # fmt: skip


def test_vision_language_gemma3_log_probs_keep_the_sliding_window() -> None:
    """Gemma 3 4B-27B (Gemma3ForConditionalGeneration): the log-prob pass read config.vocab_size (kept in the text
    config: AttributeError), and the planned 4D masks read windows from the top config (none there), so the
    sliding layers attended over the whole row (3.8-5.8 nats off past the window). Now: the model's own masks from
    the 2D one, its logits over the text vocabulary, equal to log_softmax of its logits; the tower is frozen."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.families import vision_language
    from coati_kto.models.hf import freeze_vision_tower
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.packing import padded_logps
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    tokenizer = build_tokenizer(["The capital of France is Paris. Please add 2 and 3."] * 20, vocab_size=300)
    model = build_family_model("gemma3_vl", tokenizer).eval()
    assert vision_language(model.config) and LMHead.find(model) is None
    for p in model.parameters():  # rows long past the window (8) and sharp weights: a wrong mask shows
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    rows = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (24, 17)]
    features = [
        dict(input_ids=r, completion_start=4, label=True, kl_input_ids=r, kl_completion_start=4) for r in rows
    ]
    view = KTOCollator(0)(features).example
    with torch.no_grad():
        got = padded_logps(model, view, None)
        logits = model(input_ids=view.input_ids, attention_mask=view.attention_mask).logits.float()
    token = logits[:, :-1].log_softmax(-1).gather(2, view.input_ids[:, 1:, None]).squeeze(2)
    expected = (token * view.loss_mask[:, 1:]).sum(1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-6)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    loaded = {
        n: p.detach().clone() for n, p in model.named_parameters() if "vision" in n or "multi_modal" in n
    }
    frozen = freeze_vision_tower(model, keep_fp32=True)
    tower = sum(p.numel() for p in loaded.values())
    assert frozen.keys() == loaded.keys() and all(torch.equal(frozen[n], p) for n, p in loaded.items())
    assert tower > 0 and sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable - tower
    assert freeze_vision_tower(model) == {}  # nothing left to freeze, no copy kept


def test_opt_padded_pass_takes_the_2d_mask() -> None:
    """OPT derives its learned positions from the 2D attention mask (cumsum); the padded sdpa pass handed it the
    planned 4D mask and every padded micro-batch failed ("size of tensor a (2) must match the size of tensor b
    (43)", modeling_opt.py:375, the family sweep's OPT cells). Now the 2D mask: the log-probs of OPT's own
    forward on each row alone (no padding)."""
    from transformers import OPTConfig, OPTForCausalLM

    from coati_kto.data.collator import KTOCollator
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.packing import padded_logps

    config = OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                       word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=1,
                       attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = OPTForCausalLM(config).eval()
    rows = [[(5 * i + n) % 60 + 2 for i in range(n)] for n in (12, 9)]  # the shorter row is padded
    features = [
        dict(input_ids=r, completion_start=4, label=True, kl_input_ids=r, kl_completion_start=4) for r in rows
    ]
    view = KTOCollator(1)(features).example
    with torch.no_grad():
        got = padded_logps(model, view, LMHead.find(model))
        expected = []
        for r in rows:
            logits = model(input_ids=torch.tensor([r])).logits[0, :-1].float().log_softmax(-1)
            expected.append(logits.gather(1, torch.tensor(r[1:])[:, None]).squeeze(1)[3:].sum())
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)
