"""Which records make each split, and whether a split can train: records that share a prompt (``prompt_key``)
stay on one side of the held-out split (``group_split``), exact repeats are counted (``duplicates``), and a split
without both labels is refused with what may explain it (``require_both_labels``)."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from coati_kto.data.formats import Record, RecordError, skipped_note
from coati_kto.errors import DataError


def prompt_key(record: Record) -> str:
    """The record's prompt (with its tools, and the sha256 of each image: the same words about another image
    are another prompt) as canonical JSON: records with equal keys share a prompt."""
    prompt = record.prompt if not record.tools else [record.prompt, record.tools]
    if record.images:
        prompt = [prompt, [hashlib.sha256(image).hexdigest() for image in record.images]]
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def duplicates(records: list[Record]) -> tuple[int, list[str]]:
    """(records that repeat an earlier one exactly: same prompt, completion and label; up to 5 examples as
    ``"later source = first source"``). Kept, since a user may mean them, but counted."""
    first: dict[tuple[str, str, bool], str] = {}
    count, examples = 0, []
    for r in records:
        key = (prompt_key(r), json.dumps(r.completion, sort_keys=True, ensure_ascii=False), r.label)
        if key in first:
            count += 1
            if len(examples) < 5:
                examples.append(f"{r.source} = {first[key]}")
        else:
            first[key] = r.source
    return count, examples


def group_split(
    groups: np.ndarray, labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices), all records of a group (same prompt) on one side, deterministic by seed.

    Aims at ``fraction`` of each label held out (at least 1, at most all but 1): groups are taken in a seeded
    random order, those holding the scarcer label first, each only while it overshoots neither label's target.
    Raises DataError when the held-out side cannot get both labels (too few distinct prompts).
    """
    labels = np.asarray(labels, dtype=bool)
    targets = []
    for value in (True, False):
        n = int((labels == value).sum())
        if n < 2:
            raise DataError(
                f"data.eval_fraction {fraction}: needs at least 2 {'desirable' if value else 'undesirable'} "
                f"records so both splits hold both labels (got {n}); add data or set data.eval_files"
            )
        targets.append(min(max(1, round(fraction * n)), n - 1))
    _, group = np.unique(groups, return_inverse=True)  # sorted: independent of the records' order
    per_group = np.zeros((group.max() + 1, 2), dtype=np.int64)
    np.add.at(per_group, (group, (~labels).astype(np.int64)), 1)  # columns: desirable, undesirable
    order = np.random.default_rng(seed).permutation(len(per_group))
    scarce = int(np.argmin(targets))  # the label with the smaller target first, or groups may crowd it out
    order = np.concatenate([order[per_group[order, scarce] > 0], order[per_group[order, scarce] == 0]])
    held = np.zeros(len(per_group), dtype=bool)
    room = np.array(targets, dtype=np.int64)
    for g in order:
        if (per_group[g] <= room).all():
            held[g], room = True, room - per_group[g]
    in_eval = held[group]
    if not (labels[in_eval].any() and (~labels[in_eval]).any()):
        raise DataError(
            f"data.eval_fraction {fraction}: cannot hold out both labels while keeping each prompt's records on "
            f"one side ({len(per_group)} distinct prompts for {len(labels)} records); set data.eval_files"
        )
    return np.flatnonzero(~in_eval), np.flatnonzero(in_eval)


def label_counts(labels: np.ndarray) -> dict[str, int]:
    """{"desirable": n, "undesirable": n} of a bool array (True = desirable)."""
    return {"desirable": int(labels.sum()), "undesirable": int((~labels).sum())}


def require_both_labels(
    counts: dict[str, int], files: list[str], key: str, skipped: int | list[RecordError], fitted: str = ""
) -> None:
    """Raise DataError naming ``key`` and ``files`` unless ``counts`` holds both labels; bad records skipped
    (a count, or the records: their commonest reason is named) and ``fitted`` (the rows dropped to fit
    data.max_length, and its remedy) come first in the remedy, as they may be why."""
    if counts["desirable"] and counts["undesirable"]:
        return
    missing = "undesirable" if counts["desirable"] else "desirable"
    add = f"add {missing} examples (label {str(missing == 'desirable').lower()})"
    add = f"{skipped_note(skipped)}: fix them, or {add}" if skipped else add
    raise DataError(
        f"{key} ({', '.join(files)}): {counts['desirable']} desirable and {counts['undesirable']} undesirable "
        "usable examples: KTO needs both labels, since it pushes desirable completions above the reference "
        f"point and undesirable ones below it; {f'{fitted}, or {add}' if fitted else add}"
    )
