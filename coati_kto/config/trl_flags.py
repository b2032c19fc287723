"""TRL's command-line flags (``trl kto --model_name_or_path M --dataset_name D ...``) read as this project's
overrides: a user who brings them gets the overrides they mean in one line, not argparse's "unrecognized
arguments".
"""

from __future__ import annotations

import shlex

from coati_kto.config.discovery import TRAINER_NAMES
from coati_kto.config.hub import DATASET_PREFIX

# TRL's script flags (ScriptArguments, ModelConfig) and TrainingArguments flags not in TRAINER_NAMES -> the key.
SCRIPT_FLAGS = {
    "model_name_or_path": "model.path",
    "model_revision": "model.path",  # a Hub model is pinned by downloading that revision to a directory
    "trust_remote_code": "model.trust_remote_code",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "attn_implementation": "model.attn_implementation",
    "dataset_name": "data.train_files",
    "seed": "train.seed",
    "max_steps": "train.max_steps",
    "weight_decay": "train.weight_decay",
    "resume_from_checkpoint": "train.resume",
    "hub_model_id": "output.push_to_hub",
    "lora_r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "loss_type": "kto.loss_type",
}
# Flags whose value goes into the hf://datasets entry of --dataset_name, as its query.
DATASET_QUERY = {"dataset_config": "config", "dataset_train_split": "split", "dataset_revision": "revision"}
# Flags TRL takes bare (``--bf16``: true) or with a boolean -> the override for true, and for false.
SWITCHES = {
    "gradient_checkpointing": ("model.gradient_checkpointing=true", "model.gradient_checkpointing=false"),
    "trust_remote_code": ("model.trust_remote_code=true", "model.trust_remote_code=false"),
    "bf16": ("plugin.precision=bf16", "plugin.precision=fp32"),
    "fp16": ("plugin.precision=fp16", "plugin.precision=bf16"),
    "use_peft": ("model.lora={rank: 8}", "model.lora=null"),
    "push_to_hub": ("output.push_to_hub=OWNER/NAME", "output.push_to_hub=null"),
}
_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no"}
CONFIG_COMMANDS = ("prepare", "inspect", "train", "precompute", "export", "config")


def _flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """Every ``--name value`` / ``--name=value`` / bare ``--name`` whose name TRL gives a meaning, in order."""
    known = {*SCRIPT_FLAGS, *DATASET_QUERY, *SWITCHES, *TRAINER_NAMES}
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        name, sep, value = argv[i].removeprefix("--").partition("=")
        if not argv[i].startswith("--") or name not in known:
            i += 1
            continue
        if not sep:
            following = argv[i + 1] if i + 1 < len(argv) else None
            takes = following is not None and not following.startswith("-")
            takes = takes and (name not in SWITCHES or following.lower() in _BOOL_WORDS)
            value, i = (following, i + 1) if takes else (None, i)
        out.append((name, value))
        i += 1
    return out


def _override(name: str, value: str | None, query: str) -> str:
    """The override TRL's ``--name value`` means here (``KEY=VALUE``), or what to write instead."""
    if name == "dataset_name" or name in DATASET_QUERY:
        repo = value if name == "dataset_name" else "OWNER/NAME"
        return f"data.train_files={DATASET_PREFIX}{repo}{query}"
    if name == "model_revision":
        return f"model.path=DIR (the model at revision {value}: hf download MODEL --revision {value} --local-dir DIR)"
    if name in SWITCHES and (value is None or value.lower() in _BOOL_WORDS):
        return SWITCHES[name][0 if value is None or value.lower() in ("true", "1", "yes") else 1]
    key = SCRIPT_FLAGS.get(name) or TRAINER_NAMES[name]
    return f"{key}={value if value is not None else 'VALUE'}"


def trl_flags_line(argv: list[str]) -> str | None:
    """One line for a command line holding TRL-style flags: the ``section.key=value`` overrides they mean here;
    None when it holds none (or its command takes no config: ``tiny-model`` has options of its own)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    flags = _flags(argv) if command in CONFIG_COMMANDS else []
    if not flags:
        return None
    query = "&".join(f"{DATASET_QUERY[n]}={v}" for n, v in flags if n in DATASET_QUERY and v)
    query = f"?{query}" if query else ""
    dataset = any(n == "dataset_name" for n, _ in flags)
    pairs = [(n, v) for n, v in flags if n not in DATASET_QUERY or not dataset]
    mapped = [(f"--{n}{'' if v is None else ' ' + v}", _override(n, v, query)) for n, v in pairs]
    config = next((a for a in argv if a.endswith((".yaml", ".yml"))), "CONFIG.yaml")
    overrides = " ".join(shlex.quote(o.split(" (")[0]) for _, o in mapped)  # without model_revision's note
    return (
        f"TRL-style flags are not options of coati-kto {command}: "
        + "; ".join(f"{flag} is {override}" for flag, override in mapped)
        + f"; as overrides after the config: coati-kto {command} {config} {overrides} "
        "(coati-kto config --schema lists every key)"
    )
