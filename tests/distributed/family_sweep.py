"""The family sweep: every causal-LM model type transformers builds tiny, through the lifecycle on each plugin.

For each model type (coati_kto.testing.tiny_types: its default config shrunk), on 2 gloo processes and each plugin
of ``PLUGINS`` (low_level_zero and hybrid_parallel at tp_size 1, both ZeRO-2 bf16, the default): config load (a
refusal is recorded with its one line), 2 optimizer steps saving at step 1 and at the end, the Hugging Face
export; a second run resuming from step 1. A cell is ``trained`` only when the numbers hold: the first step's
rewards and KL (raw, before the clamp) exactly 0, every weight of the resumed run equal to the uninterrupted
run's, the export reloaded (the class training loads) with the trained weights and log-probs within bf16
rounding; for an MoE with transformers' Switch load-balancing loss (its tiny config asks for router logits) also
``train/aux_loss`` logged, finite and > 0. Otherwise the cell says what failed, in one line.

Cheap per type: a type whose built model is not causal (its logits at a position move when a later token does:
an encoder such as BERT without ``is_decoder``) is recorded in the parent, no process spawned; one set of 2
processes runs many cells (after ``gc.freeze()`` of the imports: ColossalAI's group teardown runs gc.collect per
run), and goes on past a cell that failed with the same error on both ranks (both left its collectives at the
same point); a cell that fails otherwise, or runs past ``CELL_TIMEOUT_S``, ends its set.

    python tests/distributed/family_sweep.py --write docs/family_sweep.md   # every type
    python tests/distributed/family_sweep.py --types qwen3_moe mixtral      # some, the table printed
    python tests/distributed/family_sweep.py --types bart git --plugins ddp # on another plugin (OTHER_PLUGINS)

tests/distributed/test_family_sweep.py runs a representative subset in the normal suite and the whole sweep
under the ``sweep`` marker (``make test-all``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
# Columns the sweep can run instead (``--plugins``), not swept by default: the torch DDP paths.
OTHER_PLUGINS: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp", "precision": "fp32"},
    "hybrid_parallel zero0 fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
}
# Swept first (the MoE families, then the families people align today), then every other type in name order.
FIRST = (
    "gpt_oss",
    "qwen3_moe",
    "qwen3_next",
    "mixtral",
    "deepseek_v3",
    "qwen3_5_moe",
    "qwen2_moe",
    "olmoe",
    "granitemoe",
    "phimoe",
    "dbrx",
    "jetmoe",
    "ernie4_5_moe",
    "flex_olmo",
    "opt",
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


CELL_TIMEOUT_S = 600  # a cell (two runs, export, reload) past this is hung: its rank exits, the set ends


def _export_check(
    model_dir: str,
    final: Path,
    trained: dict[str, torch.Tensor],
    passes: Any,
    batch: Any,
    logps: torch.Tensor,
    dtype: torch.dtype,
) -> str | None:
    """Why the export at ``final`` is not the trained policy (None when it is); rank 0. Never raises (rank 1
    waits in the barrier after it): a failure is the reason."""
    from transformers import AutoConfig

    from coati_kto.families import auto_model_class

    try:
        hf = auto_model_class(AutoConfig.from_pretrained(final)).from_pretrained(final, dtype=dtype)
        state = hf.state_dict()
        missing = sorted(set(trained) - set(state))
        if missing:
            return f"export lacks {missing[:3]}"
        diff = max(float((state[k].float() - v.float()).abs().max()) for k, v in trained.items())
        if diff != 0.0:
            return f"exported weights differ from the trained ones by {diff:.3g}"
        with torch.no_grad():
            gap = float((passes.completion_logps(hf, batch.example) - logps).abs().max())
    except Exception as exc:
        return "export reload: " + _one_line(exc)
    if gap > 5e-4 * float(logps.abs().max()) + 1e-6:
        return f"exported log-probs differ from the trained policy's by {gap:.3g}"
    return None


def lifecycle(model_dir: str, root: Path, plugin: dict[str, Any]) -> dict[str, Any]:
    """Train, resume, export and reload on every rank; the numbers of each, and the first failed check."""
    import torch.distributed as dist
    from helpers import data_settings
    from transformers import AutoTokenizer

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.prepared import load_prepared
    from coati_kto.parallel.distributed import barrier
    from coati_kto.train import train

    config = Config.model_validate(raw_config(model_dir, root, plugin, "run"))
    data = load_prepared(*data_settings(config))
    batch = KTOCollator(AutoTokenizer.from_pretrained(model_dir).pad_token_id)(
        [data.train[i] for i in range(4)]
    )
    first = train(config)
    step1 = {k: first.history[0].get(f"train/{k}") for k in ("rewards/chosen", "rewards/rejected", "kl_raw")}
    trained = {k: v.detach().clone() for k, v in first.policy.unwrap().state_dict().items()}
    with torch.no_grad():
        logps = first.passes.completion_logps(first.policy, batch.example)
    resumed_raw = raw_config(model_dir, root, plugin, "resumed")
    resumed_raw["train"]["resume"] = str(root / "run" / "checkpoints" / "step-1")
    resumed_raw["output"]["save_final"] = False
    second = train(Config.model_validate(resumed_raw))
    resumed = second.policy.unwrap().state_dict()
    resume_diff = max(float((v.float() - resumed[k].float()).abs().max()) for k, v in trained.items())
    result: dict[str, Any] = {"step1": step1, "resume_diff": resume_diff, "resumed_step": second.global_step}
    result["aux_loss"] = first.history[0].get("train/aux_loss")
    if dist.get_rank() == 0:
        result["export"] = _export_check(
            model_dir, root / "run" / "final", trained, first.passes, batch, logps, second.plan.dtype
        )
    barrier()
    return result


def verdict(rank_results: list[dict[str, Any]], moe: bool = False) -> str:
    """``trained``, or the first check that failed on any rank, in one line. ``moe``: the model's config asks
    for router logits and its family has the Switch load-balancing loss, so ``train/aux_loss`` must be logged,
    finite and > 0."""
    for r in rank_results:
        if "error" in r:
            return "fails: " + r["error"]
        if any(v != 0.0 for v in r["step1"].values()):
            return f"fails: step-1 rewards / KL not 0 ({r['step1']})"
        if r["resumed_step"] != 2 or r["resume_diff"] != 0.0:
            return f"fails: resume not bit-exact (max weight difference {r['resume_diff']:.3g})"
        if r.get("export"):
            return "fails: " + r["export"]
        aux = r.get("aux_loss")
        if moe and not (aux is not None and math.isfinite(aux) and aux > 0):
            return f"fails: MoE router load-balancing loss not added (train/aux_loss {aux})"
    return "trained (aux loss added)" if moe else "trained"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
    return (text[0] if text else type(exc).__name__)[:200] + place


def _record(root: str, rank: int, key: str, value: dict[str, Any]) -> None:
    with open(Path(root) / f"cells-{rank}.jsonl", "a") as f:
        f.write(json.dumps({key: value}) + "\n")


def _agree(root: str, rank: int, key: str, mine: dict[str, Any], wait_s: float = 120.0) -> bool:
    """Whether every other rank ended cell ``key`` as this one did: all without an error, or all with the same
    one (read from its cells file, no collective: the ranks may disagree on theirs). Waits up to ``wait_s`` for
    them to finish the cell; a rank that never does (hung) disagrees."""
    deadline = time.monotonic() + wait_s
    others = [r for r in range(2) if r != rank]
    while time.monotonic() < deadline:
        seen = [
            {k: v for line in _lines(Path(root) / f"cells-{r}.jsonl") for k, v in line.items()}
            for r in others
        ]
        if all(key in s for s in seen):
            return all(s[key].get("error") == mine.get("error") for s in seen)
        time.sleep(0.2)
    return False


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_cells(cells: list[tuple[str, str, str, bool, dict]], root: str) -> dict[str, Any]:
    """Each ``(model type, model dir, plugin name, moe, plugin section)`` cell's lifecycle in turn on this rank, keyed ``type/plugin``,
    each appended to ``root/cells-<rank>.jsonl`` as it completes (a set killed later keeps what it finished).
    Goes on while the ranks end each cell alike (all passed it, or all failed it with the same error); stops
    otherwise (the ranks may no longer agree on their collectives), leaving the rest for a fresh set. A cell past ``CELL_TIMEOUT_S`` records
    ``hung`` and exits the process."""
    import gc
    import os
    import threading

    import torch.distributed as dist

    import coati_kto.train  # noqa: F401  (imported before the freeze: gc then skips every module's objects)

    gc.collect()
    gc.freeze()
    rank, out = dist.get_rank(), {}
    for model_type, model_dir, name, _, plugin in cells:
        key = f"{model_type}/{name}"

        def hung(key: str = key) -> None:
            _record(root, rank, key, {"error": f"hung: the cell ran past {CELL_TIMEOUT_S} s"})
            os._exit(3)

        watchdog = threading.Timer(CELL_TIMEOUT_S, hung)
        watchdog.daemon = True
        watchdog.start()
        try:
            out[key] = lifecycle(model_dir, Path(root) / model_type / name.replace(" ", "_"), plugin)
        except Exception as exc:
            out[key] = {"error": _one_line(exc)}
        finally:
            watchdog.cancel()
        _record(root, rank, key, out[key])
        gc.collect()  # the trainers of this cell
        if not _agree(
            root, rank, key, out[key]
        ):  # a rank failed alone, or hung: the collectives may disagree
            break
    return out


def _finished(root: Path) -> list[dict[str, Any]]:
    """What each rank appended to ``root/cells-<rank>.jsonl`` (``run_cells``), read after its set ended."""
    ranks = []
    for rank in range(2):
        path = root / f"cells-{rank}.jsonl"
        ranks.append({k: v for line in _lines(path) for k, v in line.items()})
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


def probe(model_dir: str) -> tuple[str | None, bool]:
    """(why the built model is no causal LM, or None; whether it is an MoE with transformers' Switch
    load-balancing loss, its config then set to ask for router logits). In this process: fp32 forwards of one
    row and of the row with its last token changed; a causal LM's logits before it do not move."""
    from transformers import AutoConfig

    from coati_kto.families import auto_model_class
    from coati_kto.models.router import RouterLoss, _text_config

    try:
        model = auto_model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir).eval()
        ids = torch.arange(3, 15)[None]
        with torch.no_grad():
            a, b = (
                model(input_ids=x).logits[0, :-1].float()
                for x in (ids, torch.cat([ids[:, :-1], ids[:, :1]], 1))
            )
    except Exception:  # the cells' runs will say why
        return None, False
    if not torch.allclose(a, b, rtol=0, atol=1e-5):
        moved = float((a - b).abs().max())
        return f"not causal: its logits move by {moved:.2g} when a later token changes (an encoder)", False
    moe = RouterLoss.supported(model) is not None
    if moe:  # the MoE cells train with the loss its authors add (kto.router_aux_loss_coef auto)
        _text_config(model.config).output_router_logits = True
        model.config.save_pretrained(model_dir)
    return None, moe


