"""Peak activation bytes per rank of one forward + backward of the sequence-parallel log-prob path (issue 47 item 3).

    PYTHONPATH=. python benchmarks/sp_memory_bench.py [--lengths 4096 8192 16384] [--budget-mib 2048]
    PYTHONPATH=. python benchmarks/sp_memory_bench.py --smoke

Each rank of an sp group (1, 2 or 4 real gloo processes) runs ``sp_packed_logps`` on its slice of one packed row
of L tokens (one KTO example in the pairs layout: a prompt of L - 2 L/8 tokens, its completion and the KL pair's
completion, L/8 each), with ``coati_sp|sdpa`` installed and grad_scale sp, as
tests/distributed/test_sequence_parallel.py drives it, then the backward of a loss of the example's log-prob.
The model is a wide tiny Llama in fp32 (hidden 1024, intermediate 2048, 2 layers, 4 heads of 32 over 4 key-value
heads, vocabulary 512). Its gradients exist before the step (zeros), so backward accumulates into them.

Memory: ``coati_kto.testing.memory.track_peak`` (live CPU tensor storages made by aten ops, each counted once
from creation until freed; its docstring says what it misses). "activation" = its ``peak_added_bytes``: the
peak minus the baseline (weights, gradients, the rows), per rank, the largest over the group's ranks. "mask" =
the [R, L, L]-shaped storages alive at that peak: the dense fp32 attention mask (whole-length on every rank) and
any bool temporaries of its build.

The longest row within ``--budget-mib`` per rank (activation bytes, activation checkpointing on), for sp 1, 2 and
4: the table's lengths give a quadratic fit of the peak in L (the mask grows as L^2), its longest multiple of
``--step`` within the budget is run, then stepped up or down until a run fits and the next does not.

The formula's checks (sp 1 and 2): :func:`layer_formula` against the tracker's growth when two layers are added
(fp32 at the first length; bf16 with half as many key-value heads at a quarter of it), and each peak against
the layers' formula plus the mask (the rest per token: embedding, final norm, head, the backward's working set).
docs/performance.md holds a run's tables and the 8B arithmetic from the same formula.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from coati_kto.testing.distributed import run_distributed

MIB = 1 << 20
MODEL = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=1 << 17,
)
SMOKE_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, head_dim=16)
PER_LAYER_RUNS = 3  # measurements of each depth in the per-layer check, the least taken (_per_layer)


def kto_row(length: int, layout: str = "pairs") -> Any:
    """Packed rows [1, length]: one KTO example whose KL pair shares its prompt (module docstring), in the pairs
    layout, or (``examples``) the example alone, prompt and completion to ``length``: the layout the trainer's
    passes run under sp, a plain causal row to which the sp pass gives no mask."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.packed import plan_rows

    completion = length // 8
    prompt = length - (2 if layout == "pairs" else 1) * completion
    gen = torch.Generator().manual_seed(length)
    ids = lambda n: torch.randint(3, 500, (n,), generator=gen).tolist()  # noqa: E731
    head = ids(prompt)
    feature = {
        "input_ids": head + ids(completion),
        "completion_start": prompt,
        "label": True,
        "kl_input_ids": head + ids(completion),
        "kl_completion_start": prompt,
    }
    batch = KTOCollator(0)([feature])
    rows = plan_rows(batch.example, batch.kl if layout == "pairs" else None, "bins")
    assert tuple(rows.input_ids.shape) == (1, length), rows.input_ids.shape
    return rows


def _slice(rows: Any, sp: int, rank: int) -> Any:
    from coati_kto.data.packed import slice_rows

    return slice_rows(rows, sp, rank)


