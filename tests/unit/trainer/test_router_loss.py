"""The MoE router's load-balancing loss in the KTO step (``coati_kto.models.router``): equal to transformers' own
``aux_loss`` on the examples' padded batch whichever layout the gradient pass runs (padded with the planned
4D mask, padding-free rows, the folded shared-prompt pass), in the gradient with the model's coefficient, and
added only when the config asks for router logits (``kto.router_aux_loss_coef: auto``) or a number says so."""

from __future__ import annotations

import types

import pytest
import torch

from coati_kto.data.collator import KTOCollator
from coati_kto.errors import ConfigError
from coati_kto.models.router import RouterLoss
from coati_kto.testing.tiny import random_causal_lm
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.passes import KTOPasses


def _moe(family: str, seed: int = 0, **config: object) -> torch.nn.Module:
    """A tiny random ``family`` MoE (4 experts, top 2, 2 layers, vocabulary 200) asking for router logits, its
    routers far from uniform (top-k choices that a rounding does not flip)."""
    import transformers as tf

    specific = {
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig,
            dict(num_experts=4, moe_intermediate_size=16),
        ),
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig, dict(num_local_experts=4)),
        "qwen2_moe": (
            tf.Qwen2MoeForCausalLM,
            tf.Qwen2MoeConfig,
            dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
        ),
        "olmoe": (tf.OlmoeForCausalLM, tf.OlmoeConfig, dict(num_experts=4)),
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig, dict(num_local_experts=4, head_dim=8)),
    }[family]
    model_class, config_class, extra = specific
    model = random_causal_lm(
        model_class,
        config_class,
        seed,
        **{"num_experts_per_tok": 2, "output_router_logits": True, "pad_token_id": 0, **extra, **config},
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate" in name.split(".")[-2] and name.endswith("weight") and param.dim() == 2:
                param.normal_(0, 0.5)
    return model


def _features(prompts: list[int], completions: list[int], seed: int = 3) -> list[dict]:
    """Rows with the given prompt / completion lengths (the KL pair: the same prompt, another completion)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, 200, (n,), generator=gen).tolist()  # noqa: E731
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt = draw(p)
        out.append(
            dict(
                input_ids=prompt + draw(c),
                completion_start=p,
                label=i % 2 == 0,
                kl_input_ids=prompt + draw(c),
                kl_completion_start=p,
            )
        )
    return out


def _step(policy, batch, coefficient: float | str = "auto", **options) -> tuple[float | None, float]:
    """One optimizer step's passes over ``batch`` (a micro-batch, or a list of them: gradient accumulation) on one
    process, reference = policy: (logged aux_loss or None, the sum of the losses handed to backward, whose
    gradient is left on ``policy``)."""
    batches = batch if isinstance(batch, list) else [batch]
    backend = types.SimpleNamespace(forward_collectives=False, torch_ddp=False, chunked_head=True)
    plan = types.SimpleNamespace(plugin="low_level_zero", backend=backend, tp_size=1, sp_size=1)
    opts = KTOOptions(router_aux_loss_coef=coefficient, **options)
    passes = KTOPasses(policy, policy, plan, opts, None, torch.device("cpu"))
    handed: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        handed.append(float(loss.detach()))
        loss.backward()

    policy.zero_grad()
    sums = StepSums(torch.device("cpu"))
    for micro in passes.train_step([batches], sums):
        backward(micro.loss())
    local, _ = sums.local()
    aux = local["aux_loss"] / local["aux_rows"] if local["aux_rows"] else None
    return aux, sum(handed)


def _transformers_aux(model, batch) -> torch.Tensor:
    """transformers' own ``aux_loss`` of ``model`` on the examples' padded batch (its 2D attention mask)."""
    view = batch.example
    return model(
        input_ids=view.input_ids, attention_mask=view.attention_mask, output_router_logits=True
    ).aux_loss


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_padded_pass_equals_transformers_aux_loss(family: str) -> None:
    """Rows of 13, 9 and 6 tokens: the shorter ones padded. Before: no router loss was computed (aux None)."""
    policy = _moe(family)
    batch = KTOCollator(0)(_features([5, 4, 3], [8, 5, 3]))
    assert bool((batch.example.attention_mask == 0).any())  # padding present
    aux, _ = _step(policy, batch)
    expected = float(_transformers_aux(policy, batch).detach())
    assert aux is not None and abs(aux - expected) < 1e-6 * expected, (aux, expected)


def test_padding_counted_would_differ() -> None:
    """The check above can fail: counting the padding tokens (no mask) gives another value."""
    policy = _moe("qwen3_moe")
    batch = KTOCollator(0)(_features([5, 4, 3], [8, 5, 3]))
    view = batch.example
    unmasked = float(policy(input_ids=view.input_ids, output_router_logits=True).aux_loss)
    assert abs(unmasked - float(_transformers_aux(policy, batch))) > 1e-3


@pytest.mark.parametrize("layout", ["padding_free", "folded"])
def test_packed_passes_equal_transformers_aux_loss(layout: str) -> None:
    """Padding-free bins (two documents in one row) and the folded shared-prompt pass (the KL pairs' tokens in
    the same rows): only the examples' tokens count, so the loss is transformers' on the padded examples."""
    policy = _moe("mixtral")
    if layout == "padding_free":
        batch = KTOCollator(0, padding_free="bins")(_features([6, 3, 3], [6, 2, 2]))
        assert batch.example_rows.input_ids.shape[0] < len(batch)  # packed: fewer rows than examples
        aux, _ = _step(policy, batch)
    else:
        batch = KTOCollator(0)(_features([12, 10, 9], [2, 3, 2]))
        assert batch.fold_pays
        aux, _ = _step(policy, batch, pack_policy=True)
    expected = float(_transformers_aux(policy, batch).detach())
    assert aux is not None and abs(aux - expected) < 1e-6 * expected, (aux, expected)


def test_gradient_holds_the_coefficient_times_the_aux_gradient() -> None:
    """The loss handed to backward is KTO's plus coefficient x aux, and so is the gradient: the difference of
    the router weights' gradients with and without the term is coefficient x d(transformers' aux_loss)."""
    policy = _moe("qwen3_moe", router_aux_loss_coef=0.25)
    batch = KTOCollator(0)(_features([5, 4, 3, 4], [8, 5, 3, 6]))
    _, plain_loss = _step(policy, batch, 0.0)
    plain = [p.grad.clone() for p in policy.parameters()]
    aux, with_loss = _step(policy, batch)  # auto: the config's 0.25
    combined = [p.grad.clone() for p in policy.parameters()]
    # Under activation checkpointing (a 30B MoE needs it) the recorded logits recompute in backward: the same.
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert _step(policy, batch) == (aux, with_loss)
    assert all(torch.equal(p.grad, c) for p, c in zip(policy.parameters(), combined, strict=True))
    policy.activation_checkpointing_disable()
    policy.zero_grad()
    expected_aux = _transformers_aux(policy, batch)
    expected_aux.backward()
    assert abs(with_loss - plain_loss - 0.25 * float(expected_aux.detach())) < 1e-6
    diff = torch.cat([(c - p).flatten() for c, p in zip(combined, plain, strict=True)])
    # (the LM head and the last norm take no part in routing: no gradient from the aux loss)
    aux_grad = torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in policy.parameters()]
    )
    assert float(aux_grad.norm()) > 1e-3
    error = float((diff - 0.25 * aux_grad).norm() / (0.25 * aux_grad).norm())
    assert error < 1e-4, error


def test_auto_follows_the_config_and_a_number_overrides_it() -> None:
    """auto: the model's coefficient only when its config asks for router logits (transformers' and TRL's rule);
    a number sets it (0: off); a number on a model without the loss is a one-line config error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    asking, silent = _moe("mixtral", router_aux_loss_coef=0.02), _moe("mixtral", output_router_logits=False)
    assert RouterLoss.find(asking, "auto").coefficient == 0.02
    assert RouterLoss.find(silent, "auto") is None
    assert RouterLoss.find(silent, 0.01).coefficient == 0.01
    assert RouterLoss.find(asking, 0.0) is None
    dense = random_causal_lm(LlamaForCausalLM, LlamaConfig)
    assert RouterLoss.find(dense, "auto") is None
    with pytest.raises(ConfigError, match="kto.router_aux_loss_coef 0.01: LlamaForCausalLM has no router"):
        RouterLoss.find(dense, 0.01)
    batch = KTOCollator(0)(_features([5, 4], [8, 5]))
    assert _step(silent, batch)[0] is None  # nothing computed, nothing logged