def admitted_cells(model_types: list[str], root: Path, tokenizer: Any) -> tuple[dict, list]:
    """Build every type's tiny model under ``root``; the verdicts known without training ("not built tiny",
    "not causal", "refused") and the ``(type, model dir, plugin name, moe, plugin)`` cells left to run."""
    from coati_kto.testing.tiny_types import save_tiny_type

    verdicts: dict[str, dict[str, str]] = {t: {} for t in model_types}
    cells = []
    for model_type in model_types:
        try:
            model_dir = str(save_tiny_type(model_type, root / model_type / "model", tokenizer))
        except Exception as exc:
            # Config load reads only config.json's model_type to refuse a type it does not admit: that line is
            # what a user of the type gets, so it is the cell; a type still admitted is "not built tiny".
            write_jsonl(chat_records(12, REFUSAL), root / model_type / "train.jsonl")
            (root / model_type / "refused").mkdir(parents=True, exist_ok=True)
            (root / model_type / "refused" / "config.json").write_text(json.dumps({"model_type": model_type}))
            built = "not built tiny: " + _one_line(exc)
            verdicts[model_type] = {
                name: refusal(str(root / model_type / "refused"), root / model_type, plugin) or built
                for name, plugin in PLUGINS.items()
            }
            continue
        not_causal, moe = probe(model_dir)
        if not_causal:
            verdicts[model_type] = dict.fromkeys(PLUGINS, not_causal)
            continue
        for name, plugin in PLUGINS.items():
            cell_root = root / model_type / name.replace(" ", "_")
            write_jsonl(chat_records(12, REFUSAL), cell_root / "train.jsonl")
            why = refusal(model_dir, cell_root, plugin)
            if why is None:
                cells.append((model_type, model_dir, name, moe, plugin))
            else:
                verdicts[model_type][name] = why
    return verdicts, cells


