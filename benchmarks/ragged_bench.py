"""The truncated join of ``prepare`` (coati_kto/data/ragged.py) over a split past Arrow's int32 offsets.

Run from the repository root: ``python benchmarks/ragged_bench.py [--rows 1050000] [--prompt 1024]
[--completion 1024]`` (the default is 2.15e9 tokens, past 2^31 - 1, in about 9 GiB of memory: the output, since
the inputs are zero pages never written but at the rows it checks). Prints the rows, tokens, output chunks,
seconds, tokens/s and the peak RSS growth; checks the first, a middle and the last row; then the seconds and peak RSS
growth of making the split's Dataset of it. Before the join was
chunked it built one list array with int32 offsets for the whole split (ArrowInvalid past 2^31 - 1 tokens) and
int64 index temporaries of 8 bytes per token of the split (34 GiB here).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from coati_kto.data.ragged import Ragged, join_truncated  # noqa: E402
from coati_kto.data.tables import _dataset  # noqa: E402


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _uniform(rows: int, length: int, marked: list[int]) -> Ragged:
    """``rows`` lists of ``length`` zero tokens (np.zeros: untouched pages cost no memory), row r of ``marked``
    starting with the token r % 30000 + 1."""
    values = np.zeros(rows * length, np.int32)
    offsets = np.arange(rows + 1, dtype=np.int64) * length
    for r in marked:
        values[offsets[r]] = r % 30000 + 1
    return Ragged(values, offsets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_050_000)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--completion", type=int, default=1024, help="completion tokens per row")
    parser.add_argument("--smoke", action="store_true", help="20,000 rows of 48 + 16 tokens (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.prompt, args.completion = 20_000, 48, 16
    marked = [0, args.rows // 2, args.rows - 1]
    prompts, completions = (
        _uniform(args.rows, args.prompt, marked),
        _uniform(args.rows, args.completion, marked),
    )
    rows = np.arange(args.rows)
    keep_p, keep_c = np.full(args.rows, args.prompt), np.full(args.rows, args.completion)
    before, start = _peak_rss_gib(), time.perf_counter()
    out = join_truncated(prompts, completions, rows, rows, keep_p, keep_c)
    seconds = time.perf_counter() - start
    tokens = args.rows * (args.prompt + args.completion)
    print(
        f"rows {args.rows:,}  tokens {tokens:,} ({'past' if tokens > 2**31 - 1 else 'within'} 2^31 - 1)  chunks {out.num_chunks}"
    )
    print(
        f"join {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s  peak RSS growth {_peak_rss_gib() - before:.2f} GiB"
    )
    for r in marked:  # the row's own prompt start and completion start, found where its offsets say
        row = out[r].values.to_numpy()
        assert len(row) == args.prompt + args.completion, (r, len(row))
        assert row[0] == row[args.prompt] == r % 30000 + 1 and not row[1 : args.prompt].any(), r
    print(f"checked rows {marked}: each its own prompt + completion")
    # The split's Dataset (tables._dataset): datasets' default fingerprint pickled the whole table, 5.6x its ids
    # at its peak (200M tokens: 14 s and 4.5 GiB more); it is hashed from the small columns.
    lengths = pa.array(keep_p + keep_c, pa.int32())
    table = pa.table({"input_ids": out, "kl_index": rows, "length": lengths, "kl_length": lengths})
    before, start = _peak_rss_gib(), time.perf_counter()
    dataset = _dataset(table, pa.chunked_array([pa.array(rows)]))
    seconds = time.perf_counter() - start
    assert len(dataset) == args.rows
    print(f"dataset {seconds:.2f} s  peak RSS growth {_peak_rss_gib() - before:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
