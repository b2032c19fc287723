"""KTOTrainer numbers on real gloo processes: hand-computed loss, layout invariance, exact metrics, single-label
ranks, tensor parallelism, non-finite handling and bit-exact resume.

Spawned process sets are shared: one 1-process run, one 2-process run doing several checks in sequence, and one
fresh 2-process run that resumes from the other's checkpoint (module-scoped fixtures, computed once).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coati_kto.data.batch import KTOBatch
from coati_kto.data.eval_sampler import EvalBatchSampler, ValidMaskLoader
from coati_kto.testing.distributed import run_distributed
from coati_kto.trainer.metrics import StepSums, summarize

MBS = 4  # rows per micro-batch in the layout runs
VOCAB_HI = 390  # token ids drawn from [3, VOCAB_HI): inside the tiny tokenizer (393 tokens)

# Labels of the 4 global micro-batches of each step. Rank r of R takes global micro-batches r, r+R, ...:
# with 2 ranks x 2 accumulation, rank 0 holds only desirable rows in step 1 and rank 1 only undesirable in step 2.
STEP_LABELS = [
    [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 1]],
    [[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]],
    [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]],
]


# ------------------------------------------------------------------------------------------- data helpers
def _row(gen: torch.Generator, label: int, vocab_hi: int = VOCAB_HI) -> dict:
    """One prepared row: a random prompt, its completion, and the same prompt with another completion (KL); token
    ids drawn from [3, ``vocab_hi``)."""

    def draw(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        return torch.randint(3, vocab_hi, (n,), generator=gen).tolist()

    prompt = draw(3, 7)
    return {
        "input_ids": prompt + draw(2, 7),
        "completion_start": len(prompt),
        "label": bool(label),
        "kl_input_ids": prompt + draw(2, 7),
        "kl_completion_start": len(prompt),
    }


def _batch(seed: int, labels: list[int], vocab_hi: int = VOCAB_HI) -> dict[str, torch.Tensor]:
    from coati_kto.data.collator import KTOCollator

    gen = torch.Generator().manual_seed(seed)
    return KTOCollator(pad_token_id=0)([_row(gen, y, vocab_hi) for y in labels])


def _global_steps(vocab_hi: int = VOCAB_HI) -> list[list[KTOBatch]]:
    """Each step's 4 global micro-batches (``STEP_LABELS``), token ids below ``vocab_hi`` (a model's vocabulary)."""
    return [
        [_batch(100 * s + g, labels, vocab_hi) for g, labels in enumerate(step)]
        for s, step in enumerate(STEP_LABELS)
    ]


def one_row(batches: list[KTOBatch]) -> list[KTOBatch]:
    """``batches`` with the padding-free layouts ``KTOCollator(padding_free="one")`` plans: every pass one row."""
    from dataclasses import replace

    from coati_kto.data.packed import plan_rows

    return [
        replace(
            b,
            pairs=plan_rows(b.example, b.kl, "one"),
            example_rows=plan_rows(b.example, None, "one"),
            kl_rows=plan_rows(None, b.kl, "one"),
        )
        for b in batches
    ]


def _rank_loader(world: int, rank: int) -> list[KTOBatch]:
    """This rank's micro-batches, step after step: global micro-batches rank, rank + world, ... of each step."""
    return [mb for step in _global_steps() for mb in step[rank::world]]


