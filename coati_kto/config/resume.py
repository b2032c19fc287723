"""What a resume does with a config that differs from the checkpoint's: apply the change, or refuse it.

A resumed run continues the saved optimizer, schedule and data position. Settings that only steer the rest of
the run (lr, beta, steps, intervals, logging, the parallel layout, which cross-layout resume re-shards) are
applied; settings that would make the checkpoint belong to another run (the model, the training data and its
order, the precision of the master weights, the objective) are refused with the reason. Every change is named
in one line at the moment of the resume, and the run records the config it actually used.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from coati_kto.config.discovery import yaml_text
from coati_kto.config.hub import anchored, same_folder, same_path
from coati_kto.errors import ConfigError

# Key prefix -> why a resume cannot change it. Checked longest prefix first.
REFUSED: dict[str, str] = {
    "model.path": "the checkpoint's weights belong to another model",
    "model.reference_path": "the rewards so far were measured against another reference",
    "model.tokenizer": "the prepared token ids belong to another tokenizer",
    "model.lora": "the checkpoint holds other trainable parameters",
    "model.train_vision": "the checkpoint holds other trainable parameters",
    "model.trust_remote_code": "the model code may differ",
    "data": "the data position of the epoch in progress belongs to the old training set",
    # Data keys that change neither the training rows nor their order: how they are built, where they are
    # stored, how a batch is laid out. A moved prepared_dir or another num_proc builds the same rows (its
    # fingerprint leaves both out), and the rows' content is checked on its own (check_training_data).
    "data.eval_files": "",
    "data.pad_to_multiple_of": "",
    "data.padding_free": "",
    "data.num_proc": "",
    "data.prepared_dir": "",
    "train.seed": "the data order of the epoch in progress depends on it",
    "plugin.precision": "the saved fp32 master weights belong to the old precision",
    "kto.loss_type": "another objective: start a new run from the exported model instead",
}
# What a checkpoint whose config lacks a key ran with, where that differs from the key's default now: the
# behaviour of the coati-kto that saved it (config_changes, optimizer_groups_problem and export's run_config).
LEGACY: dict[str, Any] = {"train.decay_norms_and_biases": True}
# Applied, but not worth a word: where the run writes, how often it logs, how long it waits.
QUIET = (
    "output.dir",
    "output.overwrite",
    "train.resume",
    "logging.",
    "eval.",  # what evaluation shows (samples), like logging
    "train.heartbeat_timeout",
    "train.dist_timeout",
    "train.file_wait_timeout",
)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str = ""  # what makes equal-looking values a change (the same relative path from another directory)

    def __str__(self) -> str:
        # the values as the YAML file spells them
        return f"{self.key} {yaml_text(self.old)} -> {yaml_text(self.new)}{self.why}"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def config_changes(saved: dict, current: dict) -> list[Change]:
    """Every leaf key whose value differs between two resolved configs (``Config.model_dump(mode="json")``).

    Versions differ in their settings: a key the checkpoint's coati-kto did not have counts as the value this
    version resolves when it is unset (what the older run did), and a key this version no longer has is no
    setting to compare. Without that, upgrading coati-kto mid-run reported every new key as a change, and
    refused the resume for a new data key ("another training set").
    """
    old, new = _flatten(saved), _flatten(current)
    missing = [k for k in new if _absent(k, old)]
    old.update(_unset_values(missing, current))
    old.update({k: LEGACY[k] for k in missing if k in LEGACY})
    keys = new.keys() | {k for k in old if not _absent(k, new)}
    return [Change(k, old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)]


def _absent(key: str, leaves: dict[str, Any]) -> bool:
    """Neither ``key`` nor a section above it is a leaf of ``leaves`` (``model.lora`` None is a leaf: its keys
    appearing under a LoRA set now are a change, not new settings)."""
    parts = key.split(".")
    return not any(".".join(parts[:n]) in leaves for n in range(1, len(parts) + 1))


def _unset_values(keys: list[str], current: dict) -> dict[str, Any]:
    """``keys`` of ``current`` as this version resolves them with none of them set ({} when that is no valid
    config: they then count as changed from None)."""
    if not keys:
        return {}
    from coati_kto.config.schema import Config

    trimmed = copy.deepcopy(current)
    for key in keys:
        *parents, leaf = key.split(".")
        section = trimmed
        for part in parents:
            section = section[part]
        del section[leaf]
    try:
        resolved = _flatten(Config.model_validate(trimmed).model_dump(mode="json"))
    except ValueError:  # pydantic's ValidationError is a ValueError
        return {}
    return {k: resolved[k] for k in keys if k in resolved}


def refusal(key: str) -> str:
    """Why ``key`` may not change on resume ('' when it may)."""
    matches = [p for p in REFUSED if key == p or key.startswith(p + ".")]
    return REFUSED[max(matches, key=len)] if matches else ""


def check_resume(
    saved: dict, current: dict, checkpoint: str, export: bool = False, saved_cwd: str | None = None
) -> str | None:
    """The one line a resume prints about changed settings (None when nothing worth saying changed).

    Raises ConfigError listing every refused change with its reason (one line each); ``export``: worded for
    ``coati-kto export``, which refuses the same changes (its model and card are the run's). ``saved_cwd``: the
    working directory the checkpoint's run read its relative paths from (trainer state ``config_cwd``; None for
    an older checkpoint: this one's, as before). The same relative text naming other folders or files here is
    refused for an export only: a resume checks what they hold (check_training_data, the reference's digest),
    so a copy of the project resumes.
    """
    changes = [
        c
        for c in config_changes(saved, current) + (_moved(saved, current, saved_cwd) if export else [])
        if not c.key.startswith(QUIET)
        and not (c.key in MODEL_FOLDERS and _same_source(c.key, saved, current, saved_cwd))
        and not (c.key in DATA_FILES and _same_files(c.old, c.new, saved_cwd))
    ]
    refused = [c for c in changes if refusal(c.key)]
    if (
        refused and export
    ):  # the export's model and card are the checkpoint's: a change here is a wrong config
        lines = [f"coati-kto export {checkpoint}: {c}{_derived(c, saved, current)}: " for c in refused]
        lines = [line + "differs from the config the checkpoint was trained with" for line in lines]
        hint = "export with the config the run trained with: output.dir/config.yaml"
        if any(c.why for c in refused):  # the same text read from here: the run's config would say it again
            hint = f"run the export from {saved_cwd}, where the run started, or write these paths absolute"
        raise ConfigError("\n".join(lines) + f"\n({hint})")
    if refused:
        lines = [
            f"train.resume {checkpoint}: {c}{_derived(c, saved, current)}: cannot change on resume ({refusal(c.key)})"
            for c in refused
        ]
        raise ConfigError("\n".join(lines) + "\n(start a new run in another output.dir, or resume unchanged)")
    if not changes:
        return None
    return f"resume: {len(changes)} setting(s) differ from {checkpoint}'s config, applied: " + ", ".join(
        map(str, changes)
    )


def with_legacy(saved: dict) -> dict:
    """``saved`` (a checkpoint's config as JSON) with the :data:`LEGACY` value of each key it lacks."""
    out = copy.deepcopy(saved)
    for key, value in LEGACY.items():
        *parents, leaf = key.split(".")
        section = out
        for part in parents:
            section = section.setdefault(part, {})
        section.setdefault(leaf, value)
    return out


def holds_apart(config: dict, resumed_apart: bool = False) -> bool:
    """``config.train.separates_no_decay`` of a config as JSON (a checkpoint's, or the current one's dump)."""
    from coati_kto.config.train import separates_no_decay

    train, lora = config.get("train") or {}, (config.get("model") or {}).get("lora") is not None
    decay = float(train.get("weight_decay") or 0.0)
    return separates_no_decay(decay, bool(train.get("decay_norms_and_biases")), lora, resumed_apart)


def saved_holds_apart(state: dict) -> bool:
    """Whether a checkpoint's optimizer holds biases and norm weights in a group of their own, from its trainer
    state: the groups it recorded (saves since 2026-12-02), else its config's rule (:data:`LEGACY` for a key it
    lacks), which is what the run that saved it built."""
    groups = state.get("optimizer_groups")
    if isinstance(groups, int):
        return groups == 2
    return holds_apart(with_legacy(state.get("config") or {}))


def optimizer_groups_problem(state: dict, current: dict, checkpoint: str) -> str | None:
    """One line when this config groups the optimizer's parameters otherwise than the checkpoint's run did
    (biases and norm weights in a group of their own at weight decay 0, or not: the saved optimizer state is by
    group), else None; ``state`` is the checkpoint's trainer state. Resumes only: an export takes the
    checkpoint's own grouping."""
    old = saved_holds_apart(state)
    if old == holds_apart(current, resumed_apart=old):
        return None
    said = {
        True: "biases and norm weights in a group of their own (train.weight_decay > 0, "
        "train.decay_norms_and_biases false)",
        False: "one group (train.weight_decay 0, train.decay_norms_and_biases true, or model.lora)",
    }
    return (
        f"train.resume {checkpoint}: its optimizer holds the parameters in {said[old]}; this config would "
        f"hold them in {said[not old]}: resume with the checkpoint's grouping, or start a new run"
    )


def _derived(change: Change, saved: dict, current: dict) -> str:
    """Why a key the user may never have set changed: data.max_prompt_length at half of data.max_length on both
    sides (its default) moved with it."""
    if change.key != "data.max_prompt_length":
        return ""
    lengths = [(config.get("data") or {}).get("max_length") for config in (saved, current)]
    defaults = [max(1, n // 2) if isinstance(n, int) else None for n in lengths]
    return " (half of data.max_length, its default)" if defaults == [change.old, change.new] else ""


def _same_source(key: str, saved: dict, current: dict, saved_cwd: str | None = None) -> bool:
    """One model folder in both configs under ``key``: model.tokenizer and model.reference_path default to
    model.path (null and model.path's folder are one), each written any way :func:`same_folder` takes, the saved
    one read from ``saved_cwd``."""
    name = key.split(".")[1]
    old, new = saved.get("model") or {}, current.get("model") or {}
    return same_folder(old.get(name) or old.get("path"), new.get(name) or new.get("path"), saved_cwd)


MODEL_FOLDERS = ("model.path", "model.tokenizer", "model.reference_path")
DATA_FILES = ("data.train_files", "data.eval_files")


def _same_files(old: Any, new: Any, saved_cwd: str | None = None) -> bool:
    """Two lists of data files naming the same files in the same order, each written any way (relative or
    absolute, ``~``, through a link), the old ones read from ``saved_cwd``; their content is checked apart (its
    digest, ``check_training_data``)."""
    if not (isinstance(old, list) and isinstance(new, list)) or len(old) != len(new):
        return False
    return all(same_path(a, b, saved_cwd) for a, b in zip(old, new, strict=True))


def _moved(saved: dict, current: dict, saved_cwd: str | None) -> list[Change]:
    """The model folders and data files both configs write alike that name other ones, the checkpoint's read
    from ``saved_cwd`` and this config's from here (config_changes sees no change in equal values); each with
    both sides as absolute paths, since the text alone reads the same."""
    here = os.getcwd()
    if saved_cwd is None or os.path.realpath(saved_cwd) == os.path.realpath(here):
        return []
    old, new = _flatten(saved), _flatten(current)
    moved = []
    for key in (*MODEL_FOLDERS, *DATA_FILES):
        value = old.get(key)
        if value is None or value != new.get(key):  # null: model.path's folder, compared under model.path
            continue
        same = _same_files if key in DATA_FILES else same_folder
        if same(value, value, saved_cwd):
            continue
        spelled = [_anchored_all(value, base) for base in (saved_cwd, here)]
        moved.append(Change(key, *spelled, " (the same relative path, read from another working directory)"))
    return moved


def _anchored_all(value: Any, base: str) -> Any:
    """``value`` (a path or a list of them) with each relative path as read from ``base``."""
    return [anchored(v, base) for v in value] if isinstance(value, list) else anchored(value, base)


def check_training_data(
    saved: str | None,
    current: str | None,
    checkpoint: str,
    parts: tuple[dict | None, dict | None] = (None, None),
) -> None:
    """ConfigError when the training data changed since the checkpoint while the config did not (files edited in
    place: the data position of the epoch in progress would index other rows). None on either side: not known.
    ``parts``: the saved and current ``train_data_parts``, to name what changed (checkpoints before 2026-12-01
    have none)."""
    if saved is not None and current is not None and (saved != current or _other_day(*parts)):
        what = _changed_parts(*parts) or "the content of data.train_files or the tokenizer"
        raise ConfigError(
            f"train.resume {checkpoint}: the training data changed since the checkpoint ({what}: {saved} -> "
            f"{current}): cannot change on resume ({REFUSED['data']})"
            "\n(start a new run in another output.dir, or resume unchanged)"
        )


def _changed_parts(saved: dict | None, current: dict | None) -> str:
    """Which of the training data's parts differ: each train file whose size or content changed (by position), a
    file more or fewer, the tokenizer, the images; '' when either side is unknown."""
    if not saved or not current:
        return ""
    old, new = saved.get("files") or [], current.get("files") or []
    changed = [f"{n[0]}'s content" for o, n in zip(old, new, strict=False) if list(o[1:]) != list(n[1:])]
    if len(old) != len(new):
        changed.append(f"{len(old)} train files -> {len(new)}")
    changed += [f"the {key}" for key in ("tokenizer", "images") if saved.get(key) != current.get(key)]
    if _other_day(saved, current):
        dates = f"{saved['template_date']} -> {current['template_date']}"
        changed.append(f"the day the chat template dates its prompts ({dates}; rebuilt on another day)")
    return ", ".join(changed)


def _other_day(saved: dict | None, current: dict | None) -> bool:
    """Whether a template that dates prompts rendered them as of other days (coati_kto.data.template_clock):
    known only where both builds recorded it (none before 2026-12-01)."""
    days = [(part or {}).get("template_date") for part in (saved, current)]
    return None not in days and days[0] != days[1]


def check_contents(state: dict, stats: dict, checkpoint: str) -> None:
    """:func:`check_training_data` and :func:`check_reference_weights` of a checkpoint's trainer state against
    this run's data stats (``train_data``, ``reference_weights``)."""
    parts = (state.get("train_data_parts"), stats.get("train_data_parts"))
    check_training_data(state.get("train_data"), stats.get("train_data"), checkpoint, parts)
    check_reference_weights(state.get("reference_weights"), stats.get("reference_weights"), checkpoint)


def check_reference_weights(saved: str | None, current: str | None, checkpoint: str) -> None:
    """ConfigError when the reference model's weights changed since the checkpoint at the same path (a new SFT
    run saved over it): the rewards so far were measured against the old ones. None on either side: not known."""
    if saved is not None and current is not None and saved != current:
        raise ConfigError(
            f"train.resume {checkpoint}: the reference model's weights changed since the checkpoint (the files "
            f"under model.reference_path / model.path: {saved[:16]} -> {current[:16]}): cannot change on resume "
            f"({REFUSED['model.reference_path']})\n(start a new run in another output.dir, or restore the weights)"
        )
