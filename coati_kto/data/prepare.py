"""``coati-kto prepare``: feedback files -> tokenized, validated, KL-paired dataset on disk, with stats.

Layout of ``data.prepared_dir``: ``train/`` and ``eval/`` (``datasets`` save_to_disk), ``stats.json``,
``skipped.txt`` (every bad record skipped, one line each) and ``fingerprint.json``, written last.

Cache: the fingerprint covers the input files (path, size, mtime), the tokenizer's content (vocab, merges,
template, special tokens), the settings that change the output (lengths, bad-record and too-long policies,
eval fraction, seed) and :data:`PIPELINE_VERSION`. Equal fingerprint -> reuse; otherwise rebuild into a
temporary sibling directory that replaces ``prepared_dir`` by rename, so a crash never leaves a half-written
cache that looks valid.

Rows (one per example): input_ids, completion_start (first completion token), label (True = desirable),
kl_input_ids / kl_completion_start (this prompt + the completion of row kl_index), index (row id), kl_index,
source ("file:line"), length / kl_length (token counts, for length grouping).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable

from coati_kto.config import Config
from coati_kto.data.formats import Record, RecordError, load_records, resolve_files
from coati_kto.data.kl_pairs import derangement, pair_stats
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.data.tokenize import Encoder, join_truncated, truncation
from coati_kto.errors import ConfigError, DataError, UserError

PIPELINE_VERSION = 1  # bump when the prepared rows change for the same inputs
MIN_ROWS_PER_PROC = 1000  # below this a worker process costs more than it saves
PROGRESS_MIN_ROWS = 10_000  # show datasets' tokenizing progress bar from this many records
GUIDELINE = (1.0, 4.0 / 3.0)  # KTO paper: (lambda_D n_D) / (lambda_U n_U) in [1, 4/3]
AUTO_TARGET = 7.0 / 6.0  # auto weights aim at the middle of the guideline, safe from rounding at its edges


@dataclass
class PreparedData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict


# ------------------------------------------------------------------------------------------- fingerprint


def load_tokenizer(config: Config):
    from transformers import AutoTokenizer

    name = config.model.tokenizer or config.model.path
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.tokenizer / model.path {name}: cannot load a tokenizer ({first})") from None


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides the token ids: vocab/merges/normalisers (tokenizer.json), template, specials."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    if getattr(tokenizer, "is_fast", False):
        h.update(tokenizer.backend_tokenizer.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _file_entries(paths: list[str], key: str) -> list[list]:
    out = []
    for path in resolve_files(paths, key):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def fingerprint(config: Config, tokenizer) -> dict[str, Any]:
    d = config.data
    parts = {
        "version": PIPELINE_VERSION,
        "train_files": _file_entries(d.train_files, "data.train_files"),
        "eval_files": _file_entries(d.eval_files, "data.eval_files"),
        "tokenizer": tokenizer_hash(tokenizer),
        "settings": _settings(config),
    }
    parts["digest"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return parts


def _settings(config: Config) -> dict[str, Any]:
    d = config.data
    return {
        "max_length": d.max_length,
        "max_prompt_length": d.max_prompt_length,
        "on_bad_record": d.on_bad_record,
        "on_too_long": d.on_too_long,
        "eval_fraction": d.eval_fraction if not d.eval_files else 0.0,
        "seed": config.train.seed,
    }


def _changed(old: dict, new: dict) -> str:
    keys = [k for k in ("version", "train_files", "eval_files", "tokenizer") if old.get(k) != new.get(k)]
    keys += [f"{k}" for k, v in new["settings"].items() if old.get("settings", {}).get(k) != v]
    return ", ".join(keys) or "fingerprint"


# ------------------------------------------------------------------------------------------------ build


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices): ``fraction`` of each label, at least one of each in both splits."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for value in (True, False):
        idx = np.flatnonzero(labels == value)
        if len(idx) < 2:
            raise DataError(
                f"data.eval_fraction {fraction}: needs at least 2 {'desirable' if value else 'undesirable'} "
                f"records so both splits hold both labels (got {len(idx)}); add data or set data.eval_files"
            )
        k = min(max(1, round(fraction * len(idx))), len(idx) - 1)
        idx = rng.permutation(idx)
        held.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(held))


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


def _label_counts(labels: np.ndarray) -> dict[str, int]:
    return {"desirable": int(labels.sum()), "undesirable": int((~labels).sum())}


def _encode(records: list[Record], tokenizer, config: Config, work: Path, name: str) -> pa.Table:
    """Render and tokenize in ``data.num_proc`` worker processes (datasets.map); one arrow row per record."""
    procs = min(config.data.num_proc, max(1, len(records) // MIN_ROWS_PER_PROC))
    features = datasets.Features(
        {
            "label": datasets.Value("bool"),
            "source": datasets.Value("string"),
            "prompt_ids": datasets.List(datasets.Value("int32")),
            "completion_ids": datasets.List(datasets.Value("int32")),
            "prompt_hash": datasets.Value("int64"),
            "boundary_merge": datasets.Value("bool"),
            "error_reason": datasets.Value("string"),
            "error": datasets.Value("string"),
        }
    )
    records_ds = datasets.Dataset.from_dict(
        {
            "prompt": [json.dumps(r.prompt) if r.chat else r.prompt for r in records],
            "completion": [json.dumps(r.completion) if r.chat else r.completion for r in records],
            "chat": [r.chat for r in records],
            "label": [r.label for r in records],
            "source": [r.source for r in records],
        }
    )
    with _progress_bars(len(records) >= PROGRESS_MIN_ROWS):
        encoded = records_ds.map(
            Encoder(tokenizer),
            batched=True,
            num_proc=procs if procs > 1 else None,
            remove_columns=["prompt", "completion", "chat"],
            features=features,
            cache_file_name=str(work / f"{name}-encoded.arrow"),  # in the build dir, not ~/.cache
            new_fingerprint=f"{name}-encoded",
            load_from_cache_file=False,
            desc=f"tokenizing {name}",
        )
    return encoded.with_format("arrow")[:]


def _build_split(
    records: list[Record], tokenizer, config: Config, work: Path, name: str, files: list[str]
) -> tuple[datasets.Dataset, dict, list[RecordError]]:
    """Tokenize, drop what cannot fit, pair, truncate; returns (rows, stats, records skipped here)."""
    d = config.data
    table = _encode(records, tokenizer, config, work, name)

    # Records the chat template could not render: an error, or skipped and counted like bad records.
    errors = np.asarray(table.column("error").to_pylist(), dtype=object)
    reasons, sources = table.column("error_reason"), table.column("source")
    skipped = [
        RecordError.restore(errors[i], reasons[i].as_py(), sources[i].as_py())
        for i in np.flatnonzero(errors != "")
    ]
    if skipped and d.on_bad_record == "error":
        raise skipped[0]

    p_len = pc.list_value_length(table.column("prompt_ids")).to_numpy()
    c_len = pc.list_value_length(table.column("completion_ids")).to_numpy()
    keep_p, keep_c = truncation(p_len, c_len, d.max_length, d.max_prompt_length)
    too_long = np.flatnonzero((errors == "") & (keep_c == 0))
    if len(too_long) and d.on_too_long == "error":
        i = too_long[0]
        raise DataError(
            f"{sources[i].as_py()}: prompt ({p_len[i]} tokens) leaves no room for the completion within "
            f"data.max_length {d.max_length} (data.max_prompt_length {d.max_prompt_length})"
        )
    rows = np.flatnonzero((errors == "") & (keep_c > 0))
    table, p_len, c_len, keep_p, keep_c = (
        table.take(rows),
        p_len[rows],
        c_len[rows],
        keep_p[rows],
        keep_c[rows],
    )
    labels = table.column("label").to_numpy(zero_copy_only=False).astype(bool)
    _require_both_labels(_label_counts(labels), files, f"the {name} split", len(skipped))

    hashes = table.column("prompt_hash").to_numpy()
    pi = derangement(hashes, [config.train.seed, int(name == "eval")])
    kl_keep_p, kl_keep_c = truncation(p_len, c_len[pi], d.max_length, d.max_prompt_length)
    stats = {
        "examples": len(rows),
        "labels": _label_counts(labels),
        "lengths": {  # as tokenized, before truncation: what data.max_length is chosen against
            "prompt": _percentiles(p_len),
            "completion": _percentiles(c_len),
            "total": _percentiles(p_len + c_len),
        },
        "truncated": {
            "prompt": int((keep_p < p_len).sum()),
            "completion": int((keep_c < c_len).sum()),
            "prompt_tokens_cut": int((p_len - keep_p).sum()),
            "completion_tokens_cut": int((c_len - keep_c).sum()),
            "kl_prompt": int((kl_keep_p < p_len).sum()),
            "kl_completion": int((kl_keep_c < c_len[pi]).sum()),
        },
        "dropped": {"no_room_for_completion": len(too_long)} if len(too_long) else {},
        "boundary_merges": int(table.column("boundary_merge").to_numpy(zero_copy_only=False).sum()),
        "kl_pairs": pair_stats(hashes, pi),
    }
    prompts = table.column("prompt_ids").combine_chunks()
    comps = table.column("completion_ids").combine_chunks()
    n = np.arange(len(rows))
    out = pa.table(
        {
            "input_ids": join_truncated(prompts, comps, n, keep_p, keep_c),
            "completion_start": pa.array(keep_p, pa.int32()),
            "label": pa.array(labels),
            "kl_input_ids": join_truncated(prompts, comps, pi, kl_keep_p, kl_keep_c),
            "kl_completion_start": pa.array(kl_keep_p, pa.int32()),
            "index": pa.array(n, pa.int64()),
            "kl_index": pa.array(pi, pa.int64()),
            "source": table.column("source"),
            "length": pa.array(keep_p + keep_c, pa.int32()),
            "kl_length": pa.array(kl_keep_p + kl_keep_c, pa.int32()),
        }
    )
    return datasets.Dataset(InMemoryTable(out)), stats, skipped


def _require_both_labels(counts: dict[str, int], files: list[str], key: str, skipped: int) -> None:
    if counts["desirable"] and counts["undesirable"]:
        return
    missing = "undesirable" if counts["desirable"] else "desirable"
    raise DataError(
        f"{key} ({', '.join(files)}): {counts['desirable']} desirable and {counts['undesirable']} undesirable "
        f"usable examples{f' ({skipped} bad records skipped)' if skipped else ''}: KTO needs both labels, "
        f"since it pushes desirable completions above the reference point and undesirable ones below it; "
        f"add {missing} examples (label {str(missing == 'desirable').lower()})"
    )


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """datasets' progress bars only for builds long enough to want them (they clutter small runs' output)."""
    was_disabled = datasets.are_progress_bars_disabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _read_inputs(config: Config, cache: str) -> tuple[list[Record], list[Record], dict, list[RecordError]]:
    """(train records, eval records, files per split, bad records skipped); eval from files or a fraction."""
    d = config.data
    with _progress_bars(False):
        train_in = load_records(d.train_files, "data.train_files", d.on_bad_record, cache)
        eval_in = (
            load_records(d.eval_files, "data.eval_files", d.on_bad_record, cache) if d.eval_files else None
        )
    files = {"train": train_in.files, "eval": eval_in.files if eval_in else []}
    labels = np.array([r.label for r in train_in.records], dtype=bool)
    _require_both_labels(_label_counts(labels), files["train"], "data.train_files", len(train_in.skipped))
    if eval_in:
        eval_labels = np.array([r.label for r in eval_in.records], dtype=bool)
        _require_both_labels(
            _label_counts(eval_labels), files["eval"], "data.eval_files", len(eval_in.skipped)
        )
        return train_in.records, eval_in.records, files, train_in.skipped + eval_in.skipped
    if d.eval_fraction == 0:
        return train_in.records, [], files, train_in.skipped
    tr, ev = stratified_split(labels, d.eval_fraction, config.train.seed)
    return [train_in.records[i] for i in tr], [train_in.records[i] for i in ev], files, train_in.skipped


def _build(config: Config, tokenizer, fp: dict, target: Path) -> None:
    """Build everything in a temporary sibling of ``target``, then rename it into place."""
    work = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        train_records, eval_records, files, skipped = _read_inputs(config, str(work / "hf-cache"))
        stats: dict[str, Any] = {
            "version": PIPELINE_VERSION,
            "fingerprint": fp["digest"],
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": _settings(config),
            "files": files,
            "tokenizer": config.model.tokenizer or config.model.path,
        }
        for name, records in (("train", train_records), ("eval", eval_records)):
            stats[name] = None
            if records:
                split_files = files[name] or files["train"]  # eval_fraction: held out of the train files
                ds, stats[name], bad = _build_split(records, tokenizer, config, work, name, split_files)
                skipped += bad
                with _progress_bars(False):
                    ds.save_to_disk(str(work / name))
        by_reason: dict[str, int] = {}
        for bad in skipped:
            by_reason[bad.reason] = by_reason.get(bad.reason, 0) + 1
        stats["bad_records"] = {
            "skipped": len(skipped),
            "by_reason": by_reason,
            "examples": [str(b) for b in skipped[:10]],
        }
        stats["imbalance"] = imbalance(config, stats, num_replicas=1)
        (work / "skipped.txt").write_text("".join(f"{b.reason}\t{b}\n" for b in skipped))
        (work / "stats.json").write_text(json.dumps(stats, indent=2))
        shutil.rmtree(work / "hf-cache", ignore_errors=True)
        for f in work.glob("*-encoded*.arrow"):
            f.unlink()
        (work / "fingerprint.json").write_text(json.dumps(fp, indent=2))  # last: marks the build complete
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        if target.exists():
            target.rename(old)
        work.rename(target)  # the only moment the cache appears: complete or not at all
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_fingerprint(target: Path) -> dict | None:
    try:
        return json.loads((target / "fingerprint.json").read_text())
    except (OSError, ValueError):
        return None


def _ensure(config: Config, tokenizer) -> tuple[dict, bool, str]:
    """Build unless the cache matches: (fingerprint, built, why)."""
    target = Path(config.data.prepared_dir)
    fp = fingerprint(config, tokenizer)
    old = _read_fingerprint(target)
    if old and old.get("digest") == fp["digest"] and (target / "train").is_dir():
        return fp, False, "inputs, tokenizer and settings unchanged"
    if target.exists() and old is None and any(target.iterdir()):
        raise DataError(
            f"data.prepared_dir {target}: exists, is not empty and holds no coati-kto fingerprint.json; "
            "refusing to overwrite it: choose another directory or empty it"
        )
    why = f"changed: {_changed(old, fp)}" if old else "no prepared data yet"
    _build(config, tokenizer, fp, target)
    return fp, True, why


def _open(config: Config) -> PreparedData:
    """Load the prepared splits; ``stats["imbalance"]`` is recomputed for the current config and 1 rank."""
    target = Path(config.data.prepared_dir)
    stats = json.loads((target / "stats.json").read_text())
    train = datasets.load_from_disk(str(target / "train"))
    evaluation = datasets.load_from_disk(str(target / "eval")) if (target / "eval").is_dir() else None
    stats["imbalance"] = imbalance(config, stats, num_replicas=1)
    return PreparedData(train=train, eval=evaluation, stats=stats)


# ------------------------------------------------------------------------------------------- public API


def prepare(config: Config) -> PreparedData:
    """Build (or reuse) ``data.prepared_dir`` and print a short summary. Single process (CLI ``prepare``)."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(config)
    fp, built, why = _ensure(config, tokenizer)
    data = _open(config)
    print(summary(data.stats, config, built, why, time.perf_counter() - start))
    return data


