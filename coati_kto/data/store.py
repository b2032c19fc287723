"""``data.prepared_dir``: the fingerprinted, atomically built directory of prepared rows. One process.

Layout: ``train/`` and ``eval/`` (``datasets`` save_to_disk; an image build's hold ``images.arrow`` too),
``stats.json``, ``skipped.txt`` (every bad record skipped, then every row dropped to fit data.max_length, one line each: reason, tab, source and why) and ``fingerprint.json``, written last.

Cache: the fingerprint covers the input files (path, size and a hash of the content: an edit that keeps size
and mtime, as ``cp -p`` or ``rsync -t`` can, still rebuilds; a Hub dataset by the commit sha its revision
resolves to, so a new commit on its branch rebuilds and an unchanged one does not), the tokenizer's content
(vocab, merges, template, special tokens), the settings that change the output (lengths, bad-record and too-long policies,
eval fraction, seed) and :data:`PIPELINE_VERSION`; with image records, the processor's config, every image's
digest (:mod:`coati_kto.data.image_store`) and :data:`IMAGE_LAYOUT`. Equal fingerprint -> reuse; otherwise rebuild into a
temporary sibling directory that replaces ``prepared_dir`` by rename, so a crash never leaves a half-written
cache that looks valid.

The rows themselves come from :mod:`coati_kto.data.tables`. Who builds on a multi-rank run, and the KTO weight
report shown with the summary, live outside the data package (:mod:`coati_kto.data.prepared`,
:mod:`coati_kto.data.weights`); a build is opened by :mod:`coati_kto.data.prepared_read`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from coati_kto.config.hub import HubDataset, is_hub_dataset
from coati_kto.data import template_clock
from coati_kto.data.build_folder import build_folder
from coati_kto.data.endings import checkpoint_eos, completion_end_line, generation_eos_ids
from coati_kto.data.files import load_records, resolve_files
from coati_kto.data.formats import Record, RecordError
from coati_kto.data.hub import check as hub_check
from coati_kto.data.image_store import images_fingerprint, load_processor, no_typed_image_tokens
from coati_kto.data.prepared_lock import deciding, read_from_now, refuse_if_read
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.splits import duplicates, group_split, label_counts, prompt_key, require_both_labels
from coati_kto.data.store_check import build_damage
from coati_kto.data.tables import build_split, progress_bars
from coati_kto.data.vocabulary import model_pad_id
from coati_kto.errors import DataError

PIPELINE_VERSION = 8  # bump when the prepared rows change for the same inputs (8: see below)
# 2: ids of the whole text tokenized once (SentencePiece-style tokenizers lost their spurious "▁"); eval split
#    by prompt group; content hash of the input files.
# 3: a cut prompt keeps its BOS; a boundary token holding only the completion's leading whitespace stays with the
#    prompt; no second BOS before plain text that starts with it; record-level tools and
#    data.chat_template_kwargs reach the chat template.
# 4: no EOS after a chat template's own end of turn (<end_of_turn>, <|im_end|>, <|eot_id|>): a chat completion is
#    the template's rendering of the turn (coati_kto.data.endings).
# 6: a cut ChatML prompt keeps no <|im_start|>.
# 7: plain-text and message records mixed in a split are KL-paired within their own kind (coati_kto.data.kl_pairs).
# 8: plain text ending with the template's end of turn gets no EOS after it (text rendered with the template);
#    a template that dates prompts renders the whole build as of one day (coati_kto.data.template_clock); a Python
#    tokenizer's prompt/completion split is the fast one's; an image is turned upright by its EXIF orientation.
# The image layout has its own marker (IMAGE_LAYOUT): bumping this for it (9, d64be4b) rebuilt every text-only
# build too, and dropped its reference caches (a full forward pass over the data to score again). 9 is taken:
# the next bump is 10 (a text-only build d64be4b wrote says 9 and holds version-8 rows).
# An image build's "image_layout": bump when image builds' files change and text builds' do not.
IMAGE_LAYOUT = 2
# 1 (no marker): each row held its images' bytes. 2: a split's distinct images stored once (<split>/images.arrow),
#    the rows hold their digests (data.image_table).
NO_BUILD = "no prepared data yet"  # the build reason of a data.prepared_dir that holds none
HASH_CHUNK = 8 << 20  # bytes per hash update; 1-8 MiB all read at about disk/hash speed (~500 MB/s here)


# ------------------------------------------------------------------------------------------- fingerprint


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


_HASHED: dict[tuple[int, int, int, int, int], str] = {}  # (device, inode, size, mtime, ctime) -> content_hash


def content_hash(path: Path) -> str:
    """SHA-256 of the file's bytes (hex), read in HASH_CHUNK pieces (hashlib releases the GIL, one pass). Read
    once per process while the file's status is unchanged: export and inspect fingerprint the inputs before
    ``ensure`` does. The key holds ctime, which any write changes (an edit that restores size and mtime too)."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHED:
        _HASHED[key] = _read_hash(path)
    return _HASHED[key]


