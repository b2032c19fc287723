"""TRL's KTOTrainer next to coati-kto on step_bench's fixture: step time, CPU time, peak RSS, step-1 loss.

    PYTHONPATH=. .venv/bin/python benchmarks/trl_side_by_side.py [--steps 20] [--examples 160]
        [--venv .trl-venv] [--trl-spec trl==1.16.0] [--work /tmp/coati_trl_side_by_side]

Fixture: ``benchmarks/step_bench.py``'s own (its ``setup`` child builds it: a random Llama of 7.4M parameters,
hidden 256, 4 layers, vocabulary 8192; prompt + completion about 100 + 100 tokens; 3:1 labels), micro-batch 8,
fp32, 1 process, max_length 256 / max_prompt_length 128 (nothing is cut), lr 1e-5, beta 0.1, no eval, no
checkpoint. ``--examples`` defaults to ``--steps`` x 8: both tools train one epoch, and a precomputed
reference scores exactly the trained data. Every run is its own process with ``OMP_NUM_THREADS=1``.

- TRL: ``KTOTrainer`` in a child process of a SEPARATE virtual environment (``--venv``), with
  ``precompute_ref_log_probs`` False (a reference copy of the model scores every batch) and True (the policy
  at step 0 scores the whole train set before the first step). A ``TrainerCallback`` times each step
  (``on_step_begin`` -> ``on_step_end``: forwards, backward, optimizer step) with ``time.perf_counter`` and
  ``time.process_time``; peak RSS is the child's ``getrusage`` at exit (precompute included).
- coati-kto: ``coati-kto train`` through step_bench's child (``kto.reference`` online, then cached with the
  cache deleted first, so that process precomputes then trains); its step CPU time is that of
  ``KTOTrainer._train_step``.

Same work per step: 8 examples and their 8 KL pairs (completions shifted by one inside the batch in both).
Online, both score examples and KL pairs with the reference (coati-kto's default ``kto.pack_reference:
false``: no shared-prompt pass), the KL pairs with the policy without gradient, the examples with the policy
with gradient; a cached / precomputed reference drops the reference passes. Tokens differ slightly: TRL
tokenizes prompt + completion as one string and the fixture's completions start without a space, so the
prompt's last word and the completion's first word merge (0.55 tokens more per example on average); coati-kto
tokenizes the two separately. Step times are medians over the steps after the first 3. The machine is shared:
CPU seconds of a step (one thread per process) are the comparable figure, wall seconds are stretched by
whatever else runs.

TRL environment (TRL is never a dependency of coati_kto): ``python -m venv`` with this interpreter, then a
``.pth`` file that appends the main venv's site-packages (torch 2.13 CPU, transformers 5.24, accelerate,
datasets ...) to the new venv's path, then ``pip install --trl-spec`` (default ``trl==1.16.0``) into the new
venv. pip sees the main venv's packages as installed, so it installs only what they do not satisfy: for TRL
1.16 that is trl itself, a few seconds from PyPI and no second torch (PyPI's torch wheel for Linux would pull
gigabytes of CUDA libraries) nor transformers. Both tools then run the same torch and the same transformers
model code: the difference is the trainer. Whatever another ``--trl-spec`` needs goes into its own venv and
shadows the main venv's; pip never writes to the main venv. TRL 1.x has no ``max_prompt_length`` (nothing is
cut at 256 anyway). The venv is reused while its recorded spec matches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# This file runs as a script, so its directory is on sys.path; step_bench and flops import only the standard
# library at module level, so the TRL child (another venv) can import them too.
import flops
import step_bench

ROOT = Path(__file__).resolve().parents[1]
MICRO_BATCH = 8
MAX_LENGTH, MAX_PROMPT_LENGTH = 256, 128
SPEC_FILE = "coati-bench-spec.txt"


# ------------------------------------------------------------------ TRL child (runs in the TRL venv)
def _trl_child(options: dict) -> None:
    """Train TRL's KTOTrainer as ``options`` say (see :func:`run_trl`); prints timings and versions as JSON."""
    import dataclasses
    import resource

    start = time.perf_counter()
    import accelerate
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    class StepTimer(TrainerCallback):
        """Wall and CPU seconds of each optimizer step; the logged loss of each step."""

        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.loss: list[float] = []
            self.kl: list[float] = []
            self.counting = None  # flops.counter() of the step being counted
            self.flops: dict[str, float] | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == options.get("flop_step"):  # counted, not timed (the mode slows it)
                self.counting = flops.counter()
                self.counting.__enter__()
                return
            if cuda:  # the step's kernels, not the previous step's, end inside its interval
                torch.cuda.synchronize()
            self._start = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            if self.counting is not None:
                self.counting.__exit__(None, None, None)
                self.flops, self.counting = flops.counted(self.counting), None
                return
            if cuda:
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.loss.append(float(logs["loss"]))
            if logs and "kl" in logs:
                self.kl.append(float(logs["kl"]))

    cuda = not options["use_cpu"] and torch.cuda.is_available()
    records = [json.loads(line) for line in Path(options["data"]).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(options["model"])
    # fp32 weights (the saved dtype may be bf16: TRL's bf16 option then runs autocast over fp32 masters, as
    # coati-kto's plugins do); .float() rather than a dtype kwarg, which 5.x renamed.
    model = AutoModelForCausalLM.from_pretrained(options["model"]).float()
    wanted = {
        "output_dir": options["out"],
        "per_device_train_batch_size": options["micro_batch"],
        "max_steps": options["steps"],
        "learning_rate": 1e-5,
        "beta": 0.1,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": [],
        "use_cpu": options["use_cpu"],
        "bf16": options["bf16"],
        "max_length": options["max_length"],
        "max_prompt_length": options["max_prompt_length"],
        "precompute_ref_log_probs": options["precompute"],
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": 0,
    }
    wanted.update(options.get("config", {}))  # learning_study.py: its hyper-parameters
    known = {f.name for f in dataclasses.fields(KTOConfig)}
    config = KTOConfig(**{k: v for k, v in wanted.items() if k in known})
    timer = StepTimer()
    trainer = KTOTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    prompts, completions = _token_counts(trainer.train_dataset)
    trainer.train()
    if options.get("save_to"):
        trainer.save_model(options["save_to"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "step_seconds": timer.wall,
        "step_cpu_seconds": timer.cpu,
        "flops": timer.flops,
        "loss": timer.loss,
        "kl": timer.kl,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "ignored_config_keys": sorted(set(wanted) - known),
        "prompt_p50": statistics.median(prompts) if prompts else None,
        "completion_p50": statistics.median(completions) if completions else None,
        "versions": {m.__name__: m.__version__ for m in (trl, transformers, torch, accelerate, datasets)},
    }
    print("RESULT " + json.dumps(out))


def _token_counts(ds) -> tuple[list[int], list[int]]:
    """Prompt and completion tokens per tokenized example (TRL 0.x: prompt + full sequence; 1.x: the two)."""
    cols = ds.column_names
    if "prompt_ids" in cols and "completion_ids" in cols:
        return [len(x) for x in ds["prompt_ids"]], [len(x) for x in ds["completion_ids"]]
    if "prompt_input_ids" in cols and "completion_input_ids" in cols:
        prompts = [len(x) for x in ds["prompt_input_ids"]]
        return prompts, [len(x) - p for x, p in zip(ds["completion_input_ids"], prompts, strict=True)]
    return [], []


# ------------------------------------------------------------------------------ parent (main venv)
def trl_spec_from_wheels(wheels: Path) -> str:
    """``trl==<version>`` of the one TRL wheel in ``wheels`` (a directory prepared with pip download)."""
    found = sorted(wheels.glob("trl-*.whl"))
    if len(found) != 1:
        sys.exit(f"{wheels}: expected exactly one trl-*.whl, found {[f.name for f in found]}")
    return "trl==" + found[0].name.split("-")[1]


def ensure_trl_venv(venv: Path, spec: str, find_links: Path | None = None) -> float | None:
    """Create ``venv`` (see the module docstring) and pip install ``spec`` into it, unless it already holds
    ``spec``; with ``find_links`` only from that directory of wheels (no index: a machine without a registry).
    Returns the install's wall seconds, or None when the venv was reused."""
    marker = venv / SPEC_FILE
    if marker.exists() and marker.read_text().strip() == spec:
        return None
    import sysconfig

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Appended after the venv's own site-packages: whatever pip installs into the venv shadows the main venv.
    (Path(site) / "coati_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", spec]
        + (["--no-index", "--find-links", str(find_links)] if find_links is not None else []),
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        sys.exit(f"pip install {spec} into {venv} failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}")
    installed = [line for line in pip.stdout.splitlines() if line.startswith("Successfully installed")]
    print(f"{venv}: {installed[-1] if installed else 'nothing new installed'}")
    marker.write_text(spec + "\n")
    return time.perf_counter() - t0


def _run_trl(venv: Path, work: Path, precompute: bool, steps: int) -> dict:
    """TRL on step_bench's fixture in ``work``: fp32, CPU, this module's lengths and micro-batch."""
    options = {
        "model": str(work / "model"),
        "data": str(work / "train.jsonl"),
        "out": str(work / f"trl-out-{int(precompute)}"),
        "micro_batch": MICRO_BATCH,
        "max_length": MAX_LENGTH,
        "max_prompt_length": MAX_PROMPT_LENGTH,
        "bf16": False,
        "use_cpu": True,
        "steps": steps,
        "flop_step": steps,  # the last step: counted, not timed
    }
    return run_trl(venv, work, precompute, options)


def run_trl(venv: Path, work: Path, precompute: bool, options: dict) -> dict:
    """TRL's KTOTrainer in a child process of ``venv``: ``options`` holds model, data (JSONL of prompt,
    completion, label), out, micro_batch, max_length, max_prompt_length, bf16, use_cpu, steps; optionally
    config (KTOConfig fields over these defaults) and save_to (where the trained model is saved). Returns the
    child's JSON (step_seconds, step_cpu_seconds, loss, kl, peak_rss_mib, peak_cuda_gib, versions, ...)."""
    # TRL's process never sees coati_kto, nor the process group of a caller that initialised one (accelerate
    # would join it: MASTER_PORT is taken).
    dist_keys = {
        "PYTHONPATH",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    }
    env = {k: v for k, v in os.environ.items() if k not in dist_keys}
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(work / "hf-datasets-cache"),
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
    )
    args = [
        str(venv / "bin" / "python"),
        __file__,
        "--trl-child",
        json.dumps({**options, "precompute": precompute}),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(work))
    if proc.returncode != 0:
        sys.exit(f"TRL child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _row(tool: str, mode: str, r: dict, trl_cpu: float, trl_wall: float) -> str:
    cpu = step_bench._median_after_warmup(r["step_cpu_seconds"])
    wall = step_bench._median_after_warmup(r["step_seconds"])
    return (
        f"{tool:<11}{mode:<26}{wall:>12.3f}{cpu:>11.3f}{r['peak_rss_mib']:>14.0f}{r['cpu_seconds']:>15.1f}"
        f"{r['loss'][0]:>13.4f}{cpu / trl_cpu:>12.2f}{wall / trl_wall:>13.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trl-child", help=argparse.SUPPRESS)  # internal: the options of one TRL run, JSON
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--examples", type=int, default=None, help="fixture examples (default: steps x 8)")
    p.add_argument("--venv", default=str(ROOT / ".trl-venv"), help="TRL's own virtual environment")
    p.add_argument("--trl-spec", default="trl==1.16.0", help="what pip installs into --venv")
    p.add_argument("--work", default="/tmp/coati_trl_side_by_side")
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="pairs of runs per reference mode, in alternating order (TRL first, then coati-kto first, ...); "
        "each pair's ratio is printed and their median: the machine's drift between runs moves single pairs",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny and fast (4 steps, hidden 64, 2 layers); reuses --venv only, never installs: without it, "
        "prints why it skipped and exits 0",
    )
    args = p.parse_args()
    if args.trl_child:
        return _trl_child(json.loads(args.trl_child))

    import shutil

    hidden, layers = ("64", "2") if args.smoke else ("256", "4")
    if args.smoke:
        args.steps = min(args.steps, 4)
    examples = args.examples or args.steps * MICRO_BATCH
    venv = Path(args.venv).resolve()
    if args.smoke and not (venv / SPEC_FILE).exists():
        print(
            f"SKIPPED: no TRL venv at {venv} (TRL is never a dependency; build it with a run without --smoke)"
        )
        return None
    installed = ensure_trl_venv(venv, args.trl_spec)
    print(
        f"TRL venv {venv} ({args.trl_spec}): "
        + (f"installed in {installed:.1f} s" if installed is not None else "reused")
    )
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info, _ = step_bench._run(["--child", "setup", str(work), str(examples), "fixture", hidden, layers])
    config = step_bench._config(
        work, "fixture", MAX_LENGTH, MAX_PROMPT_LENGTH, MICRO_BATCH, max_steps=args.steps
    )
    shape, _ = step_bench._run(["--child", "savings", str(config)])
    print(
        f"fixture: {info['params'] / 1e6:.2f}M parameters, {examples} examples (3:1), {args.steps} steps of "
        f"{MICRO_BATCH}, fp32, 1 process, OMP_NUM_THREADS=1 in every run; {os.cpu_count()} CPUs, shared"
    )

    # Each pair back to back (TRL and coati-kto, per reference mode): the machine's speed drifts by 10-20%
    # over minutes, and two runs far apart in time compare that drift too. Further pairs alternate which tool
    # runs first, so a steady drift favours neither.
    pairs = {
        mode: [_pair(venv, work, config, mode, args.steps, i) for i in range(args.pairs)] for mode in MODES
    }
    (trl_online, coati_online), (trl_cached, coati_cached) = pairs["online"][0], pairs["cached"][0]
    print(
        "versions (TRL venv): "
        + ", ".join(f"{k} {v}" for k, v in trl_online["versions"].items())
        + f"; coati-kto from {ROOT}"
    )
    if trl_online["ignored_config_keys"]:
        print(f"KTOConfig of this TRL has no {trl_online['ignored_config_keys']} (left at its defaults)")
    trl_shape = (
        f"{trl_online['prompt_p50']:.0f} + {trl_online['completion_p50']:.0f}"
        if trl_online["prompt_p50"] is not None
        else "(not in its dataset columns)"
    )
    print(
        f"tokens per example, p50 prompt + completion: TRL {trl_shape}, "
        f"coati-kto {shape['prompt_p50']:.0f} + {shape['completion_p50']:.0f}"
    )

    runs = [
        ("TRL", "online (ref model)", trl_online, trl_online),
        ("TRL", "precompute_ref_log_probs", trl_cached, trl_cached),
        ("coati-kto", "online", coati_online, trl_online),
        ("coati-kto", "cached", coati_cached, trl_cached),
    ]
    print(
        f"\n{'tool':<11}{'reference':<26}{'step wall s':>12}{'step CPU s':>11}{'peak RSS MiB':>14}"
        f"{'process CPU s':>15}{'step-1 loss':>13}{'CPU x TRL':>12}{'wall x TRL':>13}"
    )
    for tool, mode, r, base in runs:
        print(
            _row(
                tool,
                mode,
                r,
                step_bench._median_after_warmup(base["step_cpu_seconds"]),
                step_bench._median_after_warmup(base["step_seconds"]),
            )
        )
    print(
        "step-1 loss: the policy equals the reference, so every log-ratio and z0 are 0 and each example's "
        "loss is 1 - sigmoid(0) = 0.5 (lambda_D = lambda_U = 1) in both tools"
    )
    print(
        "x TRL: against TRL in the same reference mode. Step times: medians after the first 3 steps; "
        "peak RSS and process CPU: the whole process (imports, data, precompute, steps)."
    )
    if args.pairs > 1:
        _pair_ratios(pairs)
    tokens = MICRO_BATCH * (shape["prompt_p50"] + shape["completion_p50"])
    _floor(runs, work / "model" / "config.json", int(tokens))


MODES = ("online", "cached")


def _pair(venv: Path, work: Path, config: Path, mode: str, steps: int, index: int) -> tuple[dict, dict]:
    """(TRL's run, coati-kto's run) in ``mode``, TRL first in even pairs and coati-kto first in odd ones."""
    trl_first = index % 2 == 0
    first = _run_trl(venv, work, mode == "cached", steps) if trl_first else _coati_run(config, mode, steps)
    second = _coati_run(config, mode, steps) if trl_first else _run_trl(venv, work, mode == "cached", steps)
    return (first, second) if trl_first else (second, first)


def _pair_ratios(pairs: dict[str, list[tuple[dict, dict]]]) -> None:
    """Each pair's step CPU ratio TRL / coati-kto per mode, and their median."""
    print("\nTRL / coati-kto step CPU time, pair by pair (alternating which tool ran first):")
    for mode, runs in pairs.items():
        ratios = [
            step_bench._median_after_warmup(trl["step_cpu_seconds"])
            / step_bench._median_after_warmup(coati["step_cpu_seconds"])
            for trl, coati in runs
        ]
        listed = ", ".join(f"{r:.2f}x" for r in ratios)
        print(f"  {mode:<7} {listed}; median {statistics.median(ratios):.2f}x")


def _coati_run(config: Path, mode: str, steps: int) -> dict:
    """coati-kto on the fixture with ``kto.reference`` = ``mode`` (cached: a fresh cache); its last step counted
    for the floor, not timed."""
    os.environ[flops.FLOP_STEP_ENV] = str(steps)
    try:
        return step_bench._train(config, mode, fresh_cache=mode == "cached")[0]
    finally:
        del os.environ[flops.FLOP_STEP_ENV]


def _floor(runs: list[tuple[str, str, dict, dict]], model_config: Path, tokens: int) -> None:
    """Each run's matmul-class work (its counted step) against this core's GEMM rate: the floor of its step,
    and TRL's step over coati-kto's floor, the most any trainer running coati-kto's passes could reach."""
    config = json.loads(model_config.read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    dims = [(hidden, hidden), (hidden, 3 * hidden), (hidden, inter), (inter, hidden), (hidden, vocab)]
    rate = step_bench._run(["--child", "gemm", str(tokens), json.dumps(dims)])[0]["rate"]
    print(
        f"\nfloor of each step: its matmul-class FLOPs (torch's FLOP counter over its last step, untimed: "
        f"GEMMs and attention, forward and backward) at this core's best GEMM rate, {rate / 1e9:.1f} GFLOP/s "
        f"(F.linear, one thread, [{tokens}, k] x [k, n] for (k, n) in {dims}), every other op free"
    )
    print(f"{'tool':<11}{'reference':<26}{'GFLOP':>8}{'attention':>10}{'floor s':>9}{'step / floor':>14}")
    floors = {}
    for tool, mode, r, _ in runs:
        work = r.get("flops")
        if not work:
            print(f"{tool:<11}{mode:<26}  (not counted)")
            continue
        floors[(tool, mode)] = work["total"] / rate
        cpu = step_bench._median_after_warmup(r["step_cpu_seconds"])
        print(
            f"{tool:<11}{mode:<26}{work['total'] / 1e9:>8.1f}{work['attention'] / 1e9:>10.2f}"
            f"{floors[(tool, mode)]:>9.3f}{cpu / floors[(tool, mode)]:>14.2f}"
        )
    for (_, trl_mode, trl, _), (_, coati_mode, _, _) in zip(runs[:2], runs[2:], strict=True):
        if ("coati-kto", coati_mode) in floors:
            ceiling = (
                step_bench._median_after_warmup(trl["step_cpu_seconds"]) / floors[("coati-kto", coati_mode)]
            )
            print(
                f"TRL {trl_mode} step / coati-kto {coati_mode} floor: {ceiling:.2f}x (the ratio coati-kto's passes "
                "would give with every matmul at the best rate and nothing else)"
            )


if __name__ == "__main__":
    main()
