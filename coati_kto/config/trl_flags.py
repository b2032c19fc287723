"""TRL's command-line flags (``trl kto --model_name_or_path M --dataset_name D ...``) and the keys of a TRL-style
YAML read as this project's overrides: a user who brings them gets the overrides they mean in one line, not
argparse's "unrecognized arguments", and every flag is accounted for (a flag with no equivalent says so, with
why), so none of them vanishes unnoticed.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from coati_kto.config.hub import DATASET_PREFIX
from coati_kto.config.trl_argv import (
    COMMAND_OPTIONS,
    CONFIG_COMMANDS,
    as_float,
    own_options,
    read_flags,
    truth,
)
from coati_kto.config.trl_names import (
    DATASET_QUERY,
    KNOWN,
    NO_EQUIVALENT,
    RATIO_STEPS,
    SCRIPT_FLAGS,
    SWITCH_NOTES,
    SWITCHES,
    TRAINER_NAMES,
)
from coati_kto.config.trl_schedule import schedule_translation

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")
# A translation: the overrides (``KEY=VALUE``) and what follows the flag in the line (``is KEY=VALUE (note)``).
Translation = tuple[list[str], str]
Flags = Sequence[tuple[str, "str | None"]]


def is_local_path(value: str) -> bool:
    """Whether --dataset_name names a path, not a Hub id: a Hub id is NAME or OWNER/NAME, never starts with . / ~,
    never has two slashes or a data file's suffix; and one that exists here is read from disk by load_dataset too."""
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or value.lower().endswith(_DATA_SUFFIXES):
        return True
    return Path(value).expanduser().exists()


def _dataset(name: str, value: str | None, flags: Flags) -> Translation:
    """--dataset_name: a Hub entry with the query flags folded in, or a local path as given; a query flag: its part
    of that entry, or without --dataset_name of the one placeholder entry (OWNER/NAME) all query flags share."""
    dataset = next((v for n, v in flags if n == "dataset_name" and v), None)
    if name in DATASET_QUERY and dataset is not None:
        if is_local_path(dataset):
            return [], "has no equivalent for a local --dataset_name (hf://datasets entries only)"
        return [], f"is {DATASET_QUERY[name]}={value} in data.train_files"
    if name == "dataset_name" and value is not None and is_local_path(value):
        return [f"data.train_files=[{value}]"], f"is data.train_files=[{value}] (a local path)"
    query = "&".join(f"{DATASET_QUERY[n]}={v}" for n, v in flags if n in DATASET_QUERY and v)
    dataset = value if name == "dataset_name" and value else "OWNER/NAME"
    override = f"data.train_files={DATASET_PREFIX}{dataset}{'?' + query if query else ''}"
    if name in DATASET_QUERY:
        return [
            override
        ], f"is {DATASET_QUERY[name]}={value} in {override} (OWNER/NAME: the dataset's Hub id)"
    return [override], f"is {override}"


def _config_file(argv: Sequence[str]) -> Any:
    """The mapping of the config file the command line names, or None (best effort: a file it cannot read)."""
    path = next((a for a in argv if a.endswith((".yaml", ".yml"))), None)
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: UnicodeDecodeError, bytes that are not UTF-8
        return None


def _lora_flag(name: str, value: str | None) -> bool:
    """Whether TRL's ``--name value`` becomes a model.lora.* override here (which turns LoRA on)."""
    if name == "lora_target_modules":
        return bool(_targets(value)[0])
    return (SCRIPT_FLAGS.get(name) or "").startswith("model.lora.")


def _fp32_export_refused(flags: Flags, argv: Sequence[str], data: Any = None) -> bool:
    """Whether output.export_dtype=fp32 would be refused (LoRA, tp_size > 1, output.save_final false), from
    --use_peft and the LoRA flags, the overrides and the config (``data``: its mapping, else the file ``argv``
    names; one it cannot read counts as neither)."""
    data = data if data is not None else _config_file(argv)
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
            no_final = truth(raw) is False if key == "output.save_final" else no_final
    peft = next((truth(v) for n, v in flags if n == "use_peft"), None)
    lora_flags = any(_lora_flag(n, v) for n, v in flags)  # model.lora.rank=8 turns LoRA on here
    return (
        bool(peft if peft is not None else lora) or lora_flags or (isinstance(tp, int) and tp > 1) or no_final
    )