def sweep(model_types: list[str], root: Path, tokenizer: Any, log: Any = None) -> dict:
    """``{type: {plugin: verdict}}``: the cells run on one set of 2 processes, a fresh set after one that ended
    early. ``log(type, verdicts)`` is called as each type completes."""
    verdicts, cells = admitted_cells(model_types, root, tokenizer)
    for model_type in model_types:
        if log is not None and len(verdicts[model_type]) == len(PLUGINS):
            log(model_type, verdicts[model_type])
    while cells:
        try:
            run_distributed(run_cells, 2, cells, str(root), timeout_s=300 + CELL_TIMEOUT_S * len(cells))
            why = None
        except RuntimeError as err:  # a rank died or hung: the first cell it did not finish takes the blame
            why = str(err).strip().splitlines()[-1][:200]
        ranks = _finished(root)
        while cells:
            model_type, _, name, moe, _ = cells[0]
            key = f"{model_type}/{name}"
            finished = key in ranks[0] and key in ranks[1]
            if not finished and why is None:
                break
            verdicts[model_type][name] = (
                verdict([r[key] for r in ranks], moe) if finished else f"fails: {why}"
            )
            cells.pop(0)
            if log is not None and len(verdicts[model_type]) == len(PLUGINS):
                log(model_type, verdicts[model_type])
            if not finished:
                break
    return {t: {p: verdicts[t][p] for p in PLUGINS} for t in model_types}