def _config(model_dir: str, out_dir: str, **sections: dict) -> Any:
    from coati_kto.config.schema import Config

    raw: dict[str, Any] = {
        "model": {"path": model_dir},
        "data": {"train_files": ["unused.jsonl"], "prepared_dir": str(Path(out_dir) / "prepared")},
        "output": {"dir": out_dir},
        "train": {"lr": 1e-2, "warmup_steps": 1, "min_lr_ratio": 0.1, "max_grad_norm": 1.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return Config.model_validate(raw)


def _build(cfg: Any, total_steps: int, dp_size: int | None = None, **trainer_kwargs: Any):
    """Plugin, boosted policy, reference, trainer, as coati_kto.train builds them (hand-built data instead).
    ``dp_size``: the data-parallel size, as train.py gives the plan; None (unknown) plans conservatively
    (hybrid ZeRO-0 counts as torch DDP: nothing folds)."""
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.recipe.components import build_components
    from coati_kto.trainer.kto import KTOTrainer

    plan = ParallelPlan.from_config(cfg, dp_size=dp_size)
    plugin = plan.backend.build_plugin()
    parts = build_components(cfg, plugin, total_steps, plan)
    kwargs = {
        "max_epochs": 1,
        "beta": cfg.kto.beta,
        "desirable_weight": cfg.kto.desirable_weight,
        "undesirable_weight": cfg.kto.undesirable_weight,
        "accumulation_steps": cfg.train.accumulation_steps,
        "layout": parts.layout,
        "kl_scope": cfg.kto.kl_scope,
        "max_grad_norm": cfg.train.max_grad_norm,
        "plan": parts.plan,
        **trainer_kwargs,
    }
    trainer = KTOTrainer(
        parts.policy,
        parts.reference,
        parts.booster,
        parts.optimizer,
        plugin,
        parts.lr_scheduler,
        None,
        **kwargs,
    )
    return parts, trainer


@contextlib.contextmanager
def sgd() -> Iterator[None]:
    """Build the policy's optimizer as plain SGD (inside a worker process) instead of AdamW.

    Adam divides out any constant factor of the gradient; SGD shows it (layout invariance, clipping).
    """
    from coati_kto.parallel import optimizers

    original = optimizers.make_optimizer
    optimizers.make_optimizer = lambda params, lr, weight_decay, **kwargs: torch.optim.SGD(params, lr=lr)
    try:
        yield
    finally:
        optimizers.make_optimizer = original


def full_weights(policy: Any) -> np.ndarray:
    """Every weight of the whole model, fp64, by parameter name: tensor-parallel slices gathered (state_dict())."""
    state = policy.unwrap().state_dict()
    return torch.cat([state[k].detach().double().flatten() for k in sorted(state)]).cpu().numpy()


def _weights(policy: Any) -> np.ndarray:
    """Flat fp64 copy of the policy's weights; numpy, so it crosses the result queue by value (not a shared fd)."""
    return torch.cat([p.detach().double().flatten() for p in policy.unwrap().parameters()]).cpu().numpy()


def _inject_nan(trainer: Any, at_step: int, rank: int | None = None) -> None:
    """Make the policy's log-probs NaN in optimizer step ``at_step`` (on ``rank`` only, or every rank)."""
    import torch.distributed as dist

    original = trainer.passes._policy_pass  # the gradient pass, whichever way its KL pass runs

    def patched(item):
        logps, aux = original(item)
        if trainer.global_step + 1 == at_step and (rank is None or dist.get_rank() == rank):
            logps = logps * float("nan")
        return logps, aux

    trainer.passes._policy_pass = patched


# ------------------------------------------------------------------------------------------- hand computation
def _hand_logps(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sum of log p(token) over loss-mask tokens, fp64 full vocabulary: the textbook formula."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.double()
    logp = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
    return (logp * mask[:, 1:].double()).sum(1)


def _hand_logit_means(model: torch.nn.Module, view: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's logits/ numerator and denominator per row, fp64 from transformers' full logits: the sum over the
    completion tokens of the logits' mean over the vocabulary at the position predicting each, and their count."""
    with torch.no_grad():
        logits = model(input_ids=view.input_ids, attention_mask=view.attention_mask).logits.double()
    mask = view.loss_mask[:, 1:].double()
    return (logits[:, :-1].mean(-1) * mask).sum(1), mask.sum(1)


def _hand_step(
    policy: torch.nn.Module, reference: torch.nn.Module, groups: list[list[KTOBatch]], beta, wd, wu
) -> dict:
    """Eq. 7 over one optimizer step in fp64: one z0 per group of micro-batches, means per label over all; the
    logits/ means per completion token of a label over the whole step (never a mean of per-batch means)."""
    policy, reference = copy.deepcopy(policy).double(), copy.deepcopy(reference).double()
    losses, rewards, logps, labels, z0s, raw, logit_sums, tokens = ([] for _ in range(8))
    for group in groups:
        p, r, pkl, rkl = ([] for _ in range(4))
        for b in group:
            p.append(_hand_logps(policy, b.example.input_ids, b.example.attention_mask, b.example.loss_mask))
            for into, value in zip((logit_sums, tokens), _hand_logit_means(policy, b.example), strict=True):
                into.append(value)
            r.append(
                _hand_logps(reference, b.example.input_ids, b.example.attention_mask, b.example.loss_mask)
            )
            pkl.append(_hand_logps(policy, b.kl.input_ids, b.kl.attention_mask, b.kl.loss_mask))
            rkl.append(_hand_logps(reference, b.kl.input_ids, b.kl.attention_mask, b.kl.loss_mask))
            labels.append(b.label)
        p, r, pkl, rkl = (torch.cat(x) for x in (p, r, pkl, rkl))
        raw.append(float((pkl - rkl).mean()))
        z0 = max(0.0, raw[-1])
        z0s.append(z0)
        for x, t in zip((p - r).tolist(), torch.cat(labels[-len(group) :]).tolist(), strict=True):
            z = beta * (x - z0) if t else beta * (z0 - x)
            losses.append((wd if t else wu) * (1 - 1 / (1 + math.exp(-z))))
        rewards.append(beta * (p - r))
        logps.append(p)
    y, rewards, logps = torch.cat(labels), torch.cat(rewards), torch.cat(logps)
    logit_sums, tokens = torch.cat(logit_sums), torch.cat(tokens)
    return {
        "train/logits/chosen": float(logit_sums[y].sum() / tokens[y].sum()),
        "train/logits/rejected": float(logit_sums[~y].sum() / tokens[~y].sum()),
        "train/loss": sum(losses) / len(losses),
        "train/kl": sum(z0s) / len(z0s),
        "kl_raw": raw,
        "train/rewards/chosen": float(rewards[y].mean()),
        "train/rewards/rejected": float(rewards[~y].mean()),
        "train/logps/chosen": float(logps[y].mean()),
        "train/logps/rejected": float(logps[~y].mean()),
        "train/count/chosen": float(y.sum()),
        "train/count/rejected": float((~y).sum()),
    }


# ------------------------------------------------------------------------------------------- workers
def _eval_loader(world: int, rank: int) -> ValidMaskLoader:
    """7 eval examples in micro-batches of 2: padding on every layout (1 of 8 slots on 1 rank, 1 of 8 on 2)."""
    from torch.utils.data import DataLoader

    from coati_kto.data.collator import KTOCollator

    gen = torch.Generator().manual_seed(5)
    rows = [_row(gen, i % 3 != 0) for i in range(7)]
    sampler = EvalBatchSampler(len(rows), 2, num_replicas=world, rank=rank)
    return ValidMaskLoader(DataLoader(rows, batch_sampler=sampler, collate_fn=KTOCollator(0)), sampler)


def _layout_config(model_dir: str, ref_dir: str, out_dir: str, accumulation: int, **kto: Any) -> Any:
    return _config(
        model_dir,
        out_dir,
        model={"path": model_dir, "reference_path": ref_dir},
        plugin={"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
        train={"accumulation_steps": accumulation, "micro_batch_size": MBS},
        kto={"beta": 0.5, "desirable_weight": 1.3, "undesirable_weight": 0.7, **kto},
    )


def _layout_run(model_dir: str, ref_dir: str, out_dir: str, world: int, rank: int) -> dict:
    """3 optimizer steps over the same global batches, 4 / world micro-batches per rank per step; eval at the end."""
    cfg = _layout_config(model_dir, ref_dir, out_dir, 4 // world)
    parts, trainer = _build(cfg, total_steps=3)
    start = _weights(parts.policy)
    hand = None
    if world == 1:
        hand = _hand_step(parts.policy.unwrap(), parts.reference.unwrap(), _global_steps()[:1], 0.5, 1.3, 0.7)
    trainer.fit(_rank_loader(world, rank), _eval_loader(world, rank))
    return {"start": start, "weights": _weights(parts.policy), "history": trainer.history, "hand": hand}


SGD_PLUGINS = {  # plugin sections of the SGD layout runs; ZeRO-2 accumulates without no_sync
    "ddp_fp32": {"name": "ddp", "zero_stage": 0, "precision": "fp32"},
    "hybrid_zero0_fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    "low_level_zero2_fp32": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}
TP2 = {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2}


def _sgd_run(model_dir: str, ref_dir: str, out_dir: str, plugin: dict) -> dict:
    """2 SGD steps (lr 1, no clipping) over global steps 1-2, 4 / dp micro-batches per rank per step."""
    import torch.distributed as dist

    world, tp = dist.get_world_size(), plugin.get("tp_size", 1)
    cfg = _layout_config(model_dir, ref_dir, out_dir, 4 // (world // tp))
    cfg = _config(
        model_dir,
        out_dir,
        model=cfg.model.model_dump(),
        plugin=plugin,
        train={**cfg.train.model_dump(), "lr": 1.0, "warmup_steps": 0, "max_grad_norm": 0.0},
        kto=cfg.kto.model_dump(),
    )
    with sgd():
        parts, trainer = _build(cfg, total_steps=2)
    assert isinstance(parts.optimizer.optim, torch.optim.SGD)  # the patch reached the optimizer factory
    dp, dp_rank = parts.layout.dp_size, parts.layout.dp_rank
    start = full_weights(parts.policy)
    trainer.fit([mb for step in _global_steps()[:2] for mb in step[dp_rank::dp]])
    return {"start": start, "weights": full_weights(parts.policy)}


def _one_step_variants(model_dir: str, ref_dir: str, out_dir: str) -> dict:
    """Step 1 with kl_scope=micro_batch (hand-checked), and with precomputed reference log-probs (no model)."""
    step = _global_steps()[0]
    cfg = _layout_config(model_dir, ref_dir, out_dir, 4, kl_scope="micro_batch")
    parts, trainer = _build(cfg, total_steps=1)
    hand = _hand_step(parts.policy.unwrap(), parts.reference.unwrap(), [[b] for b in step], 0.5, 1.3, 0.7)
    with torch.no_grad():
        precomputed = [
            dataclasses.replace(
                b,
                reference_logps=trainer.passes.completion_logps(parts.reference, b.example),
                reference_kl_logps=trainer.passes.completion_logps(parts.reference, b.kl),
            )
            for b in step
        ]
    trainer.fit(step)
    cfg = _layout_config(model_dir, ref_dir, out_dir, 4)
    parts, no_reference = _build(cfg, total_steps=1, peak_flops=1e9)
    no_reference.reference = None
    no_reference.fit(precomputed)
    return {"micro_batch": (trainer.history[0], hand), "precomputed": no_reference.history[0]}


def _one_process(model_dir: str, ref_dir: str, out_dir: str) -> dict:
    from coati_kto.trainer.kto import NonFiniteLossError

    results = {"layout": _layout_run(model_dir, ref_dir, str(Path(out_dir) / "layout"), 1, 0)}
    results["sgd"] = {
        name: _sgd_run(model_dir, ref_dir, out_dir, plugin) for name, plugin in SGD_PLUGINS.items()
    }
    results["variants"] = _one_step_variants(model_dir, ref_dir, out_dir)

    # on_nonfinite=stop: raises naming the step, before any update; the step-1 checkpoint stays the latest.
    cfg = _config(
        model_dir, out_dir, plugin={"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"}
    )
    ckpt = Path(out_dir) / "stop_ckpt"
    parts, trainer = _build(cfg, 3, save_dir=str(ckpt), save_interval=1, on_nonfinite="stop")
    _inject_nan(trainer, at_step=2)
    loader = [mb for step in _global_steps() for mb in step[:1]]
    weights_before = None
    try:
        trainer.fit(loader)
        results["stop_error"] = None
    except NonFiniteLossError as err:
        results["stop_error"] = str(err)
    weights_before = _weights(parts.policy)
    results["stop_checkpoints"] = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    results["stop_step"] = trainer.global_step
    # The weights after the failed step equal the checkpointed step-1 weights.
    parts2, trainer2 = _build(cfg, 3, save_dir=str(ckpt))
    trainer2.resume(trainer2.checkpoint_manager.resolve("auto"))
    results["stop_weights_equal"] = bool(np.array_equal(_weights(parts2.policy), weights_before))

    # A stop request (a signal already received): the step's checkpoint, then TrainingStoppedError naming it, and
    # the stop signals told it is complete (a second Ctrl-C from then on exits 75, not "nothing saved").
    from coati_kto.runtime.signals import StopSignals, TrainingStoppedError

    stop = StopSignals()
    stop.received = signal.SIGTERM
    parts3, trainer3 = _build(cfg, 3, save_dir=str(Path(out_dir) / "signal_ckpt"), stop_signals=stop)
    try:
        trainer3.fit(loader)
        results["signal_stop"] = None
    except TrainingStoppedError as err:
        results["signal_stop"] = {"step": err.step, "checkpoint": err.checkpoint, "saved": stop.stop_saved}

    # A signal after the last step's vote (during the end's evaluation): still the checkpoint and the stop it
    # announced (exit 75), not the end of the run; the trainer's own epoch-end evaluation ran before it.
    late = StopSignals()
    parts4, trainer4 = _build(cfg, 3, save_dir=str(Path(out_dir) / "late_ckpt"), stop_signals=late)
    evaluate = trainer4._eval

    def evaluate_then_signal(epoch: int) -> None:
        evaluate(epoch)
        late.received = signal.SIGTERM

    trainer4._eval = evaluate_then_signal
    try:
        trainer4.fit(loader)
        results["late_stop"] = None
    except TrainingStoppedError as err:
        results["late_stop"] = {
            "step": err.step,
            "checkpoint": err.checkpoint,
            "trained": trainer4.global_step,
        }

    # A checkpoint every step: the last one is written after the end's evaluation, which it then records.
    from coati_kto.runtime.run_dir import saved_trainer_state

    ends = Path(out_dir) / "end_ckpt"
    parts5, trainer5 = _build(cfg, 3, save_dir=str(ends), save_interval=1)
    trainer5.fit(loader, _eval_loader(1, 0))
    last = saved_trainer_state(ends / f"step-{trainer5.global_step}")["trainer_state"]
    results["end_eval"] = {"step": trainer5.global_step, "recorded": last["last_eval_step"]}
    return results


def _two_processes(model_dir: str, ref_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = Path(out_dir)
    results: dict[str, Any] = {"layout": _layout_run(model_dir, ref_dir, str(out / "layout"), 2, rank)}
    sgd_plugins = {**SGD_PLUGINS, "tp2": TP2}
    results["sgd"] = {
        name: _sgd_run(model_dir, ref_dir, out_dir, plugin) for name, plugin in sgd_plugins.items()
    }

    # A non-finite loss on rank 1 only: both ranks skip the same step and stay identical.
    cfg = _config(
        model_dir, str(out), plugin={"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"}
    )
    parts, trainer = _build(cfg, 3, on_nonfinite="skip")
    _inject_nan(trainer, at_step=2, rank=1)
    with contextlib.redirect_stderr(io.StringIO()) as said:
        trainer.fit([mb for step in _global_steps() for mb in step[rank : rank + 1]])
    results["skip"] = {
        "said": [line for line in said.getvalue().splitlines() if "skipped" in line],
        "skipped": trainer.skipped_steps,
        "history": trainer.history,
        "weights": _weights(parts.policy),
    }

    # Tensor parallelism: tp 2, dp 1 (both ranks see the same batches), 8 steps on one fixed batch.
    cfg = _config(
        model_dir,
        str(out),
        plugin={"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
        kto={"beta": 0.5},
    )
    parts, trainer = _build(cfg, 8)
    fixed = _global_steps()[2][3]
    trainer.fit([fixed] * 8)
    results["tp"] = {
        "dp_size": parts.layout.dp_size,
        "tp_size": parts.layout.tp_size,
        "history": trainer.history,
    }

    results["resume_full"] = _resume_run(model_dir, str(out), rank, resume_from=None)
    return results


def _resume_run(model_dir: str, out_dir: str, rank: int, resume_from: str | None) -> dict:
    """4 optimizer steps over a real MixedLabelBatchSampler (3 steps per epoch: steps 3-4 cross an epoch),
    low-level ZeRO-2 bf16 (fp32 master shards must come back exactly), checkpoint at step 2, eval every 2 steps
    on a padded 2-rank eval set."""
    from torch.utils.data import DataLoader

    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.sampler import MixedLabelBatchSampler
    from coati_kto.trainer.schedule import current_lr

    gen = torch.Generator().manual_seed(7)
    rows = [_row(gen, i % 2) for i in range(12)]
    eval_rows = [_row(gen, i % 3 == 0) for i in range(5)]
    collator = KTOCollator(pad_token_id=0)
    sampler = MixedLabelBatchSampler([r["label"] for r in rows], 2, num_replicas=2, rank=rank, seed=3)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collator)
    eval_sampler = EvalBatchSampler(len(eval_rows), 2, num_replicas=2, rank=rank)
    eval_loader = ValidMaskLoader(
        DataLoader(eval_rows, batch_sampler=eval_sampler, collate_fn=collator), eval_sampler
    )

    run_dir = Path(out_dir) / ("resumed" if resume_from else "full")
    cfg = _config(
        model_dir,
        str(run_dir),
        plugin={"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
        train={"max_steps": 4, "max_epochs": 2, "micro_batch_size": 2},
    )
    parts, trainer = _build(
        cfg,
        4,
        max_epochs=2,
        max_steps=4,
        save_interval=2,
        eval_interval=2,
        save_dir=str(run_dir / "checkpoints"),
    )
    if resume_from:
        trainer.resume(resume_from)
    trainer.fit(loader, eval_loader)
    masters = parts.optimizer.get_working_to_master_map().values()
    return {
        "weights": _weights(parts.policy),
        "masters": torch.cat([m.detach().double().flatten() for m in masters]).numpy(),
        "history": trainer.history,
        "checkpoint": str(run_dir / "checkpoints" / "step-2"),
        "lr": current_lr(trainer.optimizer, trainer.lr_scheduler),
    }


def _resume_worker(model_dir: str, out_dir: str, checkpoint: str) -> dict:
    import torch.distributed as dist

    return _resume_run(model_dir, out_dir, dist.get_rank(), resume_from=checkpoint)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def one_proc(tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("one_proc")
    return run_distributed(_one_process, 1, str(tiny_model_dir), str(reference_dir), str(out))[0]


@pytest.fixture(scope="module")
def two_procs(
    tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    out = tmp_path_factory.mktemp("two_procs")
    return run_distributed(_two_processes, 2, str(tiny_model_dir), str(reference_dir), str(out))


def _records(history: list[dict], prefix: str = "train/") -> dict[int, dict]:
    return {int(h["step"]): h for h in history if any(k.startswith(prefix) for k in h)}


# ------------------------------------------------------------------------------------------- tests
_CHECKED = (
    "train/loss",
    "train/kl",
    "train/rewards/chosen",
    "train/rewards/rejected",
    "train/logps/chosen",
    "train/logps/rejected",
    "train/count/chosen",
    "train/count/rejected",
    "train/logits/chosen",
    "train/logits/rejected",
)


def _assert_matches_hand(record: dict, hand: dict) -> None:
    for key in _CHECKED:
        assert record[key] == pytest.approx(hand[key], rel=1e-5, abs=1e-6), key
    margin = hand["train/rewards/chosen"] - hand["train/rewards/rejected"]
    assert record["train/rewards/margins"] == pytest.approx(margin, rel=1e-5, abs=1e-6)


def test_step_loss_and_rewards_match_hand_computation(one_proc: dict) -> None:
    hand = one_proc["layout"]["hand"]
    assert hand["kl_raw"][0] > 0.0  # the perturbed reference makes z0 non-trivial (and unclamped)
    records = _records(one_proc["layout"]["history"])
    _assert_matches_hand(records[1], hand)
    # TRL's fractional epoch: 4 of the epoch's 12 micro-batches per step.
    assert [records[step]["train/epoch"] for step in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_micro_batch_kl_scope_matches_hand_computation(one_proc: dict) -> None:
    record, hand = one_proc["variants"]["micro_batch"]
    assert len(set(hand["kl_raw"])) == 4  # one reference point per micro-batch
    _assert_matches_hand(record, hand)


def test_precomputed_reference_logps_need_no_reference_model(one_proc: dict) -> None:
    record = one_proc["variants"]["precomputed"]
    expected = _records(one_proc["layout"]["history"])[1]
    for key in _CHECKED:
        assert record[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key


def test_layout_invariance_one_process_x4_equals_two_processes_x2(
    one_proc: dict, two_procs: list[dict]
) -> None:
    single = one_proc["layout"]
    norm = np.linalg.norm
    assert np.array_equal(single["start"], two_procs[0]["layout"]["start"])
    for result in two_procs:
        diff = norm(result["layout"]["weights"] - single["weights"])
        assert diff / norm(single["weights"]) < 1e-5, diff
        # ... and relative to the update itself, so a run that barely moved could not pass by accident.
        update = norm(single["weights"] - single["start"])
        assert update > 0 and diff / update < 1e-3, (diff, update)
    assert np.array_equal(two_procs[0]["layout"]["weights"], two_procs[1]["layout"]["weights"])


@pytest.mark.parametrize("plugin", list(SGD_PLUGINS))
def test_layout_invariance_with_sgd(one_proc: dict, two_procs: list[dict], plugin: str) -> None:
    """1 process x accumulation 4 = 2 processes x accumulation 2 with SGD, where a gradient factor would show."""
    single = one_proc["sgd"][plugin]
    update = single["weights"] - single["start"]
    # fp32: summation order only (measured 2e-7); bf16: working weights 1 ulp apart after step 1 (measured
    # 7.6e-3), far below what a constant gradient factor gives (a factor 2: 1).
    max_error = 1e-6 if "fp32" in plugin else 5e-2
    for result in two_procs:
        multi = result["sgd"][plugin]
        assert np.array_equal(multi["start"], single["start"])
        diff = np.linalg.norm(multi["weights"] - single["weights"])
        assert diff / np.linalg.norm(update) < max_error, (plugin, diff, np.linalg.norm(update))
        if "fp32" in plugin:
            assert np.abs(multi["weights"] - single["weights"]).max() < 1e-6


def test_tensor_parallel_2_equals_tensor_parallel_1(one_proc: dict, two_procs: list[dict]) -> None:
    """hybrid_parallel zero 0 fp32, SGD, the same 2 steps: tp_size 2 (dp 1) gives tp_size 1's weights."""
    single = one_proc["sgd"]["hybrid_zero0_fp32"]
    update = np.linalg.norm(single["weights"] - single["start"])
    for result in two_procs:
        tp = result["sgd"]["tp2"]
        assert np.array_equal(tp["start"], single["start"])
        diff = tp["weights"] - single["weights"]
        assert np.abs(diff).max() < 1e-6 and np.linalg.norm(diff) / update < 1e-6, np.abs(diff).max()


def test_metrics_two_processes_equal_single_process_over_same_global_batch(
    one_proc: dict, two_procs: list[dict]
) -> None:
    single = _records(one_proc["layout"]["history"])
    assert sorted(single) == [1, 2, 3]
    for result in two_procs:  # every rank holds the same reduced values
        multi = _records(result["layout"]["history"])
        for step, expected in single.items():
            got = multi[step]
            keys = {k for k in expected if k.startswith("train/") and "per_second" not in k}
            assert keys == {k for k in got if k.startswith("train/") and "per_second" not in k}
            for key in keys:
                # Steps 2-3 start from weights that differ in the last fp32 bits (summation order): abs for margins.
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=2e-6), (step, key)
    # Evaluation with padding rows (1 slot of 8 on each layout) gives the same exact metrics.
    single_eval = [h for h in one_proc["layout"]["history"] if "eval/loss" in h]
    assert [h["step"] for h in single_eval] == [3]
    assert single_eval[0]["eval/count/chosen"] == 4 and single_eval[0]["eval/count/rejected"] == 3
    for result in two_procs:
        multi_eval = [h for h in result["layout"]["history"] if "eval/loss" in h]
        for key, value in single_eval[0].items():
            if "per_second" not in key:
                assert multi_eval[0][key] == pytest.approx(value, rel=1e-5, abs=2e-6), key
    # Rank 0 holds only desirable rows in step 1 (rank 1 only undesirable in step 2), yet the counts are global.
    assert single[1]["train/count/chosen"] == 10 and single[1]["train/count/rejected"] == 6
    assert single[2]["train/count/chosen"] == 5 and single[2]["train/count/rejected"] == 11


def test_nonfinite_stop_names_step_and_keeps_last_good_checkpoint(one_proc: dict) -> None:
    error = one_proc["stop_error"]
    assert error is not None and "optimizer step 2" in error and "step-1" in error
    assert "non-finite (NaN/inf) KTO loss at" in error, error  # the loss was NaN, and so the norm; not "norm"
    assert one_proc["stop_checkpoints"] == ["step-1"]
    assert one_proc["stop_step"] == 1
    assert one_proc["stop_weights_equal"]


def test_a_signal_stop_checkpoints_and_tells_the_stop_signals(one_proc: dict) -> None:
    stopped = one_proc["signal_stop"]
    assert stopped is not None and stopped["step"] == 1
    assert (
        stopped["checkpoint"].endswith("signal_ckpt/step-1")
        and Path(stopped["checkpoint"], "COMPLETE").is_file()
    )
    assert stopped["saved"] == stopped["checkpoint"]


def test_a_signal_after_the_last_step_still_checkpoints_and_stops(one_proc: dict) -> None:
    """A SIGTERM during the end's evaluation said "checkpoint, then exit 75" and the run went on to write final/
    and exit 0 (past a scheduler's kill-wait for a large model)."""
    late = one_proc["late_stop"]
    assert late is not None and late["step"] == late["trained"] and late["step"] > 1
    assert late["checkpoint"].endswith(f"late_ckpt/step-{late['step']}")


def test_the_last_checkpoint_records_the_ends_evaluation(one_proc: dict) -> None:
    """The last step's periodic checkpoint came before the end's evaluation: resuming a finished run (a shipped
    config's resume: auto, submitted again) evaluated that step again, and TensorBoard got it twice."""
    end = one_proc["end_eval"]
    assert end["step"] > 1 and end["recorded"] == end["step"], end


def test_nonfinite_on_one_rank_skips_the_step_on_every_rank(two_procs: list[dict]) -> None:
    for result in two_procs:
        skip = result["skip"]
        assert skip["skipped"] == 1
        records = _records(skip["history"])
        assert "train/loss" not in records[2] and "train/grad_norm" not in records[2]
        assert records[2]["train/skipped_steps"] == 1
        assert "train/loss" in records[3] and math.isfinite(records[3]["train/loss"])
        assert np.isfinite(skip["weights"]).all()
    assert np.array_equal(two_procs[0]["skip"]["weights"], two_procs[1]["skip"]["weights"])
    # One line, from rank 0 alone, though only rank 1's loss was NaN: the vote is global.
    said = [result["skip"]["said"] for result in two_procs]
    assert len(said[0]) == 1 and said[1] == [], said
    assert "KTO loss or rewards at optimizer step 2 (epoch 0): step skipped" in said[0][0], said


def test_tensor_parallel_two_ranks_learns_and_agrees(two_procs: list[dict]) -> None:
    losses = []
    for result in two_procs:
        tp = result["tp"]
        assert (tp["dp_size"], tp["tp_size"]) == (1, 2)
        losses.append([h["train/loss"] for h in tp["history"]])
    assert losses[0] == losses[1]
    assert all(math.isfinite(x) for x in losses[0])
    assert losses[0][-1] < losses[0][0] - 0.02, losses[0]


def test_resume_is_bit_exact(tiny_model_dir: Path, two_procs: list[dict], tmp_path: Path) -> None:
    full = two_procs[0]["resume_full"]
    resumed = run_distributed(_resume_worker, 2, str(tiny_model_dir), str(tmp_path), full["checkpoint"])
    for rank in range(2):
        assert np.array_equal(resumed[rank]["weights"], two_procs[rank]["resume_full"]["weights"])
        # bf16: this rank's fp32 master shard too, bit for bit (the booster alone would rebuild it from bf16).
        assert np.array_equal(resumed[rank]["masters"], two_procs[rank]["resume_full"]["masters"])
        assert resumed[rank]["lr"] == two_procs[rank]["resume_full"]["lr"]

    # The resumed run logs steps 3-4 (train), 3 (epoch-end eval) and 4 (eval) with the uninterrupted run's values.
    def timeless(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in h.items() if "per_second" not in k} for h in history if h["step"] > 2]

    assert timeless(resumed[0]["history"]) == timeless(full["history"])
    evals = [h for h in full["history"] if "eval/loss" in h]
    assert [h["step"] for h in evals] == [2, 3, 4]
    assert all(h["eval/count/chosen"] + h["eval/count/rejected"] == 5 for h in evals)
    assert all(h["eval/count/chosen"] == 2 for h in evals)


# ------------------------------------------------------------------------------------------- no processes
def test_summarize_leaves_out_means_of_absent_labels() -> None:
    sums = StepSums(torch.device("cpu"))
    labels = torch.tensor([True, True])
    sums.add(
        torch.tensor([0.2, 0.4]),
        torch.tensor([0.1, 0.3]),
        torch.tensor([-5.0, -7.0]),
        labels,
        torch.tensor([True, True]),
    )
    local, _ = sums.local()
    out = summarize(local, None)
    assert out["loss"] == pytest.approx(0.3) and out["count/rejected"] == 0
    assert "rewards/rejected" not in out and "rewards/margins" not in out and "logps/rejected" not in out
    assert all(math.isfinite(v) for v in out.values())


def test_padding_rows_count_nowhere_even_when_nan() -> None:
    sums = StepSums(torch.device("cpu"))
    nan = float("nan")
    sums.add(
        torch.tensor([0.5, nan]),
        torch.tensor([0.2, nan]),
        torch.tensor([-3.0, nan]),
        torch.tensor([True, False]),
        torch.tensor([True, False]),
    )
    local, _ = sums.local()
    assert local["nonfinite"] == 0 and local["examples"] == 1 and local["count/rejected"] == 0


@pytest.mark.parametrize(("n", "m", "world"), [(5, 2, 2), (1, 3, 2), (17, 4, 3), (8, 2, 4), (3, 8, 1)])
def test_eval_sampler_covers_every_example_once_with_equal_batches(n: int, m: int, world: int) -> None:
    samplers = [EvalBatchSampler(n, m, world, r) for r in range(world)]
    assert len({len(s) for s in samplers}) == 1
    seen = []
    for s in samplers:
        for k, batch in enumerate(s):
            assert len(batch) == m
            seen += batch[: s.num_valid(k)]
    assert sorted(seen) == list(range(n))


def test_dropout_is_off_in_train_mode_and_model_config_is_kept(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from coati_kto.models.hf import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.5).train()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    # With the config's dropout, two train-mode passes differ: the check below can fail.
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    disable_dropout(model)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert model.config.attention_dropout == 0.5  # the exported config stays the user's


def test_schedule_length_is_capped_by_the_epochs(tmp_path: Path) -> None:
    from coati_kto.config.load import load_config
    from coati_kto.recipe.components import total_optimizer_steps

    path = tmp_path / "cfg.yaml"
    path.write_text("model: {path: m}\ndata: {train_files: [d.jsonl], prepared_dir: p}\noutput: {dir: o}\n")
    # 62 micro-batches per rank, accumulation 2 -> 31 steps an epoch.
    config = load_config(path, ["train.accumulation_steps=2", "train.max_epochs=2"])
    assert total_optimizer_steps(config, 62) == 62
    assert (
        total_optimizer_steps(
            load_config(path, ["train.max_steps=40", "train.accumulation_steps=2", "train.max_epochs=2"]), 62
        )
        == 40
    )
    # A max_steps beyond what the epochs hold must not stretch the cosine schedule over steps that never run.
    more = load_config(path, ["train.max_steps=100", "train.accumulation_steps=2", "train.max_epochs=2"])
    assert total_optimizer_steps(more, 62) == 62
    assert total_optimizer_steps(load_config(path, ["train.accumulation_steps=4"]), 62) == 16
    # Resumed with the config unchanged: the fresh count, wherever the checkpoint is.
    for step, epoch, left in [(0, 0, 62), (10, 0, 42), (31, 0, 0), (31, 1, 62), (45, 1, 34), (62, 1, 0)]:
        assert total_optimizer_steps(config, 62, (step, epoch, left)) == 62
    # Resumed on another layout or micro-batch size (the rest of epoch 0 re-planned into 9 micro-batches; the
    # next epoch has 124): 10 steps done, 5 more for epoch 0, then 62 for epoch 1.
    assert total_optimizer_steps(config, 124, (10, 0, 9)) == 10 + 5 + 62
    assert total_optimizer_steps(more, 124, (10, 0, 9)) == 77
    assert total_optimizer_steps(load_config(path, ["train.max_steps=20"]), 124, (10, 0, 9)) == 19


def test_a_skipped_step_leaves_its_logging_interval_finite() -> None:
    """A NaN step inside a logging interval: the interval's means come from its finite steps only."""
    from coati_kto.trainer.metrics import SUM_KEYS, IntervalMeter

    def totals(loss: float, reward: float) -> dict[str, float]:
        out = dict.fromkeys(SUM_KEYS, 0.0)
        out.update({"examples": 2, "loss": loss, "count/chosen": 1, "count/rejected": 1, "tokens": 10})
        out.update({"rewards/chosen": reward, "rewards/rejected": -reward})
        return out

    meter = IntervalMeter()
    meter.add(totals(0.8, 0.2), {"kl": 0.1, "kl_raw": -0.1}, 1.0, 0.5)
    meter.skip(1.0)  # its totals (NaN rewards) never reach the meter
    meter.add(totals(0.4, 0.4), {"kl": 0.3, "kl_raw": 0.3}, 1.0, 1.5)
    summary = meter.summary()
    assert summary["loss"] == pytest.approx(0.3) and summary["rewards/margins"] == pytest.approx(0.6)
    assert summary["kl"] == pytest.approx(0.2) and summary["kl_raw"] == pytest.approx(0.1)
    assert summary["grad_norm"] == pytest.approx(1.0)
    assert summary["skipped_in_interval"] == 1 and summary["examples_per_second"] == pytest.approx(4 / 3)
    assert all(math.isfinite(v) for v in summary.values())
    meter.reset()
    meter.skip(1.0)
    assert meter.summary() == {"skipped_in_interval": 1.0}


def _expected_flops_per_token(model_dir: Path, step: list[dict], reference: bool) -> float:
    """Model FLOPs / tokens of one training step by hand: N x (2 kl [policy] + 6 ex [gradient pass] + 2 (ex + kl)
    [reference: two passes, kto.pack_reference being off])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    ex = sum(int(b.example.attention_mask.sum()) for b in step)
    kl = sum(int(b.kl.attention_mask.sum()) for b in step)
    flops = n * (2 * kl + 6 * ex + (2 * (ex + kl) if reference else 0))
    return flops / (ex + kl)


def test_model_flops_count_the_passes_run(one_proc: dict, tiny_model_dir: Path) -> None:
    """Online reference: 4 passes' FLOPs; precomputed: the reference's two passes are not counted; MFU logged."""
    step = _global_steps()[0]
    online = _records(one_proc["layout"]["history"])[1]
    cached = one_proc["variants"]["precomputed"]
    for record, reference in ((online, True), (cached, False)):
        ratio = record["train/model_flops_per_second"] / record["train/tokens_per_second"]
        assert ratio == pytest.approx(_expected_flops_per_token(tiny_model_dir, step, reference), rel=1e-9)
    assert "train/mfu" not in online  # no peak known on CPU unless set
    assert cached["train/mfu"] == pytest.approx(cached["train/model_flops_per_second"] / 1e9, rel=1e-12)
