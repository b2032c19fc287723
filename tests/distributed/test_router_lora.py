"""LoRA on an MoE (tiny Qwen3-MoE asking for router logits), 2 gloo processes, ddp fp32: the router stays frozen
(as every base weight does under ``model.lora``), the load-balancing loss is still added (as transformers and TRL
add it under peft) and equals transformers' ``aux_loss`` of the adapted model, and its gradient reaches the
adapters, whose outputs feed every router, never the router itself. Adapters on the router are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_router_aux import _micro_batches, _tiny_qwen3_moe, built, transformers_aux_losses

from coati_kto.testing.distributed import run_distributed


def _run(model_dir: str, out_dir: str, coefficient: float | str) -> dict[str, Any]:
    import torch.distributed as dist

    from coati_kto.config.schema import Config
    from coati_kto.models.lora import base_module

    cfg = Config.model_validate(
        {
            "model": {"path": model_dir, "lora": {"rank": 4, "alpha": 8}},
            "data": {"train_files": ["unused.jsonl"], "prepared_dir": str(Path(out_dir) / "prepared")},
            "output": {"dir": out_dir},
            "train": {"lr": 1e-2, "accumulation_steps": 2, "micro_batch_size": 3},
            "plugin": {"name": "ddp", "precision": "fp32"},
            "kto": {"router_aux_loss_coef": coefficient},
        }
    )
    parts, trainer = built(cfg)
    model = base_module(parts.policy)  # the adapted model (LoRA layers in place; B = 0: the base function)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    batches = _micro_batches()
    expected = transformers_aux_losses(model, batches)
    trainer.fit(batches[dist.get_rank() :: 2])
    params = dict(model.named_parameters())
    return {
        "first": trainer.history[0],
        "expected": sum(expected) / 4,
        "router_trainable": [params[n].requires_grad for n in routers],
        "router_moved": max(float((params[n] - w).abs().max()) for n, w in routers.items()),
        "adapters": {n: p.detach().tolist() for n, p in params.items() if "lora_" in n},  # no shared memory
    }


def test_lora_router_frozen_aux_loss_reaches_the_adapters(tmp_path: Path) -> None:
    _tiny_qwen3_moe(tmp_path / "model")
    on = run_distributed(_run, 2, str(tmp_path / "model"), str(tmp_path / "on"), "auto")
    off = run_distributed(_run, 2, str(tmp_path / "model"), str(tmp_path / "off"), 0.0)
    for rank in on:
        assert abs(rank["first"]["train/aux_loss"] - rank["expected"]) < 1e-6 * rank["expected"]
        assert rank["first"]["train/rewards/chosen"] == 0.0 and rank["first"]["train/kl"] == 0.0
    for rank in on + off:
        assert rank["router_trainable"] == [False, False] and rank["router_moved"] == 0.0
    assert "train/aux_loss" not in off[0]["first"]
    # The same adapters, data and steps: only the aux loss (x 0.02) differs, and every adapter B moved with it.
    assert len(on[0]["adapters"]) == 2 * 4 * 2  # 2 layers x q, k, v, o x A, B
    for name, value in on[0]["adapters"].items():
        diff = float((torch.tensor(value) - torch.tensor(off[0]["adapters"][name])).abs().max())
        assert diff > 0, name
    assert on[0]["adapters"] == on[1]["adapters"]


def test_adapters_on_the_router_are_refused_with_the_aux_loss() -> None:
    """peft 0.21 adapts Mixtral's router (target ``gate``, through target_parameters): the load-balancing loss
    over an adapted router is not proven here, so with the loss on, one line names it; with it off, it trains."""
    import peft
    import transformers as tf

    from coati_kto.config.lora import LoraSection, peft_config
    from coati_kto.errors import ConfigError
    from coati_kto.models.router import RouterLoss
    from coati_kto.testing.tiny import random_causal_lm

    model = random_causal_lm(tf.MixtralForCausalLM, tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.02)  # fmt: skip
    adapted = peft.get_peft_model(model, peft_config(LoraSection(target_modules=["q_proj", "gate"])))
    with pytest.raises(ConfigError) as err:
        RouterLoss.find(adapted, "auto")
    (line,) = str(err.value).splitlines()
    assert line.startswith("model.lora.target_modules: adapters on the MoE router") and "gate" in line
    assert RouterLoss.find(adapted, 0.0) is None
    plain = peft.get_peft_model(
        random_causal_lm(tf.MixtralForCausalLM, tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2,
                         output_router_logits=True, router_aux_loss_coef=0.02),
        peft_config(LoraSection()),
    )  # fmt: skip
    assert RouterLoss.find(plain, "auto").coefficient == 0.02
