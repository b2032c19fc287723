"""TRL's command-line flags (``trl kto --model_name_or_path M --dataset_name D ...``) and the keys of a TRL-style
YAML read as this project's overrides: a user who brings them gets the overrides they mean in one line, not
argparse's "unrecognized arguments", and every flag is accounted for (a flag with no equivalent says so, with
why), so none of them vanishes unnoticed.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from coati_kto.config.hub import DATASET_PREFIX
from coati_kto.config.trl_names import (
    BOOLEAN,
    DATASET_QUERY,
    KNOWN,
    LIST_FLAGS,
    NO_EQUIVALENT,
    SCRIPT_FLAGS,
    SWITCH_NOTES,
    SWITCHES,
    TRAINER_NAMES,
)

# The options of the commands that take a config (coati_kto/cli.py): they are theirs, not TRL's.
COMMAND_OPTIONS = frozenset(
    ("help", "ranks", "batches", "examples", "nproc-per-node", "checkpoint", "out", "push", "schema")
)
_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no"}
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")
CONFIG_COMMANDS = ("prepare", "inspect", "train", "precompute", "export", "config")
# A translation: the overrides (``KEY=VALUE``) and what follows the flag in the line (``is KEY=VALUE (note)``).
Translation = tuple[list[str], str]
Flags = Sequence[tuple[str, "str | None"]]


def _flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """Every ``--name value`` / ``--name=value`` / bare ``--name`` that is not an option of the command, in order,
    named as TRL spells it (``_canonical``); a list-valued flag's values (``--report_to wandb tensorboard``) are
    one value, joined by spaces."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        raw, sep, value = argv[i].removeprefix("--").partition("=")
        if not argv[i].startswith("--") or raw in COMMAND_OPTIONS:
            i += 1
            continue
        name, negated = _canonical(raw)
        if negated:  # HfArgumentParser's --no_X stores false and takes no value
            value = "false"
        elif not sep:
            following = argv[i + 1] if i + 1 < len(argv) else None
            # a negative number is a value (transformers' --max_steps -1), not a flag
            takes = following is not None and (not following.startswith("-") or _float(following) is not None)
            if name in BOOLEAN:
                takes = takes and following.lower() in _BOOL_WORDS
            elif name not in KNOWN or name in LIST_FLAGS:  # neither may take the config or an override
                takes = takes and _not_positional(following)
            value, i = (following, i + 1) if takes else (None, i)
        # nargs="+": the values up to the next option, override or config (dropped after the first, they vanished)
        while name in LIST_FLAGS and value is not None and i + 1 < len(argv) and _list_value(argv[i + 1]):
            value, i = f"{value} {argv[i + 1]}", i + 1
        out.append((name, value))
        i += 1
    return out


def _canonical(raw: str) -> tuple[str, bool]:
    """A flag's name as TRL spells it, and whether it was a ``--no_X``: HfArgumentParser takes ``--warmup-ratio``
    for ``--warmup_ratio`` and ``--no_X`` / ``--no-X`` for ``--X false`` (read here for every boolean X). A name
    TRL does not know is kept as given."""
    name = raw.replace("-", "_")
    if name.startswith("no_") and name[3:] in BOOLEAN:
        return name[3:], True
    return (name, False) if name in KNOWN else (raw, False)


def _not_positional(token: str) -> bool:
    """Whether ``token`` can be a flag's value: not an override (``KEY=VALUE``) or the config file."""
    return "=" not in token and not token.endswith((".yaml", ".yml"))


def _list_value(token: str) -> bool:
    return not token.startswith("-") and _not_positional(token)


def _truth(value: str | None) -> bool | None:
    """A bare flag is true; a boolean word is its value; anything else None."""
    if value is None:
        return True
    return value.lower() in ("true", "1", "yes") if value.lower() in _BOOL_WORDS else None


