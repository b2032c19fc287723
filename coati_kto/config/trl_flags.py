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

# The names TRL's KTOConfig and transformers' TrainingArguments give these settings: users bring them along.
TRAINER_NAMES = {
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "train.micro_batch_size",
    "per_device_eval_batch_size": "train.eval_micro_batch_size",
    "gradient_accumulation_steps": "train.accumulation_steps",
    "num_train_epochs": "train.max_epochs",
    "warmup_steps": "train.warmup_steps",
    "max_grad_norm": "train.max_grad_norm",
    "logging_steps": "train.log_interval",
    "eval_steps": "train.eval_interval",
    "save_steps": "output.save_interval",
    "save_total_limit": "output.keep_last",
    "output_dir": "output.dir",
    "max_prompt_length": "data.max_prompt_length",
    "max_length": "data.max_length",
    "dataset_num_proc": "data.num_proc",
    "pad_to_multiple_of": "data.pad_to_multiple_of",
    "dataloader_num_workers": "train.num_workers",
    "ddp_timeout": "train.dist_timeout",
    "beta": "kto.beta",
    "desirable_weight": "kto.desirable_weight",
    "undesirable_weight": "kto.undesirable_weight",
    "precompute_ref_batch_size": "kto.precompute_batch_size",
    "router_aux_loss_coef": "kto.router_aux_loss_coef",
}
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
# What TRL's --generate_during_eval turns on: TRL decodes one eval batch (8 rows at transformers' default
# per_device_eval_batch_size); here a fixed, seeded set of that many prompts.
GENERATED_SAMPLES = 8
# TRL's ModelConfig LoRA defaults (trl/trainer/model_config.py: lora_r 16, lora_alpha 32, lora_dropout 0.05).
TRL_LORA = "model.lora={rank: 16, alpha: 32, dropout: 0.05}"
# Flags TRL takes bare (``--bf16``: true) or with a boolean -> the override for true, and for false.
SWITCHES = {
    "gradient_checkpointing": ("model.gradient_checkpointing=true", "model.gradient_checkpointing=false"),
    "trust_remote_code": ("model.trust_remote_code=true", "model.trust_remote_code=false"),
    "bf16": ("plugin.precision=bf16", "plugin.precision=fp32"),  # both resolved together by _precision
    "fp16": ("plugin.precision=fp16", "plugin.precision=bf16"),
    "use_peft": (TRL_LORA, "model.lora=null"),
    "push_to_hub": ("output.push_to_hub=OWNER/NAME", "output.push_to_hub=null"),
    "generate_during_eval": (f"eval.samples={GENERATED_SAMPLES}", "eval.samples=0"),
    "precompute_ref_log_probs": ("kto.reference=cached", "kto.reference=online"),
    "torch_compile": ("model.compile=true", "model.compile=false"),
    "eval_on_start": ("train.eval_at_start=true", "train.eval_at_start=false"),
}
_SWITCH_NOTES = {
    "use_peft": "TRL's LoRA defaults",
    "generate_during_eval": f"{GENERATED_SAMPLES} prompts decoded at each evaluation",
    "precompute_ref_log_probs": "train computes the cache first, or coati-kto precompute CONFIG ahead",
}
# TRL / transformers flags with no equivalent here -> why (in a few words), or what to set instead.
_UNMAPPED = [
    ("max_completion_length", "no such key: a completion keeps what data.max_length leaves after its prompt"),
    ("logging_first_step", "train/ metrics every train.log_interval steps"),
    ("logging_strategy", "set train.log_interval"),
    ("logging_dir", "TensorBoard writes under output.dir/tensorboard"),
    ("eval_strategy evaluation_strategy", "set train.eval_interval, train.eval_at_epoch_end"),
    ("save_strategy", "set output.save_interval (0: at the end only)"),
    ("save_only_model", "checkpoints always hold the optimizer state"),
    ("run_name", "W&B names the run; logging.wandb_project sets the project"),
    ("optim", "AdamW only (train.fused_optimizer fuses it)"),
    ("adam_beta1 adam_beta2 adam_epsilon", "AdamW's betas (0.9, 0.999) and eps 1e-8 are fixed"),
    ("lr_scheduler_kwargs", "the cosine's floor is train.min_lr_ratio"),
    ("tf32", "TF32 is not switched here"),
    ("deepspeed fsdp", "ColossalAI plugins here: plugin.name, plugin.zero_stage"),
    ("bf16_full_eval fp16_full_eval", "evaluation runs in plugin.precision"),
    ("data_seed", "train.seed seeds the data order too"),
    ("do_train", "train always trains"),
    ("do_eval", "evaluation runs with data.eval_files or data.eval_fraction"),
    ("dataset_test_split", "eval data: data.eval_files=[hf://datasets/OWNER/NAME?split=test]"),
    ("disable_dropout", "dropout is always off here"),
    ("remove_unused_columns", "prepare reads its fields and names the unread ones"),
    ("train_sampling_strategy", "the order is seeded (train.seed), both labels in every micro-batch"),
    ("use_liger_kernel", "no logits tensor is formed here anyway"),
    ("activation_offloading", "not offered"),
    ("sync_ref_model ref_model_mixup_alpha ref_model_sync_steps", "the reference stays fixed (no TR-DPO)"),
    ("model_init_kwargs torch_dtype dtype", "weights load in plugin.precision"),
    ("load_in_4bit load_in_8bit use_bnb_nested_quant", "no quantized training"),
    ("use_rslora use_dora", "plain LoRA only"),
    ("lora_modules_to_save", "adapters only: model.lora.target_modules"),
    ("lora_target_modules", "a list: set model.lora.target_modules=[A,B]"),
    ("hub_strategy", "output.push_to_hub={repo_id: OWNER/NAME, checkpoints: true} uploads each checkpoint"),
    ("hub_private_repo", "output.push_to_hub={repo_id: OWNER/NAME, private: BOOL}"),
    ("hub_token", "hf auth login or HF_TOKEN"),
]
NO_EQUIVALENT = {name: why for names, why in _UNMAPPED for name in names.split()}
# TRL flags whose translation depends on the value (_valued).
_VALUED = ("lr_scheduler_type", "warmup_ratio", "report_to")
# The boolean flags among the unmapped: a bare one takes no value (``--logging_first_step train.seed=1``).
_BOOLEAN = {*SWITCHES, "logging_first_step", "save_only_model", "do_train", "do_eval", "disable_dropout"}
_BOOLEAN |= {"remove_unused_columns", "use_liger_kernel", "activation_offloading", "sync_ref_model", "tf32"}
_BOOLEAN |= {"bf16_full_eval", "fp16_full_eval", "load_in_4bit", "load_in_8bit", "use_bnb_nested_quant"}
_BOOLEAN |= {"use_rslora", "use_dora", "hub_private_repo"}
KNOWN = {*TRAINER_NAMES, *SCRIPT_FLAGS, *DATASET_QUERY, *SWITCHES, *NO_EQUIVALENT, *_VALUED}
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
    """Every ``--name value`` / ``--name=value`` / bare ``--name`` that is not an option of the command, in order."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        name, sep, value = argv[i].removeprefix("--").partition("=")
        if not argv[i].startswith("--") or name in COMMAND_OPTIONS:
            i += 1
            continue
        if not sep:
            following = argv[i + 1] if i + 1 < len(argv) else None
            # a negative number is a value (transformers' --max_steps -1), not a flag
            takes = following is not None and (not following.startswith("-") or _float(following) is not None)
            if name in _BOOLEAN:
                takes = takes and following.lower() in _BOOL_WORDS
            elif name not in KNOWN:  # a flag of unknown kind must not take the config or an override
                takes = takes and "=" not in following and not following.endswith((".yaml", ".yml"))
            value, i = (following, i + 1) if takes else (None, i)
        out.append((name, value))
        i += 1
    return out


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
    note = _SWITCH_NOTES.get(name) if truth else None
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
    return [override], f"is {override}"


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
    tail = "none of them has an override here"
    if overrides:
        tail = f"as overrides after the config: coati-kto {command} {config} {' '.join(map(shlex.quote, overrides))}"
    return (
        f"TRL-style flags are not options of coati-kto {command}: "
        + "; ".join(parts)
        + f"; {tail} (coati-kto config --schema lists every key)"
    )