def _precision(flags: Flags, argv: Sequence[str], data: Any = None) -> Translation:
    """--bf16 / --fp16 together, as TRL resolves them (trl/trainer/base_config.py: bf16 unset is ``not fp16``),
    with fp32 final/ weights after bf16 or fp16 (TRL saves its fp32 weights) where that export is admitted."""
    given = {n: truth(v) for n, v in flags if n in ("bf16", "fp16")}
    if None in given.values():
        return [], "has no equivalent for that value (TRL takes true or false)"
    if given.get("fp16") and given.get("bf16"):
        return (
            [],
            'is refused, as transformers refuses it ("At most one of fp16 and bf16 can be True"): keep one',
        )
    fp16 = bool(given.get("fp16"))
    bf16 = given.get("bf16", not fp16)  # TRL: an unset bf16 is `not fp16`
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    overrides, notes = [f"plugin.precision={precision}"], []
    if "bf16" not in given and not fp16:
        notes.append("TRL trains bf16 when fp16 is off; fp32: --bf16 False")
    if precision != "fp32" and _fp32_export_refused(flags, argv, data):
        notes.append(
            f"final/ stays {precision}: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false"
        )
    elif precision != "fp32":
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


def _data_order(name: str, value: str | None) -> Translation | None:
    """--train_sampling_strategy and --truncation_mode: how the data is ordered and cut here."""
    if name == "train_sampling_strategy":
        if value == "group_by_length":
            return ["data.group_by_length=true"], "is data.group_by_length=true"
        return [], (
            "has no equivalent (the order is seeded (train.seed), both labels in every micro-batch; "
            "group_by_length: data.group_by_length=true)"
        )
    if name == "truncation_mode":
        how = (
            "a prompt cut to data.max_prompt_length keeps its leading BOS and its end here, as TRL's keep_end"
        )
        if value == "keep_end":
            return [], f"is how a prompt is cut here anyway (no key: {how})"
        return [], f"has no equivalent ({how}; no keep_start)"
    return None


def _valued(name: str, value: str | None) -> Translation | None:
    """The flags whose translation depends on their value; None for the others."""
    number, given = as_float(value), truth(value)
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
    if name == "resume_from_checkpoint" and value is not None and given is not None:
        override = "train.resume=auto" if given else "train.resume=null"
        return [override], f"is {override}" + (" (the newest checkpoint in output.dir)" if given else "")
    if name == "model_revision":
        return ["model.path=DIR"], (
            f"is model.path=DIR (the model at revision {value}: hf download MODEL --revision {value} --local-dir DIR)"
        )
    return _data_order(name, value)


def _epochs_given(flags: Flags, argv: Sequence[str]) -> bool:
    """Whether train.max_epochs comes from a whole --num_train_epochs or the user's own override."""
    epochs = [as_float(v) for n, v in flags if n == "num_train_epochs"]
    return any(e is not None and e.is_integer() for e in epochs) or any(
        a.startswith("train.max_epochs=") for a in argv
    )


def _steps(name: str, value: str | None, flags: Flags, argv: Sequence[str]) -> Translation | None:
    """--max_steps, --num_train_epochs and the intervals transformers reads below 1 as a ratio of the run."""
    number = as_float(value)
    if number is None:
        return None
    if name in RATIO_STEPS and 0 < number < 1:
        share = f"{number * 100:g}%"
        return (
            [],
            f"has no equivalent (no ratio here; set {TRAINER_NAMES[name]} to {share} of the run's steps)",
        )
    if name == "num_train_epochs" and not number.is_integer():
        return [], (
            f"has no equivalent (whole epochs here; set train.max_steps to {value} epochs' optimizer steps, with "
            f"train.max_epochs={math.ceil(number)})"
        )
    if name != "max_steps" or not number.is_integer():
        return None
    if number < 0:
        return ["train.max_steps=null"], "is train.max_steps=null (transformers' -1: no limit)"
    steps = int(number)
    if _epochs_given(flags, argv):
        return [f"train.max_steps={steps}"], (
            f"is train.max_steps={steps} (a cap within the train.max_epochs given here; TRL's max_steps "
            f"overrides the epoch count: leave that out for {steps} steps)"
        )
    overrides = [f"train.max_steps={steps}", f"train.max_epochs={steps}"]
    return overrides, (
        f"is {' '.join(overrides)} ({steps} optimizer steps, as TRL's max_steps, which overrides num_train_epochs: "
        f"train.max_steps is a cap within train.max_epochs here, and {steps} epochs hold at least {steps} steps)"
    )


def _switch(name: str, value: str | None, flags: Flags) -> Translation:
    given = truth(value)
    if given is None:
        return [], "has no equivalent for that value (TRL takes true or false)"
    override = SWITCHES[name][0 if given else 1]
    hub = next((v for n, v in flags if n == "hub_model_id" and v), None)
    if name == "push_to_hub" and given and hub:  # one override, not a placeholder that would win over it
        override = f"output.push_to_hub={hub}"
    note = SWITCH_NOTES.get(name) if given else None
    return [override], f"is {override}" + (f" ({note})" if note else "")


