"""The family sweep: every causal-LM model type transformers builds tiny, through the lifecycle on each plugin.

For each model type (coati_kto.testing.tiny_types: its default config shrunk), on 2 gloo processes and each plugin
of ``PLUGINS`` (low_level_zero and hybrid_parallel at tp_size 1, both ZeRO-2 bf16, the default): config load (a
refusal is recorded with its one line), 2 optimizer steps saving at step 1 and at the end, the Hugging Face
export; a second run resuming from step 1. A cell is ``trained`` only when the numbers hold: the first step's
rewards and KL (raw, before the clamp) exactly 0, every weight of the resumed run equal to the uninterrupted
run's, the export reloaded (the class training loads) with the trained weights and log-probs within bf16
rounding. Otherwise the cell says what failed, in one line.

    python tests/distributed/family_sweep.py --write docs/family_sweep.md   # every type (1-6 min a type on 2 busy cores)
    python tests/distributed/family_sweep.py --types qwen3_5 gemma4_text  # some, the table printed

tests/distributed/test_family_sweep.py runs a representative subset in the normal suite and the whole sweep
under the ``slow`` marker.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers when run as a script
from helpers import CORPUS, chat_records  # noqa: E402

from coati_kto.data.files import write_jsonl  # noqa: E402
from coati_kto.testing.distributed import run_distributed  # noqa: E402

PLUGINS: dict[str, dict[str, Any]] = {
    "low_level_zero": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_parallel tp1": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}
# Swept first (the families people align today), then every other type in name order.
FIRST = (
    "qwen3_5",
    "qwen3_5_text",
    "gemma4",
    "gemma4_text",
    "phi3",
    "olmo",
    "olmo2",
    "olmo3",
    "granite",
    "cohere",
    "cohere2",
    "opt",
    "gpt_oss",
    "qwen3_moe",
    "qwen3_next",
    "mixtral",
    "deepseek_v3",
    "qwen3_5_moe",
    "bloom",
)
REFUSAL = "I cannot help with that. Sorry."


def raw_config(model_dir: str, root: Path, plugin: dict[str, Any], out: str) -> dict[str, Any]:
    return {
        "model": {"path": model_dir},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
        },
        "train": {"micro_batch_size": 2, "max_steps": 2, "lr": 2e-2, "seed": 3},
        "plugin": plugin,
        "output": {"dir": str(root / out), "save_interval": 1},
        "logging": {"tensorboard": False},
    }


def _export_check(
    model_dir: str,
    final: Path,
    trained: dict[str, torch.Tensor],
    passes: Any,
    batch: Any,
    logps: torch.Tensor,
    dtype: torch.dtype,
) -> str | None:
    """Why the export at ``final`` is not the trained policy (None when it is); rank 0."""
    from transformers import AutoConfig

    from coati_kto.families import auto_model_class

    hf = auto_model_class(AutoConfig.from_pretrained(final)).from_pretrained(final, dtype=dtype)
    state = hf.state_dict()
    missing = sorted(set(trained) - set(state))
    if missing:
        return f"export lacks {missing[:3]}"
    diff = max(float((state[k].float() - v.float()).abs().max()) for k, v in trained.items())
    if diff != 0.0:
        return f"exported weights differ from the trained ones by {diff:.3g}"
    with torch.no_grad():
        gap = float((passes._sequence_logps(hf, batch.example) - logps).abs().max())
    if gap > 5e-4 * float(logps.abs().max()) + 1e-6:
        return f"exported log-probs differ from the trained policy's by {gap:.3g}"
    return None


def lifecycle(model_dir: str, root: Path, plugin: dict[str, Any]) -> dict[str, Any]:
    """Train, resume, export and reload on every rank; the numbers of each, and the first failed check."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.prepared import load_prepared
    from coati_kto.parallel.distributed import barrier
    from coati_kto.train import train

    config = Config.model_validate(raw_config(model_dir, root, plugin, "run"))
    data = load_prepared(config)
    batch = KTOCollator(AutoTokenizer.from_pretrained(model_dir).pad_token_id)(
        [data.train[i] for i in range(4)]
    )
    first = train(config)
    step1 = {k: first.history[0].get(f"train/{k}") for k in ("rewards/chosen", "rewards/rejected", "kl_raw")}
    trained = {k: v.detach().clone() for k, v in first.policy.unwrap().state_dict().items()}
    with torch.no_grad():
        logps = first.passes._sequence_logps(first.policy, batch.example)
    resumed_raw = raw_config(model_dir, root, plugin, "resumed")
    resumed_raw["train"]["resume"] = str(root / "run" / "checkpoints" / "step-1")
    resumed_raw["output"]["save_final"] = False
    second = train(Config.model_validate(resumed_raw))
    resumed = second.policy.unwrap().state_dict()
    resume_diff = max(float((v.float() - resumed[k].float()).abs().max()) for k, v in trained.items())
    result: dict[str, Any] = {"step1": step1, "resume_diff": resume_diff, "resumed_step": second.global_step}
    if dist.get_rank() == 0:
        result["export"] = _export_check(
            model_dir, root / "run" / "final", trained, first.passes, batch, logps, second.plan.dtype
        )
    barrier()
    return result


