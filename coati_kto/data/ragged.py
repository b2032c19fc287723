"""Token lists as one flat array plus int64 offsets, and the truncated (prompt + completion) join built from them.

Arrow's list type has int32 offsets: one list array holds at most 2^31 - 1 tokens in all. A split of 1M rows
of 2.1k tokens is past that, so nothing here concatenates a list column's chunks (``combine_chunks``,
``take``) or builds one list array for a whole split. The input columns are read as :class:`Ragged` (int32
values, int64 offsets; numpy has no such limit) and the joined rows come back as a chunked array whose chunks
each hold at most :data:`CHUNK_TOKENS` tokens, which also bounds the join's int64 index temporaries to 8 bytes
per token of one chunk, not of the split. :func:`kept_rows` selects rows of any column (a split's image bytes)
the same way: no concatenation, and no copy either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CHUNK_TOKENS = (
    1 << 26
)  # 64M tokens (256 MiB of int32) per output chunk; its index temporaries are 512 MiB each


@dataclass(frozen=True)
class Ragged:
    """Row i's tokens are ``values[offsets[i] : offsets[i + 1]]``. values: int32 [total]; offsets: int64 [n + 1]."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, column: pa.ChunkedArray | pa.Array) -> Ragged:
        """A list<int> column (any chunking, slices included; a null list reads as empty) without concatenating
        its chunks in Arrow."""
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        lengths = [pc.fill_null(pc.list_value_length(c), 0).to_numpy(zero_copy_only=False) for c in chunks]
        values = [pc.list_flatten(c).to_numpy(zero_copy_only=False) for c in chunks]
        flat = np.concatenate(values).astype(np.int32, copy=False) if values else np.zeros(0, np.int32)
        counts = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    @property
    def lengths(self) -> np.ndarray:
        """[n] int64 token counts."""
        return np.diff(self.offsets)

    def max_of(self, rows: np.ndarray) -> int:
        """The largest token of ``rows`` (0 when they hold none)."""
        held = np.zeros(len(self.offsets) - 1, bool)
        held[rows] = True
        held = np.repeat(held, self.lengths)
        return int(self.values.max(initial=0, where=held))

    def firsts(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] the first token of each of ``rows`` (each must be non-empty)."""
        return self.values[self.offsets[rows]]


def _ragged_take(values: np.ndarray, starts: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Flat concatenation over i of ``values[starts[i] : starts[i] + count[i]]`` (no Python loop)."""
    ends = np.cumsum(count)
    total = int(ends[-1]) if len(ends) else 0
    return values[np.arange(total) - np.repeat(ends - count - starts, count)]


def _chunk_bounds(lengths: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [a, b) of at most ``budget`` tokens each (a longer single row gets its own)."""
    bounds, ends, a = [], np.cumsum(lengths), 0
    while a < len(lengths):
        base = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, base + budget, side="right")), a + 1)
        bounds.append((a, b))
        a = b
    return bounds


def join_truncated(
    prompts: Ragged,
    completions: Ragged,
    prompt_rows: np.ndarray,
    completion_rows: np.ndarray,
    keep_prompt: np.ndarray,
    keep_completion: np.ndarray,
    prompt_head: np.ndarray | None = None,
    chunk_tokens: int | None = None,
) -> pa.ChunkedArray:
    """Row i = the kept prompt of ``prompts[prompt_rows[i]]`` + the first ``keep_completion[i]`` tokens of
    ``completions[completion_rows[i]]``, as a chunked list<int32> of at most ``chunk_tokens`` tokens a chunk.

    A whole prompt is kept as is; a cut one (``keep_prompt[i]`` below its length) keeps its first
    ``prompt_head[i]`` tokens (its BOS; default 0) and fills the rest of ``keep_prompt[i]`` from its END (the
    ``keep_*`` come from :func:`~coati_kto.data.tokenize.truncation`). Vectorised: 100k rows in milliseconds.
    """
    keep_prompt = np.asarray(keep_prompt, np.int64)
    keep_completion = np.asarray(keep_completion, np.int64)
    p_start, p_len = prompts.offsets[:-1][prompt_rows], prompts.lengths[prompt_rows]
    head = np.zeros(len(keep_prompt), np.int64) if prompt_head is None else np.asarray(prompt_head, np.int64)
    head = np.where(keep_prompt < p_len, np.minimum(head, keep_prompt), 0)
    # Three segments per row, in order (prompt head, prompt tail, completion), each from its own flat array.
    segments = (
        (prompts.values, p_start, head),
        (prompts.values, p_start + p_len - (keep_prompt - head), keep_prompt - head),
        (completions.values, completions.offsets[:-1][completion_rows], keep_completion),
    )
    lengths = keep_prompt + keep_completion
    chunks = []
    for a, b in _chunk_bounds(lengths, chunk_tokens or CHUNK_TOKENS):
        parts = [_ragged_take(values, start[a:b], count[a:b]) for values, start, count in segments]
        counts = np.stack([count[a:b] for _, _, count in segments], axis=1)
        chunks.append(_interleave(parts, counts, lengths[a:b]))
    return pa.chunked_array(chunks, pa.list_(pa.int32()))


def _interleave(parts: list[np.ndarray], counts: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """One chunk's rows from its three segment arrays (``counts``: [rows, 3] tokens each segment gives a row)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = np.empty(int(offsets[-1]), np.int32)
    at = offsets[:-1].copy()
    for k, part in enumerate(parts):
        c = counts[:, k]
        ends = np.cumsum(c)
        dest = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - c - at, c)
        out[dest] = part
        at += c
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(out, pa.int32()))


def kept_rows(column: pa.ChunkedArray | pa.Array, rows: np.ndarray) -> pa.ChunkedArray:
    """``column``'s ``rows`` (row numbers in any order), as ``column.take(rows)`` gives them, without copying:
    each run of consecutive row numbers is one zero-copy slice (a chunk of the result, one per input chunk it
    spans). Take would concatenate the chunks (past int32 offsets: an overflow) and copy every value (a second
    copy of a split's image bytes); here the result shares ``column``'s buffers. Fit drops few rows: few runs."""
    column = column if isinstance(column, pa.ChunkedArray) else pa.chunked_array([column])
    rows = np.asarray(rows, np.int64)
    if len(rows) == 0:
        return pa.chunked_array([], column.type)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # where a run of consecutive rows ends
    starts = rows[np.concatenate([[0], breaks])].tolist()
    counts = np.diff(np.concatenate([[0], breaks, [len(rows)]])).tolist()
    runs = (column.slice(start, count).chunks for start, count in zip(starts, counts, strict=True))
    return pa.chunked_array([chunk for run in runs for chunk in run if len(chunk)], column.type)
