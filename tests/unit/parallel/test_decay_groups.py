"""Weight decay leaves biases and norm weights out, as transformers' Trainer (and so TRL) does
(coati_kto.parallel.optimizers.parameter_groups), and a resume never loads one grouping into another
(coati_kto.config.resume.optimizer_groups_problem). The distributed half: tests/distributed/test_decay_groups_train.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import CORPUS
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer

from coati_kto.config.resume import config_changes, optimizer_groups_problem, with_legacy
from coati_kto.parallel.optimizers import optimizer_for, parameter_groups
from coati_kto.testing.tiny import build_family_model, build_tokenizer, random_causal_lm

TEXT_FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3",
    "phi3",
    "olmo3",
    "smollm3",
    "gemma4",
    "qwen3_5",
]


def _transformers_rule(model: torch.nn.Module) -> set[str]:
    """The names transformers' Trainer decays (its method reads nothing of the Trainer itself)."""
    return set(Trainer.get_decay_parameter_names(None, model))


def _no_decay_names(model: torch.nn.Module, groups: list[Any]) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    assert (
        isinstance(groups[1], dict) and groups[1]["weight_decay"] == 0.0 and "weight_decay" not in groups[0]
    )
    return {names[id(p)] for p in groups[1]["params"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(CORPUS, vocab_size=300)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_the_left_out_parameters_are_transformers_own(family: str, tokenizer: Any) -> None:
    model = build_family_model(family, tokenizer)
    groups = parameter_groups(model, 0.1, decay_norms_and_biases=False)
    named = dict(model.named_parameters())
    left_out = _no_decay_names(model, groups)
    assert left_out == set(named) - _transformers_rule(model)
    assert any("norm" in name for name in left_out)  # not vacuous: every family has norm weights
    # every parameter once, in named_parameters order within each group
    flat = [id(p) for group in groups for p in group["params"]]
    assert sorted(flat) == sorted(id(p) for p in named.values()) and len(flat) == len(set(flat))


def test_biases_layernorms_and_routers() -> None:
    """GPT-2's nn.LayerNorm (ln_1, ln_f) and Conv1D biases, and a MoE model's router weight, which decays."""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    left_out = _no_decay_names(gpt2, parameter_groups(gpt2, 0.1, False))
    assert left_out == set(dict(gpt2.named_parameters())) - _transformers_rule(gpt2)
    assert {
        "transformer.h.0.attn.c_attn.bias",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    } <= left_out
    assert "transformer.h.0.attn.c_attn.weight" not in left_out and "transformer.wte.weight" not in left_out
    moe = random_causal_lm(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, head_dim=8
    )
    left_out = _no_decay_names(moe, parameter_groups(moe, 0.1, False))
    assert left_out == set(dict(moe.named_parameters())) - _transformers_rule(moe)
    assert not any("gate" in name for name in left_out)


def test_one_group_when_nothing_is_left_out(tokenizer: Any) -> None:
    model = build_family_model("qwen2", tokenizer)
    every = [p for _, p in model.named_parameters()]
    for decay, decay_all in ((0.0, False), (0.1, True), (0.0, True)):
        assert parameter_groups(model, decay, decay_all) == every
    # LoRA on the weight matrices: the norms are frozen, nothing trainable is left out
    for param in model.parameters():
        param.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    assert parameter_groups(model, 0.1, False) == every


def test_the_optimizer_takes_the_groups_on_every_variant(tokenizer: Any) -> None:
    """The run's AdamW variants hold the groups, the left-out one at weight decay 0, and step them so."""
    from coati_kto.config.train import TrainSection

    model = build_family_model("llama", tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # an Adam step on zero gradients moves only by the decay
    for state_dtype in ("fp32", "bf16"):
        train = TrainSection(lr=0.5, weight_decay=0.2, optimizer_state_dtype=state_dtype)
        optimizer = optimizer_for(model, train)
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
        optimizer.step()
        for name, param in model.named_parameters():
            factor = 1.0 if "norm" in name else 0.9  # 1 - lr x weight_decay
            torch.testing.assert_close(param.detach(), before[name] * factor, rtol=0, atol=1e-7)
            param.data.copy_(before[name])


def _config(weight_decay: float, decay_all: bool | None) -> dict[str, Any]:
    train: dict[str, Any] = {"weight_decay": weight_decay, "lr": 1e-5}
    if decay_all is not None:
        train["decay_norms_and_biases"] = decay_all
    return {"train": train}


def test_a_resume_keeps_the_checkpoints_grouping() -> None:
    """A checkpoint saved before the key existed decayed every parameter (one group): its config lacks the key."""
    legacy = _config(0.1, None)
    assert with_legacy(legacy)["train"]["decay_norms_and_biases"] is True
    line = optimizer_groups_problem({"config": legacy}, _config(0.1, False), "step-4")
    assert line == (
        "train.resume step-4: its optimizer holds the parameters in one group (train.weight_decay 0, "
        "train.decay_norms_and_biases true, or model.lora); this config would hold them in biases and norm "
        "weights in a group of their own (train.weight_decay > 0, train.decay_norms_and_biases false): resume "
        "with the checkpoint's grouping, or start a new run"
    )
    assert optimizer_groups_problem({"config": legacy}, _config(0.1, True), "step-4") is None
    assert (
        optimizer_groups_problem({"config": _config(0.0, None)}, _config(0.0, False), "step-4") is None
    )  # no decay: one
    assert (
        optimizer_groups_problem({"config": _config(0.0, False)}, _config(0.1, False), "s") is not None
    )  # 0 -> 0.1
    assert (
        optimizer_groups_problem({"config": _config(0.1, False)}, _config(0.2, False), "s") is None
    )  # the rate may change
    assert optimizer_groups_problem({"config": _config(0.1, False)}, _config(0.1, True), "s") is not None
    # 0.1 -> 0: at 0 either grouping trains the same, so the resume keeps the checkpoint's two (it was refused)
    assert optimizer_groups_problem({"config": _config(0.1, False)}, _config(0.0, False), "s") is None
    changes = {c.key: (c.old, c.new) for c in config_changes(legacy, _config(0.1, True))}
    assert "train.decay_norms_and_biases" not in changes  # what the old run did, unchanged
    changes = {c.key: (c.old, c.new) for c in config_changes(legacy, _config(0.0, False))}
    assert changes["train.decay_norms_and_biases"] == (True, False)


def test_a_lora_run_holds_one_group_whatever_the_decay() -> None:
    """From an audit: a LoRA checkpoint (one group: only the adapters train, no bias, no norm) was refused as
    holding two once weight_decay > 0."""
    lora = {"lora": {"rank": 4}}
    saved, current = {"model": lora, **_config(0.0, None)}, {"model": lora, **_config(0.1, False)}
    assert optimizer_groups_problem({"config": saved}, current, "step-4") is None
    assert (
        optimizer_groups_problem({"config": {"model": lora, **_config(0.1, None)}}, current, "step-4") is None
    )


def test_the_grouping_a_checkpoint_recorded_decides() -> None:
    """At weight decay 0 a config cannot tell the grouping: a run resumed at 0 from a two-group checkpoint keeps
    two, and its own checkpoint (config weight_decay 0) says so in its trainer state (optimizer_groups)."""
    two_at_0 = {"config": _config(0.0, False), "optimizer_groups": 2}
    assert optimizer_groups_problem(two_at_0, _config(0.0, False), "s") is None
    assert optimizer_groups_problem(two_at_0, _config(0.1, False), "s") is None
    assert optimizer_groups_problem(two_at_0, _config(0.0, True), "s") is not None  # one group asked
    one = {"config": _config(0.1, False), "optimizer_groups": 1}  # e.g. LoRA on weight matrices only
    assert optimizer_groups_problem(one, _config(0.1, False), "s") is not None
