"""Training step time, one epoch end to end and peak memory: reference online vs cached, plus shared-prompt savings.

    PYTHONPATH=. python benchmarks/step_bench.py [--examples 512] [--baseline DIR] [--skip-100m]

Fixture (docs/performance.md, "Work per step"): a random Llama of 7.4M parameters (hidden 256, 4 layers, vocabulary 8192),
prompt + completion about 100 + 100 tokens, 3:1 labels, micro-batch 8, fp32, HybridParallelPlugin ZeRO-0,
1 process. Each run is a whole ``coati-kto train`` process (imports, data loading, checkpoint at the end
included; the cyclic collector off through its imports, as ``coati-kto`` has it: coati_kto.runtime.startup); the
parent imports nothing heavy, so each child's peak RSS is its own.

- step time: median over the logged steps after the first 3, in CPU seconds of the step (one thread per
  process, so other processes on a shared machine stretch the wall time, not this) and in wall seconds;
- one epoch end to end: the whole process, CPU seconds and wall; the ``cached`` run starts with the reference
  cache deleted, so it precomputes (same process) and then trains: precompute included;
- online with ``data.padding_free`` (every pass one row, no padding; sdpa takes a dense mask on CPU);
- ``--baseline DIR``: the same online run with another checkout's coati_kto (e.g. the code before this
  change: four passes per step, logits-based log-probs) for comparison;
- tool-use shape (applications/chatml_tool_use: a ~620-token system prompt, short completions): step times
  over a few steps (online; cached with and without the policy's folded KL pass, ``kto.pack_policy``; online
  with both models packed) and the reference tokens the shared-prompt pass saves (``--skip-fixture``: only
  this);
- ~100M parameters (hidden 768, 12 layers): peak RSS of online vs cached training (the cache built by a separate
  ``coati-kto precompute`` process first), against the size of the reference weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import flops  # this directory is on sys.path: the script's own

ROOT = Path(__file__).resolve().parents[1]
WORDS = 3000


# --------------------------------------------------------------------------------------- child processes
def _child_setup(work: Path, examples: int, shape: str, hidden: int, layers: int) -> dict:
    """Tokenizer, random Llama and JSONL data for ``shape`` under ``work``; the model's parameter count."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.data.files import write_jsonl
    from coati_kto.runtime.startup import release_collection
    from coati_kto.testing.tiny import build_tokenizer

    release_collection()  # the imports are done (main held the collector)
    rng = random.Random(0)
    if shape == "tool_use":
        sys.path.insert(0, str(ROOT / "applications" / "chatml_tool_use"))
        from make_data import make_records

        records = make_records(seed=0)[:examples]
        corpus = [m["content"] for r in records for m in r["messages"]] + [
            "system",
            "user",
            "assistant",
            "tool",
        ]
        tokenizer = build_tokenizer(corpus, vocab_size=1024)
    else:
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(WORDS)]
        tokenizer = build_tokenizer([" ".join(rng.sample(words, 200)) for _ in range(400)], vocab_size=8192)

        def text(n: int) -> str:
            return " ".join(rng.choice(words) for _ in range(n))

        # ~100 + ~100 tokens with this tokenizer (checked in the printed prepare summary).
        records = [
            {
                "prompt": text(rng.randint(85, 115)),
                "completion": text(rng.randint(85, 115)),
                "label": i % 4 != 3,
            }
            for i in range(examples)
        ]
    write_jsonl(records, work / "train.jsonl")
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 64),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return {"params": sum(p.numel() for p in model.parameters())}