def _hub_repo(value: str | None, flags: Flags, argv: Sequence[str]) -> Translation:
    """--hub_model_id only names the repo: transformers uploads only with push_to_hub true (default false); here
    with a true --push_to_hub, or coati-kto export's --push."""
    push = next((truth(v) for n, v in flags if n == "push_to_hub"), None)
    command = next((a for a in argv if not a.startswith("-")), None)
    by = "--push_to_hub" if push else "--push" if command == "export" and "--push" in argv else None
    override = f"output.push_to_hub={value or 'OWNER/NAME'}"
    if by is None:
        return [], (
            "has no equivalent without --push_to_hub (it only names the repo: transformers uploads nothing unless "
            f"push_to_hub is true; with it: {override})"
        )
    return [override], f"is {override} (the repo {by} uploads to)"


def translate(
    name: str, value: str | None, flags: Flags = (), argv: Sequence[str] = (), data: Any = None
) -> Translation:
    """What TRL's ``--name value`` means here, among the other ``flags`` and the command line ``argv`` (``data``:
    the config's mapping, when known without reading the file ``argv`` names)."""
    flags = flags or [(name, value)]
    if name in ("bf16", "fp16"):
        return _precision(flags, argv, data)
    if name == "dataset_name" or name in DATASET_QUERY:
        return _dataset(name, value, flags)
    if name == "hub_model_id":
        return _hub_repo(value, flags, argv)
    if (scheduled := schedule_translation(name, value, flags)) is not None:
        return scheduled
    if name in NO_EQUIVALENT:
        return [], f"has no equivalent ({NO_EQUIVALENT[name]})"
    if (valued := _valued(name, value)) is not None or (
        valued := _steps(name, value, flags, argv)
    ) is not None:
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
    peft = next((truth(v) for n, v in flags if n == "use_peft"), None)
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


def trl_hint(name: str, value: Any = None, siblings: Mapping[str, Any] | None = None) -> str | None:
    """For a TRL name given as a config key: what it means here (``TRL's bf16 true is plugin.precision=bf16 ...``);
    None for a name TRL does not have, or one that maps to a key as is (did_you_mean names that key).
    ``siblings``: the file's top-level mapping, read as the rest of the command line (a flat TRL YAML's
    dataset_config joins its dataset_name; its use_peft, or a model.lora section, keeps bf16's export as trained)."""
    if name not in KNOWN:
        return None
    text = _value_text(value)
    others = [(k, _value_text(v)) for k, v in (siblings or {}).items() if k in KNOWN and k != name]
    overrides, predicate = translate(name, text, [(name, text), *others], data=siblings)
    plain = SCRIPT_FLAGS.get(name) or TRAINER_NAMES.get(name)
    as_is = f"{plain}={text if text is not None else 'VALUE'}"
    # a key that maps as is gets did_you_mean; so does one with no TRL key beside it (max_steps: 3 out of train:)
    if plain and (overrides == [as_is] or (not others and overrides[:1] == [as_is])):
        return None
    return f"TRL's {name}{'' if text is None else ' ' + text} {predicate}"


def trl_flags_line(argv: list[str]) -> str | None:
    """One line for a command line holding TRL-style flags: what each flag means here (its overrides, or that it
    has none) and the command with those overrides; None when it holds none that TRL knows (or its command takes
    no config: ``tiny-model`` has options of its own)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    flags = read_flags(argv) if command in CONFIG_COMMANDS else []
    if not any(n in KNOWN for n, _ in flags):
        return None
    parts, overrides = [], []
    for name, value in flags:
        found, predicate = translate(name, value, flags, argv)
        parts.append(f"--{name}{'' if value is None else ' ' + value} {predicate}")
        overrides += found
    # model.lora={...} first, the model.lora.rank=... after it: the printed command reads in the order it applies
    overrides = sorted(dict.fromkeys(overrides), key=lambda o: not o.startswith("model.lora="))
    config = next((a for a in argv if a.endswith((".yaml", ".yml"))), "CONFIG.yaml")
    # The command's own options (--nproc-per-node 2, export's --checkpoint DIR --push) and the user's own
    # KEY=VALUE overrides stay in the command, the overrides after the translations (theirs win): a copied command
    # that dropped them would run otherwise, unsaid.
    own, taken = own_options(argv)
    own = [
        o for o in own if o != "--schema"
    ]  # it takes no overrides: `config CONFIG.yaml X=Y` shows them applied
    values = {v for _, v in flags}
    overrides += [
        a
        for i, a in enumerate(argv)
        if "=" in a and not a.startswith("-") and a not in values and i not in taken
    ]
    tail = "none of them has an override here"
    if overrides:
        words = " ".join(map(shlex.quote, [*own, *overrides]))
        tail = f"as overrides after the config: coati-kto {command} {config} {words}"
    return (
        f"TRL-style flags are not options of coati-kto {command}: "
        + "; ".join(parts)
        + f"; {tail} (coati-kto config --schema lists every key)"
    )