def load_prepared(config: Config) -> PreparedData:
    """For training: every rank calls it. Global rank 0 builds if needed while the others wait at a barrier;
    then every rank loads from disk. A rank-0 failure is raised on every rank (nobody hangs in a collective).

    Long builds can outlast the process-group timeout: run ``coati-kto prepare`` before launching.
    """
    import torch.distributed as dist

    from coati_kto.distributed import barrier, broadcast_object

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    outcome: tuple[str, str, str] = ("ok", "", "")
    if rank == 0:
        try:
            start = time.perf_counter()
            tokenizer = load_tokenizer(config)
            fp, built, why = _ensure(config, tokenizer)
            outcome = ("ok", fp["digest"], "")
            if built:
                print(summary(_open(config).stats, config, built, why, time.perf_counter() - start))
        except UserError as err:
            outcome = (type(err).__name__, "", str(err))
        except Exception as err:
            outcome = ("internal", "", f"{type(err).__name__}: {err}")
            barrier()
            broadcast_object(outcome)
            raise
    barrier()
    kind, digest, message = broadcast_object(outcome)
    if kind == "internal":
        raise RuntimeError(f"global rank 0 failed to prepare the data: {message}")
    if kind != "ok":
        raise (ConfigError if kind == "ConfigError" else DataError)(message)
    target = Path(config.data.prepared_dir)
    found = (_read_fingerprint(target) or {}).get("digest")
    if found != digest:
        raise DataError(
            f"data.prepared_dir {target}: rank {rank} sees prepared data {found or 'missing'}, rank 0 built "
            f"{digest}: on multi-node runs put data.prepared_dir on a shared filesystem"
        )
    return _open(config)


