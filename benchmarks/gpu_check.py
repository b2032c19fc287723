"""The CUDA path, checked for real on one GPU: kernels, plugins, bf16 training, export; one table of figures.

    python benchmarks/gpu_check.py --out /tmp/gpu_check [--size 550m --steps 30 --cases hybrid_sdpa,...]

What it does, offline: builds a byte-level BPE tokenizer (coati_kto.testing.tiny) and a random Llama of ``--size``
(vocabulary 32000), writes a synthetic KTO dataset whose desirable and undesirable completions use different
words (learnable: the loss must fall) and prepares it once. Then, each case in a fresh process (peak memory is a
process high-water mark), it runs ``coati_kto.train.train(config)`` for ``--steps`` optimizer steps and checks:
the backend (nccl on CUDA), the inner optimizer class (HybridAdam on CUDA), that policy and reference sequence
log-probs agree before the first step, that the loss falls, that the final export reloads with transformers,
has trained (changed) and finite weights; it records which attention kernel ran (ColossalAI's ColoAttention
dispatch, and the CUDA attention kernels a profiled step launched).

Figures per case: median optimizer-step time (synchronized, after 3 warm-up steps), non-padding tokens/s,
peak ``torch.cuda.max_memory_allocated``, and an approximate MFU: per micro-batch the policy's gradient pass
costs 6·N per completion-batch token, the three no-grad passes (reference on it, policy and reference on the
KL batch) 2·N per token each; N counts every parameter except the input embedding (attention scores and the
``logits_to_keep`` saving are ignored), against a dense bf16 peak of 989 TFLOP/s (H100 SXM).

On a machine without CUDA it runs the cases that exist there (no ColoAttention kernel) on a tiny model: a
dry run of everything but the GPU specifics. Exit status 1 when a check fails. On an H100 the default four cases
take about 5 minutes after HybridAdam's kernels are built (about 100 s, once per machine). Within 20-30 steps the
KTO loss of a random model moves at noise level (0.500 -> 0.494-0.508 measured), so "loss falls" can fail there
while everything else holds: the loss arithmetic itself is checked by the CPU tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16
WARMUP_STEPS = 3
VOCAB_SIZE = 32000
SIZES = {  # hidden, layers, heads, intermediate
    "tiny": (64, 2, 4, 128),
    "110m": (768, 10, 12, 2048),
    "550m": (1536, 16, 12, 4096),
    "1b": (2048, 16, 16, 5632),
}
HYBRID = {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}
LOW_LEVEL = {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}
# name -> plugin section, model.attn_implementation, ColossalAI flash attention (ColoAttention) on, needs CUDA,
# overlap_communication (None: the plugin's default, which coati_kto keeps on CUDA)
CASES: dict[str, dict[str, Any]] = {
    "hybrid_zero2_eager": {"plugin": HYBRID, "attn": "eager"},
    "hybrid_zero2_sdpa": {"plugin": HYBRID, "attn": "sdpa"},
    "hybrid_zero2_coloattn": {"plugin": HYBRID, "attn": "sdpa", "coloattn": True, "cuda_only": True},
    "lowlevel_zero2_sdpa": {"plugin": LOW_LEVEL, "attn": "sdpa"},
    "hybrid_zero2_sdpa_nooverlap": {"plugin": HYBRID, "attn": "sdpa", "overlap": False},
    "lowlevel_zero2_sdpa_nooverlap": {"plugin": LOW_LEVEL, "attn": "sdpa", "overlap": False},
    # Padded lengths rounded up to 64: few distinct shapes, so cuDNN attention reuses its plans.
    "hybrid_zero2_sdpa_pad64": {"plugin": HYBRID, "attn": "sdpa", "data": {"pad_to_multiple_of": 64}},
    # torch AdamW (fused) instead of HybridAdam: tells the plugins' behaviour from the optimizer's.
    "hybrid_zero2_sdpa_adamw": {"plugin": HYBRID, "attn": "sdpa", "adamw": True},
    "lowlevel_zero2_sdpa_adamw": {"plugin": LOW_LEVEL, "attn": "sdpa", "adamw": True},
}
DEFAULT_CASES = "hybrid_zero2_eager,hybrid_zero2_sdpa,hybrid_zero2_coloattn,lowlevel_zero2_sdpa"
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attention", "sdpa", "cudnn", "softmax")


# ------------------------------------------------------------------------------------------------ setup
def _word_pool(rng: random.Random, n: int) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(n)})


def make_dataset(
    out: Path, n_rows: int, prompt_words: int, completion_words: int, seed: int = 0
) -> list[str]:
    """KTO rows whose desirable completions draw from one word pool and undesirable ones from another.

    Returns the corpus texts (for the tokenizer). Labels alternate: exactly half desirable.
    """
    from coati_kto.data.formats import write_jsonl

    rng = random.Random(seed)
    words = _word_pool(rng, 6000)
    rng.shuffle(words)
    common, good, bad = words[:4000], words[4000:4800], words[4800:5600]
    rows = []
    for i in range(n_rows):
        label = i % 2 == 0
        prompt = " ".join(rng.choices(common, k=rng.randint(prompt_words // 2, prompt_words)))
        pool = good if label else bad
        completion = " ".join(
            rng.choices(pool + common[:200], k=rng.randint(completion_words // 2, completion_words))
        )
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion},
                ],
                "label": label,
            }
        )
    write_jsonl(rows, out / "train.jsonl")
    return [m["content"] for r in rows for m in r["messages"]]


def make_model(out: Path, corpus: list[str], size: str, device: str) -> int:
    """Tokenizer (coati_kto.testing.tiny) + random Llama with a 32000-row vocabulary, saved in bf16; returns N params."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(corpus, vocab_size=8192)
    hidden, layers, heads, inter = SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    count = sum(p.numel() for p in model.parameters())
    del model  # the cases run in other processes: free this one's GPU memory
    if device == "cuda":
        torch.cuda.empty_cache()
    return count


