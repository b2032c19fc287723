"""The policy's shared-prompt passes: one packed pass with gradient (``kto.pack_policy``) gives the example's
log-probs and gradients of a separate pass and the KL pair's log-probs without gradient; a 2-process run that
folds its KL passes into its gradient passes, and one whose KL passes continue from the gradient passes' KV
cache (``kto.kl_continuation``, the online reference's too), train exactly as the run with separate passes
(SGD, fp32)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_trainer import VOCAB_HI, _build, _config, _weights, sgd
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import coati_kto.trainer.passes as passes_module
from coati_kto.data.collator import KTOCollator
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.packing import pair_logps
from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.tiny import random_causal_lm


def _rows(seed: int, labels: list[int], prompt: tuple[int, int], completion: tuple[int, int]) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        return torch.randint(3, VOCAB_HI, (n,), generator=gen).tolist()

    rows = []
    for label in labels:
        p = draw(*prompt)
        rows.append(
            {
                "input_ids": p + draw(*completion),
                "completion_start": len(p),
                "label": bool(label),
                "kl_input_ids": p + draw(*completion),
                "kl_completion_start": len(p),
            }
        )
    return rows


def _long_prompts(seed: int, labels: list[int]):
    """Prompts of 14-19 tokens, completions of 1-3: the tool-use shape, where folding pays."""
    return KTOCollator(0)(_rows(seed, labels, (14, 20), (1, 4)))


def test_fold_pays_for_long_prompts_only() -> None:
    assert _long_prompts(0, [1, 0, 1, 0]).fold_pays
    assert not KTOCollator(0)(_rows(0, [1, 0, 1, 0], (5, 8), (5, 8))).fold_pays  # P ~ C: two passes cheaper
    rows = _rows(1, [1, 0, 1, 0], (14, 20), (1, 4))
    rows[2]["kl_input_ids"] = rows[2]["kl_input_ids"][1:]  # truncation cut this KL prompt differently
    rows[2]["kl_completion_start"] -= 1
    assert not KTOCollator(0)(rows).fold_pays


@pytest.mark.parametrize(
    "cls,config_cls,extra",
    [(LlamaForCausalLM, LlamaConfig, {}), (MistralForCausalLM, MistralConfig, {"sliding_window": 6})],
)
def test_packed_gradient_pass_equals_separate_passes(cls, config_cls, extra) -> None:
    model = random_causal_lm(cls, config_cls, vocab_size=400, attn_implementation="sdpa", **extra)
    separate = copy.deepcopy(model)
    batch = _long_prompts(2, [1, 0, 0, 1, 1])
    weights = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.5])
    example, kl, shared = pair_logps(model, batch)
    assert example.requires_grad and not kl.requires_grad and bool((shared > 0).all())
    (example * weights).sum().backward()
    head = LMHead.find(separate)
    ex, kv = batch.example, batch.kl
    ref_example = model_sequence_logps(separate, ex.input_ids, ex.attention_mask, ex.loss_mask, head)
    (ref_example * weights).sum().backward()
    with torch.no_grad():
        ref_kl = model_sequence_logps(separate, kv.input_ids, kv.attention_mask, kv.loss_mask, head)
    torch.testing.assert_close(example, ref_example, atol=1e-5, rtol=0)
    torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=0)
    grads = dict(separate.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------- 2 processes
STEPS = [[[1, 0, 1, 0], [0, 1, 1, 1]], [[1, 1, 0, 0], [0, 0, 1, 1]], [[1, 0, 0, 1], [1, 0, 1, 0]]]


def _record_folds(trainer: Any) -> list[str]:
    """The list each micro-batch's KL path is appended to, from its scoring plan, as the trainer's passes plan
    them: training "folded", "continued" or "separate"; evaluation "eval:" and "packed", "continued" or
    "separate". A training path that scores the KL pairs with the gradient pass reduces z0 after its forward."""
    plans: list[str] = []
    scoring_plan = trainer.passes.scoring_plan

    def recorded(*args: Any, **kwargs: Any) -> Any:
        plan = scoring_plan(*args, **kwargs)
        assert plan.kl_late == (plan.policy_kl in ("folded", "continued") and plan.train), plan
        plans.append(plan.policy_kl if plan.train else f"eval:{plan.policy_kl}")
        return plan

    trainer.passes.scoring_plan = recorded
    return plans


MODES = {  # the KL pass: (pack_policy, kl_continuation)
    "separate": (False, False),
    "folded": (True, False),
    "continued": (False, True),
    "both": (True, True),  # folding first where it pays (these long prompts), as with a cached reference
}


def _run(model_dir: str, ref_dir: str, out_dir: str, mode: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from coati_kto.data.eval_sampler import EvalBatchSampler, ValidMaskLoader

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(
        model_dir,
        str(Path(out_dir) / mode),
        model={"path": model_dir, "reference_path": ref_dir},
        # ZeRO-2: hybrid_parallel at ZeRO-0 with 2 data-parallel ranks is torch DDP, whose forward holds
        # collectives, so nothing folds or continues there (test_torch_ddp_never_folds_nor_continues...).
        plugin={"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
        train={"micro_batch_size": 4},
        kto={"beta": 0.5, "desirable_weight": 1.3, "undesirable_weight": 0.7},
    )
    eval_rows = _rows(9, [1, 0, 1, 1, 0, 1, 0], (14, 20), (1, 4))
    sampler = EvalBatchSampler(len(eval_rows), 2, num_replicas=world, rank=rank)
    eval_loader = ValidMaskLoader(
        DataLoader(eval_rows, batch_sampler=sampler, collate_fn=KTOCollator(0)), sampler
    )
    with sgd():
        pack, continuation = MODES[mode]
        parts, trainer = _build(
            cfg,
            total_steps=len(STEPS),
            pack_policy=pack,
            kl_continuation=continuation,
            eval_at_start=True,
        )
        folded = _record_folds(trainer)
        batches = [
            _long_prompts(10 * s + r, labels) for s, step in enumerate(STEPS) for r, labels in enumerate(step)
        ]
        continued: list[bool] = []  # per policy KL pass continued: in training (grad on) or evaluation
        original = passes_module.continued_kl_logps

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            continued.append(torch.is_grad_enabled())
            return original(*args, **kwargs)

        passes_module.continued_kl_logps = counted
        try:
            trainer.fit(batches[rank::world], eval_loader)
        finally:
            passes_module.continued_kl_logps = original
    return {
        "history": trainer.history,
        "weights": _weights(parts.policy),
        "folded": folded,
        "continued": continued,
    }


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list]:
    out = tmp_path_factory.mktemp("policy_packing")
    return {
        mode: run_distributed(_run, 2, str(tiny_model_dir), str(reference_dir), str(out), mode)
        for mode in MODES
    }


@pytest.mark.parametrize("mode", ["folded", "continued", "both"])
def test_run_equals_the_run_with_separate_passes(runs: dict[str, list], mode: str) -> None:
    for rank in range(2):
        plain, packed = runs["separate"][rank], runs[mode][rank]
        # Evaluation at start and end (2 micro-batches each: no gradient pass to fold into, so it packs or
        # continues without gradient) around 3 training micro-batches per rank, every one folded or continued.
        evaluation = ["eval:separate"] * 2
        assert plain["folded"] == evaluation + ["separate"] * 3 + evaluation, plain["folded"]
        kind = "folded" if mode == "both" else mode
        evaluation = ["eval:continued" if mode == "continued" else "eval:packed"] * 2
        assert packed["folded"] == evaluation + [kind] * 3 + evaluation, packed["folded"]
        # Evaluation continues too where it does not pack (2 micro-batches at start and at end).
        continued_passes = {"folded": 0, "continued": 7, "both": 0}[mode]
        assert len(packed["continued"]) == continued_passes, packed["continued"]
        assert packed["continued"].count(True) == (3 if mode == "continued" else 0)  # in the gradient passes
        np.testing.assert_allclose(packed["weights"], plain["weights"], rtol=0, atol=1e-6)
        assert len(packed["history"]) == len(plain["history"])
        for got, want in zip(packed["history"], plain["history"], strict=True):
            assert got.keys() == want.keys()
            for key in want:
                if "per_second" in key or "flops" in key or key.endswith("mfu"):
                    continue
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # The reference differs from the policy, so z0 and the rewards are not trivially 0.
    first = next(h for h in runs[mode][0]["history"] if "train/kl_raw" in h)
    assert abs(first["train/kl_raw"]) > 1e-3


def _ddp_run(model_dir: str, ref_dir: str, out_dir: str, plugin: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = _config(
        model_dir,
        str(Path(out_dir) / plugin["name"]),
        model={"path": model_dir, "reference_path": ref_dir},
        plugin=plugin,
        train={"micro_batch_size": 4, "dist_timeout": 60},
    )
    parts, trainer = _build(
        cfg, total_steps=3, dp_size=dist.get_world_size(), pack_policy=True, kl_continuation=True
    )
    folded = _record_folds(trainer)
    # Rank 0's micro-batches would fold (long prompts), rank 1's neither fold (prompt ~ completion) nor continue
    # (one KL prompt cut otherwise by truncation).
    batches = []
    for s in range(3):
        if rank == 0:
            batches.append(_long_prompts(s, [1, 0, 1, 0]))
            continue
        rows = _rows(s, [0, 1, 1, 0], (5, 8), (5, 8))
        rows[1]["kl_input_ids"] = rows[1]["kl_input_ids"][1:]
        rows[1]["kl_completion_start"] -= 1
        batches.append(KTOCollator(0)(rows))
    assert [b.fold_pays for b in batches] == [rank == 0] * 3
    assert [b.kl_continuation is not None for b in batches] == [rank == 0] * 3
    trainer.fit(batches, None)
    return {"folded": folded, "steps": trainer.global_step}


@pytest.mark.parametrize(
    "plugin",
    [
        {"name": "ddp", "precision": "fp32"},
        {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    ],
    ids=["ddp", "hybrid_zero0"],
)
def test_torch_ddp_never_folds_nor_continues_so_ranks_meet_the_same_collectives(
    tiny_model_dir: Path, reference_dir: Path, tmp_path: Path, plugin: dict[str, Any]
) -> None:
    """torch DDP's forward enters collectives (its bucket rebuild at the second gradient forward, its buffer
    broadcast). A rank folding or continuing its KL pass ran its forwards before the z0 all-reduce, a rank with
    separate passes after it: a cached-reference ddp run hung at step 2, and a hybrid ZeRO-0 run (torch DDP at
    2 data-parallel ranks) hung once the KL pass continued, and again here once it folded. Under torch DDP no micro-batch folds or continues;
    the run ends on every rank."""
    results = run_distributed(
        _ddp_run, 2, str(tiny_model_dir), str(reference_dir), str(tmp_path), plugin, timeout_s=300
    )
    for r in results:
        assert r["steps"] == 3 and r["folded"] == ["separate"] * 3, r


def test_continued_run_counts_the_tokens_its_passes_ran(runs: dict[str, list], tiny_model_dir: Path) -> None:
    """Model FLOPs of a continued step by hand: the policy's gradient pass 6 N per example token and its KL pass
    2 N per continued token ([last prompt token, y_j]), the online reference 2 N on each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    train = [h for h in runs["continued"][0]["history"] if "train/model_flops_per_second" in h]
    assert len(train) == len(STEPS)
    for s, (record, step) in enumerate(zip(train, STEPS, strict=True)):
        batches = [_long_prompts(10 * s + r, labels) for r, labels in enumerate(step)]
        ex = sum(int(b.example.attention_mask.sum()) for b in batches)
        kl = sum(int(b.kl.attention_mask.sum()) for b in batches)
        continued = sum(int(b.kl_continuation.view.attention_mask.sum()) for b in batches)
        assert continued < kl  # the prompts ran once
        ratio = record["train/model_flops_per_second"] / record["train/tokens_per_second"]
        assert ratio == pytest.approx(n * (8 * ex + 4 * continued) / (ex + kl), rel=1e-9)
