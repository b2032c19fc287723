"""The last decoder layer's MLP at the read positions only (coati_kto.models.last_mlp,
``model.skip_unread_mlp``): the same completion log-probs and gradients as the whole MLP for every tiny family
(the proof behind PROVEN_TYPES), the MLP really fed only the N read rows; refused for MoE, unproven types and
non-dense MLPs; off with the config key, under compile and under activation checkpointing (whose recompute
would otherwise run another path). The KL continuation with it: tests/distributed/test_kl_continuation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from coati_kto.models.last_mlp import PROVEN_TYPES, _last_mlp, skip_unread_mlp, skips_unread_mlp
from coati_kto.models.lm_head import model_sequence_logps
from coati_kto.models.logprobs import completion_logits_to_keep
from coati_kto.testing.tiny import FAMILIES, build_family_model


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Right-padded ids [3, 12], attention mask, completion mask (row 1 padded after 10, row 2 after 7)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 12), generator=gen)
    loss_mask = torch.zeros(3, 12, dtype=torch.bool)
    loss_mask[0, 5:12], loss_mask[1, 8:10], loss_mask[2, 3:7] = True, True, True
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[1, 10:], attention[2, 7:] = 0, 0
    return ids, attention, loss_mask


def _logps_and_grads(
    model: nn.Module, ids, attention, loss_mask
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    keep = completion_logits_to_keep(loss_mask)
    targets = loss_mask[:, ids.shape[1] - keep + 1 :].nonzero(as_tuple=True)
    model.zero_grad(set_to_none=True)
    logps = model_sequence_logps(model, ids, attention, loss_mask, None, keep, targets)
    logps.sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows_seen(mlp: nn.Module) -> list[int]:
    """The row counts of every linear input inside ``mlp`` from now on (the hooks stay on this test's
    model)."""
    seen: list[int] = []
    for module in mlp.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(
                lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            )
    return seen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tiny_family_gets_the_same_logps_and_gradients(family: str, tiny_tokenizer) -> None:
    model = build_family_model(family, tiny_tokenizer, seed=3).float()
    ids, attention, loss_mask = _batch(len(tiny_tokenizer))
    whole_logps, whole_grads = _logps_and_grads(model, ids, attention, loss_mask)
    assert model.get_decoder().config.model_type in PROVEN_TYPES
    assert skip_unread_mlp(model) and skips_unread_mlp(model)
    seen = _rows_seen(_last_mlp(model))
    logps, grads = _logps_and_grads(model, ids, attention, loss_mask)
    read = int(loss_mask.sum())  # one hidden state per completion token
    assert seen and set(seen) == {read}, seen  # the MLP saw the 13 read rows, not 3 x 12
    torch.testing.assert_close(logps, whole_logps, rtol=0, atol=1e-6)
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():  # fp32 rounding of each tensor's scale (sums over other rows' zeros)
        scale = float(whole_grads[name].abs().max())
        assert float((grad - whole_grads[name]).abs().max()) <= 1e-6 * scale + 1e-12, name


def test_moe_unproven_and_non_dense_mlps_run_whole(tiny_tokenizer) -> None:
    import transformers

    from coati_kto.testing.tiny import random_causal_lm

    moe = random_causal_lm(
        transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2
    )
    neox = random_causal_lm(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig)
    assert not skip_unread_mlp(moe) and not skips_unread_mlp(moe)  # a router and experts: not proven
    assert not skip_unread_mlp(neox)  # an unproven type
    shifted = build_family_model("qwen2", tiny_tokenizer)
    mlp = shifted.get_decoder().layers[-1].mlp
    mlp.time_mix = nn.Parameter(torch.ones(mlp.gate_proj.in_features))  # a parameter outside any linear layer
    assert not skip_unread_mlp(shifted)
    del mlp.time_mix
    mlp.register_buffer("state", torch.zeros(1))
    assert not skip_unread_mlp(shifted)


def test_loaded_by_default_off_by_config_and_under_compile(tiny_model_dir: Path) -> None:
    from coati_kto.config.schema import ModelSection
    from coati_kto.models.hf import load_causal_lm

    def loaded(**keys: object) -> nn.Module:
        return load_causal_lm(
            str(tiny_model_dir), ModelSection(path=str(tiny_model_dir), **keys), torch.float32
        )

    assert skips_unread_mlp(loaded())
    assert not skips_unread_mlp(loaded(skip_unread_mlp=False))
    assert not skips_unread_mlp(loaded(compile=True))


def test_activation_checkpointing_runs_the_mlp_whole(tiny_model_dir: Path) -> None:
    """A checkpointed layer recomputes in backward, outside the pass: the pass runs the MLP whole too (else
    the recompute would save other tensors than the forward and autograd would refuse it)."""
    from coati_kto.config.schema import ModelSection
    from coati_kto.models.hf import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), ModelSection(path=str(tiny_model_dir)), torch.float32)
    ids, attention, loss_mask = _batch(model.config.vocab_size)
    logps, grads = _logps_and_grads(model, ids, attention, loss_mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert not skips_unread_mlp(model)
    seen = _rows_seen(_last_mlp(model))
    recomputed_logps, recomputed_grads = _logps_and_grads(model, ids, attention, loss_mask)
    assert set(seen) == {ids.numel()}  # forward and recompute alike: every position
    torch.testing.assert_close(recomputed_logps, logps, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        assert float((recomputed_grads[name] - grad).abs().max()) <= 1e-6 * float(grad.abs().max()) + 1e-12


def test_a_deep_copy_runs_its_own_weights(tiny_tokenizer) -> None:
    """LoRA's export merges a deep copy: its last MLP must compute with the copy's weights, not the original's."""
    import copy

    model = build_family_model("llama", tiny_tokenizer).float()
    assert skip_unread_mlp(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.get_decoder().layers[-1].mlp.parameters():
            p.mul_(2.0)
    ids, attention, loss_mask = _batch(len(tiny_tokenizer))
    twin_logps, _ = _logps_and_grads(twin, ids, attention, loss_mask)
    plain = build_family_model("llama", tiny_tokenizer).float()
    plain.load_state_dict(twin.state_dict())
    plain_logps, _ = _logps_and_grads(plain, ids, attention, loss_mask)  # the whole MLP, the copy's weights
    assert skips_unread_mlp(twin) and not skips_unread_mlp(plain)
    torch.testing.assert_close(twin_logps, plain_logps, rtol=0, atol=1e-6)