def _child_run(config_path: str, overrides: list[str], command: str) -> None:
    """``coati-kto train|precompute`` in this process; prints timings, throughput and peak RSS as JSON."""
    import resource

    start = time.perf_counter()
    from coati_kto.config.load import load_config

    config = load_config(config_path, overrides)
    out: dict = {}
    if command == "precompute":
        from coati_kto.recipe.precompute import precompute
        from coati_kto.runtime.startup import release_collection

        release_collection()  # as `coati-kto precompute` does after its imports
        precompute(config)
    else:
        from coati_kto.train import train
        from coati_kto.trainer.kto import KTOTrainer

        # CPU seconds per step beside the wall time: on a shared machine other processes stretch the wall
        # time of whichever run they overlap, not its CPU time (one thread per process, see main()).
        cpu: list[float] = []
        step = KTOTrainer._train_step
        peak_after_steps = [0.0]
        count_at, calls = flops.flop_step(), [0]

        def timed_step(self, *a, **k):
            calls[0] += 1
            if calls[0] == count_at:  # counted, not timed: the counting mode slows the step
                with flops.counter() as mode:
                    step(self, *a, **k)
                out["flops"] = flops.counted(mode)
                return
            t = time.process_time()
            step(self, *a, **k)
            cpu.append(time.process_time() - t)
            # Peak RSS up to the end of this step: training memory, before the final checkpoint's transient
            # copies (the whole-process peak includes them and varies by a few hundred MiB run to run).
            peak_after_steps[0] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        KTOTrainer._train_step = timed_step
        trainer = train(config)
        out["step_cpu_seconds"] = cpu
        out["peak_rss_steps_mib"] = peak_after_steps[0]
        records = [h for h in trainer.history if "train/examples_per_second" in h]
        if "flops" in out and len(records) >= count_at:
            del records[count_at - 1]
        out["step_seconds"] = [8.0 / h["train/examples_per_second"] for h in records]
        out["tokens_per_second"] = [h["train/tokens_per_second"] for h in records]
        out["flops_per_second"] = [h.get("train/model_flops_per_second", float("nan")) for h in records]
        out["loss"] = [h.get("train/loss", float("nan")) for h in records]
    out["seconds"] = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_seconds"] = (
        usage.ru_utime + usage.ru_stime
    )  # the whole process: imports, precompute, steps, save
    out["peak_rss_mib"] = usage.ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def _child_count(config_path: str, params: int, overrides: list[str]) -> None:
    """``coati-kto train`` for 3 steps under the kernel counter (benchmarks/counts.py); prints the per-step
    figures as JSON."""
    from counts import counted_run

    from coati_kto.config.load import load_config
    from coati_kto.train import train

    config = load_config(config_path, ["train.max_steps=3", *overrides])
    print(
        "RESULT "
        + json.dumps({"case": " ".join(overrides) or "online", **counted_run(lambda: train(config), params)})
    )


def _counts(args: argparse.Namespace, base: Path) -> None:
    """Kernels, bytes per parameter and host syncs per optimizer step on the fixture, per path (this tree, and
    ``--baseline-rev`` in a temporary worktree as the before column)."""
    from counts import baseline_results, count_table

    work = base / "counts"
    work.mkdir(parents=True)
    hidden, layers = ("64", "2") if args.smoke else ("256", "4")
    info, _ = _run(["--child", "setup", str(work), "64", "fixture", hidden, layers])
    config = _config(work, "fixture", 256, 128, 8, max_epochs=1)
    paths = [[], ["kto.reference=cached"], ["kto.pack_reference=true"], ["data.padding_free=true"]]
    results, argvs = [], []
    for overrides in paths:
        argv = ["--child", "count", str(config), str(info["params"]), *overrides]
        shutil.rmtree(work / "out-fixture", ignore_errors=True)
        results.append(_run(argv)[0])
        argvs.append(argv)
    before = None
    if args.baseline_rev:
        before = {}
        for argv in argvs:
            shutil.rmtree(work / "out-fixture", ignore_errors=True)
            for r in baseline_results(args.baseline_rev, [__file__, *argv]):
                before[r["case"]] = r
    print(
        f"fixture counts ({info['params'] / 1e6:.2f}M parameters, micro-batch 8, fp32, hybrid ZeRO-0, 1 process)"
    )
    print(count_table(results, before))