def base_config(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {"path": str(work / "model")},
        "data": {
            "train_files": [str(work / "data" / "train.jsonl")],
            "prepared_dir": str(work / "prepared"),
            "max_length": args.max_length,
            "max_prompt_length": args.max_length * 2 // 3,
            "num_proc": 4,
        },
        "kto": {"beta": 0.1},
        "train": {
            "micro_batch_size": args.micro_batch_size,
            "accumulation_steps": args.accumulation_steps,
            "max_epochs": 100,
            "max_steps": args.steps,
            "lr": args.lr,
            "warmup_steps": 3,
            "min_lr_ratio": 0.1,
            "seed": 0,
        },
        "output": {"dir": str(work / "runs" / "prepare"), "save_interval": 0},
        "logging": {"tensorboard": False},
    }


# ------------------------------------------------------------------------------------------------ one case
def _cuda_attention_kernels(prof: Any) -> list[str]:
    names = {}
    for event in prof.key_averages():
        if any(w in event.key.lower() for w in ATTENTION_KERNEL_WORDS):
            names[event.key[:90]] = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))
    return [k for k, _ in sorted(names.items(), key=lambda kv: -kv[1])[:6]]


def _gpu_busy(prof: Any, seconds: float) -> dict[str, Any]:
    """Kernel time of the profiled step over its wall time, and the kernels that took most of it."""
    import torch

    averages = prof.key_averages()
    cpu_top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:8]
    # Kernels only: CPU ops also carry the device time of the kernels they launched (counted twice otherwise).
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in averages if e.device_type == cuda and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
    return {
        "profiled_step_seconds": seconds,
        "gpu_busy_fraction": total_us / 1e6 / seconds,
        "top_kernels_ms": [[e.key[:70], round(e.self_device_time_total / 1e3, 2), e.count] for e in top],
        "top_cpu_ops_ms": [[e.key[:70], round(e.self_cpu_time_total / 1e3, 2), e.count] for e in cpu_top],
    }


