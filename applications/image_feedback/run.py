"""KTO on image feedback, end to end on CPU with no downloads: a tiny Gemma 3 vision-language model learns
which colour an image is from unpaired thumbs-up / thumbs-down feedback.

1. model     a tiny random Gemma 3 VL (SigLIP tower of one layer, random projector, 2 text layers) and its
             processor (28x28 pixels, 4 image tokens), built offline into outputs/image_feedback/model
2. data      make_data.py: "What colour is this image?" feedback, 3:5 desirable:undesirable, PNGs beside the JSONL
3. before    evaluate.py: held-out accuracy of the random model (it ignores the image: 25%)
4. prepare   coati-kto prepare configs/image_feedback_cpu.yaml
5. kto       coati-kto train configs/image_feedback_cpu.yaml (one process; the tower and projector frozen)
6. after     evaluate.py on outputs/image_feedback/kto/final

Everything lands in outputs/image_feedback/ (removed first): results.md (the table) and results.json. Extra
arguments of the form section.key=value go to the KTO config (e.g. ``train.max_steps=100 kto.beta=1.0``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from make_data import COLOURS  # this script's folder is first on sys.path

if TYPE_CHECKING:
    from evaluate import Scores

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OUT = Path("outputs/image_feedback")
CONFIG = "configs/image_feedback_cpu.yaml"

# --check (CI): KTO clearly taught the model to read the image. The random model picks one colour for every
# image (25%); docs/image_feedback_plan.md §7 has the measured runs.
CHECK_MIN_GAIN = 0.4  # after - before held-out accuracy, absolute
CHECK_MIN_ACCURACY = 0.75  # after KTO
CHECK = f"held-out accuracy after KTO >= {CHECK_MIN_ACCURACY:.0%} and >= {CHECK_MIN_GAIN * 100:.0f} points above before"


def check(before: Scores, after: Scores) -> list[str]:
    """The ``--check`` thresholds ``after`` (and its gain over ``before``) misses; empty: KTO worked."""
    failures = []
    if after.accuracy < CHECK_MIN_ACCURACY:
        failures.append(f"accuracy {after.accuracy:.1%} < {CHECK_MIN_ACCURACY:.0%}")
    if after.accuracy - before.accuracy < CHECK_MIN_GAIN:
        failures.append(f"accuracy gain {after.accuracy - before.accuracy:+.1%} < {CHECK_MIN_GAIN:.0%}")
    return failures


def build_model(out: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 VL (``coati_kto.testing.tiny``'s gemma3_vl) and its processor, saved in ``out``; the
    4 colour words are whole tokens of its tokenizer (COLOURS)."""
    from coati_kto.testing.tiny import build_family_model
    from coati_kto.testing.tiny_processors import gemma3_processor

    processor = gemma3_processor()
    # One token per answer, so the accuracy measures the image -> colour decision. In the tiny byte-level
    # vocabulary the words take 2-5 tokens: a random model then ranks them by length (margin -8 nats), and
    # KTO's balanced pushes on the continuation tokens (each word is desirable for one colour, undesirable for
    # three) left "blue" and "yellow" never picked at 0.5 held-out accuracy after 300 steps.
    processor.tokenizer.add_tokens(list(COLOURS))
    build_family_model("gemma3_vl", processor.tokenizer, seed=seed).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def relocated(out: Path) -> list[str]:
    """The config overrides that move the run from OUT (the config's paths) to ``out``; none for OUT."""
    if out == OUT:
        return []
    return [
        f"model.path={out / 'model'}",
        f"data.train_files=[{out / 'data' / 'train.jsonl'}]",
        f"data.eval_files=[{out / 'data' / 'eval.jsonl'}]",
        f"output.dir={out / 'kto'}",
    ]


def stage(name: str, start: float) -> None:
    print(f"[{name}] done in {time.perf_counter() - start:.1f}s", flush=True)


def sh(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run a command from the repo root, echoing it; stop the pipeline if it fails."""
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code != 0:
        sys.exit(f"command failed with exit status {code}: {' '.join(cmd)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="model, data and KTO seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every stage; default 1")
    parser.add_argument("--check", action="store_true", help="exit 1 unless KTO clearly worked (see CHECK)")
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"where everything goes, from the repo root (default {OUT})"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value for the KTO config")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    os.chdir(ROOT)
    sys.path.insert(0, str(HERE))
    # Threads that spin while another process holds the core are ruinous on a busy machine (the quickstart's note).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from evaluate import evaluate, table
    from make_data import N_DESIRABLE, N_UNDESIRABLE, write_data

    torch.set_num_threads(args.threads)
    begin = time.perf_counter()
    out = args.out
    shutil.rmtree(out, ignore_errors=True)

    t = time.perf_counter()
    build_model(out / "model", args.seed)
    paths = write_data(out / "data", args.seed)
    print(f"KTO data: {N_DESIRABLE} desirable : {N_UNDESIRABLE} undesirable -> {paths['train']}")
    stage("model and data", t)

    t = time.perf_counter()
    results = {"before KTO (random)": evaluate(out / "model", paths["held_out"])}
    stage("evaluate before", t)

    overrides = [f"train.seed={args.seed}", *relocated(out), *args.overrides]
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    t = time.perf_counter()
    sh([sys.executable, "-m", "coati_kto", "prepare", CONFIG, *overrides], env=env)
    stage("prepare", t)

    t = time.perf_counter()
    sh([sys.executable, "-m", "coati_kto", "train", CONFIG, *overrides], env=env)
    stage("kto", t)

    t = time.perf_counter()
    results["after KTO"] = evaluate(out / "kto" / "final", paths["held_out"])
    stage("evaluate after", t)

    n = results["after KTO"].n
    report = (
        f"{n} held-out images (never in a training record), the best of 4 colour words:\n{table(results)}\n"
    )
    (out / "results.md").write_text(report)
    (out / "results.json").write_text(
        json.dumps({"seed": args.seed, "threads": args.threads} | {k: asdict(v) for k, v in results.items()})
    )
    print(f"\n{report}\n(also in {out}/results.md)")
    print(f"total wall time {time.perf_counter() - begin:.0f}s")
    failures = check(results["before KTO (random)"], results["after KTO"])
    if args.check and failures:
        sys.exit("check failed: KTO did not clearly work: " + "; ".join(failures))
    if args.check:
        print("check passed: " + CHECK)


if __name__ == "__main__":
    main()