def is_local_path(value: str) -> bool:
    """Whether --dataset_name names a path, not a Hub id: a Hub id is NAME or OWNER/NAME, never starts with . / ~,
    never has two slashes or a data file's suffix; and one that exists here is read from disk by load_dataset too."""
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or value.lower().endswith(_DATA_SUFFIXES):
        return True
    return Path(value).expanduser().exists()


def _dataset(name: str, value: str | None, flags: Flags) -> Translation:
    """--dataset_name: a Hub entry with the query flags folded in, or a local path as given; a query flag: its part
    of that entry (or of a placeholder entry when --dataset_name is not given)."""
    dataset = next((v for n, v in flags if n == "dataset_name" and v), None)
    if name in DATASET_QUERY and dataset is not None:
        if is_local_path(dataset):
            return [], "has no equivalent for a local --dataset_name (hf://datasets entries only)"
        return [], f"is {DATASET_QUERY[name]}={value} in data.train_files"
    if name == "dataset_name" and value is not None and is_local_path(value):
        return [f"data.train_files=[{value}]"], f"is data.train_files=[{value}] (a local path)"
    query = "&".join(f"{DATASET_QUERY[n]}={v}" for n, v in flags if n in DATASET_QUERY and v)
    override = f"data.train_files={DATASET_PREFIX}{value or 'OWNER/NAME'}{'?' + query if query else ''}"
    return [override], f"is {override}"


def _fp32_export_refused(flags: Flags, argv: Sequence[str]) -> bool:
    """Whether output.export_dtype=fp32 would be refused (LoRA, tp_size > 1, output.save_final false), from
    --use_peft, the overrides and the config file (best effort: a file it cannot read counts as neither)."""
    path = next((a for a in argv if a.endswith((".yaml", ".yml"))), None)
    try:
        data = yaml.safe_load(Path(path).read_text()) if path else None
    except (OSError, yaml.YAMLError):
        data = None
    data = data if isinstance(data, dict) else {}
    model, plugin, output = data.get("model"), data.get("plugin"), data.get("output")
    lora = isinstance(model, dict) and model.get("lora") is not None
    tp = plugin.get("tp_size") if isinstance(plugin, dict) else 1
    no_final = isinstance(output, dict) and output.get("save_final") is False  # nothing to export to fp32
    for item in argv:
        key, sep, raw = item.partition("=")
        if sep and not item.startswith("-") and key == "model.lora":
            lora = raw.strip() not in ("null", "~", "")
        elif sep and not item.startswith("-"):
            lora = lora or key.startswith("model.lora.")
            tp = int(raw) if key == "plugin.tp_size" and raw.strip().isdigit() else tp
            no_final = _truth(raw) is False if key == "output.save_final" else no_final
    peft = next((_truth(v) for n, v in flags if n == "use_peft"), None)
    return bool(peft if peft is not None else lora) or (isinstance(tp, int) and tp > 1) or no_final


def _precision(flags: Flags, argv: Sequence[str]) -> Translation:
    """--bf16 / --fp16 together, as TRL resolves them (trl/trainer/base_config.py: bf16 unset is ``not fp16``),
    with fp32 final/ weights after bf16 (TRL saves its fp32 weights) where that export is admitted."""
    given = {n: _truth(v) for n, v in flags if n in ("bf16", "fp16")}
    if None in given.values():
        return [], "has no equivalent for that value (TRL takes true or false)"
    fp16 = bool(given.get("fp16"))
    bf16 = given.get("bf16", not fp16)  # TRL: an unset bf16 is `not fp16`
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    overrides, notes = [f"plugin.precision={precision}"], []
    if "bf16" not in given and not fp16:
        notes.append("TRL trains bf16 when fp16 is off; fp32: --bf16 False")
    if precision == "bf16" and _fp32_export_refused(flags, argv):
        notes.append(
            "final/ stays bf16: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false"
        )
    elif precision == "bf16":
        overrides.append("output.export_dtype=fp32")
        notes.append("fp32 final/ weights, as TRL saves")
    return overrides, f"is {' '.join(overrides)}" + (f" ({'; '.join(notes)})" if notes else "")