def tally(results: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """Per plugin: how many cells are trained, refused at config load, fail, not causal, not built, not run."""
    kinds = ("trained", "refused", "fails", "not causal", "not built", "not run")
    return {p: {k: sum(r[p].startswith(k) for r in results.values()) for k in kinds} for p in PLUGINS}


def markdown(results: dict[str, dict[str, str]], date: str, seconds: float, kept: int = 0) -> str:
    """The docs table: one row per model type, one column per plugin, and the tally of its cells; ``kept``: how
    many rows come from an earlier run (``--previous``)."""
    import transformers

    counts = tally(results)
    ran = len(results) - next(iter(counts.values()))["not run"]
    summary = "; ".join(
        f"{p}: " + ", ".join(f"{k} {n}" for k, n in c.items() if n) for p, c in counts.items()
    )
    lines = [
        "# Model families: the sweep",
        "",
        f"Generated by `python tests/distributed/family_sweep.py --write docs/family_sweep.md` on {date} (transformers "
        f"{transformers.__version__}, torch {torch.__version__}, 2 gloo processes on CPU; this run took {seconds / 60:.0f} min). "
        f"{len(results)} causal-LM model types, {ran} of them run (built tiny from their default configs), "
        f"the rest `not run` (the sweep's time limit)"
        + (f"; {kept} rows kept from an earlier run of the script (`--previous`)" if kept else "")
        + f". {summary}. A cell is `trained` when the first step's rewards "
        "and KL are exactly 0, the resumed run's weights equal the uninterrupted run's bit for bit, and the export "
        "reloads with the trained weights and log-probs; `trained (aux loss added)`: an MoE whose config asks for "
        "router logits, its `train/aux_loss` also logged and > 0. `not causal`: the built model's logits move "
        "when a later token changes (an encoder), so it is no KTO policy. Plugins: ZeRO-2 bf16. Tensor "
        "parallelism (tp_size 2): [families.md](families.md).",
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
    parser.add_argument("--chunk", type=int, default=8, help="model types per set of processes (default 8)")
    parser.add_argument(
        "--previous", help="an earlier run's --json: its verdicts kept for the types not run now"
    )
    parser.add_argument(
        "--plugins",
        nargs="*",
        choices=[*PLUGINS, *OTHER_PLUGINS],
        help=f"columns to run (default: {', '.join(PLUGINS)})",
    )
    args = parser.parse_args(argv)
    if args.plugins:  # the parent's columns; the ranks get each cell's plugin section with the cell
        known = {**PLUGINS, **OTHER_PLUGINS}
        PLUGINS.clear()
        PLUGINS.update({name: known[name] for name in args.plugins})
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    started, done = time.perf_counter(), {}

    def log(model_type: str, cells: dict[str, str]) -> None:
        done[model_type] = cells
        print(model_type, json.dumps(cells), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(done, indent=1))

    every = causal_lm_types()
    default = [t for t in FIRST if t in every] + [t for t in every if t not in FIRST]
    earlier = json.loads(Path(args.previous).read_text()) if args.previous else {}
    previous = {t: v for t, v in earlier.items() if not v[next(iter(PLUGINS))].startswith("not run")}
    ordered = args.types or [t for t in default if t not in previous]
    results: dict[str, dict[str, str]] = {}
    for i in range(0, len(ordered), args.chunk):  # one set of processes per chunk (more after a failure)
        if args.minutes and time.perf_counter() - started > 60 * args.minutes:
            stop = f"not run: the sweep's time limit ({args.minutes} min) ended first"
            results.update({t: dict.fromkeys(PLUGINS, stop) for t in ordered[i:]})
            break
        with tempfile.TemporaryDirectory() as root:
            results.update(sweep(ordered[i : i + args.chunk], Path(root), tokenizer, log=log))
    kept = [t for t in previous if t not in results]
    if previous:  # the whole table: this run's verdicts, the earlier run's for the rest
        none = dict.fromkeys(PLUGINS, "not run: neither this run nor the earlier one reached it")
        results = {t: results.get(t) or previous.get(t) or none for t in default}
    table = markdown(results, datetime.date.today().isoformat(), time.perf_counter() - started, len(kept))
    if args.write:
        Path(args.write).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
