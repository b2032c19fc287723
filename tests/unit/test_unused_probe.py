"""``coati_kto.parallel.unused.unreached_parameters``: the probe that decides torch DDP's
``find_unused_parameters`` (the training itself: tests/distributed/test_unused_params_ddp.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from coati_kto.parallel.unused import unreached_parameters


class _TopOneExperts(nn.Module):
    """Four expert modules, each token routed to one of them (the shape of an MoE kept as separate modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.router = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.dropout = nn.Dropout(0.5)  # draws from the random state in train mode

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        hidden = self.dropout(self.embed(input_ids))
        weight, chosen = self.router(hidden).softmax(-1).max(-1)
        out = torch.zeros_like(hidden)
        for index, expert in enumerate(self.experts):
            hit = chosen == index
            if hit.any():
                out[hit] = weight[hit, None] * expert(hidden[hit])
        return SimpleNamespace(logits=out)


def test_a_causal_lm_reaches_every_parameter_and_unused_ones_are_named(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    assert unreached_parameters(model) == []
    # Non-reentrant activation checkpointing (train.py's) keeps the graph whole; the reentrant kind would not.
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert unreached_parameters(model) == []
    model.model.extra = nn.Linear(4, 4)  # a cross-attention without an encoder, in miniature
    model.lm_head.weight.requires_grad_(False)  # frozen parameters are not DDP's concern
    assert unreached_parameters(model) == ["model.extra.weight", "model.extra.bias"]


def test_experts_no_token_reached_are_unreached_and_rng_is_untouched() -> None:
    torch.manual_seed(0)
    model = _TopOneExperts()
    before = torch.random.get_rng_state()
    unreached = unreached_parameters(model)
    assert torch.equal(torch.random.get_rng_state(), before)
    # One token: one expert reached, the other three (weights and biases) not.
    assert len(unreached) == 6 and all(name.startswith("experts.") for name in unreached)


def test_a_forward_that_fails_answers_none() -> None:
    assert unreached_parameters(nn.Linear(2, 2)) is None  # no input_ids argument
    assert unreached_parameters(nn.Module()) == []  # nothing trainable: nothing to look for
