"""Padding-free passes (data.padding_free): a micro-batch's rows as one sequence give each row's log-probs and
gradients of its own padded pass (fp32, 1e-5), for every packable family and attention kernel, and a
training run with them equals the padded run step by step."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_packing import FAMILIES, _model, _rows, _separate
from test_policy_packing import STEPS
from test_policy_packing import _rows as _prompt_rows
from test_trainer import _build, _config, _weights, sgd
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from coati_kto.data.collator import KTOCollator
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.packing import packed_logps, pair_logps
from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.flex import flex_reference

CASES = {**FAMILIES, "qwen3": (Qwen3ForCausalLM, Qwen3Config, {})}


def _layouts(model: Any, batch: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    head = LMHead.find(model)
    with torch.no_grad():
        example, _ = packed_logps(model, head, batch.example_rows, len(batch))
        _, kl = packed_logps(model, head, batch.kl_rows, len(batch))
        pair_example, pair_kl, _ = pair_logps(model, batch)
    return {"views": (example, kl), "pairs": (pair_example, pair_kl)}


@pytest.mark.parametrize("layout", ["one", "bins"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(CASES))
def test_packed_passes_equal_padded_passes_fp32(layout: str, attn: str, family: str) -> None:
    cls, config_cls, config = CASES[family]
    model = _model(cls, config_cls, attn, **config)
    batch = KTOCollator(0, padding_free=layout)(_rows(7, 6, mismatched=(3,)))
    if layout == "one":
        assert tuple(batch.pairs.input_ids.shape)[0] == 1 and bool((batch.pairs.document >= 0).all())
    else:  # documents of 3-20 tokens: some bins hold two (here 4 rows of KL pairs for 6 documents)
        assert tuple(batch.kl_rows.input_ids.shape) == (4, 14)
    ref_example, ref_kl = _separate(model, batch)
    for name, (example, kl) in _layouts(model, batch).items():
        torch.testing.assert_close(example, ref_example, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=0, msg=name)


def test_one_row_gradient_equals_padded_gradient() -> None:
    model = _model(LlamaForCausalLM, LlamaConfig, "sdpa")
    padded = copy.deepcopy(model)
    batch = KTOCollator(0, padding_free="one")(_rows(8, 5))
    weights = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.5])
    example, kl = packed_logps(model, LMHead.find(model), batch.example_rows, len(batch))
    assert example.requires_grad and kl is None
    (example * weights).sum().backward()
    view = batch.example
    reference = model_sequence_logps(
        padded, view.input_ids, view.attention_mask, view.loss_mask, LMHead.find(padded)
    )
    (reference * weights).sum().backward()
    torch.testing.assert_close(example, reference, atol=1e-5, rtol=0)
    grads = dict(padded.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)


FLEX_FAMILIES = ["llama", "qwen3", "gemma3"]  # plain; grouped-query with q/k norms; sliding and full layers


@pytest.mark.parametrize("family", FLEX_FAMILIES)
def test_flex_attention_block_mask_equals_padded_passes(family: str) -> None:
    """flex_attention as transformers runs it on CPU (compiled by inductor): the BlockMask (rows padded to its
    128-token block; Gemma 3 one per layer type, windows of 4) is the dense 4D mask's rule, every layout."""
    cls, config_cls, config = CASES[family]
    model = _model(cls, config_cls, "sdpa", **config)
    batch = KTOCollator(0, padding_free="one")(_rows(9, 6, mismatched=(1,)))
    ref_example, ref_kl = _separate(model, batch)
    model.config._attn_implementation = "flex_attention"
    for name, (example, kl) in _layouts(model, batch).items():
        torch.testing.assert_close(example, ref_example, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("family", FLEX_FAMILIES)
def test_flex_attention_gradients_equal_padded_gradients(family: str) -> None:
    """The policy's gradient passes under flex_attention's block mask (torch's reference operator: no CPU
    backward otherwise, coati_kto.testing.flex), one row of examples and the shared-prompt pairs (the folded
    pass: the example's log-probs with gradient, the KL pair's without), against the padded sdpa pass."""
    check_flex_gradients(family, "cpu", flex_reference, atol=1e-5, rtol=1e-5)


def check_flex_gradients(family: str, device: str, flex: Any, atol: float, rtol: float) -> None:
    """One row of examples and the folded shared-prompt pass under flex_attention (inside ``flex()``) against the
    padded sdpa pass of the same model on ``device``: log-probs within ``atol``, gradients within atol / rtol."""
    cls, config_cls, config = CASES[family]
    if device == "cuda":  # inductor's CUDA flex kernel needs heads of at least 16 (tl.dot); the CPU's are 8
        config = {**config, "head_dim": 16}
    model = _model(cls, config_cls, "sdpa", **config).to(device)
    padded = copy.deepcopy(model)
    model.config._attn_implementation = "flex_attention"
    batch = KTOCollator(0, padding_free="one")(_rows(8, 5)).to(device)
    weights = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.5], device=device)
    view = batch.example
    reference = model_sequence_logps(
        padded, view.input_ids, view.attention_mask, view.loss_mask, LMHead.find(padded)
    )
    (reference * weights).sum().backward()
    grads = {name: p.grad for name, p in padded.named_parameters()}
    with flex():
        rows, _ = packed_logps(model, LMHead.find(model), batch.example_rows, len(batch))
        (rows * weights).sum().backward()
        row_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        folded, kl = pair_logps(model, batch)[:2]
        (folded * weights).sum().backward()
    assert not kl.requires_grad
    for logps in (rows, folded):
        torch.testing.assert_close(logps, reference, atol=atol, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(row_grads[name], grads[name], atol=atol, rtol=rtol, msg=name)
        torch.testing.assert_close(p.grad, grads[name], atol=atol, rtol=rtol, msg=name)


# ------------------------------------------------------------------------------------------- 2 processes
def _run(
    model_dir: str,
    out_dir: str,
    padding_free: str | None,
    pack: bool,
    tp_size: int = 1,
    model: dict[str, Any] | None = None,
    precision: str = "fp32",
) -> dict[str, Any]:
    """Three steps, fp32: low_level_zero ZeRO-2 over 2 data-parallel processes, else hybrid ZeRO-0 (one process,
    or ``tp_size`` 2); online reference (the policy's own start, so step 0's rewards are 0), tool-use rows where
    the policy's folded pass pays; ``pack``: the shared-prompt reference pass and the policy's folded pass, else
    every view on its own. ``tp_size`` 2: one data-parallel rank, whose
    two tensor-parallel ranks see every batch (the packed passes then go through the model's logits)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = (rank, world) if tp_size == 1 else (0, 1)
    cfg = _config(
        model_dir,
        str(Path(out_dir) / f"free-{padding_free}-{pack}"),
        model={"path": model_dir, **(model or {})},  # the CUDA test's attention kernel and dtype
        # Not hybrid ZeRO-0 at 2 data-parallel ranks: that is torch DDP, where nothing folds (forward_collectives).
        plugin={"name": "low_level_zero", "zero_stage": 2, "precision": precision}
        if dp_size > 1
        else {"name": "hybrid_parallel", "zero_stage": 0, "precision": precision, "tp_size": tp_size},
        train={"micro_batch_size": 4},
        kto={"beta": 0.5},
    )
    collate = KTOCollator(0, padding_free=padding_free)
    batches = [
        collate(_prompt_rows(10 * s + r, labels, (14, 20), (1, 4)))
        for s, step in enumerate(STEPS)
        for r, labels in enumerate(step)
    ]
    import coati_kto.models.packing as packing
    import coati_kto.trainer.passes as passes

    rows_per_pass: list[int] = []
    original = packing.packed_logps

    def counted(model: Any, head: Any, rows: Any, batch_size: int) -> Any:
        rows_per_pass.append(int(rows.input_ids.shape[0]))
        return original(model, head, rows, batch_size)

    packing.packed_logps = passes.packed_logps = counted
    try:
        with sgd():
            parts, trainer = _build(
                cfg, total_steps=len(STEPS), dp_size=dp_size, pack_reference=pack, pack_policy=pack
            )
            trainer.fit(batches[dp_rank::dp_size], None)
    finally:
        packing.packed_logps = passes.packed_logps = original
    return {"history": trainer.history, "weights": _weights(parts.policy), "rows": rows_per_pass}


def _padded_and_flex_runs(model_dir: str, out_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_run` padded under sdpa, then padding-free in one row under flex_attention (torch's reference
    operator: coati_kto.testing.flex), both with the shared-prompt passes, in the same processes."""
    padded = _run(model_dir, out_dir, None, True)
    with flex_reference():
        return padded, _run(model_dir, out_dir, "one", True, 1, {"attn_implementation": "flex_attention"})


def test_flex_attention_run_equals_padded_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """What model.attn_implementation auto runs on a GPU (flex_attention, every pass padding-free in one row,
    the shared-prompt reference pass and the policy's folded pass on block masks), 2 processes, against the
    padded sdpa run: the same steps, step-0 rewards exactly 0 (policy and reference on the same kernel)."""
    for rank, (padded, free) in enumerate(
        run_distributed(_padded_and_flex_runs, 2, str(tiny_model_dir), str(tmp_path))
    ):
        assert free["rows"] == [1] * 6  # the reference's pairs and the policy's folded pass, per micro-batch
        steps = [h for h in padded["history"] if "train/loss" in h]
        free_steps = [h for h in free["history"] if "train/loss" in h]
        assert len(steps) == len(free_steps) == len(STEPS)
        assert free_steps[0]["train/rewards/chosen"] == 0.0 and free_steps[0]["train/rewards/rejected"] == 0.0
        keys = ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/kl")
        diffs = [abs(a[k] - b[k]) for a, b in zip(steps, free_steps, strict=True) for k in keys]
        weights = float(abs(padded["weights"] - free["weights"]).max())
        print(f"rank {rank}: flex vs padded, max |step metric| diff {max(diffs):.2e}, weights {weights:.2e}")
        assert max(diffs) <= 1e-5 and weights <= 1e-5, (diffs, weights)


@pytest.mark.parametrize("pack,layout", [(False, "one"), (True, "one"), (True, "bins")])
def test_padding_free_run_equals_padded_run(
    pack: bool, layout: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    padded, free = (
        run_distributed(_run, 2, str(tiny_model_dir), str(tmp_path), f, pack) for f in (None, layout)
    )
    for rank in range(2):
        # 3 micro-batches of 4 per rank. Padded: only the packed passes (reference pair, policy fold) run packed
        # rows, a row per example; padding-free: every pass (two per micro-batch packed, four not), in one row
        # or in bins (these rows are of similar lengths: bins hold one or two).
        assert padded[rank]["rows"] == ([4] * 6 if pack else [])
        if layout == "one":
            assert free[rank]["rows"] == [1] * (6 if pack else 12)
        else:
            assert len(free[rank]["rows"]) == 6 and all(1 <= r <= 4 for r in free[rank]["rows"])
        steps = [h for h in padded[rank]["history"] if "train/loss" in h]
        free_steps = [h for h in free[rank]["history"] if "train/loss" in h]
        assert len(steps) == len(free_steps) == len(STEPS)
        assert free_steps[0]["train/rewards/chosen"] == 0.0 and free_steps[0]["train/rewards/rejected"] == 0.0
        for a, b in zip(steps, free_steps, strict=True):
            for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/kl"):
                assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
        assert abs(padded[rank]["weights"] - free[rank]["weights"]).max() <= 1e-5


@pytest.mark.parametrize("pack,layout", [(False, "one"), (True, "bins")])
def test_tensor_parallel_padding_free_run_equals_padded_run(
    pack: bool, layout: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """tp_size 2: the vocabulary-parallel head has no chunked path; the packed rows go through the model's own
    logits (whole on every rank) and give the padded run's steps."""
    padded, free = (
        run_distributed(_run, 2, str(tiny_model_dir), str(tmp_path), f, pack, 2) for f in (None, layout)
    )
    for rank in range(2):
        # 6 micro-batches of 4, on both ranks: the same packed passes as at tp_size 1, twice as many.
        assert padded[rank]["rows"] == ([4] * 12 if pack else [])
        if layout == "one":
            assert free[rank]["rows"] == [1] * 24
        else:
            assert len(free[rank]["rows"]) == 12 and all(1 <= r <= 4 for r in free[rank]["rows"])
        steps = [h for h in padded[rank]["history"] if "train/loss" in h]
        free_steps = [h for h in free[rank]["history"] if "train/loss" in h]
        assert len(steps) == len(free_steps) == 2 * len(STEPS)  # one data-parallel rank
        assert free_steps[0]["train/rewards/chosen"] == 0.0 and free_steps[0]["train/rewards/rejected"] == 0.0
        for a, b in zip(steps, free_steps, strict=True):
            for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/kl"):
                assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
        assert abs(padded[rank]["weights"] - free[rank]["weights"]).max() <= 1e-5


def _tp2_packed(family: str, attn: str) -> dict[str, float]:
    """Max |packed at tp_size 2 - padded at tp_size 1| per layout and view, fp32 (2 processes)."""
    from helpers import CORPUS

    from coati_kto.parallel import upstream
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    upstream.apply()
    tokenizer = build_tokenizer(CORPUS, vocab_size=300, style="chatml")
    model = build_family_model(family, tokenizer, seed=1).eval()
    single = copy.deepcopy(model)
    model.config._attn_implementation = attn
    plan = ParallelPlan("hybrid_parallel", "fp32", 0, tp_size=2, model_class=type(model).__name__)
    sharded = plan.backend.build_reference(plan.backend.build_plugin(), model)
    assert LMHead.find(sharded) is None and LMHead.vocab_parallel(sharded)  # the logits path
    diffs = {}
    for layout in ("one", "bins"):
        batch = KTOCollator(0, padding_free=layout)(_rows(7, 6, mismatched=(3,)))
        ref_example, ref_kl = _separate(single, batch)
        for name, (example, kl) in _layouts(sharded, batch).items():
            diffs[f"{layout}/{name}/example"] = float((example - ref_example).abs().max())
            diffs[f"{layout}/{name}/kl"] = float((kl - ref_kl).abs().max())
    return diffs


@pytest.mark.parametrize(
    "family,attn",
    # flex_attention at tp_size 2 is left out: on CPU, inductor's flex kernel for this shape failed to compile
    # (a C++ codegen error, torch 2.13) in two runs of three; on a GPU flex compiles to Triton instead.
    [
        ("llama", "sdpa"),
        ("llama", "eager"),
        ("mistral", "sdpa"),
        ("qwen2", "sdpa"),
        ("qwen3", "sdpa"),
        ("gemma3", "sdpa"),  # sliding and full layers: one mask per layer type
    ],
)
def test_tensor_parallel_packed_passes_equal_unsharded_padded_passes(family: str, attn: str) -> None:
    """Every family admitted at tp_size 2 (Mistral and Gemma 3 with windows shorter than the rows), packed rows
    through the vocabulary-parallel model's logits, against the unsharded model's padded passes."""
    for rank, diffs in enumerate(run_distributed(_tp2_packed, 2, family, attn)):
        assert len(diffs) == 8 and max(diffs.values()) <= 1e-5, (rank, diffs)