def run_case(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One training run in this process; returns its figures and checks (rank 0 of a world of one)."""
    import torch
    import torch.distributed as dist

    from coati_kto import plugins
    from coati_kto.config.schema import Config
    from coati_kto.parallel import compat
    from coati_kto.trainer import checkpoint as checkpoint_mod
    from coati_kto.trainer.kto import KTOTrainer

    case = CASES[name]
    coloattn = case.get("coloattn", False)
    cuda = torch.cuda.is_available()
    raw = base_config(work, args)
    raw["model"]["attn_implementation"] = case["attn"]
    raw["plugin"] = case["plugin"]
    raw["data"].update(case.get("data", {}))
    raw["output"]["dir"] = str(work / "runs" / name)
    config = Config.model_validate(raw)
    result: dict[str, Any] = {"case": name}

    if coloattn:  # train() turns it on only for flash_attention_2, which needs the flash-attn package
        build = plugins.build_plugin
        plugins.build_plugin = lambda cfg, norm, flash_attention=False: build(cfg, norm, flash_attention=True)
    if case.get("overlap") is not None:
        overrides = compat.plugin_overrides
        compat.plugin_overrides = lambda: {**overrides(), "overlap_communication": case["overlap"]}
    # AdamW when the HybridAdam kernels failed to build (reported), or where the case asks for it.
    if (args.adamw_fallback or case.get("adamw")) and cuda:
        compat.make_optimizer = lambda params, lr, wd, fused_ok=True: torch.optim.AdamW(
            params, lr=lr, weight_decay=wd, fused=True
        )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    steps: list[dict[str, float]] = []
    train_step, fit, save = KTOTrainer._train_step, KTOTrainer.fit, checkpoint_mod.CheckpointManager.save

    def timed_step(self: KTOTrainer, micro_batches: list, epoch: int) -> None:
        main = sum(int(b.example.attention_mask.sum()) for b in micro_batches)
        kl = sum(int(b.kl.attention_mask.sum()) for b in micro_batches)
        padded = sum(b.example.input_ids.numel() + b.kl.input_ids.numel() for b in micro_batches)
        profile = cuda and len(steps) == WARMUP_STEPS
        sync()
        start = time.perf_counter()
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                train_step(self, micro_batches, epoch)
                sync()
            result["cuda_attention_kernels"] = _cuda_attention_kernels(prof)
            result.update(_gpu_busy(prof, time.perf_counter() - start))
        else:
            train_step(self, micro_batches, epoch)
        sync()
        seconds = time.perf_counter() - start
        steps.append({"seconds": seconds, "main": main, "kl": kl, "padded": padded, "profiled": profile})

    def checked_fit(self: KTOTrainer, train_loader: Any, *rest: Any, **kw: Any) -> None:
        # Before any step the policy's working copy equals the reference: their log-probs must agree.
        rows = [train_loader.dataset[i] for i in range(config.train.micro_batch_size)]
        batch = train_loader.collate_fn(rows).to(self.device)
        with torch.no_grad():
            policy = self.passes._sequence_logps(self.policy, batch.example)
            reference = self.passes._sequence_logps(self.reference, batch.example)
        tokens = batch.example.loss_mask.sum(1).clamp(min=1).float()
        result["step0_logp_max_abs_diff"] = float((policy - reference).abs().max())
        result["step0_logp_max_abs_diff_per_token"] = float(((policy - reference).abs() / tokens).max())
        result["step0_policy_logp_mean"] = float(policy.mean())
        fit(self, train_loader, *rest, **kw)

    def timed_save(self: Any, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        out = save(self, *a, **kw)
        result["checkpoint_save_seconds"] = time.perf_counter() - start
        return out

    KTOTrainer._train_step, KTOTrainer.fit = timed_step, checked_fit
    checkpoint_mod.CheckpointManager.save = timed_save

    from coati_kto.train import train

    started = time.perf_counter()
    trainer = train(config)
    result["train_seconds"] = time.perf_counter() - started
    result["backend"] = dist.get_backend()
    optim = trainer.optimizer
    while hasattr(optim, "optim"):
        optim = optim.optim
    result["optimizer"] = f"{type(trainer.optimizer).__name__}({type(optim).__name__})"
    result["attn_implementation"] = getattr(trainer.policy.unwrap().config, "_attn_implementation", None)
    if coloattn:
        from colossalai.shardformer.layer.attn import ColoAttention

        dispatch = (ColoAttention._kernel_dispatch_map or {}).get(torch.bfloat16, {})
        result["coloattention_kernels"] = sorted(
            {getattr(v, "__qualname__", type(v).__name__) for v in dispatch.values() if callable(v)}
        )
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["device"] = torch.cuda.get_device_name()
    keys = ("train/loss", "train/grad_norm", "train/rewards/chosen", "train/rewards/rejected", "train/kl")
    result["history"] = [[r.get(k) for k in keys] for r in trainer.history if "train/loss" in r]
    losses = [r["train/loss"] for r in trainer.history if "train/loss" in r]
    result["loss_first3"] = statistics.fmean(losses[:3])
    result["loss_last3"] = statistics.fmean(losses[-3:])
    margins = [r["train/rewards/margin"] for r in trainer.history if "train/rewards/margin" in r]
    result["margin_last3"] = statistics.fmean(margins[-3:]) if margins else None
    result["steps"] = len(steps)

    # After warm-up, without the profiled step (the profiler slows it several-fold).
    timed = [s for s in steps[WARMUP_STEPS:] if not s["profiled"]] or steps
    n = args.n_params - args.n_embedding
    seconds = sum(s["seconds"] for s in timed)
    flops = sum(8 * n * s["main"] + 4 * n * s["kl"] for s in timed)
    result["step_seconds_median"] = statistics.median(s["seconds"] for s in timed)
    result["tokens_per_second"] = sum(s["main"] + s["kl"] for s in timed) / seconds
    result["padding_fraction"] = 1 - sum(s["main"] + s["kl"] for s in timed) / sum(s["padded"] for s in timed)
    result["tflops"] = flops / seconds / 1e12
    result["mfu"] = flops / seconds / PEAK_BF16_FLOPS if cuda else None
    result.update(check_export(work, name))
    return result


def check_export(work: Path, name: str) -> dict[str, Any]:
    """The final export reloads with transformers, holds finite weights, and differs from the initial model."""
    import torch
    from transformers import AutoModelForCausalLM

    final = work / "runs" / name / "final"
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    a, b = exported.state_dict(), initial.state_dict()
    changed = max(float((a[k] - b[k]).abs().max()) for k in b)
    finite = all(bool(torch.isfinite(v).all()) for v in a.values())
    return {"export_reloads": sorted(a) == sorted(b), "export_max_change": changed, "export_finite": finite}


# ------------------------------------------------------------------------------------------------ driver
def kernel_report() -> dict[str, Any]:
    """Load (JIT-building on first use) the two kernels HybridAdam needs; report time or the error's last line."""
    import torch

    out: dict[str, Any] = {}
    if not torch.cuda.is_available():
        return out
    from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

    for loader in (CPUAdamLoader, FusedOptimizerLoader):
        start = time.perf_counter()
        try:
            loader().load()
            out[loader.__name__] = f"ok in {time.perf_counter() - start:.1f} s"
        except Exception as err:  # noqa: BLE001 - reported, the run goes on without the kernel
            lines = [line for line in str(err).splitlines() if line.strip()]
            out[loader.__name__] = f"FAILED: {type(err).__name__}: {' | '.join(lines[-12:])}"
    return out


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    for pkg in (
        "colossalai",
        "transformers",
        "tokenizers",
        "huggingface_hub",
        "peft",
        "bitsandbytes",
        "datasets",
    ):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return env


def table(results: list[dict[str, Any]]) -> str:
    head = "case                          status  step_s  tok/s     peakGiB  TFLOP/s  MFU    loss first->last  margin  step0 dlogp  optimizer"
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:<29} FAIL    {r['error'][-150:]}")
            continue
        mem = r.get("peak_memory_gib")
        mfu = r.get("mfu")
        lines.append(
            f"{r['case']:<29} {'ok' if r['passed'] else 'FAIL':<7} {r['step_seconds_median']:<7.3f} "
            f"{r['tokens_per_second']:<9.0f} {mem if mem is None else round(mem, 1)!s:<8} {r['tflops']:<8.1f} "
            f"{'-' if mfu is None else f'{mfu:.1%}':<6} {r['loss_first3']:.4f}->{r['loss_last3']:.4f}   "
            f"{r.get('margin_last3') or 0:<7.3f} {r['step0_logp_max_abs_diff']:<11.3g}  {r['optimizer']}"
        )
    return "\n".join(lines)


