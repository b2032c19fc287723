"""Find and read feedback files: ``.jsonl``, ``.json`` (an array, ``{"data": [...]}`` or JSON lines),
``.parquet``, a directory of them (recursive, sorted), a ``datasets`` save_to_disk directory, or a Hub dataset
(``hf://datasets/...``: :mod:`coati_kto.data.hub`); each raw record goes to
:func:`coati_kto.data.formats.normalize` under its ``file:line`` (``file:row N`` for arrays and tables, N from 1 as
line numbers are).

A data-looking file a directory holds but this module does not read (``.csv``, ``.jsonl.gz``, ``.JSONL``...) is an
error, never skipped in silence; a ``ClassLabel`` label column maps by its class names, never by index.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coati_kto.config.hub import HubDataset, is_hub_dataset, looks_like_hub_id, parse_hub_dataset
from coati_kto.data.formats import LoadResult, RecordError, normalize
from coati_kto.data.image_refs import attach_images, undecoded
from coati_kto.data.json_files import json_rows, jsonl_rows
from coati_kto.data.unread import unread_fields
from coati_kto.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet", ".ndjson", ".jsonlines")
JSON_LINES = (".jsonl", ".ndjson", ".jsonlines")  # one record per line, whatever the name
# Suffixes of data this module does not read: a directory holding one is an error, not a silent skip.
UNREAD = (".csv", ".tsv", ".gz", ".zst", ".bz2", ".xz", ".zip", ".arrow")
DESIRABLE_NAMES = {"true", "1", "desirable", "good", "chosen", "positive", "yes", "accepted"}
UNDESIRABLE_NAMES = {"false", "0", "undesirable", "bad", "rejected", "negative", "no"}


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).exists() for name in ("state.json", "dataset_dict.json", "dataset_info.json"))


def _walk(root: Path) -> list[Path]:
    """Data files and saved datasets under ``root``, sorted; skips hidden entries and coati-kto prepared dirs
    (a prepared_dir placed inside the data directory must not be read back as data)."""
    found: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") and entry.is_file() and entry.suffix.lower() in SUFFIXES + UNREAD:
            raise DataError(  # ._train.jsonl (macOS), .train.jsonl: neither read nor skipped in silence
                f"{entry}: a hidden data file (its name starts with '.'): coati-kto reads none; name it in the "
                f"config's data files, or rename or remove it from {root}"
            )
        if entry.name.startswith("."):  # .git, .cache, editor files
            continue
        if entry.is_dir():
            if (entry / "fingerprint.json").exists():
                continue
            found.extend([entry] if _is_saved_dataset(entry) else _walk(entry))
        elif entry.suffix in SUFFIXES:
            found.append(entry)
        elif entry.suffix.lower() in SUFFIXES + UNREAD:
            raise DataError(
                f"{entry}: a data file this directory holds that coati-kto does not read (use "
                f"{', '.join(SUFFIXES)}, lower case, uncompressed); convert it or move it out of {root}"
            )
    return found


def resolve_files(paths: list[str], key: str) -> list[Path | HubDataset]:
    """Expand directories (sorted, recursive) into data files; a saved dataset stays one path, a Hub dataset one
    entry (parsed only: :func:`coati_kto.data.hub.check` asks the Hub)."""
    out: list[Path | HubDataset] = []
    for name in paths:
        if is_hub_dataset(name):
            out.append(parse_hub_dataset(name, key))
            continue
        path = Path(name)
        if not path.exists():
            raise DataError(missing_entry(key, name))
        if path.is_dir() and not _is_saved_dataset(path):
            found = _walk(path)
            if not found:
                raise DataError(f"{key}: {name}: directory holds no {'/'.join(SUFFIXES)} files or datasets")
            _refuse_split_files(path, found, f"{key}: {name}")
            out.extend(found)
        elif path.is_file() and path.suffix not in SUFFIXES:
            raise DataError(
                f"{key}: {name}: unsupported file type (use {', '.join(SUFFIXES)} or a dataset dir)"
            )
        else:
            out.append(path)
    return out


def missing_entry(key: str, name: str) -> str:
    """The line for a ``key`` entry that names nothing on disk: where a relative one was looked for, and for one
    shaped as a Hub id (``org/name``: TRL's ``--dataset_name``) how a Hub dataset is written, which it is not."""
    where = "" if Path(name).expanduser().is_absolute() else f" (read from {Path.cwd()})"
    return f"{key}: {name}: no such file or directory{where}{_hub_hint(name)}"


def _hub_hint(name: str) -> str:
    """'; ... hf://datasets/org/name' for ``org/name`` with no data file suffix whose first part is no local
    folder (``data/train`` beside a ``data`` folder is a mistyped path); else ''."""
    first, _, _ = name.partition("/")
    if name.count("/") != 1 or not looks_like_hub_id(name) or Path(first).expanduser().exists():
        return ""
    if Path(name).suffix.lower() in SUFFIXES + UNREAD:
        return ""
    return f"; a Hub dataset is read only as hf://datasets/{name} (add ?config=C&split=S to choose)"


def _refuse_split_files(root: Path, found: list[Path], where: str) -> None:
    """DataError when ``root``'s files are named for more than one split of a dataset by datasets' rules (what
    ``hf download --local-dir`` writes: data/train-*.parquet and data/test-*.parquet; train.jsonl beside
    eval.jsonl): read whole, the held-out split was trained on, where TRL's ``load_dataset(dir)`` trains on
    train alone."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        patterns = get_data_patterns(str(root))
    except EmptyDatasetError:  # no file datasets reads (saved datasets only): no split naming to refuse
        return
    if len(patterns) < 2:
        return
    ours = {p.resolve() for p in found}
    splits = DataFilesDict.from_patterns(patterns, base_path=str(root))
    named = {str(s): [Path(f) for f in files if Path(f).resolve() in ours] for s, files in splits.items()}
    named = {s: files for s, files in named.items() if files}
    if len(named) < 2:
        return
    shown = "; ".join(
        f"{s}: {', '.join(os.path.relpath(f, root) for f in fs[:2])}{' ...' * (len(fs) > 2)}"
        for s, fs in named.items()
    )
    raise DataError(
        f"{where}: the directory holds a dataset's splits ({shown}): read whole, they would be one split (under "
        "data.train_files, the held-out ones trained on); name the train files in data.train_files and the "
        "others in data.eval_files"
    )


def _table_rows(path: Path, cache_dir: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    # datasets' parquet reader logs a corrupt file's error before raising it: the one line below says it.
    parquet_log = logging.getLogger("datasets.packaged_modules.parquet.parquet")
    was_disabled, parquet_log.disabled = parquet_log.disabled, True
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.Dataset.from_parquet(str(path), cache_dir=cache_dir)
    except Exception as err:  # corrupt or foreign files: say which, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DataError(
            f"{path}: cannot read it with datasets ({type(err).__name__}: {first[:200]})"
        ) from None
    finally:
        parquet_log.disabled = was_disabled
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise DataError(
                f"{path}: a DatasetDict with splits {sorted(ds)}: point at one split's directory, "
                f"e.g. {path / ('train' if 'train' in ds else sorted(ds)[0])}"
            )
        ds = next(iter(ds.values()))
    return dataset_rows(ds, str(path))


def dataset_rows(ds: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(``name:row N``, N from 1, record) per row of a ``datasets.Dataset``; a ClassLabel label maps by its class
    names."""
    label_of = class_label_map(ds, name)  # ClassLabel indices -> bool by the class names
    ds = undecoded(ds)  # images as their stored bytes, not PIL images
    for i, row in enumerate(ds, start=1):  # 1-based, as JSON lines' line numbers
        if label_of is not None:
            row = _class_label(row, label_of, f"{name}:row {i}")
            if isinstance(row, RecordError):
                yield (row.source, row)
                continue
        # A table has every column in every row, a record's absent keys as None: kept, for normalize to read as
        # absent yet name as "null" where the record needs the field. Inside them, every struct has the union of
        # its rows' keys: a get_weather call got search's "query": null, which the template renders and the
        # model was trained on. Those are dropped (a null written on purpose inside a struct cannot be told).
        yield (
            f"{name}:row {i}",
            {key: _inner_nulls_dropped(value, key == "tools") for key, value in row.items()},
        )


def _class_label(row: dict[str, Any], label_of: list[bool], source: str) -> dict[str, Any] | RecordError:
    """``row`` with its ClassLabel index as the class's bool; a RecordError for an index that names no class (-1:
    datasets' "no label") where the row's shape reads the label (a chosen/rejected pair reads none: dropped)."""
    index = row.get("label")
    if index is None:  # a table's gap: named "null", as in any other column
        return row
    if index in range(len(label_of)):
        return {**row, "label": label_of[index]}
    if row.get("chosen") is not None and row.get("rejected") is not None:
        return {**row, "label": None}
    if index == -1:  # was named "got -1", then "null": neither a value the user wrote, nor what it means
        problem = (
            "-1, a ClassLabel's 'no label': the dataset has no label for this row (data.on_bad_record: skip skips "
            "such rows and counts them as missing_label; error stops at the first); label it, or filter them out"
        )
        return RecordError(source, "label", problem, "missing_label")
    problem = f"class index {index}, which names no class of the ClassLabel ({len(label_of)} names)"
    return RecordError(source, "label", problem, "bad_label")


def _inner_nulls_dropped(value: Any, whole: bool) -> Any:
    """``value`` with the None-valued keys of the structs inside it dropped; a list's own items keep theirs (a
    message's absent content is named as "null") unless ``whole`` (a tool's absent keys are just absent)."""
    if isinstance(value, list):
        return [_nulls_dropped(item) if whole else _inner_nulls_dropped(item, True) for item in value]
    if isinstance(value, dict):
        return {k: _nulls_dropped(v) for k, v in value.items()}
    return value


def _nulls_dropped(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nulls_dropped(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_nulls_dropped(item) for item in value]
    return value


def iter_raw(
    path: Path | HubDataset, cache_dir: str | None = None, sha: str | None = None
) -> Iterator[tuple[str, Any]]:
    """(source, raw record) of one resolved entry; a Hub dataset at commit ``sha``."""
    if isinstance(path, HubDataset):
        from coati_kto.data.hub import open_split, pinned

        return dataset_rows(open_split(path, sha), pinned(path, sha))
    if path.suffix in JSON_LINES:
        return jsonl_rows(path)
    if path.suffix == ".json":
        return json_rows(path)
    return _table_rows(path, cache_dir)


def load_records(
    paths: list[str],
    key: str = "data.train_files",
    on_bad_record: str = "error",
    cache_dir: str | None = None,
    revisions: dict[str, str] | None = None,
    images: bool = False,
    decode_images: bool = True,
) -> LoadResult:
    """Read and validate every record of ``paths``; ``on_bad_record`` is ``"error"`` or ``"skip"``. A Hub
    dataset is read at the commit ``revisions`` gives for its ``source`` (resolved here when not given).
    ``images``: image records are read (paths relative to each file's folder), else refused;
    ``decode_images``: each must decode with PIL (the fingerprint reads their bytes only), each distinct image
    decoded once (many records share one)."""
    from coati_kto.data.hub import check, pinned

    files = resolve_files(paths, key)
    shas = {
        p.source: (revisions or {}).get(p.source) or check(p, key) for p in files if isinstance(p, HubDataset)
    }
    result = LoadResult(
        records=[], files=[pinned(p, shas[p.source]) if isinstance(p, HubDataset) else str(p) for p in files]
    )
    rows = 0
    checked: dict[bytes, tuple[str, str] | None] = {}  # each distinct image is decoded once per load
    for path in files:
        sha = shas.get(path.source) if isinstance(path, HubDataset) else None
        base = None if isinstance(path, HubDataset) else (path if path.is_dir() else path.parent)
        for source, raw in iter_raw(path, cache_dir, sha):
            rows += 1
            try:
                if isinstance(raw, RecordError):
                    raise raw
                records = normalize(raw, source, images)
                if images:
                    attach_images(records, raw.get("images"), source, base, decode_images, checked)
                result.records.extend(records)
                for name in unread_fields(raw, images):  # a "system" field is no system turn: say so
                    result.unread_fields[name] = result.unread_fields.get(name, 0) + 1
            except RecordError as bad:
                if on_bad_record == "error":
                    raise
                result.skipped.append(bad)
    if files and not rows:
        raise DataError(f"{key}: no records in {', '.join(result.files)} (empty)")
    return result


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as JSON Lines (the input format ``prepare`` reads), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def class_label_map(ds: Any, path: Path | str) -> list[bool] | None:
    """A ``ClassLabel`` label column stores class indices: map them by the class names (``names=["good",
    "bad"]`` stores good as 0), never by the index. None when the column is no ClassLabel."""
    import datasets

    feature = ds.features.get("label")
    if not isinstance(feature, datasets.ClassLabel):
        return None
    keys = [str(name).strip().lower() for name in feature.names]
    out = [key in DESIRABLE_NAMES for key in keys]
    known = all(key in DESIRABLE_NAMES | UNDESIRABLE_NAMES for key in keys)
    if not known or len(keys) != 2 or out[0] == out[1]:
        raise DataError(
            f"{path}: column 'label' is a ClassLabel with names {feature.names}: cannot tell which class is "
            "desirable; store the label as a bool (true = desirable)"
        )
    return out