# ------------------------------------------------------------------------------------------ imbalance


def auto_weights(n_desirable: int, n_undesirable: int) -> tuple[float, float]:
    """(lambda_D, lambda_U) with (lambda_D n_D) / (lambda_U n_U) in [1, 4/3].

    Data already inside the guideline keeps (1, 1). Otherwise the ratio is set to 7/6 (the middle of the
    guideline) by lowering one weight and keeping the larger at 1, so the loss scale (and the effective
    learning rate) never grows.
    """
    ratio = n_desirable / n_undesirable
    if GUIDELINE[0] <= ratio <= GUIDELINE[1]:
        return 1.0, 1.0
    scale = AUTO_TARGET / ratio  # lambda_D / lambda_U
    return (scale, 1.0) if scale < 1 else (1.0, 1.0 / scale)


def imbalance(config: Config, stats: dict, num_replicas: int) -> dict[str, Any]:
    """The imbalance report for ``num_replicas`` data-parallel ranks (effective counts from the sampler)."""
    n_d, n_u = stats["train"]["labels"]["desirable"], stats["train"]["labels"]["undesirable"]
    mbs = config.train.micro_batch_size
    out: dict[str, Any] = {
        "n_desirable": n_d,
        "n_undesirable": n_u,
        "micro_batch_size": mbs,
        "num_replicas": num_replicas,
    }
    try:
        s = MixedLabelBatchSampler.compute_stats(n_d, n_u, mbs, num_replicas)
    except ValueError as err:
        return {**out, "error": str(err), "report": f"imbalance: cannot lay out micro-batches: {err}"}
    e_d, e_u = s.effective_desirable, s.effective_undesirable
    if config.kto.auto_weights:
        w_d, w_u = auto_weights(e_d, e_u)
    else:
        w_d, w_u = config.kto.desirable_weight, config.kto.undesirable_weight
    ratio = (w_d * e_d) / (w_u * e_u)
    inside = GUIDELINE[0] - 1e-9 <= ratio <= GUIDELINE[1] + 1e-9
    how = "auto" if config.kto.auto_weights else "configured"
    report = (
        f"kto weights ({how}): desirable {w_d:.4g}, undesirable {w_u:.4g}; (lambda_D n_D)/(lambda_U n_U) = "
        f"({w_d:.4g} x {e_d})/({w_u:.4g} x {e_u}) = {ratio:.3f} "
        f"{'inside' if inside else 'OUTSIDE'} the KTO guideline [1, 4/3] "
        f"(examples per epoch, micro_batch_size {mbs}, {num_replicas} rank{'s' * (num_replicas > 1)})"
    )
    if not inside:
        sd, su = auto_weights(e_d, e_u)
        report = (
            f"warning: {report}; set kto.auto_weights=true (desirable_weight {sd:.4g}, "
            f"undesirable_weight {su:.4g})"
        )
    return {
        **out,
        "effective_desirable": e_d,
        "effective_undesirable": e_u,
        "minority_repeats": s.minority_repeats,
        "left_out": s.left_out,
        "desirable_weight": w_d,
        "undesirable_weight": w_u,
        "auto_weights": config.kto.auto_weights,
        "ratio": ratio,
        "guideline": list(GUIDELINE),
        "inside_guideline": inside,
        "report": report,
    }


