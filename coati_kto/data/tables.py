"""Records -> tokenized, truncated, KL-paired arrow rows and their per-split stats. No files of its own.

One row per usable example: input_ids, completion_start (first completion token), label (True = desirable),
kl_input_ids / kl_completion_start (this prompt + the completion of row kl_index), index (row id), kl_index,
source ("file:line"), length / kl_length (token counts after truncation, for length grouping). With a
processor (image records, :mod:`coati_kto.data.image_store`): images (the references of the row's prompt's
images, which its KL row shares: their digests, the bytes stored once per split, :mod:`coati_kto.data.image_table`)
and image_tokens (the image soft tokens in that prompt).

The only disk use is ``datasets``' own: the tokenizing map writes its arrow cache into the build directory the
caller passes (:mod:`coati_kto.data.store` owns that directory, the fingerprint and stats.json).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from datasets.table import InMemoryTable

from coati_kto.config.schema import DataSection
from coati_kto.data.chat import require_chat_template
from coati_kto.data.endings import checkpoint_eos, generation_eos_ids
from coati_kto.data.formats import Record, RecordError
from coati_kto.data.image_table import PreparedSplit, distinct_images
from coati_kto.data.images import image_cut, image_stats
from coati_kto.data.kl_pairs import derangement_by_kind, pair_stats
from coati_kto.data.ragged import Ragged, join_truncated, kept_rows
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.splits import label_counts, require_both_labels
from coati_kto.data.tokenize import Encoder, bos_prefix, truncation
from coati_kto.errors import DataError

MIN_ROWS_PER_PROC = 1000  # below this a worker process costs more than it saves
PROGRESS_MIN_ROWS = 10_000  # show datasets' tokenizing progress bar from this many records
# A row's image bytes. large_binary: binary's int32 offsets hold 2 GiB a column, which a split's images pass
# (11k images of 200 KB); its int64 offsets do not bind. The outer list's int32 offsets count images, not bytes.
IMAGE_BYTES = pa.list_(pa.large_binary())


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """datasets' progress bars only for builds long enough to want them (they clutter small runs' output)."""
    was_disabled = datasets.are_progress_bars_disabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _percentiles(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {}
    q = np.percentile(x, [50, 90, 99])
    return {
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(x.max()),
        "mean": float(x.mean()),
    }


def _encode(
    records: list[Record], tokenizer, settings: PrepareSettings, work: Path, name: str, processor=None
) -> pa.Table:
    """Render and tokenize in ``data.num_proc`` worker processes (datasets.map); one arrow row per record. With
    ``processor``, the image placeholders are expanded and the records' image bytes kept (column image_bytes,
    :data:`IMAGE_BYTES`: one Arrow copy, which the tokenizing map reads as well)."""
    data = settings.data
    procs = min(data.num_proc, max(1, len(records) // MIN_ROWS_PER_PROC))
    counts = ("images", "image_tokens", "image_start") if processor is not None else ()
    features = datasets.Features(
        {
            **{c: datasets.Value("int32") for c in counts},
            "label": datasets.Value("bool"),
            # given as messages (else plain text): KL pairs stay within a kind
            "chat": datasets.Value("bool"),
            "source": datasets.Value("string"),
            "prompt_ids": datasets.List(datasets.Value("int32")),
            "completion_ids": datasets.List(datasets.Value("int32")),
            "prompt_hash": datasets.Value("int64"),
            "boundary_inside_token": datasets.Value("bool"),
            "stop_inside_completion": datasets.Value("bool"),
            "completion_end": datasets.Value("string"),
            "error_reason": datasets.Value("string"),
            "error": datasets.Value("string"),
        }
    )
    records_ds = datasets.Dataset.from_dict(
        {
            "prompt": [json.dumps(r.prompt) if r.chat else r.prompt for r in records],
            "completion": [json.dumps(r.completion) if r.chat else r.completion for r in records],
            "chat": [r.chat for r in records],
            "tools": [json.dumps(r.tools) if r.tools else "" for r in records],
            "label": [r.label for r in records],
            "source": [r.source for r in records],
        }
    )
    images = pa.array([r.images for r in records], IMAGE_BYTES) if processor is not None else None
    if images is not None:  # named, not hashed: datasets would pickle every image byte to fingerprint them
        records_ds = records_ds.add_column("images", images, new_fingerprint=f"{name}-records")
    # model.path's generation_config.json EOS ids end a chat turn; its EOS stands in for a tokenizer's missing one
    path = settings.model.path
    eos = checkpoint_eos(path)
    encoder = Encoder(tokenizer, data.chat_template_kwargs, generation_eos_ids(path), processor, eos)
    with progress_bars(len(records) >= PROGRESS_MIN_ROWS):
        encoded = records_ds.map(
            encoder,
            batched=True,
            num_proc=procs if procs > 1 else None,
            remove_columns=["prompt", "completion", "tools"],
            features=features,
            cache_file_name=str(work / f"{name}-encoded.arrow"),  # in the build dir, not ~/.cache
            new_fingerprint=f"{name}-encoded",
            load_from_cache_file=False,
            desc=f"tokenizing {name}",
        )
    table = encoded.with_format("arrow")[:]
    return table if images is None else table.append_column("image_bytes", images)


def _skipped_records(table: pa.Table, on_bad_record: str) -> tuple[np.ndarray, list[RecordError]]:
    """(per-row error text, "" when fine; the RecordErrors of the rest): records the template could not render
    or with no prompt token. Raises the first with ``data.on_bad_record: error``; else they are skipped."""
    errors = np.asarray(table.column("error").to_pylist(), dtype=object)
    reasons, sources = table.column("error_reason"), table.column("source")
    skipped = [
        RecordError.restore(errors[i], reasons[i].as_py(), sources[i].as_py())
        for i in np.flatnonzero(errors != "")
    ]
    if skipped and on_bad_record == "error":
        raise skipped[0]
    return errors, skipped


@dataclass(frozen=True)
class _Ids:
    """Every encoded row's prompt and completion tokens (before fitting), by encoded row number."""

    prompts: Ragged
    completions: Ragged