def _report_to(value: str | None) -> Translation:
    """--report_to: W&B and TensorBoard have switches here; other integrations do not."""
    chosen = {
        "wandb": ["logging.wandb=true"],
        "tensorboard": ["logging.tensorboard=true"],
        "all": ["logging.wandb=true", "logging.tensorboard=true"],
        "none": ["logging.wandb=false", "logging.tensorboard=false"],
    }
    names = (value or "").replace(",", " ").split()
    overrides = list(dict.fromkeys(o for n in names for o in chosen.get(n, [])))
    others = [n for n in names if n not in chosen]
    notes = [f"{', '.join(others)}: no equivalent, TensorBoard and W&B only"] if others else []
    if "wandb" in names and not {"tensorboard", "all"} & set(names):
        notes.append("TensorBoard stays on unless logging.tensorboard=false")
    if not overrides:
        return [], "has no equivalent (TensorBoard and W&B only: logging.tensorboard, logging.wandb)"
    return overrides, f"is {' '.join(overrides)}" + (f" ({'; '.join(notes)})" if notes else "")


def _targets(value: str | None) -> Translation:
    """--lora_target_modules A B (or A,B): every name; peft's ``all-linear`` has no spelling here."""
    names = (value or "").replace(",", " ").split()
    if names == ["all-linear"]:
        return [], (
            "has no equivalent (name the layers: model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,"
            "up_proj,down_proj] on Llama-style models)"
        )
    if not names:
        return [], "has no equivalent without module names (model.lora.target_modules=[A,B])"
    override = f"model.lora.target_modules=[{','.join(names)}]"
    return [override], f"is {override}"


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _valued(name: str, value: str | None) -> Translation | None:
    """The flags whose translation depends on their value; None for the others."""
    number, truth = _float(value), _truth(value)
    schedule = (
        "the schedule here: linear warmup over train.warmup_steps, then cosine to lr x train.min_lr_ratio"
    )
    if name == "lr_scheduler_type":  # a cosine to a floor of 1.0 is constant
        ratio = {"cosine": "0.0", "constant": "1.0", "constant_with_warmup": "1.0"}.get(value or "")
        override = f"train.min_lr_ratio={ratio}"
        return (
            ([override], f"is {override} ({schedule})") if ratio else ([], f"has no equivalent ({schedule})")
        )
    # transformers 5 folded warmup_ratio into warmup_steps: a float in (0, 1) is a ratio there
    if name == "warmup_ratio" or (name == "warmup_steps" and number is not None and 0 < number < 1):
        if number == 0:
            return ["train.warmup_steps=0"], "is train.warmup_steps=0"
        share = f"{number * 100:g}% of" if number is not None else "that fraction of"
        return [], f"has no equivalent (no ratio here; set train.warmup_steps to {share} the run's steps)"
    if name == "report_to":
        return _report_to(value)
    if name == "lora_target_modules":
        return _targets(value)
    if name == "max_steps" and number is not None and number < 0:
        return ["train.max_steps=null"], "is train.max_steps=null (transformers' -1: no limit)"
    if name == "resume_from_checkpoint" and value is not None and truth is not None:
        override = "train.resume=auto" if truth else "train.resume=null"
        return [override], f"is {override}" + (" (the newest checkpoint in output.dir)" if truth else "")
    if name == "model_revision":
        return ["model.path=DIR"], (
            f"is model.path=DIR (the model at revision {value}: hf download MODEL --revision {value} --local-dir DIR)"
        )
    return None


def _switch(name: str, value: str | None, flags: Flags) -> Translation:
    truth = _truth(value)
    if truth is None:
        return [], "has no equivalent for that value (TRL takes true or false)"
    override = SWITCHES[name][0 if truth else 1]
    hub = next((v for n, v in flags if n == "hub_model_id" and v), None)
    if name == "push_to_hub" and truth and hub:  # one override, not a placeholder that would win over it
        override = f"output.push_to_hub={hub}"
    note = SWITCH_NOTES.get(name) if truth else None
    return [override], f"is {override}" + (f" ({note})" if note else "")