def verdict(rank_results: list[dict[str, Any]]) -> str:
    """``trained``, or the first check that failed on any rank, in one line."""
    for r in rank_results:
        if "error" in r:
            return "fails: " + r["error"]
        if any(v != 0.0 for v in r["step1"].values()):
            return f"fails: step-1 rewards / KL not 0 ({r['step1']})"
        if r["resumed_step"] != 2 or r["resume_diff"] != 0.0:
            return f"fails: resume not bit-exact (max weight difference {r['resume_diff']:.3g})"
        if r.get("export"):
            return "fails: " + r["export"]
    return "trained"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
    return (text[0] if text else type(exc).__name__)[:200] + place


def run_cells(cells: list[tuple[str, str, str]], root: str) -> dict[str, Any]:
    """Each ``(model type, model dir, plugin)`` cell's lifecycle in turn on this rank, keyed ``type/plugin``;
    stops at the first failure (the ranks may no longer agree on their collectives), leaving the rest for a
    fresh set of processes. Each result is also appended to ``root/cells-<rank>.jsonl`` as it completes, so a
    set killed later (the OOM killer, a hang) keeps what it finished."""
    import gc

    import torch.distributed as dist

    out: dict[str, Any] = {}
    for model_type, model_dir, name in cells:
        key = f"{model_type}/{name}"
        try:
            out[key] = lifecycle(model_dir, Path(root) / model_type / name.replace(" ", "_"), PLUGINS[name])
        except Exception as exc:
            out[key] = {"error": _one_line(exc)}
        with open(Path(root) / f"cells-{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps({key: out[key]}) + "\n")
        gc.collect()  # the trainers of this cell: a set of processes runs several cells
        if "error" in out[key]:
            break
    return out


def _finished(root: Path) -> list[dict[str, Any]]:
    """What each rank appended to ``root/cells-<rank>.jsonl`` (``run_cells``), read after its set ended."""
    ranks = []
    for rank in range(2):
        path = root / f"cells-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        ranks.append({k: v for line in lines for k, v in json.loads(line).items()})
        path.unlink(missing_ok=True)
    return ranks


def refusal(model_dir: str, root: Path, plugin: dict[str, Any]) -> str | None:
    """The one line config load refuses ``plugin`` with for the model (None when admitted)."""
    from pydantic import ValidationError

    from coati_kto.config.schema import Config

    try:
        Config.model_validate(raw_config(model_dir, root, plugin, "run"))
    except ValidationError as err:
        return "refused: " + "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
    return None


def admitted_cells(model_types: list[str], root: Path, tokenizer: Any) -> tuple[dict, list]:
    """Build every type's tiny model under ``root``; the verdicts known without training ("not built tiny",
    "refused") and the ``(type, model dir, plugin)`` cells left to run."""
    from coati_kto.testing.tiny_types import save_tiny_type

    verdicts: dict[str, dict[str, str]] = {t: {} for t in model_types}
    cells = []
    for model_type in model_types:
        try:
            model_dir = str(save_tiny_type(model_type, root / model_type / "model", tokenizer))
        except Exception as exc:
            verdicts[model_type] = dict.fromkeys(PLUGINS, "not built tiny: " + _one_line(exc))
            continue
        for name, plugin in PLUGINS.items():
            cell_root = root / model_type / name.replace(" ", "_")
            write_jsonl(chat_records(12, REFUSAL), cell_root / "train.jsonl")
            why = refusal(model_dir, cell_root, plugin)
            if why is None:
                cells.append((model_type, model_dir, name))
            else:
                verdicts[model_type][name] = why
    return verdicts, cells


def sweep(model_types: list[str], root: Path, tokenizer: Any, batch: int = 4, log: Any = None) -> dict:
    """``{type: {plugin: verdict}}``: the cells run ``batch`` at a time on one set of 2 processes (a failed cell
    ends its set; the next set starts after it). ``log(type, verdicts)`` is called as each type completes."""
    verdicts, cells = admitted_cells(model_types, root, tokenizer)
    while cells:
        chunk = cells[:batch]
        try:
            run_distributed(run_cells, 2, chunk, str(root), timeout_s=300 + 600 * len(chunk))
            why = None
        except RuntimeError as err:  # a rank died or hung: the first cell it did not finish takes the blame
            why = str(err).strip().splitlines()[-1][:200]
        ranks = _finished(root)
        for model_type, _, name in chunk:
            key = f"{model_type}/{name}"
            finished = key in ranks[0] and key in ranks[1]
            if not finished and why is None:
                break
            verdicts[model_type][name] = verdict([r[key] for r in ranks]) if finished else f"fails: {why}"
            cells.pop(0)
            if log is not None and len(verdicts[model_type]) == len(PLUGINS):
                log(model_type, verdicts[model_type])
            if not finished:
                break
    return {t: {p: verdicts[t][p] for p in PLUGINS} for t in model_types}


def markdown(results: dict[str, dict[str, str]], date: str, seconds: float) -> str:
    """The docs table: one row per model type, one column per plugin."""
    import transformers

    trained = {p: sum(r[p].startswith("trained") for r in results.values()) for p in PLUGINS}
    first = [r[next(iter(PLUGINS))] for r in results.values()]
    built = sum(not c.startswith(("not built", "not run")) for c in first)
    not_run = sum(c.startswith("not run") for c in first)
    lines = [
        "# Model families: the sweep",
        "",
        f"Generated by `python tests/distributed/family_sweep.py --write docs/family_sweep.md` on {date} (transformers "
        f"{transformers.__version__}, torch {torch.__version__}, 2 gloo processes on CPU, {seconds / 60:.0f} min). "
        f"{len(results)} causal-LM model types; {not_run} not run (time limit); {built} run, built tiny from their "
        "default configs; trained: "
        + ", ".join(f"{p} {n}" for p, n in trained.items())
        + ". A cell is `trained` when the first step's rewards and KL are exactly 0, the resumed run's weights "
        "equal the uninterrupted run's bit for bit, and the export reloads with the trained weights and log-probs. "
        "Plugins: ZeRO-2 bf16. Tensor parallelism (tp_size 2): [families.md](families.md).",
        "",
        "| model type | " + " | ".join(PLUGINS) + " |",
        "| --- | " + " | ".join("---" for _ in PLUGINS) + " |",
    ]
    for model_type, cells in results.items():
        lines.append(f"| {model_type} | " + " | ".join(cells[p].replace("|", "/") for p in PLUGINS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from coati_kto.testing.tiny import build_tokenizer
    from coati_kto.testing.tiny_types import causal_lm_types

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--write", help="write the markdown table here")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--minutes", type=float, help="start no model type after this many minutes")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    started, done = time.perf_counter(), {}

    def log(model_type: str, cells: dict[str, str]) -> None:
        done[model_type] = cells
        print(model_type, json.dumps(cells), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(done, indent=1))

    every = causal_lm_types()
    ordered = args.types or [t for t in FIRST if t in every] + [t for t in every if t not in FIRST]
    results: dict[str, dict[str, str]] = {}
    for i in range(0, len(ordered), 2):  # two types (four cells) per set of processes
        if args.minutes and time.perf_counter() - started > 60 * args.minutes:
            stop = f"not run: the sweep's time limit ({args.minutes} min) ended first"
            results.update({t: dict.fromkeys(PLUGINS, stop) for t in ordered[i:]})
            break
        with tempfile.TemporaryDirectory() as root:
            results.update(sweep(ordered[i : i + 2], Path(root), tokenizer, log=log))
    table = markdown(results, datetime.date.today().isoformat(), time.perf_counter() - started)
    if args.write:
        Path(args.write).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