def _child_savings(config_path: str) -> dict:
    """Reference tokens with two passes vs one shared-prompt pass, over the prepared train split."""
    import numpy as np

    from coati_kto.config.load import load_config
    from coati_kto.data.prepared import load_prepared
    from coati_kto.data.settings import PrepareSettings
    from coati_kto.data.weights import WeightSettings
    from coati_kto.parallel.distributed import init_distributed

    config = load_config(config_path, [])
    init_distributed()
    settings = PrepareSettings(config.data, config.model, config.train.seed)
    ds = load_prepared(settings, WeightSettings(config.kto, config.train.micro_batch_size)).train
    starts, kl_starts = np.asarray(ds["completion_start"]), np.asarray(ds["kl_completion_start"])
    lengths, kl_lengths = np.asarray(ds["length"]), np.asarray(ds["kl_length"])
    shared = np.array(
        [
            s if s == k and list(a[:s]) == list(b[:s]) else 0
            for a, b, s, k in zip(ds["input_ids"], ds["kl_input_ids"], starts, kl_starts, strict=True)
        ]
    )
    two = int(lengths.sum() + kl_lengths.sum())
    return {
        "two_passes": two,
        "one_pass": two - int(shared.sum()),
        "prompt_p50": float(np.median(starts)),
        "completion_p50": float(np.median(lengths - starts)),
        "packable": float((shared > 0).mean()),
    }