def translate(name: str, value: str | None, flags: Flags = (), argv: Sequence[str] = ()) -> Translation:
    """What TRL's ``--name value`` means here, among the other ``flags`` and the command line ``argv``."""
    flags = flags or [(name, value)]
    if name in ("bf16", "fp16"):
        return _precision(flags, argv)
    if name == "dataset_name" or name in DATASET_QUERY:
        return _dataset(name, value, flags)
    if name in NO_EQUIVALENT:
        return [], f"has no equivalent ({NO_EQUIVALENT[name]})"
    if (valued := _valued(name, value)) is not None:
        return valued
    if name in SWITCHES:
        return _switch(name, value, flags)
    key = SCRIPT_FLAGS.get(name) or TRAINER_NAMES.get(name)
    if key is None:
        option = name.replace("_", "-")
        mine = (
            f"coati-kto's option is --{option}" if option in COMMAND_OPTIONS else "not a TRL flag known here"
        )
        return [], f"has no equivalent ({mine})"
    override = f"{key}={value if value is not None else 'VALUE'}"
    return [override], f"is {override}{_lora_note(key, flags)}"


def _lora_note(key: str, flags: Flags) -> str:
    """For a ``model.lora.*`` key without a true ``--use_peft``: TRL would train every weight and ignore the flag,
    while the key turns LoRA on here (said, so a run the user knew as full fine-tuning does not silently change)."""
    peft = next((_truth(v) for n, v in flags if n == "use_peft"), None)
    if not key.startswith("model.lora.") or peft:
        return ""
    return " (TRL ignores it without --use_peft and trains every weight; here it turns LoRA on)"


def _value_text(value: Any) -> str | None:
    """A YAML value as the command line would give it (``true``, ``wandb,tensorboard``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return None if value is None else str(value)


def trl_hint(name: str, value: Any = None) -> str | None:
    """For a TRL name given as a config key: what it means here (``TRL's bf16 true is plugin.precision=bf16 ...``);
    None for a name TRL does not have, or one that maps to a key as is (did_you_mean names that key)."""
    if name not in KNOWN:
        return None
    text = _value_text(value)
    overrides, predicate = translate(name, text, [(name, text)])
    plain = SCRIPT_FLAGS.get(name) or TRAINER_NAMES.get(name)
    if plain and overrides == [f"{plain}={text if text is not None else 'VALUE'}"]:
        return None
    return f"TRL's {name}{'' if text is None else ' ' + text} {predicate}"


def trl_flags_line(argv: list[str]) -> str | None:
    """One line for a command line holding TRL-style flags: what each flag means here (its overrides, or that it
    has none) and the command with those overrides; None when it holds none that TRL knows (or its command takes
    no config: ``tiny-model`` has options of its own)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    flags = _flags(argv) if command in CONFIG_COMMANDS else []
    if not any(n in KNOWN for n, _ in flags):
        return None
    parts, overrides = [], []
    for name, value in flags:
        found, predicate = translate(name, value, flags, argv)
        parts.append(f"--{name}{'' if value is None else ' ' + value} {predicate}")
        overrides += found
    # model.lora={...} replaces the whole mapping: it must come before the model.lora.rank=... it would drop
    overrides = sorted(dict.fromkeys(overrides), key=lambda o: not o.startswith("model.lora="))
    config = next((a for a in argv if a.endswith((".yaml", ".yml"))), "CONFIG.yaml")
    # The user's own KEY=VALUE overrides stay in the command, after the translations (theirs win): a copied
    # command that dropped them would train with other settings, unsaid.
    values = {v for _, v in flags}
    overrides += [a for a in argv if "=" in a and not a.startswith("-") and a not in values]
    tail = "none of them has an override here"
    if overrides:
        tail = f"as overrides after the config: coati-kto {command} {config} {' '.join(map(shlex.quote, overrides))}"
    return (
        f"TRL-style flags are not options of coati-kto {command}: "
        + "; ".join(parts)
        + f"; {tail} (coati-kto config --schema lists every key)"
    )