def passed(r: dict[str, Any], cuda: bool) -> bool:
    checks = [
        r["loss_last3"] < r["loss_first3"],
        r["export_reloads"] and r["export_finite"] and r["export_max_change"] > 0,
        r["step0_logp_max_abs_diff_per_token"] < 0.05,
    ]
    if cuda:
        adamw = r.get("adamw_fallback") or CASES[r["case"]].get("adamw")
        checks += [r["backend"] == "nccl", "HybridAdam" in r["optimizer"] or adamw]
    return all(checks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="work directory (model, data, runs)")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: 550m on CUDA, tiny on CPU"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"any of {','.join(CASES)}")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--case-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case
    parser.add_argument("--n-params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--n-embedding", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--adamw-fallback", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if args.case:
        try:
            result = run_case(args.case, args.out, args)
        except Exception as err:  # noqa: BLE001 - the driver reports it in the table
            import traceback

            traceback.print_exc()
            result = {"case": args.case, "error": f"{type(err).__name__}: {err}"}
        (args.out / "runs" / f"{args.case}.json").write_text(json.dumps(result))
        return 0

    from coati_kto.parallel.compat import quiet_known_warnings

    quiet_known_warnings()
    size = args.size or ("550m" if cuda else "tiny")
    report: dict[str, Any] = {"environment": environment(), "size": size}
    print(json.dumps(report["environment"]), flush=True)
    report["kernels"] = kernel_report()
    print("kernels:", json.dumps(report["kernels"]), flush=True)
    adamw_fallback = any(v.startswith("FAILED") for v in report["kernels"].values())

    start = time.perf_counter()
    rows = args.steps * args.micro_batch_size * args.accumulation_steps + 64
    words = args.max_length // 3  # ~1.5 tokens per word: prompt + completion fit max_length
    corpus = make_dataset(args.out / "data", rows, words, words // 2)
    n_params = make_model(args.out / "model", corpus, size, "cuda" if cuda else "cpu")
    hidden = SIZES[size][0]
    n_embedding = VOCAB_SIZE * hidden
    from coati_kto.config.schema import Config
    from coati_kto.data.prepared import prepare

    prepare(Config.model_validate(base_config(args.out, args)))
    report["setup_seconds"] = time.perf_counter() - start
    print(
        f"model {size}: {n_params / 1e6:.0f}M parameters; setup {report['setup_seconds']:.0f} s", flush=True
    )

    results = []
    for name in args.cases.split(","):
        if CASES[name].get("cuda_only") and not cuda:
            continue
        cmd = [sys.executable, __file__, "--out", str(args.out), "--case", name]
        cmd += ["--n-params", str(n_params), "--n-embedding", str(n_embedding), "--steps", str(args.steps)]
        cmd += [
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--accumulation-steps",
            str(args.accumulation_steps),
        ]
        cmd += ["--max-length", str(args.max_length), "--lr", str(args.lr)]
        cmd += ["--adamw-fallback"] if adamw_fallback else []
        print(f"--- case {name}", flush=True)
        case_json = args.out / "runs" / f"{name}.json"
        case_json.parent.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                cmd, timeout=args.case_timeout, check=False, env={**os.environ, "TQDM_DISABLE": "1"}
            )
            result = json.loads(case_json.read_text())
        except subprocess.TimeoutExpired:
            result = {"case": name, "error": f"timed out after {args.case_timeout} s"}
        except FileNotFoundError:
            result = {"case": name, "error": "the case process died before writing its result"}
        if "error" not in result:
            result["adamw_fallback"] = adamw_fallback
            result["passed"] = passed(result, cuda)
        print(json.dumps(result), flush=True)
        results.append(result)
        # Checkpoints of a large model fill the disk: keep only the figures.
        subprocess.run(["rm", "-rf", str(args.out / "runs" / name)], check=False)

    report["cases"] = results
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(table(results), flush=True)
    return 0 if results and all(r.get("passed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