# --------------------------------------------------------------------------------------------- parent
def _run(args: list[str], pythonpath: Path = ROOT) -> tuple[dict, float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(pythonpath),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=str(pythonpath)
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"child {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("RESULT ", "{"))]
    return json.loads(lines[-1].removeprefix("RESULT ")), wall


def _config(work: Path, name: str, max_length: int, max_prompt: int, mbs: int, **train: object) -> Path:
    import yaml  # light: no torch

    path = work / f"{name}.yaml"
    raw = {
        "model": {"path": str(work / "model")},
        "data": {
            "train_files": [str(work / "train.jsonl")],
            "prepared_dir": str(work / "prepared"),
            "max_length": max_length,
            "max_prompt_length": max_prompt,
        },
        "train": {"micro_batch_size": mbs, "lr": 1e-5, "log_interval": 1, **train},
        "plugin": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
        "output": {"dir": str(work / f"out-{name}"), "save_final": False},
        "logging": {"tensorboard": False},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def _median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[3:] if len(values) > 4 else values)


def _train(
    config: Path, mode: str, pythonpath: Path = ROOT, fresh_cache: bool = False, extra: tuple[str, ...] = ()
) -> tuple[dict, float]:
    if fresh_cache:
        shutil.rmtree(config.parent / "prepared" / "reference_cache", ignore_errors=True)
    overrides = [f"kto.reference={mode}", *extra] if pythonpath == ROOT else []
    shutil.rmtree(config.parent / f"out-{config.stem}", ignore_errors=True)
    return _run(["--child", "run", str(config), "train", *overrides], pythonpath)


def _step_table(title: str, runs: dict[str, tuple[dict, float]]) -> None:
    print(f"\n{title}")
    print(
        f"{'run':<30}{'step CPU s':>11}{'step wall s':>12}{'tokens/s':>10}{'GFLOP/s':>9}{'process CPU s':>14}"
        f"{'wall s':>8}{'peak RSS MiB':>14}"
    )
    for name, (r, wall) in runs.items():
        cpu = _median_after_warmup(r["step_cpu_seconds"])
        step = _median_after_warmup(r["step_seconds"])
        tps = _median_after_warmup(r["tokens_per_second"])
        fps = _median_after_warmup(r["flops_per_second"]) / 1e9
        print(
            f"{name:<30}{cpu:>11.3f}{step:>12.3f}{tps:>10.0f}{fps:>9.2f}{r['cpu_seconds']:>14.1f}{wall:>8.1f}"
            f"{r['peak_rss_mib']:>14.0f}"
        )


def _ratios(runs: dict[str, tuple[dict, float]], cached: str, online: str, label: str) -> None:
    """Step and whole-process ratios, CPU time first (robust to other processes on a shared machine)."""
    c, o = runs[cached][0], runs[online][0]
    step_cpu = _median_after_warmup(c["step_cpu_seconds"]) / _median_after_warmup(o["step_cpu_seconds"])
    step_wall = _median_after_warmup(c["step_seconds"]) / _median_after_warmup(o["step_seconds"])
    print(f"step time {cached} / {label}: CPU {step_cpu:.3f}, wall {step_wall:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/coati_step_bench")
    p.add_argument("--examples", type=int, default=512, help="fixture examples (one epoch)")
    p.add_argument("--tool-examples", type=int, default=128)
    p.add_argument("--tool-steps", type=int, default=8)
    p.add_argument("--baseline", default=None, help="another checkout whose online run to compare with")
    p.add_argument(
        "--counts", action="store_true", help="only kernels, bytes/param and syncs per step, per path"
    )
    p.add_argument(
        "--baseline-rev", default=None, help="with --counts: the before column from this git revision"
    )
    p.add_argument("--skip-100m", action="store_true")
    p.add_argument("--compile", action="store_true", help="also the fixture's online run with model.compile")
    p.add_argument(
        "--compile-only", action="store_true", help="only the fixture's online run, eager vs compiled"
    )
    p.add_argument("--skip-fixture", action="store_true", help="only the tool-use shape (and the ~100M run)")
    p.add_argument("--skip-tool-use", action="store_true", help="no tool-use shape runs")
    p.add_argument("--repeats", type=int, default=2, help="~100M runs per mode")
    p.add_argument("--only-100m", action="store_true", help="just the ~100M peak-memory comparison")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the fixture's table only (online and cached), on a hidden-64 2-layer Llama and 32 examples (4 "
        "steps): tests/e2e",
    )
    args, rest = p.parse_known_args()
    if args.smoke and not args.child:
        args.examples, args.skip_fixture, args.skip_100m = 32, False, True
    if args.compile_only:
        args.compile, args.skip_tool_use, args.skip_100m = True, True, True
    if args.child:
        kind, *params = args.child + rest
        # As the `coati-kto` entry point: the collector off through the imports; train() (or the child, after its
        # imports) releases it. A --baseline checkout from before coati_kto.runtime.startup has neither.
        with contextlib.suppress(ImportError):
            from coati_kto.runtime.startup import hold_collection

            if kind in ("setup", "run", "count"):
                hold_collection()
        if kind == "setup":  # WORK EXAMPLES SHAPE HIDDEN LAYERS [CONFIG]
            info = _child_setup(Path(params[0]), int(params[1]), params[2], int(params[3]), int(params[4]))
            if (
                len(params) > 5
            ):  # the shared-prompt savings on CONFIG's data too: one child's imports, not two
                info.update(_child_savings(params[5]))
            return print("RESULT " + json.dumps(info))
        if kind == "run":
            return _child_run(params[0], params[2:], params[1])
        if kind == "count":
            return _child_count(params[0], int(params[1]), params[2:])
        if kind == "gemm":  # one thread (the parent's _run sets OMP_NUM_THREADS=1)
            return print(json.dumps({"rate": flops.gemm_rate(int(params[0]), json.loads(params[1]))}))
        raise SystemExit(f"unknown child {kind}")

    base = Path(args.work)
    shutil.rmtree(base, ignore_errors=True)
    print(f"work dir {base}; {os.cpu_count()} CPUs (shared: other processes may load them)")

    if args.counts:
        return _counts(args, base)
    if not args.only_100m:
        if not args.skip_fixture:
            _fixture(args, base)
        if not (args.smoke or args.skip_tool_use):  # the fixture's training path on other data: not in smoke
            _tool_use(args, base)
    if not args.skip_100m:
        _memory_100m(base, args.repeats)


def _fixture(args: argparse.Namespace, base: Path) -> None:
    # ---- fixture: 7.4M Llama, ~100 + ~100 tokens, micro-batch 8, fp32, one epoch
    work = base / "fixture"
    work.mkdir(parents=True)
    hidden, layers = ("64", "2") if args.smoke else ("256", "4")
    config = _config(work, "fixture", 256, 128, 8, max_epochs=1)
    savings, _ = _run(
        ["--child", "setup", str(work), str(args.examples), "fixture", hidden, layers, str(config)]
    )
    print(
        f"fixture: {savings['params'] / 1e6:.2f}M parameters, {args.examples} examples (3:1), prompt p50 "
        f"{savings['prompt_p50']:.0f} tokens, completion p50 {savings['completion_p50']:.0f}"
    )
    runs: dict[str, tuple[dict, float]] = {}
    if args.baseline:
        runs["online, baseline checkout"] = _train(config, "online", Path(args.baseline))
    runs["online"] = _train(config, "online")
    if args.compile:  # model.compile: each decoder layer compiled (inductor), policy and reference
        runs["online, model.compile"] = _train(config, "online", extra=("model.compile=true",))
    if not (args.compile_only or args.smoke):  # smoke: test_gpu_bench_smoke's /free cases train padding-free
        runs["online, padding-free"] = _train(config, "online", extra=("data.padding_free=true",))
    if not args.compile_only:
        # The cache is deleted first: this process precomputes, then trains (its steps: cached-reference steps).
        runs["cached"] = _train(config, "cached", fresh_cache=True)
    _step_table(
        f"fixture, one epoch per run ({args.examples // 8} steps); cached includes its precompute", runs
    )
    if args.compile:  # the step after the first 3 (compiled then); the epoch's CPU seconds hold the compiling
        _ratios(runs, "online, model.compile", "online", "online (eager)")
        (c, c_wall), (o, o_wall) = runs["online, model.compile"], runs["online"]
        print(
            f"model.compile: first step CPU {c['step_cpu_seconds'][0]:.1f} s (eager {o['step_cpu_seconds'][0]:.1f} "
            f"s); the epoch's process CPU {c['cpu_seconds'] - o['cpu_seconds']:+.1f} s, wall {c_wall - o_wall:+.1f} s"
        )
    if args.compile_only:
        return
    _ratios(runs, "cached", "online", "online (target <= 0.65)")
    if "online, padding-free" in runs:
        _ratios(runs, "online, padding-free", "online", "online (padded)")
    if args.baseline:
        _ratios(runs, "cached", "online, baseline checkout", "baseline online")
        _ratios(runs, "online", "online, baseline checkout", "baseline online")
    c, o = runs["cached"], runs["online"]
    print(
        f"one epoch end to end, cached with precompute / online (target <= 1): process CPU "
        f"{c[0]['cpu_seconds'] / o[0]['cpu_seconds']:.3f}, wall {c[1] / o[1]:.3f}"
    )
    print(
        f"reference tokens per epoch: two passes {savings['two_passes']}, one shared-prompt pass "
        f"{savings['one_pass']} ({1 - savings['one_pass'] / savings['two_passes']:.1%} fewer)"
    )


def _tool_use(args: argparse.Namespace, base: Path) -> None:
    """Long system prompt, short completions: the shape where the policy's folded pass pays (kto.pack_policy)."""
    work = base / "tool_use"
    work.mkdir(parents=True)
    config = _config(work, "tool_use", 768, 704, 8, max_steps=args.tool_steps)
    savings, _ = _run(
        ["--child", "setup", str(work), str(args.tool_examples), "tool_use", "256", "4", str(config)]
    )
    # micro-batch 8, no accumulation: z0 covers one micro-batch, so the policy may fold its KL pass
    runs = {
        "online": _train(config, "online"),
        "cached (pack_policy auto: on)": _train(config, "cached", fresh_cache=True),
        "cached, pack_policy=false": _train(config, "cached", extra=("kto.pack_policy=false",)),
        "online, pack_reference+policy": _train(config, "online", extra=("kto.pack_reference=true",)),
        "online, padding-free": _train(config, "online", extra=("data.padding_free=true",)),
    }
    _step_table(f"tool-use shape, {args.tool_steps} steps per run; the first cached run precomputes", runs)
    _ratios(runs, "cached (pack_policy auto: on)", "online", "online")
    _ratios(runs, "cached (pack_policy auto: on)", "cached, pack_policy=false", "cached without folding")
    _ratios(runs, "online, pack_reference+policy", "online", "online")
    _ratios(runs, "online, padding-free", "online", "online (padded)")
    print(
        f"tool-use shape: prompt p50 {savings['prompt_p50']:.0f} tokens, completion p50 "
        f"{savings['completion_p50']:.0f}; {savings['packable']:.0%} of pairs share the prompt; reference tokens "
        f"two passes {savings['two_passes']}, one shared-prompt pass {savings['one_pass']} "
        f"({1 - savings['one_pass'] / savings['two_passes']:.1%} fewer)"
    )


def _memory_100m(base: Path, repeats: int) -> None:
    """~100M parameters: peak RSS online vs cached, the reference really not resident with the cache.

    The reference is a copy of the policy's directory: safetensors weights are memory-mapped, and a reference
    loaded from the policy's own file shares its page-cache pages with the policy's initial weights (and
    clean file pages may be evicted), which would hide part of the reference from RSS on CPU. On a GPU the
    reference is copied to device memory either way.
    """
    work = base / "fixture_100m"
    work.mkdir(parents=True)
    info, _ = _run(["--child", "setup", str(work), "32", "fixture", "768", "12"])
    shutil.copytree(work / "model", work / "reference")
    config = _config(work, "m100", 256, 128, 4, max_steps=2)
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["model"]["reference_path"] = str(work / "reference")
    config.write_text(yaml.safe_dump(raw))
    _run(["--child", "run", str(config), "precompute", "kto.reference=cached"])
    reference_mib = info["params"] * 4 / 2**20
    print(
        f"\n~100M fixture ({info['params'] / 1e6:.1f}M parameters, fp32 reference weights {reference_mib:.0f} MiB); "
        f"peak RSS over the training steps and over the whole process (final checkpoint included), {repeats} "
        "runs each, alternating"
    )
    peaks: dict[str, list[tuple[float, float]]] = {"online": [], "cached": []}
    # glibc keeps freed heap blocks, so peak RSS drifts by +-150 MiB run to run with where the allocator's
    # fragmentation peaks; blocks of 64 KiB and more from mmap go back to the OS at free, so RSS follows the live
    # tensors and repeats to the MiB.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        for _ in range(repeats):
            for mode in peaks:
                r, _ = _train(config, mode)
                peaks[mode].append((r["peak_rss_steps_mib"], r["peak_rss_mib"]))
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
    for mode, values in peaks.items():
        listed = ", ".join(f"{s:.0f}/{p:.0f}" for s, p in values)
        print(f"  {mode:<8} peak RSS MiB, steps/process: {listed}")
    for i, what in enumerate(("training steps", "whole process")):
        diffs = [o[i] - c[i] for o, c in zip(peaks["online"], peaks["cached"], strict=True)]
        print(
            f"  online - cached, {what}: median {statistics.median(diffs):.0f} MiB (runs: "
            f"{', '.join(f'{d:.0f}' for d in diffs)}; target >= the reference weights, {reference_mib:.0f} MiB)"
        )
    print(
        "  (the online run holds the reference's weights as far as it reads them: safetensors are memory-mapped, "
        "and the embedding rows of tokens the data never uses stay unread on disk)"
    )


if __name__ == "__main__":
    main()
