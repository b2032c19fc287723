"""KTO training on one GPU in one command: step time, tokens/s, MFU, memory, GPU-busy share, launches, syncs.

    PYTHONPATH=. python benchmarks/gpu_bench.py --out /tmp/gpu_bench [--trl-wheels DIR] [--json report.json]
    PYTHONPATH=. python benchmarks/gpu_bench.py --smoke          # CPU, tiny, seconds: the same table

Fixture, built offline: a byte-level BPE tokenizer (coati_kto.testing.tiny), a random ~1B Llama (hidden 2048, 16
layers, vocabulary 32000) and a Qwen3 of the same shape (grouped-query attention, q/k norms), saved in bf16; two
synthetic KTO datasets of rows up to ``--max-length`` (1024) tokens, half desirable, whose lengths spread:
``tool_use`` (prompts of 76-92% of the row, completions of 1-8%: a long system prompt, a short answer) and
``half`` (prompt and completion 35-50% each). Token counts are exact: each word's tokens are counted with the
tokenizer (the byte-level pre-tokenizer splits on spaces, so a text's tokens are the sum of its words').

Cases: model x shape x reference (``online``; ``cached``: the train's own cache step computes the reference
log-probs once, before the first step) x plugin (hybrid_parallel ZeRO-2 bf16, low_level_zero ZeRO-2 bf16),
micro-batch 8, ``model.attn_implementation`` sdpa; and the Llama hybrid ZeRO-2 cases again with ``data.padding_free``
(``.../free``: ``model.attn_implementation: auto`` on a GPU, i.e. ``flex_attention`` with every pass on a block
mask, ``--attn`` on CPU; ``--attn auto`` runs every case so); and the Llama tool-use online case with ``model.compile:
true`` (``.../compile``: each decoder layer and the LM head's chunks compiled; off by default until a GPU run shows
it wins, so the GPU check times it beside the eager case). A model the plugin does not admit (Qwen3 under
hybrid_parallel with transformers 4.51: no shardformer policy) is skipped with the config check's reason.
Each case runs ``coati_kto.train.train(config)`` twice in a fresh process (peak memory is a process figure):

- timed run, ``--warmup`` (2) + ``--steps`` (6) optimizer steps, ``train.log_interval`` 1: the trainer's own per-step
  record gives the step's wall seconds (its one metric all-reduce reads the step's sums back to the host, so
  the step ends after the GPU finished its forward and backward passes), its non-pad tokens and its model
  FLOPs counted over the passes actually run (coati_kto.trainer.throughput: 6 N per token of the policy's
  gradient pass, 2 N per token of each no-grad pass, no reference pass with the cached reference). Printed:
  medians over the steps after the warm-up; MFU = model FLOP/s / the device's dense bf16 peak (throughput's
  table); peak ``torch.cuda.max_memory_allocated``.
- profiled run, 1 + ``--profile-steps`` (2) steps under ``torch.profiler`` (CPU and CUDA activities, from the
  first forward pass with gradients on: the set-up before it holds none of the events read). Steps are
  cut at the end of each ``Optimizer.step#...`` range (torch records one per optimizer step); over the steps
  after the first: GPU busy = summed CUDA kernel time / wall time, kernel launches, host syncs
  (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize calls and blocking cudaMemcpy), device
  to host copies, and host ops (``aten::`` op events, nested ones included) per step.

On CPU (``--smoke``: a model of a few hundred K parameters, rows of 64 tokens, 2 steps per case, gloo, all cases
in one process) the GPU columns say n/a and host ops per step are still counted; the timed run is the profiled
run there (the compiled case excepted), since CPU step times prove the plumbing, not a speed.

TRL side by side (``--trl-wheels DIR``): TRL's KTOTrainer on the same model and data (llama, both shapes,
reference model / ``precompute_ref_log_probs``), bf16, micro-batch 8, in a throwaway venv built from the wheels
in DIR only (``pip install --no-index --find-links DIR``: the GPU machine reaches no registry), its steps timed
by a TrainerCallback with CUDA synchronization (benchmarks/trl_side_by_side.py's child does the run). The
docs/gpu.md says how to prepare DIR.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 32000
MICRO_BATCH = 8
# model name -> (transformers class, hidden, layers, heads, kv heads, intermediate)
MODELS: dict[str, tuple[str, int, int, int, int, int]] = {
    "llama": ("Llama", 2048, 16, 16, 16, 5632),
    "qwen3": ("Qwen3", 2048, 16, 16, 8, 5632),
}
SMOKE_MODELS: dict[str, tuple[str, int, int, int, int, int]] = {
    "llama": ("Llama", 64, 2, 4, 4, 128),
    "qwen3": ("Qwen3", 64, 2, 4, 2, 128),
}
# shape -> (prompt, completion) token ranges as fractions of max_length (uniform within each range).
SHAPES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "tool_use": ((0.76, 0.92), (0.01, 0.08)),
    "half": ((0.35, 0.50), (0.35, 0.50)),
}
PLUGINS: dict[str, dict[str, Any]] = {
    "hybrid_z2": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "lowlevel_z2": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
}
REFERENCES = ("online", "cached")
TOP_KERNELS = 12  # the kernels with the most GPU time per step, printed under the table (where time goes)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass(frozen=True)
class Case:
    """One benchmark run: which model, data shape, reference mode and plugin; ``free``: data.padding_free, with
    ``auto`` (flex_attention: its BlockMask skips what no document reaches) on a GPU and ``--attn`` on CPU;
    ``compiled``: model.compile true."""

    model: str
    shape: str
    reference: str
    plugin: str
    free: bool = False
    compiled: bool = False

    @property
    def name(self) -> str:
        suffix = ("/free" if self.free else "") + ("/compile" if self.compiled else "")
        return f"{self.model}/{self.shape}/{self.reference}/{self.plugin}{suffix}"


def all_cases() -> list[Case]:
    """Every case, most wanted first (one GPU call has a time limit): the targets' cases (llama, hybrid ZeRO-2),
    padded, padding-free, then compiled, then llama under low_level_zero, then Qwen3."""
    cases = [Case(m, s, r, p) for m in MODELS for p in PLUGINS for s in SHAPES for r in REFERENCES]
    cases += [Case("llama", s, r, "hybrid_z2", free=True) for s in SHAPES for r in REFERENCES]
    cases.append(Case("llama", "tool_use", "online", "hybrid_z2", compiled=True))
    return sorted(cases, key=lambda c: (c.model != "llama", c.plugin != "hybrid_z2", c.free, c.compiled))


# ------------------------------------------------------------------------------------------------ fixture
def _words(rng: random.Random, n: int) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(n)})


def _text(rng: random.Random, words: list[str], cost: dict[str, int], tokens: int) -> str:
    """Words drawn until their tokens reach ``tokens`` (each word's count measured with the tokenizer)."""
    out, n = [], 0
    while n < tokens:
        word = rng.choice(words)
        n += cost[word]
        out.append(word)
    return " ".join(out)


def build_fixture(work: Path, max_length: int, rows: int, models: dict[str, tuple]) -> dict[str, Any]:
    """Tokenizer, one random model per ``models`` entry (bf16 safetensors) and one JSONL file per shape."""
    import torch
    import transformers

    from coati_kto.data.files import write_jsonl
    from coati_kto.testing.tiny import build_tokenizer

    rng = random.Random(0)
    words = _words(rng, 6000)
    tokenizer = build_tokenizer(
        [" ".join(rng.sample(words, 300)) for _ in range(300)], vocab_size=4096 if max_length > 128 else 512
    )
    # " word" is what a word costs inside a text: the byte-level pre-tokenizer splits before each space.
    cost = {w: len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) for w in words}
    info: dict[str, Any] = {"shapes": {}, "models": {}}
    for shape, ((p_lo, p_hi), (c_lo, c_hi)) in SHAPES.items():
        records, prompts, completions = [], [], []
        for i in range(rows):
            p = rng.randint(max(1, int(p_lo * max_length)), int(p_hi * max_length))
            c = rng.randint(max(1, int(c_lo * max_length)), max(1, int(c_hi * max_length)))
            records.append(
                {
                    "prompt": _text(rng, words, cost, p),
                    "completion": " " + _text(rng, words, cost, c),
                    "label": i % 2 == 0,
                }
            )
            prompts.append(p)
            completions.append(c)
        write_jsonl(records, work / "data" / shape / "train.jsonl")
        info["shapes"][shape] = {
            "prompt_p50": statistics.median(prompts),
            "completion_p50": statistics.median(completions),
        }
    for name, (family, hidden, layers, heads, kv_heads, inter) in models.items():
        config_class = getattr(transformers, f"{family}Config")
        model_class = getattr(transformers, f"{family}ForCausalLM")
        extra = {"head_dim": hidden // heads} if family == "Qwen3" else {}
        config = config_class(
            vocab_size=VOCAB_SIZE if max_length > 128 else 512,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max(2048, max_length),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            torch_dtype="bfloat16",
            **extra,
        )
        torch.manual_seed(0)
        model = model_class(config)
        out = work / "models" / name
        model.to(torch.bfloat16).save_pretrained(out)
        tokenizer.save_pretrained(out)
        embedding = model.get_input_embeddings().weight.numel()
        info["models"][name] = {"params": sum(p.numel() for p in model.parameters()), "embedding": embedding}
        del model
    return info


def case_config(work: Path, case: Case, args: argparse.Namespace, steps: int, tag: str) -> dict[str, Any]:
    """The run's config as a plain dict (validated by the caller: a refused combination is a skip reason)."""
    import torch

    # /free on a GPU: model.attn_implementation auto, which is flex_attention with every pass padding-free there
    # (coati_kto.config.attention); the CPU has no FlexAttention backward.
    attn = "auto" if case.free and torch.cuda.is_available() else args.attn
    return {
        "model": {
            "path": str(work / "models" / case.model),
            "attn_implementation": attn,
            "compile": case.compiled,
        },
        "data": {
            "train_files": [str(work / "data" / case.shape / "train.jsonl")],
            # One prepared dir per (model, shape): the reference cache lives there and is reused by later runs.
            "prepared_dir": str(work / "prepared" / f"{case.model}-{case.shape}"),
            "max_length": args.max_length,
            "max_prompt_length": args.max_length - 1,
            "padding_free": case.free,
        },
        "kto": {"beta": 0.1, "reference": case.reference},
        "train": {
            "micro_batch_size": MICRO_BATCH,
            "max_epochs": 1000,
            "max_steps": steps,
            "lr": 1e-5,
            "log_interval": 1,
            "seed": 0,
        },
        "plugin": dict(PLUGINS[case.plugin]),
        "output": {"dir": str(work / "runs" / f"{case.name.replace('/', '-')}-{tag}"), "save_final": False},
        "logging": {"tensorboard": False},
    }


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``section.key=value`` pairs (value parsed as YAML) set into the case's config: the bench's seam for trying a
    knob (``kto.pack_reference=false``, ``model.attn_implementation=eager``) without touching the trainer."""
    import yaml

    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set {item!r}: expected section.key=value")
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return config


# ------------------------------------------------------------------------------------------------ one case
def _profile_figures(prof: Any, cuda: bool) -> dict[str, Any]:
    """Per-step figures of a profiled run, over the steps after the first (cut at optimizer-step ends)."""
    import torch

    events = list(prof.events())
    ends = sorted(e.time_range.end for e in events if e.name.startswith("Optimizer.step#"))
    if len(ends) < 2:
        return {"profile_error": f"{len(ends)} optimizer steps found in the profile (need 2)"}
    lo, hi, steps = ends[0], ends[-1], len(ends) - 1
    inside = [e for e in events if lo <= e.time_range.start < hi]
    cpu_ops = sum(
        1 for e in inside if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
    )
    out: dict[str, Any] = {"host_ops": cpu_ops / steps, "profiled_steps": steps}
    if not cuda:
        return out
    gpu = [e for e in inside if e.device_type == torch.autograd.DeviceType.CUDA]
    # user annotations (a module's or the optimizer's range mirrored on the GPU timeline) are not kernels
    kernels = [
        e
        for e in gpu
        if not e.name.startswith(("Memcpy", "Memset")) and not getattr(e, "is_user_annotation", False)
    ]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    syncs = sum(1 for e in inside if e.name in SYNC_CALLS)
    dtoh = sum(1 for e in gpu if e.name.startswith("Memcpy DtoH"))
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    from busy import busy_by_category

    out.update(
        busy_ms=busy_by_category(inside, lo, hi, steps, busy_us / steps / 1e3),
        top_kernels=[(name[:90], us / steps / 1e3) for name, us in top],
        gpu_busy=busy_us / (hi - lo),
        kernels=len(kernels) / steps,
        syncs=syncs / steps,
        dtoh=dtoh / steps,
    )
    return out


def _profiled(run: Any, activities: list[Any]) -> Any:
    """``run()`` (a training run) under ``torch.profiler`` from its first forward pass with gradients on; the
    stopped profiler. What comes before that pass (model load, the booster, the data, a cached reference's
    pass) ends before the first optimizer step ends, where :func:`_profile_figures` starts reading, and no op of
    the steps it reads runs inside it: the same figures, from fewer events to parse. None: no such pass."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    prof = torch.profiler.profile(activities=activities)
    started = False

    def start(module: Any, inputs: Any) -> None:
        nonlocal started
        if torch.is_grad_enabled() and not started:
            started = True
            hook.remove()
            prof.start()

    hook = register_module_forward_pre_hook(start)
    try:
        run()
    finally:
        hook.remove()
        if started:
            prof.stop()
    return prof if started else None


def _timed_figures(trainer: Any, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Step time, tokens/s, TFLOP/s, MFU, peak memory and ZeRO stage of a finished run: medians over the
    trainer's per-step records after ``--warmup``."""
    import torch

    from coati_kto.trainer.throughput import table_peak_flops

    records = [r for r in trainer.history if "train/examples_per_second" in r]
    timed = records[args.warmup :] or records
    seconds = [MICRO_BATCH / r["train/examples_per_second"] for r in timed]
    flops = [r["train/model_flops_per_second"] * s for r, s in zip(timed, seconds, strict=True)]
    tokens = [r["train/tokens_per_second"] * s for r, s in zip(timed, seconds, strict=True)]
    peak = table_peak_flops(torch.cuda.get_device_name()) if cuda else None
    tflops = statistics.median(f / s for f, s in zip(flops, seconds, strict=True)) / 1e12
    return {
        "step_s": statistics.median(seconds),
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds, strict=True)),
        "tokens_per_step": statistics.fmean(tokens),
        "tflops": tflops,
        "loss_first": records[0].get("train/loss"),
        "steps": len(records),
        "zero": trainer.plan.zero_stage,  # the stage that ran: 0 for hybrid_parallel on one GPU (running_zero_stage)
        "mfu": tflops * 1e12 / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def run_case(work: Path, case: Case, args: argparse.Namespace, fixture: dict[str, Any]) -> dict[str, Any]:
    """Timed run, profiled run, then counted run of ``case`` in this process; its figures (or the reason it was
    skipped). ``--smoke`` on CPU: the timed run is the profiled run (its steps under the profiler), since CPU
    step times are the plumbing's, not speeds; a GPU times its steps with no profiler attached. Not for a
    compiled case: the second step of a process's first compiled run counts 2.4x the host ops of a later run's
    (the smoke's: 9668 against 4044), and the profiled run is a later one."""
    import torch
    from pydantic import ValidationError

    from coati_kto.config.schema import Config
    from coati_kto.errors import ConfigError
    from coati_kto.train import train

    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {"case": case.name}
    try:
        config = Config.model_validate(
            apply_overrides(case_config(work, case, args, args.warmup + args.steps, "timed"), args.set)
        )
    except (ValidationError, ConfigError) as err:
        reason = str(err).splitlines()
        result["skipped"] = next((line.strip() for line in reversed(reason) if "plugin" in line), reason[-1])
        return result
    params = fixture["models"][case.model]["params"]
    if args.counts_only:  # the counter alone (e.g. a --baseline-rev run)
        result.update(_counted(work, case, args, params))
        return result
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.reset_peak_memory_stats()
    one_run = args.smoke and not cuda and not case.compiled
    trainers: list[Any] = []
    prof = _profiled(lambda: trainers.append(train(config)), activities) if one_run else None
    result.update(_timed_figures(trainers[0] if one_run else train(config), args, cuda))
    trainers.clear()
    gc.collect()  # the timed run's models and optimizer states go before the next run loads its own
    if cuda:
        torch.cuda.empty_cache()
    if not one_run:
        config = Config.model_validate(
            apply_overrides(case_config(work, case, args, 1 + args.profile_steps, "profiled"), args.set)
        )
        prof = _profiled(lambda: train(config), activities)
    result.update(
        _profile_figures(prof, cuda) if prof else {"profile_error": "no forward pass with gradients"}
    )
    gc.collect()
    result.update(_counted(work, case, args, params))
    return result


def _counted(work: Path, case: Case, args: argparse.Namespace, params: int) -> dict[str, Any]:
    """Kernels, bytes per parameter and host syncs per optimizer step (coati_kto.testing.kernels), from a
    third run of 1 + ``--profile-steps`` steps under the counter (benchmarks/counts.py)."""
    from counts import counted_run

    from coati_kto.config.schema import Config
    from coati_kto.train import train

    config = Config.model_validate(
        apply_overrides(case_config(work, case, args, 1 + max(1, args.profile_steps), "counted"), args.set)
    )
    try:
        return counted_run(lambda: train(config), params)
    except Exception as err:  # noqa: BLE001 - a run the counter cannot follow is a row that says so
        return {"count_error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def run_cases_here(work: Path, names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of ``names`` in this process, one after the other; each result is also printed as JSON."""
    from coati_kto.runtime.startup import hold_collection, release_collection

    hold_collection()  # the collector off through what every case imports, as `coati-kto` has it (startup.py)
    import coati_kto.train  # noqa: F401 - ColossalAI, transformers' models

    release_collection()
    fixture = json.loads((work / "fixture.json").read_text())
    by_name = {c.name: c for c in all_cases()}
    results = []
    for name in names:
        # What is alive between cases (imported modules, compiled code: half a million objects) is never garbage:
        # frozen, the collections each case triggers (gc.collect here, ColossalAI's plugin teardown) skip it.
        gc.collect()
        gc.freeze()
        try:
            result = run_case(work, by_name[name], args, fixture)
        except Exception as err:  # noqa: BLE001 - one failing case is a row of the table, not the end
            import traceback

            traceback.print_exc()
            result = {"case": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        print("RESULT " + json.dumps(result), flush=True)
        results.append(result)
    return results


# ------------------------------------------------------------------------------------------------ ceiling
def model_ceiling(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The bare model's forward + backward on [8, max_length] (bf16 weights, sdpa, no KTO, no plugin): what the
    GPU gives this model and shape at best, with no mask (causal kernel) and with a padding mask (4D path)."""
    import torch
    import transformers

    if not torch.cuda.is_available():
        return []
    model = transformers.AutoModelForCausalLM.from_pretrained(
        work / "models" / "llama",
        dtype=torch.bfloat16,
        attn_implementation="sdpa" if args.attn == "auto" else args.attn,
    ).cuda()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH, args.max_length), device="cuda")
    rows = []
    for label, mask in (("no mask", None), ("padding mask", torch.ones_like(ids))):
        if mask is not None:
            mask[0, -17:] = 0
        for grad in (True, False):
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.set_grad_enabled(grad):
                    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=64)
                    if grad:
                        out.logits.float().sum().backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            step = statistics.median(times[2:])
            flops = (6 if grad else 2) * params * ids.numel()
            rows.append(
                {
                    "case": f"bare llama {'fwd+bwd' if grad else 'fwd'} {label}",
                    "step_s": step,
                    "tflops": flops / step / 1e12,
                }
            )
    del model
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ TRL
def trl_rows(work: Path, args: argparse.Namespace, started: float) -> list[dict[str, Any]]:
    """TRL's KTOTrainer on the llama fixture (both shapes, both reference modes) in a venv built from wheels."""
    import trl_side_by_side

    if args.skip_trl:
        return [{"case": "TRL", "skipped": "--skip-trl"}]

    venv = Path(args.trl_venv).resolve() if args.trl_venv else work / "trl-venv"
    wheels = Path(args.trl_wheels).resolve() if args.trl_wheels else None
    if wheels is None and not (venv / trl_side_by_side.SPEC_FILE).exists():
        return [{"case": "TRL", "skipped": "no --trl-wheels DIR given and no TRL venv at " + str(venv)}]
    if wheels is not None:
        try:
            spec = trl_side_by_side.trl_spec_from_wheels(wheels)
            trl_side_by_side.ensure_trl_venv(venv, spec, find_links=wheels)
        except SystemExit as err:  # pip's own words: which wheel the directory lacks
            return [{"case": "TRL", "error": " ".join(str(err).split())[-300:]}]
    rows = []
    # The TRL counterparts of the selected llama cases (all four when none is selected).
    pairs = {tuple(n.split("/")[1:3]) for n in args.selected if n.startswith("llama/")}
    for shape in SHAPES:
        for reference, precompute in (("online", False), ("cached", True)):
            if pairs and (shape, reference) not in pairs:
                continue
            name = f"TRL llama/{shape}/{reference}"
            if args.time_limit - (time.perf_counter() - started) < 60:
                rows.append({"case": name, "skipped": f"--time-limit {args.time_limit:.0f} s spent"})
                continue
            options = {
                "model": str(work / "models" / "llama"),
                "data": str(work / "data" / shape / "train.jsonl"),
                "out": str(work / "runs" / f"trl-{shape}-{reference}"),
                "micro_batch": MICRO_BATCH,
                "max_length": args.max_length,
                "max_prompt_length": args.max_length - 1,
                "bf16": not args.smoke,
                "use_cpu": args.smoke,
                "steps": args.warmup + args.steps,
            }
            try:
                r = trl_side_by_side.run_trl(venv, work, precompute, options)
            except SystemExit as err:  # run_trl exits with the child's output tail
                rows.append({"case": name, "error": str(err)[-300:]})
                continue
            timed = r["step_seconds"][args.warmup :] or r["step_seconds"]
            rows.append(
                {
                    "case": name,
                    "step_s": statistics.median(timed),
                    "peak_gib": r.get("peak_cuda_gib"),
                    "versions": r["versions"],
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------ table
def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


COLUMNS = (
    ("case", 34, None, "case"),
    ("zero", 4, "d", "ZeRO"),
    ("step_s", 8, ".4f", "step_s"),
    ("tokens_per_s", 10, ".0f", "tok/s"),
    ("tflops", 8, ".3g", "TFLOP/s"),
    ("mfu", 6, ".1%", "MFU"),
    ("peak_gib", 8, ".2f", "peakGiB"),
    ("gpu_busy", 8, ".1%", "GPUbusy"),
    ("kernels", 9, ".0f", "kernels"),
    ("count_kernels", 9, ".0f", "predicted"),  # coati_kto.testing.kernels, beside the CUDA profile's
    ("syncs", 7, ".1f", "syncs"),
    ("count_syncs", 9, ".1f", "predicted"),
    ("dtoh", 6, ".1f", "DtoH"),
    ("host_ops", 9, ".0f", "host_ops"),
)


def table(results: list[dict[str, Any]]) -> str:
    """One line per case; per step figures; ``n/a`` where the device has none (CPU) or the case lacks it."""
    lines = ["  ".join(f"{title:<{width}}" for _, width, _, title in COLUMNS)]
    for r in results:
        if "skipped" in r or "error" in r:
            what = "skipped" if "skipped" in r else "FAILED"
            lines.append(f"{r['case']:<34}  {what}: {r.get('skipped') or r.get('error')}")
            continue
        cells = [f"{r['case']:<34}"]
        for key, width, spec, _ in COLUMNS[1:]:
            cells.append(f"{_fmt(r.get(key), spec):<{width}}")
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def speedups(results: list[dict[str, Any]], trl: list[dict[str, Any]]) -> list[str]:
    """Per-step speed-up of coati-kto (hybrid ZeRO-2, llama) over TRL on the same shape and reference mode."""
    ours = {r["case"]: r for r in results if "step_s" in r}
    lines = []
    for t in trl:
        if "step_s" not in t:
            continue
        shape, reference = t["case"].split("/")[1:]
        for suffix, what in (("", ""), ("/free", ", padding-free"), ("/compile", ", compiled")):
            mine = ours.get(f"llama/{shape}/{reference}/hybrid_z2{suffix}")
            if mine:
                lines.append(
                    f"llama/{shape}/{reference}: TRL step / coati-kto step (hybrid ZeRO-2{what}) = "
                    f"{t['step_s'] / mine['step_s']:.2f}x (target >= 1.5 on a GPU)"
                )
    return lines


# ------------------------------------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny models, rows of 64 tokens, 2 steps per case"
    )
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names (that case alone) or substrings (default: all)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps after warm-up (default 6; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; smoke 1)")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default 2; smoke 1)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per row at most (1024; smoke 64)")
    p.add_argument("--attn", default="sdpa", choices=["eager", "sdpa", "flash_attention_2", "auto"])
    p.add_argument("--trl-wheels", default=None, help="wheels for TRL's throwaway venv (see docs/gpu.md)")
    p.add_argument("--trl-venv", default=None, help="TRL venv to build or reuse (default: OUT/trl-venv)")
    p.add_argument("--ceiling", action="store_true", help="also time the bare model's passes (GPU only)")
    p.add_argument("--trl-only", action="store_true", help="only TRL's rows for the selected llama cases")
    p.add_argument("--skip-trl", action="store_true", help="no TRL rows (e.g. a second call for other cases)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=540,
        help="seconds for the whole bench: cases that would start later are listed as not run (default 540: "
        "one device call is limited to 600 s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set a config knob in every case (repeatable), e.g. --set kto.pack_reference=false",
    )
    p.add_argument(
        "--counts-only", action="store_true", help="only the counted run (kernels, bytes, syncs) per case"
    )
    p.add_argument(
        "--baseline-rev",
        default=None,
        help="also count on this git revision (a temporary worktree), printed as the before column",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--run-cases", default=None, help=argparse.SUPPRESS)  # internal: a case process
    args = p.parse_args(argv)
    small = args.smoke
    # One device call is limited to 10 minutes: few steps per case, so that the target cases and TRL fit.
    args.steps = args.steps if args.steps is not None else (1 if small else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 2)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (1 if small else 2)
    args.max_length = args.max_length or (64 if small else 1024)
    return args


def _selected(spec: str | None) -> list[str]:
    """The cases ``--cases`` names: an entry that is a case's whole name selects that case alone, any other entry
    every case whose name contains it."""
    names = [c.name for c in all_cases()]
    if not spec:
        return names
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    exact, parts = {w for w in wanted if w in names}, [w for w in wanted if w not in names]
    return [n for n in names if n in exact or any(w in n for w in parts)]


def _case_process(work: Path, name: str, args: argparse.Namespace, started: float) -> dict[str, Any]:
    """Run ``name`` in a fresh process (unless ``--time-limit`` is spent); its result, printed as JSON too."""
    left = args.time_limit - (time.perf_counter() - started)
    if left < 30:
        result = {
            "case": name,
            "skipped": f"--time-limit {args.time_limit:.0f} s spent (run it with --cases)",
        }
        print("RESULT " + json.dumps(result), flush=True)
        return result
    cmd = [sys.executable, __file__, "--run-cases", name, "--out", str(work), "--attn", args.attn]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--profile-steps", str(args.profile_steps), "--max-length", str(args.max_length)]
    cmd += [f"--set={item}" for item in args.set] + (["--counts-only"] if args.counts_only else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]]),
    }  # children import what we import
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=left, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1].removeprefix("RESULT "))
        else:
            tail = proc.stderr.strip().splitlines()
            result = {"case": name, "error": tail[-1][:300] if tail else f"exit status {proc.returncode}"}
    except subprocess.TimeoutExpired:
        result = {"case": name, "error": f"stopped at --time-limit {args.time_limit:.0f} s"}
    result["case_wall_s"] = time.perf_counter() - t0  # both runs: loads, booster set-up, compile, profile
    print("RESULT " + json.dumps(result), flush=True)
    shutil.rmtree(work / "runs", ignore_errors=True)  # the final checkpoints of a 1B model fill the disk
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.run_cases:  # a case process: the fixture exists
        run_cases_here(args.out, args.run_cases.split(","), args)
        return 0

    from coati_kto.runtime.startup import hold_collection, release_collection

    hold_collection()  # through the imports (coati_kto.runtime.startup)
    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()
    import torch
    import transformers  # noqa: F401 - the fixture's

    release_collection()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: running the smoke sizes instead (--smoke)", flush=True)
        return main([*(argv if argv is not None else sys.argv[1:]), "--smoke"])
    work = args.out or Path(__import__("tempfile").mkdtemp(prefix="coati_gpu_bench_"))
    shutil.rmtree(work / "runs", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    args.out = work
    started = time.perf_counter()
    names = args.selected = _selected(args.cases)
    rows = MICRO_BATCH * (args.warmup + args.steps + 1 + args.profile_steps) + 16
    built_for = {"max_length": args.max_length, "rows": rows, "smoke": args.smoke}
    saved = work / "fixture.json"
    fixture = json.loads(saved.read_text()) if saved.exists() else {}
    if fixture.get("built_for") != built_for:  # a second call with the same --out reuses models and data
        fixture = build_fixture(work, args.max_length, rows, SMOKE_MODELS if args.smoke else MODELS)
        fixture["built_for"] = built_for
        saved.write_text(json.dumps(fixture))
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(
        f"device {device}; torch {torch.__version__}; models "
        + ", ".join(f"{k} {v['params'] / 1e6:.2f}M" for k, v in fixture["models"].items())
        + f"; rows <= {args.max_length} tokens, micro-batch {MICRO_BATCH}; "
        + "; ".join(
            f"{k}: prompt p50 {v['prompt_p50']:.0f}, completion p50 {v['completion_p50']:.0f}"
            for k, v in fixture["shapes"].items()
        )
        + f"; setup {time.perf_counter() - started:.1f} s",
        flush=True,
    )

    results: list[dict[str, Any]] = []
    trl: list[dict[str, Any]] = []
    first = [n for n in names if n.startswith("llama/") and n.endswith("/hybrid_z2")]
    if args.smoke:  # all cases in this process: imports once, seconds per case
        results = run_cases_here(work, names, args)
        trl = trl_rows(work, args, started)
    else:  # a fresh process per case: peak memory and the CUDA caching allocator are that case's own
        if args.trl_only:
            names = first = []
        for name in first:
            results.append(_case_process(work, name, args, started))
        trl = trl_rows(work, args, started)  # right after the cases it is compared with
        for name in names:
            if name not in first:
                results.append(_case_process(work, name, args, started))

    if args.ceiling:
        for row in model_ceiling(work, args):
            print(f"{row['case']:<34}  {row['step_s']:.4f} s  {row['tflops']:.0f} TFLOP/s", flush=True)
    for r in results:
        for name, ms in r.get("top_kernels", []):
            print(f"  {r['case']}: {ms:8.2f} ms/step  {name}")
        if r.get("busy_ms"):  # the GPU's kernel time per category (benchmarks/busy.py), beside the counter's
            shares = ", ".join(f"{c} {ms:.1f}" for c, ms in r["busy_ms"].items())
            print(f"  {r['case']}: GPU busy ms/step by category: {shares}")
    print("\n" + table(results + trl), flush=True)
    from counts import baseline_results, count_table

    before = None
    if args.baseline_rev:
        argv_base = [__file__, "--run-cases", ",".join(names), "--counts-only", "--out", str(work)]
        argv_base += ["--attn", args.attn, "--max-length", str(args.max_length)]
        argv_base += ["--profile-steps", str(args.profile_steps), *[f"--set={item}" for item in args.set]]
        shutil.rmtree(work / "runs", ignore_errors=True)  # the same run directories, on the other revision
        before = {r["case"]: r for r in baseline_results(args.baseline_rev, argv_base)}
        for r in before.values():
            if "error" in r or "count_error" in r:
                print(
                    f"before ({args.baseline_rev}) {r['case']}: {r.get('error') or r['count_error']}",
                    flush=True,
                )
    print("\n" + count_table(results, before), flush=True)
    for line in speedups(results, trl):
        print(line)
    print(
        "per optimizer step; step_s, tok/s (non-pad), TFLOP/s, MFU: medians over the timed steps; kernels, syncs, "
        "DtoH, host_ops: from the profiled run; predicted: the kernel counter's (a third run, "
        "coati_kto.testing.kernels; its per-category table below); n/a: no such figure on this device",
        flush=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": device, "fixture": fixture, "cases": results, "trl": trl, "before": before},
                indent=2,
            )
        )
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0 if all("error" not in r for r in results + trl + list((before or {}).values())) else 1


if __name__ == "__main__":
    sys.exit(main())
