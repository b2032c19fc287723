"""The truncated join over int64 offsets (coati_kto.data.ragged): the same rows as a Python reference, whatever
the input's chunking and the output's chunk budget; no Arrow concatenation of a list column anywhere in prepare.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from coati_kto.data import ragged
from coati_kto.data.ragged import Ragged, join_truncated, kept_rows

INT_LISTS = pa.list_(pa.int32())


def chunked(lists: list[list[int]], cuts: list[int]) -> pa.ChunkedArray:
    """``lists`` as a chunked column cut at ``cuts``, each chunk a slice of a larger array (offsets not at 0)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(lists)}), len(lists)]
    chunks = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        padded = pa.array([[7, 7]] + lists[a:b] + [[9]], INT_LISTS)
        chunks.append(padded.slice(1, b - a))
    return pa.chunked_array(chunks, INT_LISTS)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12)), min_size=1, max_size=20), st.data())
def test_join_truncated_matches_python(lengths, data) -> None:
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 100, p).tolist() for p, _ in lengths]
    comps = [rng.integers(100, 200, c).tolist() for _, c in lengths]
    n = len(lengths)
    rows = st.lists(st.integers(0, n - 1), min_size=n, max_size=n)
    p_rows, c_rows = np.array(data.draw(rows)), np.array(data.draw(rows))
    keep_p = np.array([data.draw(st.integers(0, len(prompts[i]))) for i in p_rows])
    keep_c = np.array([data.draw(st.integers(0, len(comps[j]))) for j in c_rows])
    head = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    cuts = data.draw(st.lists(st.integers(0, n), max_size=3))
    budget = data.draw(st.integers(1, 40))
    p_in, c_in = Ragged.of(chunked(prompts, cuts)), Ragged.of(chunked(comps, cuts[::-1]))
    out = join_truncated(p_in, c_in, p_rows, c_rows, keep_p, keep_c, head, chunk_tokens=budget)

    def kept_prompt(k: int) -> list[int]:
        p, keep = prompts[p_rows[k]], int(keep_p[k])
        if keep == len(p):
            return p
        h = min(int(head[k]), keep)  # a cut prompt keeps its head (the BOS), then its END
        return p[:h] + p[len(p) - (keep - h) :]

    assert out.to_pylist() == [kept_prompt(k) + comps[j][: keep_c[k]] for k, j in enumerate(c_rows)]
    for chunk in out.chunks:  # within the budget, or one row alone that is longer than it
        assert len(chunk.values) <= budget or len(chunk) == 1
    whole = join_truncated(p_in, c_in, p_rows, c_rows, keep_p, keep_c)
    assert whole.num_chunks == 1
    assert whole.to_pylist() == [
        prompts[i][len(prompts[i]) - keep_p[k] :] + comps[j][: keep_c[k]]
        for k, (i, j) in enumerate(zip(p_rows, c_rows, strict=True))
    ]


def test_ragged_reads_slices_and_chunks_and_their_maxima() -> None:
    lists = [[1, 2], [], [30], [4, 5, 6], [0]]
    tokens = Ragged.of(chunked(lists, [2, 3]))
    assert tokens.values.tolist() == [1, 2, 30, 4, 5, 6, 0] and tokens.values.dtype == np.int32
    assert tokens.offsets.tolist() == [0, 2, 2, 3, 6, 7] and tokens.offsets.dtype == np.int64
    assert tokens.lengths.tolist() == [2, 0, 1, 3, 1]
    assert (
        tokens.max_of(np.array([0, 1, 3])),
        tokens.max_of(np.array([2])),
        tokens.max_of(np.array([1])),
    ) == (
        6,
        30,
        0,
    )
    assert tokens.firsts(np.array([3, 0])).tolist() == [4, 1]
    with_null = Ragged.of(pa.array([[1], None, [2, 3]], INT_LISTS))
    assert with_null.lengths.tolist() == [1, 0, 2] and with_null.values.tolist() == [1, 2, 3]


def test_a_split_past_arrows_int32_offsets_is_written_in_chunks(monkeypatch) -> None:
    """The budget is what keeps every output chunk's int32 offsets in range: with it at 8 tokens, 10 rows of 3
    come back as 5 chunks of 2, rows in order. (At the real budget a split of 2^31 + tokens is thousands of chunks;
    benchmarks/ragged_bench.py runs one.)"""
    monkeypatch.setattr(ragged, "CHUNK_TOKENS", 8)
    prompts = Ragged.of(pa.array([[i, i + 100] for i in range(10)], INT_LISTS))
    comps = Ragged.of(pa.array([[1000 + i] for i in range(10)], INT_LISTS))
    rows = np.arange(10)
    out = join_truncated(prompts, comps, rows, rows, np.full(10, 2), np.ones(10, np.int64))
    assert [len(c) for c in out.chunks] == [2, 2, 2, 2, 2]  # 6 tokens each: a third row would make 9
    assert out.to_pylist() == [[i, i + 100, 1000 + i] for i in range(10)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=4), min_size=1, max_size=16), st.data())
def test_kept_rows_are_takes_rows_in_the_columns_own_buffers(values, data) -> None:
    """Any rows (repeats and any order included) of any chunking, as take gives them, every chunk of the result a
    slice of an input chunk: nothing concatenated or copied (a split's image bytes, coati_kto.data.tables)."""
    n = len(values)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n), max_size=3))) - {n})
    bounds = [0, *cuts, n]
    column = pa.chunked_array(
        [
            pa.array([[v] for v in values[a:b]], pa.list_(pa.large_binary()))
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    )
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), np.int64)
    kept = kept_rows(column, rows)
    assert kept.type == column.type and kept.to_pylist() == column.take(rows).to_pylist()
    owned = {chunk.values.buffers()[2].address for chunk in column.chunks if len(chunk.values)}
    assert {chunk.values.buffers()[2].address for chunk in kept.chunks if len(chunk.values)} <= owned
    runs = 1 + int((np.diff(rows) != 1).sum()) if len(rows) else 0
    assert kept.num_chunks <= runs + len(cuts) * runs  # one chunk a run and input chunk it spans