def _read_hash(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _file_entries(paths: list[str], key: str) -> list[list]:
    """[path, size, content hash] of every input file (a directory's files, sorted); [entry, commit sha] of a Hub
    dataset (its revision resolved now: the Hub is asked, or the cache under HF_HUB_OFFLINE)."""
    out: list[list] = []
    for path in resolve_files(paths, key):
        if isinstance(path, HubDataset):
            out.append([path.source, hub_check(path, key)])
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            out.append([str(f.resolve()), f.stat().st_size, content_hash(f)])
    return out


def fingerprint(settings: PrepareSettings, tokenizer, processor: Any = None) -> dict[str, Any]:
    """What the prepared rows depend on, with ``digest`` (16 hex digits) over all of it; ``images`` and
    ``image_layout`` (:data:`IMAGE_LAYOUT`) only where ``processor`` is given and a record holds an image."""
    d = settings.data
    parts = {
        "version": PIPELINE_VERSION,
        "train_files": _file_entries(d.train_files, "data.train_files"),
        "eval_files": _file_entries(d.eval_files, "data.eval_files"),
        "tokenizer": tokenizer_hash(tokenizer),
        "settings": _settings(settings),
        # chat completions ending with one get no EOS
        "generation_eos_ids": generation_eos_ids(settings.model.path),
        # the EOS a tokenizer without one ends completions with (config.json is not in the tokenizer's hash)
        "checkpoint_eos": list(checkpoint_eos(settings.model.path) or ()) or None,  # as stats.json reads back
    }
    if processor is not None and (images := images_fingerprint(settings, processor, parts)):
        parts["images"] = images
        # Beside ``images``, not in it: a resume compares that part (train_data), and a rebuild into this layout
        # holds the same rows; a text-only build has no marker, its fingerprint as version 8 wrote it.
        parts["image_layout"] = IMAGE_LAYOUT
    parts["digest"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return parts


def _settings(settings: PrepareSettings) -> dict[str, Any]:
    """The settings that change the rows (fingerprinted, and recorded in stats.json)."""
    d = settings.data
    return {
        "max_length": d.max_length,
        "max_prompt_length": d.max_prompt_length,
        "on_bad_record": d.on_bad_record,
        "on_too_long": d.on_too_long,
        "chat_template_kwargs": d.chat_template_kwargs,
        "eval_fraction": d.eval_fraction if not d.eval_files else 0.0,
        "seed": settings.seed,
    }


def _files_changed(old: list, new: list) -> str:
    """E.g. ``" (content of a.jsonl; b.jsonl added)"``: what changed among the input files, by name."""
    before = {entry[0]: entry[1:] for entry in old or [] if isinstance(entry, list) and entry}
    after = {entry[0]: entry[1:] for entry in new}

    def name(p: str) -> str:
        return p if is_hub_dataset(p) else Path(p).name

    what = [f"{name(p)} added" for p in after if p not in before]
    what += [f"{name(p)} removed" for p in before if p not in after]
    what += [
        f"revision of {p}: {before[p][-1][:12]} -> {after[p][-1][:12]}"
        if is_hub_dataset(p)
        else f"content of {name(p)}"
        for p in after
        if p in before and before[p] != after[p]
    ]
    return f" ({'; '.join(what)})" if what else ""


def _changed(old: dict, new: dict) -> str:
    keys = [
        k
        for k in ("version", "tokenizer", "generation_eos_ids", "checkpoint_eos", "images", "image_layout")
        if old.get(k) != new.get(k)
    ]
    keys += [
        f"{k}{_files_changed(old.get(k), new[k])}"
        for k in ("train_files", "eval_files")
        if old.get(k) != new.get(k)
    ]
    keys += [f"{k}" for k, v in new["settings"].items() if old.get("settings", {}).get(k) != v]
    return ", ".join(keys) or "fingerprint"


def read_fingerprint(target: Path) -> dict | None:
    """``target/fingerprint.json`` (present only in a complete build), or None when missing or unreadable."""
    try:
        return json.loads((target / "fingerprint.json").read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ build


def _read_inputs(
    settings: PrepareSettings, cache: str, fp: dict
) -> tuple[list[Record], list[Record], dict, list[RecordError], dict[str, int]]:
    """(train records, eval records, files per split, bad records skipped, fields that records hold but no
    record shape reads: field -> records); eval from files or a fraction. Hub datasets at the commits ``fp``
    resolved (what the fingerprint names is what is read)."""
    d = settings.data
    shas = {e[0]: e[1] for e in fp["train_files"] + fp["eval_files"] if is_hub_dataset(e[0])}
    images = "images" in fp
    with progress_bars(False):
        train_in = load_records(d.train_files, "data.train_files", d.on_bad_record, cache, shas, images)
        eval_in = (
            load_records(d.eval_files, "data.eval_files", d.on_bad_record, cache, shas, images)
            if d.eval_files
            else None
        )
    files = {"train": train_in.files, "eval": eval_in.files if eval_in else []}
    unread = dict(train_in.unread_fields)
    for name, count in (eval_in.unread_fields if eval_in else {}).items():
        unread[name] = unread.get(name, 0) + count
    unread = dict(sorted(unread.items()))
    labels = np.array([r.label for r in train_in.records], dtype=bool)
    require_both_labels(label_counts(labels), files["train"], "data.train_files", train_in.skipped)
    if eval_in:
        eval_labels = np.array([r.label for r in eval_in.records], dtype=bool)
        require_both_labels(label_counts(eval_labels), files["eval"], "data.eval_files", eval_in.skipped)
        return train_in.records, eval_in.records, files, train_in.skipped + eval_in.skipped, unread
    if d.eval_fraction == 0:
        return train_in.records, [], files, train_in.skipped, unread
    groups = np.array([prompt_key(r) for r in train_in.records], dtype=object)
    tr, ev = group_split(groups, labels, d.eval_fraction, settings.seed)
    return (
        [train_in.records[i] for i in tr],
        [train_in.records[i] for i in ev],
        files,
        train_in.skipped,
        unread,
    )


def _stats_head(
    settings: PrepareSettings, tokenizer, fp: dict, files: dict, unread: dict, records: list[Record]
) -> dict[str, Any]:
    """stats.json's keys known before the splits are built: the build, its inputs, duplicates and padding."""
    repeats, repeat_examples = duplicates(records)
    pad, pad_note = model_pad_id(tokenizer, settings.model)
    return {
        "version": PIPELINE_VERSION,
        "fingerprint": fp["digest"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": _settings(settings),
        "files": files,
        "unread_fields": unread,
        "tokenizer": settings.model.tokenizer or settings.model.path,
        "duplicates": {"records": repeats, "examples": repeat_examples},
        "padding": {"pad_id": pad, "note": pad_note},
    }


def _build(settings: PrepareSettings, tokenizer, fp: dict, target: Path, processor: Any = None) -> None:
    """Build everything in a temporary sibling of ``target``, then rename it into place. ``processor``: a
    vision-language model's (:func:`load_processor`), or None."""
    with contextlib.ExitStack() as held:
        try:
            work = held.enter_context(build_folder(target))  # removed at the end (renamed into place by then)
        except OSError as err:  # a parent that is a file, a read-only or missing mount: one line
            raise DataError(f"data.prepared_dir {target}: cannot write there ({err.strerror})") from None
        train_records, eval_records, files, skipped, unread = _read_inputs(
            settings, str(work / "hf-cache"), fp
        )
        if "images" not in fp:  # text records only: for a vision model, none may type its image token
            train_records, eval_records, typed = no_typed_image_tokens(
                processor, settings.data.on_bad_record, train_records, eval_records
            )
            skipped, processor = skipped + typed, None
        stats = _stats_head(settings, tokenizer, fp, files, unread, train_records + eval_records)
        left_out: list[str] = []  # rows dropped to fit data.max_length (counted in each split's "dropped")
        # A template that dates prompts renders the whole build as of one day: a rebuild on another day differs.
        day = template_clock.today() if template_clock.dates_prompts(tokenizer) else None
        if day is not None:
            stats["template_date"] = fp["template_date"] = day.isoformat()
        for name, records in (("train", train_records), ("eval", eval_records)):
            stats[name] = None
            if records:
                split_files = files[name] or files["train"]  # eval_fraction: held out of the train files
                with template_clock.rendered_as_of(day):
                    ds, stats[name], bad, dropped = build_split(
                        records, tokenizer, settings, work, name, split_files, processor
                    )
                skipped += bad
                left_out += dropped
                with progress_bars(False):
                    ds.save_to_disk(str(work / name))
        stats["bad_records"] = _bad_records(skipped)
        ends = [(stats[split] or {}).get("completion_end", {}) for split in ("train", "eval")]
        stats["completion_end"] = completion_end_line(ends, tokenizer.eos_token)
        (work / "skipped.txt").write_text(
            "".join([f"{b.reason}\t{b}\n" for b in skipped] + [f"{x}\n" for x in left_out])
        )
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


# ------------------------------------------------------------------------------------------- public API


def ensure(settings: PrepareSettings, tokenizer) -> tuple[dict, bool, str]:
    """Build ``data.prepared_dir`` unless its fingerprint matches: (fingerprint, built, why, for the summary); this
    process then uses it until ``prepared_lock.release`` (its command's end). One process at a time decides and
    builds. Raises DataError for bad data, a directory that is not empty and no coati-kto build (never
    overwritten), or a build that would replace one another process uses."""
    target = Path(settings.data.prepared_dir)
    processor = load_processor(settings)
    fp = fingerprint(settings, tokenizer, processor)
    with deciding(target):
        _restore_aside(target)
        why = _build_reason(target, fp)
        if why is not None:
            if target.exists() and not target.is_dir():
                raise DataError(f"data.prepared_dir {target}: is a file, not a directory")
            if target.exists() and read_fingerprint(target) is None and any(target.iterdir()):
                raise DataError(
                    f"data.prepared_dir {target}: exists, is not empty and holds no coati-kto fingerprint.json; "
                    "refusing to overwrite it: choose another directory or empty it"
                )
            refuse_if_read(target, why)
            _build(settings, tokenizer, fp, target, processor)
        read_from_now(target)
    return fp, why is not None, why or "inputs, tokenizer and settings unchanged"


def _restore_aside(target: Path) -> None:
    """The previous build renamed aside by ``_build`` (``.NAME.old-<8 hex>``) back at ``target`` when a stop or
    kill came between its two renames and left ``target`` absent (it was complete: it stood at ``target``); any
    other such copy removed. Only those exact names are touched."""
    aside = re.compile(rf"\.{re.escape(target.name)}\.old-[0-9a-f]{{8}}")
    if not target.parent.is_dir():
        return
    for leftover in sorted(p for p in target.parent.iterdir() if aside.fullmatch(p.name) and p.is_dir()):
        if not target.exists() and read_fingerprint(leftover) is not None:
            leftover.rename(target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def _bad_records(skipped: list[RecordError]) -> dict[str, Any]:
    """stats.json's ``bad_records``: how many were skipped, by reason, and the first ten."""
    by_reason: dict[str, int] = {}
    for bad in skipped:
        by_reason[bad.reason] = by_reason.get(bad.reason, 0) + 1
    return {"skipped": len(skipped), "by_reason": by_reason, "examples": [str(b) for b in skipped[:10]]}


def _build_reason(target: Path, fp: dict) -> str | None:
    """Why ``target`` needs a build for fingerprint ``fp`` ('no prepared data yet', 'changed: ...'); None when it
    holds that complete build."""
    old = read_fingerprint(target)
    if old and old.get("digest") == fp["digest"]:
        damaged = build_damage(target)
        return None if damaged is None else f"damaged: {damaged}"
    return f"changed: {_changed(old, fp)}" if old else NO_BUILD


def build_reason(settings: PrepareSettings, tokenizer) -> str | None:
    """Why ``data.prepared_dir`` does not hold the build of ``settings`` (as :func:`ensure` would say it), or None
    when it does. Reads the inputs' content to fingerprint them; writes nothing."""
    fp = fingerprint(settings, tokenizer, load_processor(settings))
    return _build_reason(Path(settings.data.prepared_dir), fp)
