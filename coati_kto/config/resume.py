"""What a resume does with a config that differs from the checkpoint's: apply the change, or refuse it.

A resumed run continues the saved optimizer, schedule and data position. Settings that only steer the rest of
the run (lr, beta, steps, intervals, logging, the parallel layout, which cross-layout resume re-shards) are
applied; settings that would make the checkpoint belong to another run (the model, the training data and its
order, the precision of the master weights, the objective) are refused with the reason. Every change is named
in one line at the moment of the resume, and the run records the config it actually used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coati_kto.errors import ConfigError

# Key prefix -> why a resume cannot change it. Checked longest prefix first.
REFUSED: dict[str, str] = {
    "model.path": "the checkpoint's weights belong to another model",
    "model.reference_path": "the rewards so far were measured against another reference",
    "model.tokenizer": "the prepared token ids belong to another tokenizer",
    "model.lora": "the checkpoint holds other trainable parameters",
    "model.trust_remote_code": "the model code may differ",
    "data": "the data position of the epoch in progress belongs to the old training set",
    "data.eval_files": "",
    "data.pad_to_multiple_of": "",
    "train.seed": "the data order of the epoch in progress depends on it",
    "plugin.precision": "the saved fp32 master weights belong to the old precision",
    "kto.loss_type": "another objective: start a new run from the exported model instead",
}
# Applied, but not worth a word: where the run writes, how often it logs, how long it waits.
QUIET = (
    "output.dir",
    "output.overwrite",
    "train.resume",
    "logging.",
    "train.heartbeat_timeout",
    "train.dist_timeout",
)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def config_changes(saved: dict, current: dict) -> list[Change]:
    """Every leaf key whose value differs between two resolved configs (``Config.model_dump(mode="json")``)."""
    old, new = _flatten(saved), _flatten(current)
    return [
        Change(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)
    ]


def refusal(key: str) -> str:
    """Why ``key`` may not change on resume ('' when it may)."""
    matches = [p for p in REFUSED if key == p or key.startswith(p + ".")]
    return REFUSED[max(matches, key=len)] if matches else ""


def check_resume(saved: dict, current: dict, checkpoint: str) -> str | None:
    """The one line a resume prints about changed settings (None when nothing worth saying changed).

    Raises ConfigError listing every refused change with its reason (one line each).
    """
    changes = [c for c in config_changes(saved, current) if not c.key.startswith(QUIET)]
    refused = [f"{c}: cannot change on resume ({refusal(c.key)})" for c in changes if refusal(c.key)]
    if refused:
        lines = [f"train.resume {checkpoint}: {line}" for line in refused]
        raise ConfigError("\n".join(lines) + "\n(start a new run in another output.dir, or resume unchanged)")
    if not changes:
        return None
    return f"resume: {len(changes)} setting(s) differ from {checkpoint}'s config, applied: " + ", ".join(
        map(str, changes)
    )


def check_training_data(saved: str | None, current: str | None, checkpoint: str) -> None:
    """ConfigError when the training data changed since the checkpoint while the config did not (files edited in
    place: the data position of the epoch in progress would index other rows). None on either side: not known."""
    if saved is not None and current is not None and saved != current:
        raise ConfigError(
            f"train.resume {checkpoint}: the training data changed since the checkpoint (the content of "
            f"data.train_files or the tokenizer: {saved} -> {current}): cannot change on resume ({REFUSED['data']})"
            "\n(start a new run in another output.dir, or resume unchanged)"
        )