@dataclass
class _Fitted:
    """The rows kept (indices into the encoded table) with their token counts before and after truncation."""

    rows: np.ndarray
    dropped: int
    p_len: np.ndarray
    c_len: np.ndarray
    keep_p: np.ndarray
    keep_c: np.ndarray
    image_cut: int = 0
    # skipped.txt's line per row dropped here: its reason, a tab, its source and why
    left_out: list[str] = field(default_factory=list)


# stats.json's "dropped" key, by data.on_too_long ("error" raised on a row too long: what it drops has no room left)
DROP_REASON = {"skip": "too_long", "truncate": "no_room_for_completion", "error": "no_room_for_completion"}
IMAGE_CUT = "image_cut"  # stats.json's "dropped" key: a prompt cut would reach an image's tokens


def kept_bos(tokenizer: Any) -> int | None:
    """The id a cut prompt keeps at its head: the tokenizer's BOS where it is one (the tokenizer puts it before
    plain text, or the chat template renders ``bos_token``), else None: a ChatML tokenizer whose ``bos_token`` is
    ``<|im_start|>`` opens every turn with it, and a cut prompt kept it before text from inside a turn."""
    bos = tokenizer.bos_token_id
    if bos is None or bos_prefix(tokenizer):
        return bos
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return bos if any("bos_token" in text for text in texts) else None


def _heads(prompts: Ragged, bos_id: int | None) -> np.ndarray:
    """[n] int64: 1 where the prompt starts with ``bos_id`` (a cut keeps it), else 0."""
    head = np.zeros(len(prompts.lengths), np.int64)
    if bos_id is not None:
        nonempty = np.flatnonzero(prompts.lengths > 0)
        head[nonempty] = prompts.firsts(nonempty) == bos_id
    return head


def _fit(
    table: pa.Table, ids: _Ids, errors: np.ndarray, d: DataSection, bos_id: int | None = None
) -> _Fitted:
    """Fit every usable row to ``data.max_length`` as ``data.on_too_long`` says: truncate it (a row with no room
    for a completion token, reachable only when the prompt limit is not below max_length, is dropped), skip it
    (counted), or raise DataError naming the first one. An image row whose prompt cut would reach an image
    (:func:`~coati_kto.data.images.image_cut`) is dropped and counted under ``image_cut``, whatever the policy."""
    p_len, c_len = ids.prompts.lengths, ids.completions.lengths
    keep_p, keep_c = truncation(p_len, c_len, d.max_length, d.max_prompt_length)
    usable = errors == ""
    over = usable & (p_len + c_len > d.max_length)
    if over.any() and d.on_too_long == "error":
        i = np.flatnonzero(over)[0]
        raise DataError(
            f"{table.column('source')[i].as_py()}: {p_len[i]} prompt + {c_len[i]} completion tokens, longer than "
            f"data.max_length {d.max_length} (data.on_too_long: error; truncate or skip it instead)"
        )
    drop = over if d.on_too_long == "skip" else usable & (keep_c == 0)
    cut = np.zeros_like(drop)
    if "image_start" in table.column_names:
        head = _heads(ids.prompts, bos_id)
        start = table.column("image_start").to_numpy(zero_copy_only=False)
        longest = int(c_len[usable & ~drop].max(initial=0))  # the longest completion a KL row can take
        cut = usable & ~drop & image_cut(p_len, start, head, d.max_prompt_length, d.max_length, longest)
    rows = np.flatnonzero(usable & ~drop & ~cut)
    sources = table.column("source")
    left_out = [
        f"{DROP_REASON[d.on_too_long]}\t{sources[i].as_py()}: {p_len[i]} prompt + {c_len[i]} completion tokens, "
        f"longer than data.max_length {d.max_length}"
        for i in np.flatnonzero(drop)
    ] + [
        f"{IMAGE_CUT}\t{sources[i].as_py()}: a prompt of {p_len[i]} tokens, cut to data.max_prompt_length "
        f"{d.max_prompt_length} where a pass is longer than data.max_length {d.max_length}, would cut an image"
        for i in np.flatnonzero(cut)
    ]
    fitted = (p_len[rows], c_len[rows], keep_p[rows], keep_c[rows])
    return _Fitted(rows, int(drop.sum()), *fitted, int(cut.sum()), left_out)


