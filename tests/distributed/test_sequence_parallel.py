"""Sequence parallelism's building blocks (coati_kto.parallel.sequence), on 2 real gloo processes: the all_to_all
and the sum as autograd ops (fp64, against autograd on the whole tensor in one process), and the attention wrapper
in a tiny Llama (fp32: each rank fed its half of packed rows equals one process fed the whole rows).

One launch per group of checks (the suite's time budget): ``_ops_worker`` and ``_attention_worker`` run every
case and return numbers; the tests read them from a module-scoped fixture.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coati_kto.testing.distributed import run_distributed

SP = 2
# (kernel, activation checkpointing)
ATTENTION_CASES = (("eager", False), ("sdpa", False), ("sdpa", True))
# (kernel, chunked head: else the model's logits)
LOGPS_CASES = (("sdpa", True), ("sdpa", False), ("eager", True))
LOGPS_BATCH = 3  # KTO rows in _packed_rows
# The classes SEQUENCE_PARALLEL_FAMILIES admits besides Llama (which the cases above and the training runs prove):
# sliding windows (Mistral; Gemma 3 per layer type), per-head q/k norms (Qwen3, Gemma 3), no-rope layers (SmolLM3),
# the logits path of a scaled head (Gemma 3). Phi-3, Olmo 3 and Gemma 4 take no packed rows (no chunked head or no
# set of 4D masks for their layers), so data.padding_free, which sp needs, refuses them first.
SP_FAMILIES = {
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}


def _slice(length: int, rank: int) -> slice:
    step = length // SP
    return slice(rank * step, (rank + 1) * step)


def _round_trips(group: Any, rank: int) -> dict[str, bool]:
    """all_to_all_single through the module's exchange: [B, H, S/sp, D] -> [B, H/sp, S, D] must hold exactly the
    whole tensor's rank-th head slice, and the inverse exchange must give back the input, bit for bit."""
    from coati_kto.parallel.sequence import _all_to_all

    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        whole = (torch.randn(2, 4, 6, 3, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
        local = whole[:, :, _slice(6, rank)]  # not contiguous: the op must not rely on it
        there = _all_to_all(local, group, scatter_dim=1, gather_dim=2)
        back = _all_to_all(there, group, scatter_dim=2, gather_dim=1)
        out[str(dtype)] = torch.equal(there, whole[:, _slice(4, rank)]) and torch.equal(back, local)
    return out


def _mixing(q: torch.Tensor, w: torch.Tensor, c: torch.Tensor, exchange: Any, total: Any) -> tuple[Any, ...]:
    """q [B, H, S, D] -> per-row sums [B] through an op that mixes along the sequence per head (a softmax over S,
    as attention does), then a loss nonlinear in the summed rows. ``exchange``/``total``: identity in the
    reference, the sp ops on a rank (q and w then hold the rank's slice)."""
    heads = exchange(q, 1, 2)  # [B, H/sp, S, D]
    mixed = torch.softmax(heads, dim=2) * heads.tanh()
    back = exchange(mixed.transpose(1, 2), 1, 2)  # [B, S/sp, H, D]
    rows = total((back * w).sum((1, 2, 3)))
    return back, rows, (rows.square() * c).sum()


def _ops_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from coati_kto.parallel.sequence import sp_all_to_all, sp_sum

    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # a group of its own: the ops must use the one given, not the default
    out: dict[str, Any] = {"round_trip": _round_trips(group, rank)}
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 6, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(2, 6, 4, 3, generator=gen, dtype=torch.float64)
    c = torch.randn(2, generator=gen, dtype=torch.float64)
    whole = q.clone().requires_grad_()
    ref_back, ref_rows, ref_loss = _mixing(whole, w, c, lambda t, s, g: t, lambda t: t)
    ref_loss.backward()
    own = _slice(6, rank)
    for scale in (1.0, 2.0):
        local = q[:, :, own].clone().requires_grad_()
        back, rows, loss = _mixing(
            local,
            w[:, own],
            c,
            lambda t, s, g: sp_all_to_all(t, group, scatter_dim=s, gather_dim=g),
            lambda t, scale=scale: sp_sum(t, group, grad_scale=scale),
        )
        loss.backward()
        out[scale] = {
            "output": (back - ref_back[:, own]).abs().max().item(),
            "rows": (rows - ref_rows).abs().max().item(),
            "loss": (loss - ref_loss).abs().item(),
            "grad": (local.grad - scale * whole.grad[:, :, own]).abs().max().item(),
            "grad_size": whole.grad[:, :, own].abs().max().item(),
        }
    return out


def _packed_rows(pad: bool = True, longer: int = 0) -> Any:
    """Packed pairs-layout rows (bins) of three KTO rows, two of them sharing their prompt with the KL pair:
    [R=2, 26], row 1 holding two documents (columns 0-11 and 12-22) and padding. Widened from 25 columns to a
    multiple of sp with the project's padding columns (the pad path runs); ``pad`` False: the 25 columns. ``longer``: completions that many tokens longer ([3, 31]
    unpadded at 6)."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.packed import pad_columns, plan_rows

    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 200, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [ids(5), ids(3), ids(7)]
    features = [
        {
            "input_ids": prompt + ids(4 + i + longer),
            "completion_start": len(prompt),
            "label": bool(i % 2),
            "kl_input_ids": (prompt if i < 2 else ids(2)) + ids(10 if i == 2 else 3),
            "kl_completion_start": len(prompt) if i < 2 else 2,
        }
        for i, prompt in enumerate(prompts)
    ]
    batch = KTOCollator(0)(features)
    rows = plan_rows(batch.example, batch.kl, "bins")
    assert rows.input_ids.shape[1] % SP == 1  # the pad path
    return pad_columns(rows, SP) if pad else rows


def _tiny_llama(**config: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.testing.tiny import random_causal_lm

    # 4 query heads over 2 key-value heads by default: grouped-query attention split over sp.
    return random_causal_lm(LlamaForCausalLM, LlamaConfig, seed=0, **config).float()


def _hidden_and_grads(model: Any, inputs: dict, weight: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Last hidden states of ``model.model`` and the parameters' gradients of sum(hidden * weight)."""
    model.zero_grad()
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    (hidden * weight).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _one_case(model: Any, rows: Any, mask: torch.Tensor, group: Any, kernel: str) -> dict[str, Any]:
    """sp=1 (this process, whole rows) against sp=2 (each rank its columns), hidden states and gradients."""
    import torch.distributed as dist

    from coati_kto.parallel.sequence import SEQUENCE_GROUP, sp_attention_name

    rank, length = dist.get_rank(), rows.input_ids.shape[1]
    weight = torch.randn(*rows.input_ids.shape, 32, generator=torch.Generator().manual_seed(4))
    model.config._attn_implementation = kernel
    whole = {"input_ids": rows.input_ids, "position_ids": rows.position_ids, "attention_mask": mask}
    ref_hidden, ref_grads = _hidden_and_grads(model, whole, weight)
    own = _slice(length, rank)
    local = {
        "input_ids": rows.input_ids[:, own],
        "position_ids": rows.position_ids[:, own],
        "attention_mask": mask,
    }
    model.config._attn_implementation = sp_attention_name(kernel)
    exchanges = []
    single = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: exchanges.append(1) or single(*a, **k)  # count the exchanges
    try:
        with SEQUENCE_GROUP.using(group):
            hidden, grads = _hidden_and_grads(model, local, weight[:, own])
    finally:
        dist.all_to_all_single = single
        model.config._attn_implementation = kernel
    parts = [torch.empty_like(hidden) for _ in range(SP)]
    dist.all_gather(parts, hidden, group=group)
    for grad in grads.values():
        dist.all_reduce(grad, group=group)  # each rank's gradient covers its own tokens: the sum is sp=1's
    return {
        "hidden": (torch.cat(parts, dim=1) - ref_hidden).abs().max().item(),
        "hidden_size": ref_hidden.abs().max().item(),
        "grad": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "grad_size": max(g.abs().max().item() for g in ref_grads.values()),
        # per parameter, its largest difference over its largest gradient entry
        "grad_relative": max(
            ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items()
        ),
        "params": sorted(grads) == sorted(ref_grads),
        "exchanges": len(exchanges),
    }


def _refusal(model: Any, inputs: dict, group: Any, kernel: str = "sdpa") -> str:
    """The ValueError's message of an sp forward (every rank raises it, before any exchange)."""
    from coati_kto.parallel.sequence import SEQUENCE_GROUP, sp_attention_name

    model.config._attn_implementation = sp_attention_name(kernel)
    try:
        with SEQUENCE_GROUP.using(group), torch.no_grad():
            model.model(**inputs, use_cache=False)
    except ValueError as err:
        return str(err)
    return "no error"


def _attention_worker() -> dict[str, Any]:
    import torch.distributed as dist

    from coati_kto.models.packing import _additive_mask

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    rows = _packed_rows()
    mask = _additive_mask(rows, None, torch.float32)
    out: dict[str, Any] = {"shape": tuple(rows.input_ids.shape)}
    for kernel, checkpointing in ATTENTION_CASES:
        model = _tiny_llama()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # transformers recomputes only in training mode (dropout is 0)
        out[(kernel, checkpointing)] = _one_case(model, rows, mask, group, kernel)
    own = _slice(rows.input_ids.shape[1], rank)
    local = {"input_ids": rows.input_ids[:, own], "position_ids": rows.position_ids[:, own]}
    out["one kv head"] = _refusal(
        _tiny_llama(num_key_value_heads=1), {**local, "attention_mask": mask}, group
    )
    # eager would attend to everything without a mask (sdpa takes None: its own causal attention, tested below)
    out["no mask"] = _refusal(_tiny_llama(), {**local, "attention_mask": None}, group, "eager")
    out.update(_logps_checks(group, rank))  # plan step 5, in this launch (the suite's time budget)
    return out


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| / |ref| over the entries (per-row log-prob sums: none is near 0)."""
    return ((got - ref).abs() / ref.abs()).max().item()


def _scored(model: Any, score: Any, weights: torch.Tensor) -> tuple[Any, ...]:
    """(example sums, KL sums, the recorder's logit-mean sums and token counts, parameter gradients) of one
    pass, its loss ``sum(w * e + w^2 * e^2 / 100)`` of the example sums ``e`` (nonlinear: each row's weight on
    the gradient depends on its sum)."""
    from coati_kto.models.logit_means import LogitMeans, recording

    model.zero_grad()
    recorder = LogitMeans()
    with recording(recorder):
        example, kl = score()
    (weights * example + (weights * example).square() / 100).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return example.detach(), kl, recorder.sums, recorder.tokens, grads


def _one_logps_case(
    rows: Any, group: Any, rank: int, kernel: str, use_head: bool, model: Any = None, sp: int = SP
) -> dict[str, Any]:
    """packed_logps on the whole rows (one process, sp=1) against sp_packed_logps on this rank's slice, of
    ``model`` (default: the tiny Llama)."""
    import torch.distributed as dist

    from coati_kto.data.packed import slice_rows
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.packing import packed_logps
    from coati_kto.models.sequence_packing import sp_packed_logps
    from coati_kto.parallel.sequence import SEQUENCE_GROUP, sp_attention_name

    model = _tiny_llama() if model is None else model
    head = LMHead.find(model) if use_head else None
    weights = torch.randn(LOGPS_BATCH, generator=torch.Generator().manual_seed(5))
    model.config._attn_implementation = kernel
    ref = _scored(model, lambda: packed_logps(model, head, rows, LOGPS_BATCH), weights)
    piece = slice_rows(rows, sp, rank)
    model.config._attn_implementation = sp_attention_name(kernel)  # as the policy would install it
    with SEQUENCE_GROUP.using(group):
        # grad_scale 1: every rank's loss is the one sp=1 loss, so the rank gradients summed are sp=1's
        # (grad_scale sp, as a run passes it, only multiplies that by the sp the dp x sp average divides by).
        got = _scored(
            model, lambda: sp_packed_logps(model, head, piece, LOGPS_BATCH, grad_scale=1.0), weights
        )
    for grad in got[4].values():
        dist.all_reduce(grad, group=group)
    return {
        "example": _relative(got[0], ref[0]),
        "kl": _relative(got[1], ref[1])
        if ref[1] is not None
        else 0.0,  # the examples' layout has no KL pairs
        "means": _relative(got[2], ref[2]),
        "tokens": torch.equal(got[3], ref[3]),
        "grad_relative": max(((got[4][n] - g).abs().max() / g.abs().max()).item() for n, g in ref[4].items()),
        "grad_size": max(g.abs().max().item() for g in ref[4].values()),
        "params": sorted(got[4]) == sorted(ref[4]),
        "sizes": tuple(r.abs().min().item() for r in ref[:2] if r is not None),
    }


def _causal_rows_case(group: Any, rank: int) -> dict[str, Any]:
    """The examples' layout in bins of one document each (what the trainer's passes run under sp): sp 2 builds no
    mask (sdpa's own causal attention on the whole rows) and equals sp 1's packed_logps with its 4D mask."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.packed import plan_rows
    from coati_kto.models import packing

    pairs = _packed_rows(pad=False, longer=6)
    gen = torch.Generator().manual_seed(7)
    features = [
        {
            "input_ids": torch.randint(3, 200, (n,), generator=gen).tolist(),
            "completion_start": 4,
            "label": bool(i % 2),
            "kl_input_ids": [5, 6, 7],
            "kl_completion_start": 1,
        }
        for i, n in enumerate((15, 14, 19))
    ]
    example = KTOCollator(0)(features).example
    rows = plan_rows(example, None, "bins")
    built = []
    original = packing._additive_mask
    packing._additive_mask = lambda *a: built.append(1) or original(*a)  # count the masks the sp pass builds
    try:
        out = _one_logps_case(rows, group, rank, "sdpa", True)
    finally:
        packing._additive_mask = original
    # sp=1's reference pass builds one (packed_logps always does); the sp pass none
    return {
        **out,
        "causal_rows": rows.causal_rows,
        "rows": tuple(rows.input_ids.shape),
        "masks": len(built),
        "pairs causal": pairs.causal_rows,
    }


def _logps_checks(group: Any, rank: int) -> dict[str, Any]:
    """Plan step 5: the local head and the per-row reduction on pairs rows [3, 31] (longer completions; padded to
    32 by slice_rows), where rows' documents and scored tokens straddle the split at column 16; and the refusal
    of a model without the wrapper."""
    from coati_kto.data.packed import slice_rows
    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.sequence_packing import sp_packed_logps
    from coati_kto.parallel.sequence import SEQUENCE_GROUP

    rows = _packed_rows(pad=False, longer=6)
    out: dict[str, Any] = {}
    for kernel, use_head in LOGPS_CASES:
        out[("logps", kernel, use_head)] = _one_logps_case(rows, group, rank, kernel, use_head)
    out["causal rows"] = _causal_rows_case(group, rank)
    piece = slice_rows(rows, SP, rank)
    width = piece.stop - piece.start
    out["whole targets"] = (len(rows.example.cols), len(rows.kl.cols))
    # the KTO rows whose scored tokens lie on both ranks (their row sums are the group's sum), per view
    out["straddling"] = [
        sorted(set(t.owner[t.cols < width].tolist()) & set(t.owner[t.cols >= width].tolist()))
        for t in (rows.example, rows.kl)
    ]
    out["local targets"] = (len(piece.example.cols), len(piece.kl.cols), piece.start, piece.stop)
    model = _tiny_llama()
    model.config._attn_implementation = "sdpa"
    try:
        with SEQUENCE_GROUP.using(group), torch.no_grad():
            sp_packed_logps(model, LMHead.find(model), piece, LOGPS_BATCH, grad_scale=1.0)
        out["unwrapped"] = "no error"
    except ValueError as err:
        out["unwrapped"] = str(err)
    return out


def _families_worker() -> dict[str, Any]:
    """:func:`_one_logps_case`'s comparison for each of :data:`SP_FAMILIES`' tiny models (sdpa, their own head:
    the chunked one where the family's logits are ``lm_head(hidden)``, else the model's logits)."""
    import torch.distributed as dist
    from helpers import CORPUS

    from coati_kto.models.lm_head import LMHead
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    tokenizer = build_tokenizer(CORPUS[:20], vocab_size=280)
    group, rank = dist.new_group([0, 1]), dist.get_rank()
    rows = _packed_rows(pad=False, longer=6)
    out = {}
    for family in SP_FAMILIES:
        model = build_family_model(family, tokenizer).float()
        model.config._attn_implementation = "sdpa"
        head = LMHead.find(model)
        out[family] = {
            **_one_logps_case(rows, group, rank, "sdpa", head is not None, model),
            "head": head is not None,
        }
    return out


@pytest.fixture(scope="module")
def families() -> list[dict[str, Any]]:
    return run_distributed(_families_worker, SP)


@pytest.mark.parametrize("family", list(SP_FAMILIES))
def test_sp_packed_logps_equal_one_process_per_family(families, family) -> None:
    """Each admitted family's tiny model: sp 2 per-row example and KL log-prob sums, logit means and parameter
    gradients equal one process's within 1e-5, as for Llama (test_sp_packed_logps_equal_one_process)."""
    from coati_kto.families.shardformer import SEQUENCE_PARALLEL_FAMILIES

    for result in families:
        numbers = result[family]
        assert min(numbers["sizes"]) > 1.0 and numbers["grad_size"] > 1e-3, numbers
        assert numbers["example"] < 1e-5 and numbers["kl"] < 1e-5, numbers
        assert numbers["means"] < 1e-5 and numbers["tokens"], numbers
        assert numbers["grad_relative"] < 1e-5, numbers
        assert numbers["params"]
    assert 2 in SEQUENCE_PARALLEL_FAMILIES[SP_FAMILIES[family]]


def _sp4_worker() -> dict[str, Any]:
    """sp 4 (4 processes): the tiny Llama with 4 key-value heads (one per rank) on pairs rows [3, 31], padded to
    32 (8 columns a rank: most documents span several ranks)."""
    import torch.distributed as dist

    rows = _packed_rows(pad=False, longer=6)
    model = _tiny_llama(num_key_value_heads=4)
    return _one_logps_case(rows, dist.new_group(list(range(4))), dist.get_rank(), "sdpa", True, model, sp=4)


def test_sp4_packed_logps_equal_one_process() -> None:
    """Llama's sp_size 4 entry in SEQUENCE_PARALLEL_FAMILIES: the same bounds as sp 2, on 4 ranks."""
    for numbers in run_distributed(_sp4_worker, 4):
        assert min(numbers["sizes"]) > 1.0 and numbers["grad_size"] > 1.0
        assert numbers["example"] < 1e-5 and numbers["kl"] < 1e-5, numbers
        assert numbers["means"] < 1e-5 and numbers["tokens"], numbers
        assert numbers["grad_relative"] < 1e-5, numbers
        assert numbers["params"]


@pytest.fixture(scope="module")
def ops() -> list[dict[str, Any]]:
    return run_distributed(_ops_worker, SP)


@pytest.fixture(scope="module")
def attention() -> list[dict[str, Any]]:
    return run_distributed(_attention_worker, SP)


def test_all_to_all_single_round_trip_is_exact_on_gloo(ops) -> None:
    """What the ops rely on: gloo's all_to_all_single with equal splits moves every dtype the model uses, bit
    for bit (the probe's other collectives: docs/sequence_parallelism_plan.md §5 step 1)."""
    for result in ops:
        assert result["round_trip"] == {
            "torch.float32": True,
            "torch.bfloat16": True,
            "torch.float64": True,
            "torch.int64": True,
        }


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_sp_ops_match_one_process_autograd_fp64(ops, scale) -> None:
    """sp_all_to_all there and back around a sequence-mixing op, then sp_sum: forward values equal the whole
    tensor's, and each rank's input gradient is its slice of the one-process gradient times ``grad_scale``."""
    for result in ops:
        numbers = result[scale]
        assert numbers["output"] <= 1e-15  # the exchange moves values; the op on them is the same (0.0 here)
        assert numbers["rows"] < 1e-12 and numbers["loss"] < 1e-12  # the sum's order differs
        assert numbers["grad_size"] > 0.1  # a gradient worth comparing
        assert numbers["grad"] < 1e-12


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}{'-checkpointing' if c[1] else ''}")
def test_sp_attention_equals_one_process_tiny_llama(attention, case) -> None:
    """Packed rows, each rank fed its half of the columns with the whole row's 4D mask: the gathered last hidden
    states equal one process's on the whole rows (fp32, 1e-6), and the parameters' gradients of a fixed linear
    function of them, summed over the ranks, equal one process's (1e-5 of each parameter's largest entry). With
    the received chunks joined in the wrong order (sequence interleaved) the hidden states differ by 3.5."""
    kernel, checkpointing = case
    for result in attention:
        numbers = result[case]
        assert result["shape"] == (2, 26)
        assert numbers["hidden_size"] > 1.0 and numbers["grad_size"] > 1.0
        assert numbers["hidden"] < 1e-6  # 0.0 here: the exchange moves values, the kernels see sp=1's q/k/v
        # Each rank's gradient covers its own tokens, summed in another order: fp32 rounding of the largest
        # entries (the embedding's and norms' ~265: 3.4e-5 absolute, 3.3e-7 of the parameter's largest entry).
        assert numbers["grad_relative"] < 1e-5
        assert numbers["params"]  # every parameter got a gradient in both
        # q, k, v and the output per layer (2 layers), forward and backward; recompute replays the forward's.
        assert numbers["exchanges"] == 8 * (3 if checkpointing else 2)


def test_sp_attention_refuses_heads_sp_does_not_divide_and_a_missing_mask(attention) -> None:
    for result in attention:
        assert result["one kv head"] == (
            "LlamaAttention: all_to_all sequence parallelism splits the attention heads over sp_size=2 ranks: "
            "num_attention_heads (4) and num_key_value_heads (1) per tensor-parallel rank must both be multiples "
            "of it"
        )
        assert result["no mask"] == (
            "sequence-parallel attention needs the whole row's 4D mask [B, 1, 26, 26] (the caller builds it: a 2D "
            "mask or none would be rebuilt at the slice's length), got NoneType"
        )


@pytest.mark.parametrize("case", LOGPS_CASES, ids=lambda c: f"{c[0]}-{'head' if c[1] else 'logits'}")
def test_sp_packed_logps_equal_one_process(attention, case) -> None:
    """Plan step 5: each rank runs its half of pairs rows [3, 31] (padded to 32; documents and two rows' scored
    tokens straddle the split), scores the targets its columns predict through the local head (or its local logits) and sums per
    row over the group: the example and KL log-prob sums and the logit means equal one process's packed_logps
    on the whole rows within 1e-5 relative (fp32; the summation order differs), and the parameters' gradients
    of a nonlinear loss of the example sums, at grad_scale 1 summed over the ranks, equal sp=1's within 1e-5 of
    each parameter's largest entry. grad_scale 1 is checked because it states the exact identity (the rank
    gradients add up to the one loss's); a run passes sp, which the dp x sp gradient average divides back."""
    kernel, use_head = case
    for result in attention:
        numbers = result[("logps", kernel, use_head)]
        assert min(numbers["sizes"]) > 1.0 and numbers["grad_size"] > 1.0  # numbers worth comparing
        assert numbers["example"] < 1e-5 and numbers["kl"] < 1e-5
        assert numbers["means"] < 1e-5 and numbers["tokens"]  # the recorder's sums, also over the group
        assert numbers["grad_relative"] < 1e-5
        assert numbers["params"]


def test_sp_pass_over_plain_causal_rows_builds_no_mask_and_equals_one_process(attention) -> None:
    """Bins of one document each (the example and kl layouts the trainer runs under sp) are plain causal rows:
    the sp pass gives sdpa no mask, so no [R, 1, L, L] tensor exists on any rank, and its example log-probs and
    gradients still equal one process's masked packed pass (1e-5). The pairs layout is never plain causal."""
    for result in attention:
        numbers = result["causal rows"]
        assert numbers["causal_rows"] and not numbers["pairs causal"] and numbers["rows"] == (3, 19)
        assert numbers["masks"] == 1  # sp=1's reference pass only
        assert numbers["example"] < 1e-5 and numbers["grad_relative"] < 1e-5 and numbers["params"]
        assert min(numbers["sizes"]) > 1.0


def test_slice_rows_splits_targets_on_the_host_and_sp_packed_logps_refuses_without_the_wrapper(
    attention,
) -> None:
    """Example 2's completion and KL pair 0's have scored tokens on both sides of column 16 (so their row sums
    need the group's sum); every target lands on exactly one rank. Without the coati_sp| attention the slice would attend only to itself: refused."""
    local = [result["local targets"] for result in attention]
    assert [r[2:] for r in local] == [(0, 16), (16, 32)]
    whole = attention[0]["whole targets"]
    assert (local[0][0] + local[1][0], local[0][1] + local[1][1]) == whole and min(whole) > 0
    for result in attention:
        assert result["straddling"] == [[2], [0]]  # example 2's completion, KL pair 0's
        assert result["unwrapped"] == (
            "sp_packed_logps needs the sequence-parallel attention installed (config._attn_implementation "
            "'coati_sp|<kernel>', coati_kto.parallel.sequence.sp_attention_name), got 'sdpa'"
        )
