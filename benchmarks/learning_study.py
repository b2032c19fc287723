"""How much coati-kto and TRL's KTOTrainer learn from the same data: gains on held-out prompts, over seeds.

    PYTHONPATH=. .venv/bin/python benchmarks/learning_study.py [--seeds 0 1 2] [--coati-root /work/main]
        [--coati-override kto.kl_scope=micro_batch] [--trl-shuffle] [--venv .trl-venv] [--smoke]

Tasks (made here, on the quickstart's items: letters, weekdays, months), each on its own tiny base model:

- ``after/chatml``: "what comes after X?", desirable the successor, undesirable the predecessor; a byte-level
  BPE tokenizer with the ChatML template whose EOS is ``</s>`` while a turn ends with ``<|im_end|>\\n``.
- ``before/gemma-sp``: "what comes before X?", desirable the predecessor, undesirable the successor; a
  SentencePiece-style (Metaspace) tokenizer with Gemma's template: EOS ``<eos>``, turns end ``<end_of_turn>\\n``.

Base: a random Llama (hidden 64, 2 layers) fine-tuned (SFT, plain PyTorch, one process) on the template's
rendering of every (item, training phrasing) answered both ways, 50/50 (300 steps of 32): it knows the format and both neighbours
but not which one is asked for. Cached in ``--work`` by the task's settings (the second run skips it).

KTO, both tools, same base, data and hyper-parameters: 256 records 3:1, conversational prompt/completion, one
epoch, micro-batch 8 on 1 process (32 steps), AdamW lr 3e-4 constant (no warmup, no decay), max_grad_norm 1,
beta 0.1, desirable_weight 1, undesirable_weight 2.5 ((1 x 192)/(2.5 x 64) = 1.2, inside the paper's [1, 4/3]),
fp32. coati-kto: ``ddp`` on 1 process, ``train.seed`` = the seed; TRL 1.16: its own venv (``trl_side_by_side``'s
machinery), ``seed`` = the seed (its default sampler is sequential: the data order is the file's;
``--trl-order shuffled|mixed`` reorders it by the seed, see :func:`trl_order`).

Gain: on held-out phrasings of every item, the margin m = log p(desirable turn | prompt) - log p(undesirable
turn | prompt), summed over the completion tokens as the template renders them (the answer, the end-of-turn
token and its newline; the same tokens for both tools and the base); gain = mean m after KTO - mean m of the
base, in nats. Also the held-out preference accuracy (m > 0) after. ``train/kl``: the last logged z0 (TRL's
"kl"), with the mean over the epoch's last 10 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trl_side_by_side

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "applications" / "quickstart"))
SETTINGS = {"sft_steps": 300, "hidden": 64, "layers": 2, "n_train": 256, "micro_batch": 8, "lr": 3e-4}
SMOKE = {"sft_steps": 20, "hidden": 32, "layers": 1, "n_train": 32, "micro_batch": 8, "lr": 3e-4}
BETA, WEIGHTS, MAX_LENGTH = 0.1, (1.0, 2.5), 64
TASKS = {"after/chatml": ("after", "chatml_s"), "before/gemma-sp": ("before", "sentencepiece")}
PREFIXES = ("", "Quick question: ", "Hi! ", "Please help. ", "Hello. ", "One more: ")
QUESTIONS = (
    "Which {k} comes {d} {x}?",
    "What is the {k} {d} {x}?",
    "Name the {k} that comes {d} {x}.",
    "Tell me the {k} right {d} {x}.",
    "What {k} is just {d} {x}?",
)


# ------------------------------------------------------------------------------------------------ data
def task_data(direction: str, n_train: int, seed: int = 0) -> dict[str, list]:
    """sft (both answers of every item x training phrasing), kto (n_train records 3:1 as conversational
    prompt/completion), heldout (prompt, desirable, undesirable) on phrasings never trained on."""
    from make_data import answers, items

    rng = random.Random(seed)
    templates = [p + q.replace("{d}", direction) for p in PREFIXES for q in QUESTIONS]
    rng.shuffle(templates)
    train_t, held_t = templates[: len(templates) * 3 // 4], templates[len(templates) * 3 // 4 :]

    def good_bad(kind: str, x: str) -> tuple[str, str]:
        succ, pred = answers(kind, x)
        return (succ, pred) if direction == "after" else (pred, succ)

    every = items()
    sft = [(t.format(k=k, x=x), a) for k, x in every for t in train_t for a in good_bad(k, x)]
    labels = [True] * (n_train * 3 // 4) + [False] * (n_train - n_train * 3 // 4)
    rng.shuffle(labels)
    kto = []
    for label in labels:
        kind, x = rng.choice(every)
        prompt = rng.choice(train_t).format(k=kind, x=x)
        answer = good_bad(kind, x)[0 if label else 1]
        kto.append({"prompt": [user(prompt)], "completion": [assistant(answer)], "label": label})
    heldout = [(t.format(k=k, x=x), *good_bad(k, x)) for k, x in every for t in held_t[:2]]
    return {"sft": sft, "kto": kto, "heldout": heldout, "words": [x for _, x in every]}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def turn_ids(tok, prompt: str, answer: str) -> tuple[list[int], int]:
    """(ids of the conversation as the template renders it, number of prompt ids): what a chat model sees."""
    text_p = tok.apply_chat_template([user(prompt)], tokenize=False, add_generation_prompt=True)
    text = tok.apply_chat_template([user(prompt), assistant(answer)], tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(tok(text_p, add_special_tokens=False)["input_ids"])
    assert ids[:n] == tok(text_p, add_special_tokens=False)["input_ids"], "prompt is not a token prefix"
    return ids, n


# ------------------------------------------------------------------------------------------------ base
def build_base(task: str, settings: dict, work: Path) -> Path:
    """The task's SFT base (cached by its settings): tokenizer, random Llama, SFT on both answers 50/50."""
    fixed = {k: v for k, v in settings.items() if k != "weights"}  # KTO's weights are not the base's
    key = hashlib.sha256(json.dumps([task, fixed], sort_keys=True).encode()).hexdigest()[:10]
    out = work / f"base-{task.replace('/', '-')}-{key}"
    if (out / "config.json").exists():
        return out
    import torch
    from sft import batches

    from coati_kto.testing.tiny import build_llama, build_sentencepiece_tokenizer, build_tokenizer

    direction, style = TASKS[task]
    data = task_data(direction, settings["n_train"])
    corpus = [f"{p} {a}" for p, a in data["sft"]] + data["words"] + ["user model assistant"] * 5
    tok = (
        build_sentencepiece_tokenizer(corpus, 400)
        if style == "sentencepiece"
        else build_tokenizer(corpus, 400, style=style)
    )
    model = build_llama(tok, settings["hidden"], settings["layers"], 4, 128, seed=0)
    torch.manual_seed(0)
    examples = [turn_ids(tok, p, a) for p, a in data["sft"]]
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-3, weight_decay=0.0)
    stream = batches(examples, 32, tok.pad_token_id, random.Random(0))
    for _ in range(settings["sft_steps"]):
        ids, mask, labels = next(stream)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    print(f"base {task}: SFT {settings['sft_steps']} steps, last loss {loss.item():.3f} -> {out}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def margins(model_dir: Path, base_dir: Path, heldout: list[tuple[str, str, str]]) -> list[float]:
    """m per held-out prompt (module docstring), with the model at ``model_dir`` and the base's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()

    def logp(prompt: str, answer: str) -> float:
        ids, n = turn_ids(tok, prompt, answer)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(lp[n - 1 :].sum())

    return [logp(p, good) - logp(p, bad) for p, good, bad in heldout]


# ------------------------------------------------------------------------------------------------ runs
def run_coati(
    base: Path, data: Path, out: Path, seed: int, settings: dict, root: Path, overrides: list[str]
) -> dict:
    """coati-kto train (1 process, ddp fp32) with ``root``'s coati_kto; its exported model and train/kl."""
    import yaml

    config = {
        "model": {"path": str(base)},
        "data": {"train_files": [str(data)], "prepared_dir": str(out / "prepared"), "max_length": MAX_LENGTH},
        "kto": {
            "beta": BETA,
            "desirable_weight": settings["weights"][0],
            "undesirable_weight": settings["weights"][1],
        },
        "train": {"seed": seed, "micro_batch_size": settings["micro_batch"], "lr": settings["lr"]}
        | {"warmup_steps": 0, "min_lr_ratio": 1.0, "max_grad_norm": 1.0, "eval_at_start": False},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(out / "run")},
        "logging": {"tensorboard": False},
    }
    path = out / "coati.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, __file__, "--coati-child", str(path), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(root),
    )
    if proc.returncode != 0:
        sys.exit(f"coati-kto run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "model": str(out / "run" / "final")}


def _coati_child(path: str, overrides: list[str]) -> None:
    from coati_kto.config.load import load_config
    from coati_kto.train import train

    history = train(load_config(path, overrides)).history
    print("RESULT " + json.dumps({"kl": [h["train/kl"] for h in history if "train/kl" in h]}))


def run_trl(base: Path, data: Path, out: Path, seed: int, settings: dict, venv: Path) -> dict:
    """TRL's KTOTrainer (trl_side_by_side's child, in ``venv``) with the same hyper-parameters."""
    options = {
        "model": str(base),
        "data": str(data),
        "out": str(out / "trl-out"),
        "micro_batch": settings["micro_batch"],
        "max_length": MAX_LENGTH,
        "max_prompt_length": MAX_LENGTH,
        "bf16": False,
        "use_cpu": True,
        "steps": -1,
        "save_to": str(out / "trl-final"),
        "config": {
            "num_train_epochs": 1,
            "learning_rate": settings["lr"],
            "lr_scheduler_type": "constant",
            "warmup_steps": 0,
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "beta": BETA,
            "desirable_weight": settings["weights"][0],
            "undesirable_weight": settings["weights"][1],
            "seed": seed,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    result = trl_side_by_side.run_trl(venv, out, False, options)
    return {"kl": result["kl"], "model": str(out / "trl-final")}


# ------------------------------------------------------------------------------------------------ report
def _row(task: str, seed: int | str, tool: str, gain: float, acc: float, kl: list[float]) -> str:
    tail = statistics.fmean(kl[-10:]) if kl else float("nan")
    last = kl[-1] if kl else float("nan")
    return f"{task:<17}{seed!s:>5}  {tool:<10}{gain:>+10.3f}{acc:>10.1%}{last:>11.3f}{tail:>12.3f}"


def _summary(task: str, tool: str, gains: list[float], kls: list[float], trl_mean: float | None) -> str:
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    versus = f"{mean / trl_mean:>8.2f}x TRL" if trl_mean else ""
    return (
        f"{task:<17} mean  {tool:<10}{mean:>+10.3f}  sd {sd:.3f}  range {max(gains) - min(gains):.3f}  "
        f"train/kl {statistics.fmean(kls):.3f}{versus}"
    )


def trl_order(rows: list[dict], order: str, seed: int) -> list[dict]:
    """TRL's data order for an ablation: "shuffled" by the seed, or "mixed": shuffled, then laid out so every
    micro-batch of 8 holds 6 desirable and 2 undesirable records (as coati-kto's sampler lays out 3:1 data)."""
    rng = random.Random(seed)
    rows = rng.sample(rows, len(rows))
    if order == "shuffled":
        return rows
    good, bad = [r for r in rows if r["label"]], [r for r in rows if not r["label"]]
    out = []
    while good or bad:
        out += good[:6] + bad[:2]
        good, bad = good[6:], bad[2:]
    return out


def study_task(task: str, args: argparse.Namespace, settings: dict, venv: Path | None) -> list[str]:
    """Every seed of one task, both tools (``args.jobs`` training processes at a time); prints the rows,
    returns the summary lines."""
    from concurrent.futures import ThreadPoolExecutor

    from coati_kto.data.files import write_jsonl

    work = Path(args.work)
    base = build_base(task, settings, Path(args.base_dir or args.work))
    data = task_data(TASKS[task][0], settings["n_train"])
    train_file = write_jsonl(data["kto"], work / task.replace("/", "-") / "kto.jsonl")
    before = margins(base, base, data["heldout"])
    print(f"{task}: base mean margin {statistics.fmean(before):+.3f} on {len(before)} held-out prompts")

    def job(seed: int, tool: str) -> dict:
        out = work / task.replace("/", "-") / f"seed{seed}"
        if tool == "coati-kto":
            return run_coati(base, train_file, out, seed, settings, args.coati_root, args.override)
        trl_file = train_file
        if args.trl_order != "file":
            trl_file = write_jsonl(trl_order(data["kto"], args.trl_order, seed), out / "kto-trl.jsonl")
        return run_trl(base, trl_file, out, seed, settings, venv)

    tools = [t for t in args.tools if t == "coati-kto" or venv is not None]
    keys = [(seed, tool) for seed in args.seeds for tool in tools]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(zip(keys, pool.map(lambda k: job(*k), keys), strict=True))
    results: dict[str, tuple[list[float], list[float]]] = {}
    for (seed, tool), run in runs.items():
        after = margins(Path(run["model"]), base, data["heldout"])
        gain = statistics.fmean(after) - statistics.fmean(before)
        print(_row(task, seed, tool, gain, sum(m > 0 for m in after) / len(after), run["kl"]), flush=True)
        gains, kls = results.setdefault(tool, ([], []))
        gains.append(gain)
        kls.append(run["kl"][-1] if run["kl"] else float("nan"))
    trl_mean = statistics.fmean(results["TRL"][0]) if "TRL" in results else None
    return [
        _summary(task, tool, g, k, trl_mean if tool != "TRL" else None) for tool, (g, k) in results.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coati-child", help=argparse.SUPPRESS)  # internal: one coati-kto run's config
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--work", default="/tmp/coati_learning_study")
    p.add_argument("--venv", default=str(ROOT / ".trl-venv"), help="TRL's venv (trl_side_by_side builds it)")
    p.add_argument("--trl-spec", default="trl==1.16.0")
    p.add_argument("--no-trl", action="store_true", help="coati-kto only")
    p.add_argument("--tools", nargs="+", default=["coati-kto", "TRL"], choices=["coati-kto", "TRL"])
    p.add_argument(
        "--trl-order", choices=["file", "shuffled", "mixed"], default="file", help="TRL's data order"
    )
    p.add_argument("--weights", type=float, nargs=2, default=list(WEIGHTS), help="desirable, undesirable")
    p.add_argument("--coati-root", type=Path, default=ROOT, help="the checkout whose coati_kto trains")
    p.add_argument("--override", nargs="*", default=[], help="coati-kto config overrides (ablations)")
    p.add_argument("--jobs", type=int, default=3, help="training processes at a time")
    p.add_argument("--base-dir", help="where the SFT bases are cached (default --work)")
    p.add_argument("--smoke", action="store_true", help="tiny and fast; TRL only when --venv exists")
    args, rest = p.parse_known_args()
    if args.coati_child:
        # As the `coati-kto` entry point: the collector off through the imports (train() releases it); a
        # --coati-root from before coati_kto.runtime.startup has neither.
        with contextlib.suppress(ImportError):
            from coati_kto.runtime.startup import hold_collection

            hold_collection()
        return _coati_child(args.coati_child, rest)
    settings = {**(SMOKE if args.smoke else SETTINGS), "weights": args.weights}
    if args.smoke:  # one seed of one task: the whole path (base, both tools, evaluation) in a minute or two
        args.seeds, args.tasks = args.seeds[:1], args.tasks[:1]
        args.work = str(Path(args.work) / "smoke")
    venv: Path | None = None if args.no_trl or "TRL" not in args.tools else Path(args.venv).resolve()
    if venv is not None and args.smoke and not (venv / trl_side_by_side.SPEC_FILE).exists():
        print(f"TRL skipped: no TRL venv at {venv} (a run without --smoke builds it)")
        venv = None
    elif venv is not None:
        trl_side_by_side.ensure_trl_venv(venv, args.trl_spec)
    from coati_kto.runtime.startup import hold_collection, release_collection

    hold_collection()  # through the imports of the base's SFT and the evaluations (coati_kto.runtime.startup)
    import torch
    import transformers  # noqa: F401

    import coati_kto.testing.tiny  # noqa: F401

    release_collection()
    torch.set_num_threads(
        1
    )  # the base's SFT and the evaluations: tiny matrices, beside the training processes
    start = time.perf_counter()
    print(f"coati-kto from {args.coati_root}; overrides {args.override or 'none'}; settings {settings}")
    print(
        f"{'task':<17}{'seed':>5}  {'tool':<10}{'gain':>10}{'acc after':>10}{'train/kl':>11}{'kl last 10':>12}"
    )
    summaries = [line for task in args.tasks for line in study_task(task, args, settings, venv)]
    print("\n".join(["", *summaries, f"study took {time.perf_counter() - start:.0f} s"]))


if __name__ == "__main__":
    main()
