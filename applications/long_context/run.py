"""Long feedback on 2 CPU processes: 16 agent traces of ~8k tokens trained with each row split over 2 ranks.

1. data      make_data.py: synthetic tool-use traces (~8k tokens), the verdict on the final answer
2. base      a tiny random Llama with 16k positions and the ChatML tokenizer of ``coati-kto tiny-model``
3. kto       coati-kto train configs/long_context_cpu.yaml --nproc-per-node 2   (plugin.sp_size 2)

Everything lands in outputs/long_context/ (removed first). Extra section.key=value arguments go to the config,
e.g. ``plugin.sp_size=1`` for the same run with whole rows on each rank (launched on one process then).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "outputs" / "long_context"
CONFIG = "configs/long_context_cpu.yaml"


def write_model(out: Path) -> None:
    """The tiny-model Llama (hidden 64, 2 layers, 4 heads, 4 key-value heads) with 16k positions."""
    from coati_kto.models.tiny import build_llama, chatml_tokenizer

    tokenizer = chatml_tokenizer()
    build_llama(tokenizer, hidden_size=64, num_layers=2, max_positions=16384).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="section.key=value for the config")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from make_data import write

    shutil.rmtree(OUT, ignore_errors=True)
    print(f"wrote {write(OUT)}", flush=True)
    write_model(OUT / "model")
    sp = next((int(o.split("=", 1)[1]) for o in args.overrides if o.startswith("plugin.sp_size=")), 2)
    command = [
        sys.executable,
        "-m",
        "coati_kto",
        "train",
        CONFIG,
        *args.overrides,
        "--nproc-per-node",
        str(sp),
    ]
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    if (code := subprocess.call(command, cwd=ROOT)) != 0:
        sys.exit(f"command failed with exit status {code}")
    print(
        f"trained 4 steps of ~8k-token rows at plugin.sp_size {sp} in {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