def resolve_kto_weights(config: Config, stats: dict, num_replicas: int) -> tuple[float, float, str]:
    """(desirable_weight, undesirable_weight, one-line report) for ``num_replicas`` data-parallel ranks.

    Uses the sampler's effective counts per epoch (minority repeats included). ``kto.auto_weights``: see
    :func:`auto_weights`; otherwise the configured weights, and the report warns when outside [1, 4/3].
    """
    info = imbalance(config, stats, num_replicas)
    if "error" in info:
        raise DataError(f"data.prepared_dir {config.data.prepared_dir}: {info['error']}")
    return info["desirable_weight"], info["undesirable_weight"], info["report"]


def summary(stats: dict, config: Config, built: bool, why: str, seconds: float) -> str:
    """A short human summary of stats.json."""
    target = config.data.prepared_dir
    lines = []
    if built:
        n = sum((stats[s] or {}).get("examples", 0) for s in ("train", "eval"))
        lines.append(f"prepared {target} ({why}) in {seconds:.1f} s, {n / max(seconds, 1e-9):.0f} examples/s")
    else:
        lines.append(f"reusing {target} ({why}; fingerprint {stats['fingerprint']})")
    for name in ("train", "eval"):
        s = stats.get(name)
        if not s:
            continue
        lab, tot, tr = s["labels"], s["lengths"]["total"], s.get("truncated", {})
        lines.append(
            f"  {name}: {s['examples']} examples ({lab['desirable']} desirable, {lab['undesirable']} "
            f"undesirable); tokens per example p50 {tot['p50']:.0f}, p99 {tot['p99']:.0f}, max {tot['max']}"
        )
        lines.append(
            f"    truncated to data.max_length {config.data.max_length}: {tr.get('prompt', 0)} prompts, "
            f"{tr.get('completion', 0)} completions; dropped: {s['dropped'] or 'none'}; "
            f"KL pairs: {s['kl_pairs']['self_pairs']} self, {s['kl_pairs']['same_prompt_pairs']} same-prompt "
            f"(minimum possible {s['kl_pairs']['min_same_prompt_pairs']})"
        )
        if s["boundary_merges"]:
            lines.append(
                f"    {s['boundary_merges']} prompt/completion boundaries would merge into one token if "
                f"tokenized together (e.g. a prompt ending in a space); split at the text boundary"
            )
    bad = stats["bad_records"]
    if bad["skipped"]:
        lines.append(
            f"  bad records skipped: {bad['skipped']} {bad['by_reason']} (all in {target}/skipped.txt)"
        )
    lines.append(f"  {stats['imbalance']['report']}")
    return "\n".join(lines)
