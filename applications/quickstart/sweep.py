"""Run the quickstart over seeds x threads per process, one run after the other, and print the band.

Every run is the full pipeline (``run.py --seed S --threads T``). Seeds change the data, the base model and
the SFT model; threads may change the order of float sums (on the 2-core VM of the band in docs/quickstart.md they did
not: 1 and 2 threads printed the same numbers). That band comes from this script. From the repo root:

    nice .venv/bin/python applications/quickstart/sweep.py --seeds 0 1 2 3 4 --threads 1 2

Each run's results.json is kept as outputs/quickstart_sweep/seed{S}_threads{T}.json (run.py clears
outputs/quickstart/ every time); the table is also written to outputs/quickstart_sweep/table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "outputs" / "quickstart_sweep"
BEFORE, AFTER = "before KTO (SFT)", "after KTO"


def run_one(seed: int, threads: int, overrides: list[str]) -> dict:
    """One full quickstart; returns its results.json plus the wall time (s)."""
    cmd = [
        sys.executable,
        str(ROOT / "applications/quickstart/run.py"),
        f"--seed={seed}",
        f"--threads={threads}",
    ]
    start = time.perf_counter()
    log = OUT / f"seed{seed}_threads{threads}.log"
    with log.open("w") as f:
        code = subprocess.call([*cmd, *overrides], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"seed {seed} threads {threads}: run.py failed with exit status {code}, see {log}")
    result = json.loads((ROOT / "outputs/quickstart/results.json").read_text())
    result["wall_s"] = time.perf_counter() - start
    (OUT / f"seed{seed}_threads{threads}.json").write_text(json.dumps(result))
    return result


def table(results: list[dict]) -> str:
    """Markdown: one row per run, then the band (min-max) of every column over the runs."""
    lines = [
        "| seed | threads | accuracy before | after | predecessor after | other after | margin before | after | wall |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        b, a = r[BEFORE], r[AFTER]
        lines.append(
            f"| {r['seed']} | {r['threads']} | {b['accuracy']:.1%} | {a['accuracy']:.1%} | {a['wrong_rate']:.1%}"
            f" | {a['other_rate']:.1%} | {b['margin']:+.2f} | {a['margin']:+.2f} | {r['wall_s']:.0f}s |"
        )

    def band(model: str, key: str, fmt: str) -> str:
        values = [r[model][key] for r in results]
        return f"{min(values):{fmt}} to {max(values):{fmt}}"

    lines.append(
        f"\nband over {len(results)} runs: accuracy {band(BEFORE, 'accuracy', '.1%')} before KTO ->"
        f" {band(AFTER, 'accuracy', '.1%')} after; other answers after {band(AFTER, 'other_rate', '.1%')};"
        f" margin {band(BEFORE, 'margin', '+.2f')} -> {band(AFTER, 'margin', '+.2f')}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "overrides", nargs="*", help="passed to run.py (section.key=value for the KTO config)"
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for threads in args.threads:
            results.append(run_one(seed, threads, args.overrides))
            r = results[-1]
            print(
                f"seed {seed} threads {threads}: {r[BEFORE]['accuracy']:.1%} -> {r[AFTER]['accuracy']:.1%},"
                f" other {r[AFTER]['other_rate']:.1%}, margin {r[AFTER]['margin']:+.2f} ({r['wall_s']:.0f}s)",
                flush=True,
            )
    report = table(results)
    (OUT / "table.md").write_text(report + "\n")
    print("\n" + report)


if __name__ == "__main__":
    main()
