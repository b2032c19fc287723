"""Pad fraction of the tokens each pass processes: padded batches against padding-free rows (data.padding_free).

    PYTHONPATH=. python benchmarks/padding_bench.py [--config configs/quickstart_cpu.yaml] [--rows 4096]
    PYTHONPATH=. python benchmarks/padding_bench.py --smoke

Micro-batches of 8 rows in random order go through the real KTOCollator; a pass processes R x L tokens of its
layout (R rows, L columns). Per data shape and layout, printed: the pad fraction = 1 - data tokens / processed
tokens, for the examples' pass, the KL pairs' pass and the shared-prompt pairs pass, padded as the trainer pads
(to the micro-batch's longest row, and with ``pad_to_multiple_of: 64`` as the GPU configs do) and padding-free:
``bins`` (rows as long as the longest document: what eager and sdpa run) and ``free`` (one row: flex attention).

Shapes (lengths only matter): ``tool_use`` and ``half`` as gpu_bench.py draws them (rows up to 1024 tokens),
``long_tail`` (log-normal row lengths, median 180 tokens, sigma 1, at most 2048: chat data), and the quickstart's
prepared data when ``--config`` names a prepared dir (``make quickstart`` builds it).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MICRO_BATCH, SHAPES  # noqa: E402

from coati_kto.data.inspect import pad_fractions  # noqa: E402


def synthetic_rows(shape: str, n: int, max_length: int, seed: int = 0) -> list[dict]:
    """Rows whose (prompt, completion, KL completion) lengths follow ``shape``; token ids are arbitrary."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if shape == "long_tail":
            total = min(2 * max_length, max(4, int(rng.lognormvariate(math.log(180), 1.0))))
            p = max(1, int(total * rng.uniform(0.2, 0.8)))
            c, kc = max(1, total - p), max(1, int(rng.lognormvariate(math.log(max(2, total - p)), 0.3)))
        else:
            (p_lo, p_hi), (c_lo, c_hi) = SHAPES[shape]
            p = rng.randint(max(1, int(p_lo * max_length)), int(p_hi * max_length))
            c = rng.randint(max(1, int(c_lo * max_length)), max(1, int(c_hi * max_length)))
            kc = rng.randint(max(1, int(c_lo * max_length)), max(1, int(c_hi * max_length)))
        prompt = [3] * p
        rows.append(
            {
                "input_ids": prompt + [4] * c,
                "completion_start": p,
                "label": i % 2 == 0,
                "kl_input_ids": prompt + [5] * kc,
                "kl_completion_start": p,
            }
        )
    return rows


def prepared_rows(config_path: str) -> list[dict] | None:
    from coati_kto.config.load import load_config
    from coati_kto.data.store import read_prepared

    config = load_config(config_path)
    if not (Path(config.data.prepared_dir) / "stats.json").is_file():
        return None
    train = read_prepared(config.data.prepared_dir).train
    keys = ["input_ids", "completion_start", "label", "kl_input_ids", "kl_completion_start"]
    return [dict(zip(keys, values, strict=True)) for values in zip(*(train[k] for k in keys), strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument(
        "--config", default="configs/quickstart_cpu.yaml", help="a config whose prepared data to read"
    )
    p.add_argument("--smoke", action="store_true", help="a few hundred short rows (seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.max_length = 256, 64
    torch.set_num_threads(1)
    data = {shape: synthetic_rows(shape, args.rows, args.max_length) for shape in (*SHAPES, "long_tail")}
    quickstart = prepared_rows(args.config) if args.config and not args.smoke else None
    if quickstart is not None:
        data["quickstart"] = quickstart
    elif not args.smoke:
        print(f"(no prepared data for {args.config}: run `make quickstart` to add its row)")
    columns = ["example/padded", "example/padded64", "example/bins", "example/free"]
    columns += ["kl/padded", "kl/padded64", "kl/bins", "kl/free", "pairs/padded", "pairs/bins", "pairs/free"]
    print(f"pad fraction of processed tokens, micro-batch {MICRO_BATCH}, random order")
    print(f"{'shape':<12} {'rows':>6} " + " ".join(f"{c:>16}" for c in columns))
    for shape, rows in data.items():
        order = list(range(len(rows)))
        random.Random(0).shuffle(order)
        batches = [[rows[i] for i in order[s : s + MICRO_BATCH]] for s in range(0, len(order), MICRO_BATCH)]
        fractions = pad_fractions(batches)
        fractions.update(
            {k.replace("/padded", "/padded64"): v for k, v in pad_fractions(batches, 64).items()}
        )
        fractions = {k.replace("/one", "/free"): v for k, v in fractions.items()}
        print(f"{shape:<12} {len(rows):>6} " + " ".join(f"{fractions[c]:>16.1%}" for c in columns))
        if any(fractions[c] != 0.0 for c in columns if c.endswith("/free")):
            raise SystemExit(f"{shape}: padding-free rows hold padding")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