def build_model(shape: dict[str, Any], checkpointing: bool, dtype: torch.dtype = torch.float32) -> Any:
    """The bench's Llama (same weights on every rank) with sp attention installed and zero gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.parallel.sequence import sp_attention_name
    from coati_kto.testing.tiny import random_causal_lm

    model = random_causal_lm(LlamaForCausalLM, LlamaConfig, seed=0, **shape).to(dtype)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers recomputes only in training mode (dropout is 0)
    model.config._attn_implementation = sp_attention_name("sdpa")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def measure(model: Any, length: int, group: Any, layout: str = "pairs") -> dict[str, Any]:
    """One forward + backward of this rank's slice of a ``length``-token row: the tracker's figures."""
    import torch.distributed as dist

    from coati_kto.models.lm_head import LMHead
    from coati_kto.models.sequence_packing import sp_packed_logps
    from coati_kto.parallel.sequence import SEQUENCE_GROUP
    from coati_kto.testing.memory import track_peak

    sp = dist.get_world_size(group)
    piece = _slice(kto_row(length, layout), sp, dist.get_rank(group))
    head = LMHead.find(model)
    start = time.perf_counter()
    with SEQUENCE_GROUP.using(group), track_peak(model) as memory:
        example, _ = sp_packed_logps(model, head, piece, 1, grad_scale=float(sp))
        (example * 1e-3).sum().backward()
    seconds = time.perf_counter() - start
    width = piece.rows.input_ids.shape[1]
    mask = sum(s.nbytes for s in memory.peak_live if s.shape[-2:] == (width, width))
    top = [(s.op, s.shape, s.nbytes) for s in memory.peak_live[:6]]
    return {"activation": memory.peak_added_bytes, "mask": mask, "s": seconds, "top": top}


def _max_over(group: Any, value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def fit_longest(points: dict[int, int], budget: int, step: int) -> int:
    """The longest multiple of ``step`` whose quadratic fit through ``points`` (length -> bytes) is within
    ``budget`` (at least ``step``)."""
    xs = sorted(points)[-3:]
    if len(xs) < 3:
        slope = points[xs[-1]] / xs[-1]
        return max(step, int(budget / slope) // step * step)
    coeffs = torch.linalg.solve(
        torch.tensor([[1.0, x, x * x] for x in xs], dtype=torch.float64),
        torch.tensor([float(points[x]) for x in xs], dtype=torch.float64),
    ).tolist()
    a, b, c = coeffs
    linear = c <= 0  # no square term left (the mask taken out): a line
    longest = (budget - a) / b if linear else (-b + math.sqrt(b * b - 4 * c * (a - budget))) / (2 * c)
    return max(step, int(longest) // step * step)


def _per_layer(
    shape: dict[str, Any], length: int, checkpointing: bool, dtype: torch.dtype, group: Any
) -> float:
    """Activation bytes two more decoder layers add, per layer and per token of this rank (the largest rank).

    Each depth's peak is the least of ``PER_LAYER_RUNS`` measurements: a collective's buffer is released on
    gloo's worker thread a moment after the main thread goes on (coati_kto.testing.memory), and once in a while,
    on a loaded machine, it is still alive at the next peak. With checkpointing a layer keeps one hidden-sized
    tensor, the size of the sp all-gather's input, so one late release read as 1.5 layers (sp 2, fp32,
    checkpointing: 1.5 twice and 1.0261 once in whole-suite runs, on pooled and on fresh ranks). A late release
    only adds, so the least is the layers' own bytes."""
    import torch.distributed as dist

    sp = dist.get_world_size(group)
    peaks = []
    for extra in (0, 2):
        deeper = build_model(
            dict(shape, num_hidden_layers=shape["num_hidden_layers"] + extra), checkpointing, dtype
        )
        runs = [_max_over(group, measure(deeper, length, group)["activation"]) for _ in range(PER_LAYER_RUNS)]
        peaks.append(min(runs))
    return (peaks[1] - peaks[0]) / 2 / (length // sp)


def layer_checks(shape: dict[str, Any], length: int, modes: list[bool], group: Any) -> dict[Any, float]:
    """The per-layer formula's checks at this world's sp: the bench's model in fp32 at ``length``, and in bf16
    with half as many key-value heads (sdpa repeats them under a dense mask) at a quarter of it."""
    out = {("per layer", "fp32", c): _per_layer(shape, length, c, torch.float32, group) for c in modes}
    grouped = dict(shape, num_key_value_heads=shape["num_attention_heads"] // 2)
    out[("per layer", "bf16 grouped kv", False)] = _per_layer(
        grouped, max(length // 4, 64), False, torch.bfloat16, group
    )
    return out


def worker(
    shape: dict[str, Any],
    lengths: list[int],
    modes: list[bool],
    budget: int,
    step: int,
    layout: str = "pairs",
) -> dict:
    """On every rank of the world (one sp group): the table's cases, then the longest row within ``budget``."""
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    out: dict[Any, Any] = {}
    for checkpointing in modes:
        model = build_model(shape, checkpointing)
        for length in lengths:
            numbers = measure(model, length, group, layout)
            numbers["activation"] = _max_over(group, numbers["activation"])
            numbers["mask"] = _max_over(group, numbers["mask"])
            out[(length, checkpointing)] = numbers
    if dist.get_world_size() <= 2 and layout == "pairs":
        out.update(layer_checks(shape, lengths[0], modes, group))
    if budget <= 0:
        return out
    model = build_model(shape, True)
    seen = {n: out[(n, True)]["activation"] for n in lengths if (n, True) in out}
    # predicted only: the fit of activation minus the dense mask (what a BlockMask or is_causal would leave)
    bare = {n: out[(n, True)]["activation"] - out[(n, True)]["mask"] for n in seen}
    out["longest without mask"] = fit_longest(bare, budget, step)
    length = fit_longest(seen, budget, step)
    for _ in range(6):  # bracket: a run that fits and the next step that does not
        for n in (length, length + step):
            if n not in seen:
                seen[n] = _max_over(group, measure(model, n, group, layout)["activation"])
        if seen[length] > budget:
            length = max(step, length - step)
        elif seen[length + step] <= budget:
            length += step
        else:
            break
    out["longest"] = (length, seen[length], seen[length + step])
    return out


def layer_formula(
    shape: dict[str, Any], checkpointing: bool, sp: int = 1, dtype_bytes: int = 4, repeat_kv: bool = False
) -> int:
    """Bytes per token per decoder layer that autograd keeps: ``coati_kto.parallel.activations.layer_bytes``
    (what ``coati-kto plan`` counts), the layer's input alone with checkpointing."""
    from types import SimpleNamespace

    from coati_kto.parallel.activations import layer_bytes

    if checkpointing:
        return dtype_bytes * shape["hidden_size"]
    model = SimpleNamespace(
        hidden=shape["hidden_size"],
        intermediate=shape["intermediate_size"],
        heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
    )
    return layer_bytes(model, 1, sp, 0, dtype_bytes, eager=False, repeat_kv=repeat_kv)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def table(results: dict[int, dict], lengths: list[int], modes: list[bool]) -> list[str]:
    """Markdown: per length and checkpointing, sp 1 and sp 2 activation bytes (and their masks), the ratio."""
    lines = [
        "| tokens/row | checkpointing | sp 1 act MiB (mask) | sp 2 act MiB (mask) | sp2/sp1 | sp2/sp1 without "
        "mask | sp 1 s | sp 2 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for checkpointing in modes:
        for n in lengths:
            one, two = results[1][(n, checkpointing)], results[2][(n, checkpointing)]
            ratio = two["activation"] / one["activation"]
            bare = (two["activation"] - two["mask"]) / (one["activation"] - one["mask"])
            lines.append(
                f"| {n} | {'yes' if checkpointing else 'no'} | {_mib(one['activation'])} ({_mib(one['mask'])}) | "
                f"{_mib(two['activation'])} ({_mib(two['mask'])}) | {ratio:.3f} | {bare:.3f} | "
                f"{one['s']:.1f} | {two['s']:.1f} |"
            )
    return lines


def layers_bytes(
    shape: dict[str, Any], tokens: int, checkpointing: bool, sp: int, dtype_bytes: int = 4
) -> int:
    """What the decoder layers keep on a rank at the backward's start: every layer's activations, or with
    checkpointing every layer's input plus one layer's activations while it is recomputed."""
    n = shape["num_hidden_layers"]
    full = layer_formula(shape, False, sp, dtype_bytes)
    if not checkpointing:
        return n * tokens * full
    return n * tokens * layer_formula(shape, True, sp, dtype_bytes) + tokens * full


def peaks_vs_formula(results: dict[int, dict], shape: dict[str, Any], lengths: list[int]) -> list[str]:
    """Markdown: each measured peak against the layers' formula plus the mask; the rest per token of the rank."""
    lines = [
        "| sp | tokens/row | checkpointing | measured MiB | layers (formula) + mask MiB | rest B/token |",
        "|---|---|---|---|---|---|",
    ]
    for sp, by_case in results.items():
        for key, numbers in by_case.items():
            if not (isinstance(key, tuple) and len(key) == 2 and key[0] in lengths):
                continue
            n, checkpointing = key
            tokens = -(-n // sp)
            formula = layers_bytes(shape, tokens, checkpointing, sp) + numbers["mask"]
            rest = (numbers["activation"] - formula) / tokens
            lines.append(
                f"| {sp} | {n} | {'yes' if checkpointing else 'no'} | {_mib(numbers['activation'])} | "
                f"{_mib(formula)} | {rest:.0f} |"
            )
    return lines


def layer_checks_table(results: dict[int, dict], shape: dict[str, Any]) -> list[str]:
    """Markdown: each per-layer check (sp 1 and 2) against :func:`layer_formula`."""
    lines = [
        "\nper token per decoder layer (two more layers, the largest rank's peak), bytes:",
        "| sp | dtype | checkpointing | measured | formula | measured/formula |",
        "|---|---|---|---|---|---|",
    ]
    grouped_shape = dict(shape, num_key_value_heads=shape["num_attention_heads"] // 2)
    for sp in [s for s in results if s <= 2]:
        for key, measured in results[sp].items():
            if not (isinstance(key, tuple) and key[0] == "per layer"):
                continue
            _, kind, checkpointing = key
            grouped = kind != "fp32"
            formula = layer_formula(
                grouped_shape if grouped else shape, checkpointing, sp, 2 if grouped else 4, repeat_kv=grouped
            )
            lines.append(
                f"| {sp} | {kind} | {'yes' if checkpointing else 'no'} | {measured:.2f} | {formula} | "
                f"{measured / formula:.4f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--budget-mib", type=int, default=2048, help="per-rank activation budget")
    parser.add_argument("--step", type=int, default=1024, help="the longest row's granularity, in tokens")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and rows of 256/512 tokens")
    parser.add_argument(
        "--layout",
        choices=["pairs", "examples"],
        default="pairs",
        help="pairs: an example and its KL pair in one row (a dense mask); examples: the example alone, as the "
        "trainer's sp passes run it (a plain causal row: no mask)",
    )
    args = parser.parse_args(argv)
    shape = MODEL
    if args.smoke:
        shape, args.lengths, args.budget_mib, args.step, args.sizes = SMOKE_MODEL, [256, 512], 3, 64, [1, 2]
    modes, budget = [False, True], args.budget_mib * MIB
    results = {}
    for sp in args.sizes:
        # sp 4 runs only what the longest-row search needs (checkpointing on)
        start = time.perf_counter()
        results[sp] = run_distributed(
            worker,
            sp,
            shape,
            args.lengths,
            modes if sp < 4 else [True],
            budget,
            args.step,
            args.layout,
            timeout_s=3600,
        )[0]
        print(f"sp {sp}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(
        f"model: Llama {shape}; fp32; sdpa (coati_sp|sdpa); {args.layout} layout; activation = peak - baseline, "
        "per rank"
    )
    print("\n".join(table(results, args.lengths, modes)))
    if budget > 0:
        print(f"\nlongest row within {args.budget_mib} MiB of activations per rank (checkpointing on):")
        print(
            "| sp | longest row (tokens) | its activation MiB | next step's MiB | predicted without the mask |"
        )
        print("|---|---|---|---|---|")
        for sp in args.sizes:
            n, fits, over = results[sp]["longest"]
            bare = results[sp]["longest without mask"]
            print(f"| {sp} | {n} | {fits / MIB:.3f} | {over / MIB:.3f} | {bare} |")
    print("\neach peak against the formula (the rest: embedding, final norm, head, backward working set):")
    print("\n".join(peaks_vs_formula(results, shape, args.lengths)))
    print("\n".join(layer_checks_table(results, shape)))
    for sp in args.sizes:
        for key, numbers in results[sp].items():
            if isinstance(key, tuple) and key[0] == args.lengths[-1] and len(key) == 2:
                print(f"sp {sp} {key}: live at the peak, largest first: {numbers['top']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