def test_a_number_for_a_family_without_the_loss_is_refused_at_config_load(tmp_path) -> None:
    """kto.router_aux_loss_coef 0.01 with a dense Llama (or DeepSeek-V3, which balances with a bias): one line at
    config load, before any data is prepared; auto and 0 pass; a garbage value names the key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.config.load import load_config
    from coati_kto.errors import ConfigError

    random_causal_lm(LlamaForCausalLM, LlamaConfig).save_pretrained(tmp_path / "llama")
    _moe("mixtral").save_pretrained(tmp_path / "mixtral")
    path = tmp_path / "c.yaml"
    path.write_text(
        f"model: {{path: {tmp_path / 'llama'}}}\ndata: {{train_files: [x.jsonl], prepared_dir: p}}\n"
        "plugin: {name: low_level_zero}\n"
    )
    for ok in ("kto.router_aux_loss_coef=auto", "kto.router_aux_loss_coef=0"):
        load_config(path, [ok])
    load_config(path, [f"model.path={tmp_path / 'mixtral'}", "kto.router_aux_loss_coef=0.01"])
    with pytest.raises(ConfigError) as err:
        load_config(path, ["kto.router_aux_loss_coef=0.01"])
    (line,) = str(err.value).splitlines()
    assert (
        "kto.router_aux_loss_coef 0.01: LlamaForCausalLM" in line
        and "has no router load-balancing loss" in line
    )
    with pytest.raises(
        ConfigError, match=r"^override kto.router_aux_loss_coef=-1: must be auto or a number >= 0"
    ):
        load_config(path, ["kto.router_aux_loss_coef=-1"])


def test_accumulated_micro_batches_train_on_the_mean_aux_loss() -> None:
    """Two micro-batches of one step (accumulation 2): the router term of the gradient is coefficient x the mean
    of transformers' aux_loss gradients over the two, and the logged aux_loss their mean (HF Trainer's scaling:
    each micro-batch's loss / accumulation steps)."""
    policy = _moe("mixtral", router_aux_loss_coef=0.5)
    first = KTOCollator(0)(_features([5, 4, 3], [8, 5, 3], seed=3))
    second = KTOCollator(0)(_features([3, 6, 4], [4, 2, 7], seed=4))
    _step(policy, [first, second], 0.0)
    plain = torch.cat([p.grad.flatten() for p in policy.parameters()])
    aux, _ = _step(policy, [first, second])
    combined = torch.cat([p.grad.flatten() for p in policy.parameters()])
    policy.zero_grad()
    each = [_transformers_aux(policy, b) for b in (first, second)]
    ((each[0] + each[1]) / 2).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in policy.parameters()]
    expected = 0.5 * torch.cat([g.flatten() for g in grads])
    assert abs(aux - float((each[0] + each[1]).detach()) / 2) < 1e-6
    error = float((combined - plain - expected).norm() / expected.norm())
    assert error < 1e-4, error