def _stops_inside(table: pa.Table) -> dict[str, Any]:
    """The kept rows whose completion holds a token that stops generation before its end (Endings.stops_early),
    and the first one's source."""
    flags = table.column("stop_inside_completion").to_numpy(zero_copy_only=False)
    first = str(table.column("source")[int(np.argmax(flags))]) if flags.any() else ""
    return {"rows": int(flags.sum()), "first": first}


def _chat(table: pa.Table) -> np.ndarray:
    """[n] bool: the rows whose records were messages (rendered by the chat template), not plain text."""
    return table.column("chat").to_numpy(zero_copy_only=False).astype(bool)


def _split_stats(
    table: pa.Table, ids: _Ids, fit: _Fitted, labels: np.ndarray, pi: np.ndarray, d: DataSection
) -> dict:
    """stats.json's entry for one split (``table``: the kept rows; ``pi``: each row's KL partner)."""
    p_len, c_len, keep_p, keep_c = fit.p_len, fit.c_len, fit.keep_p, fit.keep_c
    kl_keep_p, kl_keep_c = truncation(p_len, c_len[pi], d.max_length, d.max_prompt_length)
    return {
        "examples": len(fit.rows),
        "labels": label_counts(labels),
        "lengths": {  # as tokenized, before truncation: what data.max_length is chosen against
            "prompt": _percentiles(p_len),
            "completion": _percentiles(c_len),
            "total": _percentiles(p_len + c_len),
        },
        "lengths_truncated": {"total": _percentiles(keep_p + keep_c)},  # what training sees
        "truncated": {
            "prompt": int((keep_p < p_len).sum()),
            "completion": int((keep_c < c_len).sum()),
            "prompt_tokens_cut": int((p_len - keep_p).sum()),
            "completion_tokens_cut": int((c_len - keep_c).sum()),
            "kl_prompt": int((kl_keep_p < p_len).sum()),
            "kl_completion": int((kl_keep_c < c_len[pi]).sum()),
        },
        "dropped": {
            k: n for k, n in ((DROP_REASON[d.on_too_long], fit.dropped), (IMAGE_CUT, fit.image_cut)) if n
        },
        "boundary_inside_token": int(
            table.column("boundary_inside_token").to_numpy(zero_copy_only=False).sum()
        ),
        "stop_inside_completion": _stops_inside(table),
        "kl_pairs": pair_stats(table.column("prompt_hash").to_numpy(), pi, _chat(table)),
        # how the completions end (coati_kto.data.endings): {"stop:<|im_end|>": n, "eos_added:plain": n, ...}
        "completion_end": {
            str(v["values"]): int(v["counts"])
            for v in pc.value_counts(table.column("completion_end")).to_pylist()
        },
        # every id the rows hold (completions' EOS included): checked against the model's vocabulary on opening
        "max_token_id": max(ids.prompts.max_of(fit.rows), ids.completions.max_of(fit.rows)),
    }


def _rows(
    table: pa.Table,
    ids: _Ids,
    fit: _Fitted,
    labels: np.ndarray,
    pi: np.ndarray,
    d: DataSection,
    bos_id: int | None,
) -> pa.Table:
    """The prepared rows (module docstring): truncated sequences and their KL pairs; a cut prompt keeps its
    leading ``bos_id``. ``table``: the kept rows' other columns; ``ids``: every encoded row's tokens."""
    keep_p, keep_c = fit.keep_p, fit.keep_c
    kl_keep_p, kl_keep_c = truncation(fit.p_len, fit.c_len[pi], d.max_length, d.max_prompt_length)
    head = _heads(ids.prompts, bos_id)[fit.rows]
    n, rows = np.arange(len(fit.rows)), fit.rows
    images = {}
    if "image_refs" in table.column_names:  # the row's prompt's images: its KL row (prompt i) uses them too
        images = {"images": table.column("image_refs"), "image_tokens": table.column("image_tokens")}
    return pa.table(
        {
            "input_ids": join_truncated(ids.prompts, ids.completions, rows, rows, keep_p, keep_c, head),
            "completion_start": pa.array(keep_p, pa.int32()),
            "label": pa.array(labels),
            "kl_input_ids": join_truncated(
                ids.prompts, ids.completions, rows, rows[pi], kl_keep_p, kl_keep_c, head
            ),
            "kl_completion_start": pa.array(kl_keep_p, pa.int32()),
            "index": pa.array(n, pa.int64()),
            "kl_index": pa.array(pi, pa.int64()),
            "source": table.column("source"),
            "length": pa.array(keep_p + keep_c, pa.int32()),
            "kl_length": pa.array(kl_keep_p + kl_keep_c, pa.int32()),
            **images,
        }
    )


def _dataset(rows: pa.Table, prompt_hash: pa.ChunkedArray) -> datasets.Dataset:
    """``rows`` as an in-memory Dataset, fingerprinted (datasets' cache key) by its schema and small per-row
    columns: the prompts' hashes (which hold their images' digests), the KL partners and the lengths. Left to
    itself, datasets hashes a pickle of the whole table: several copies of a split's image bytes at once (over
    20 GiB for 2 GiB), or of its token ids (17 GB for a split of 2^31 tokens)."""
    small = [rows.column(c) for c in ("kl_index", "length", "kl_length")]
    return datasets.Dataset(
        InMemoryTable(rows), fingerprint=Hasher.hash([str(rows.schema), prompt_hash, *small])
    )


def build_split(
    records: list[Record],
    tokenizer,
    settings: PrepareSettings,
    work: Path,
    name: str,
    files: list[str],
    processor=None,
) -> tuple[PreparedSplit, dict, list[RecordError], list[str]]:
    """One split (``name``: "train" or "eval", which also seeds its KL pairing): tokenize, drop what cannot fit,
    pair, truncate. Returns (the in-memory rows and, for image records, the split's distinct images; the split's
    stats, records skipped here, a line per row dropped to fit: its reason, a tab, its source and why).
    ``work``: a scratch directory for the tokenizer's arrow cache (the caller deletes it); ``files``: named in
    errors; ``processor``: a vision-language processor for image records (the rows then reference their images).

    Raises the first bad record (``data.on_bad_record: error``), a too-long example (``data.on_too_long:
    error``) or a split left without both labels, as DataError.
    """
    require_chat_template(tokenizer, records, settings.model)  # once, not one failure per record
    table = _encode(records, tokenizer, settings, work, name, processor)
    errors, skipped = _skipped_records(table, settings.data.on_bad_record)
    bos = kept_bos(tokenizer)
    ids = _Ids(Ragged.of(table.column("prompt_ids")), Ragged.of(table.column("completion_ids")))
    fit = _fit(table, ids, errors, settings.data, bos)
    # Arrow's take would concatenate the list columns' chunks (int32 offsets: 2^31 tokens at most): they are
    # read from ``ids`` by row number instead (coati_kto.data.ragged). It would also copy every image byte (a
    # second copy of the split's images): the kept rows' are zero-copy runs, each distinct image stored once.
    images = table.column("image_bytes") if "image_bytes" in table.column_names else None
    unread = [c for c in ("prompt_ids", "completion_ids", "image_bytes") if c in table.column_names]
    table = table.drop_columns(unread).take(fit.rows)
    distinct = None
    if images is not None:
        refs, distinct = distinct_images(kept_rows(images, fit.rows))
        table = table.append_column("image_refs", refs)
    labels = table.column("label").to_numpy(zero_copy_only=False).astype(bool)
    left = fit.dropped + fit.image_cut  # a split short of a label for its length is not short of data
    first = fit.left_out[0].split("\t", 1)[-1] if fit.left_out else ""
    fitted = f"{left} examples were dropped to fit data.max_length (e.g. {first}): raise it"
    require_both_labels(label_counts(labels), files, f"the {name} split", skipped, fitted if left else "")
    seed = [settings.seed, int(name == "eval")]  # KL pairs within a format: plain text, or messages
    pi = derangement_by_kind(table.column("prompt_hash").to_numpy(), _chat(table), seed)
    stats = _split_stats(table, ids, fit, labels, pi, settings.data)
    if processor is not None:
        stats["images"] = image_stats(
            table.column("images").to_numpy(),
            table.column("image_tokens").to_numpy(),
            fit.keep_p + fit.keep_c,
        )
    rows = _rows(table, ids, fit, labels, pi, settings.data, bos)
    return PreparedSplit(_dataset(rows, table.column("prompt_hash")), distinct), stats, skipped, fit.left_out
